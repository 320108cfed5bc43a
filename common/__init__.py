"""Common loader layer: resource detection, worker sizing, loader profiles, worker init."""

from recipes.common.caches.packed_strings import PackedStrings
from recipes.common.corpora.corpus_objects import CorpusChangedError, CorpusFormatError
from recipes.common.corpora.text_corpus import TextCorpus, open_text_corpus
from recipes.common.loader_warning import LoaderWarning
from recipes.common.loading.isolated_loader import IsolatedLoader
from recipes.common.loading.loader import make_loader
from recipes.common.loading.robust_loader import RobustLoader
from recipes.common.loading.stateful_loader import StatefulLoader
from recipes.common.loading.thread_loader import ThreadLoader
from recipes.common.remote.prefetch_cache import DownloadError, PrefetchCache
from recipes.common.sampling.bucketing import LengthBucketSampler
from recipes.common.sampling.elastic_sampler import ElasticDistributedSampler
from recipes.common.sampling.mixture import MixtureSampler
from recipes.common.sampling.mixture_iterable import MixtureIterable
from recipes.common.sampling.mixture_shares import ShareTrace, plot_shares, share_trace
from recipes.common.sampling.mixture_sources import MixtureSources
from recipes.common.sampling.pacing.mixture_schedule import Schedule
from recipes.common.sampling.sharding import shard_indices
from recipes.common.shards.shard_formats import ShardFormatError, read_parquet, read_tar
from recipes.common.shards.shard_set import ShardIndexError, ShardSet
from recipes.common.shards.shard_writer import index_shards, write_shards
from recipes.common.shards.sharded_dataset import ShardedIterableDataset
from recipes.common.sizing.profiles import PROFILES, LoaderRecipe, profile_settings
from recipes.common.sizing.resources import Resources, detect_resources
from recipes.common.sizing.sizing import (
    estimate_loader_memory,
    max_workers_for_memory,
    smart_num_workers,
)
from recipes.common.tuning.autotune import TuneResult, autotune
from recipes.common.tuning.monitor import LoaderMonitor
from recipes.common.tuning.trace import profile_trace
from recipes.common.workers.worker import worker_init
from recipes.common.workers.worker_memory import measure_worker_memory_growth

__all__ = [
    "CorpusChangedError",
    "CorpusFormatError",
    "DownloadError",
    "ElasticDistributedSampler",
    "IsolatedLoader",
    "LengthBucketSampler",
    "LoaderMonitor",
    "LoaderRecipe",
    "LoaderWarning",
    "MixtureIterable",
    "MixtureSampler",
    "MixtureSources",
    "PROFILES",
    "PackedStrings",
    "PrefetchCache",
    "Resources",
    "RobustLoader",
    "Schedule",
    "ShardFormatError",
    "ShardIndexError",
    "ShardSet",
    "ShardedIterableDataset",
    "ShareTrace",
    "StatefulLoader",
    "TextCorpus",
    "ThreadLoader",
    "TuneResult",
    "autotune",
    "detect_resources",
    "estimate_loader_memory",
    "index_shards",
    "make_loader",
    "open_text_corpus",
    "max_workers_for_memory",
    "measure_worker_memory_growth",
    "plot_shares",
    "profile_settings",
    "profile_trace",
    "read_parquet",
    "read_tar",
    "shard_indices",
    "share_trace",
    "smart_num_workers",
    "worker_init",
    "write_shards",
]
