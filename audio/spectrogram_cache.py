"""Spectrogram cache: (log-)mel features computed once into a memory-mapped store.

Use when: the same audio is featurised every epoch. Computing a mel spectrogram costs a
decode, an STFT and a filterbank per item; reading it back costs a memory-map slice.
Cost: one pass over the dataset in DataLoader workers; `n_mels * frames * 2` bytes per item
in float16 (80 x 401 frames for a 4 s window: 64 KB, 4x smaller than the float32 waveform).
Adapt here: `featurizer` in `spectrogram_inputs.py` (e.g. add deltas), the dtype.
Trade-off: features are fixed at build time; waveform augmentations (speed, noise) must
happen before the cache or be replaced by feature-space ones (SpecAugment).

Layout of `cache_dir` (the `recipes.common.caches.cache_files` protocol: built in a temp folder,
fsynced, renamed into place; split over the ranks of a process group when one is initialised, each
node's folder ending with the whole cache):
  header.json    {"format": "recipes-spectrogram-cache", "version", "fingerprint", "count",
                  "n_mels", "layout": "fixed" | "ragged", "dtype", ...}
  features.bin   every item's [n_mels, F_i] block back to back (a fixed layout is [N, n_mels, F])
  offsets.bin    int64 x (N + 1), in frames: item i is frames offsets[i]:offsets[i + 1]
  info.bin       int64 file index, float64 start second, int64 valid frames, per item
  checksums.bin  uint64 x N: item i's checksum, checked when read (`verify=`: "first_read" per
                 process by default, "always" or "never"; `recipes.common.caches.cache_checks`)
The header holds its own checksum and those of the other small files (checked on open).
  damaged.json   written when a read (or `recipes cache verify`) finds a damaged item: the folder
                 then fails to open, so `build_spectrogram_cache` rebuilds it instead of reusing it
Copy with: audio/chunked.py, audio/shard_audio.py, audio/shard_utterances.py,
  audio/spectrogram_inputs.py, common/caches/build_ranks.py, common/caches/cache_builds.py,
  common/caches/cache_checks.py, common/caches/cache_files.py, common/caches/cache_folder.py,
  common/caches/packed_strings.py, common/loader_warning.py, common/loading/build_loader.py,
  common/remote/object_download.py, common/sampling/sharding.py,
  common/shards/epochs/epoch_resume.py, common/shards/epochs/plan_settings.py,
  common/shards/epochs/rank_epoch.py, common/shards/epochs/shard_mixing.py,
  common/shards/epochs/shard_plan.py, common/shards/epochs/shard_reading.py,
  common/shards/epochs/shard_reshape.py, common/shards/shard_checks.py,
  common/shards/shard_content.py, common/shards/shard_formats.py, common/shards/shard_index.py,
  common/shards/shard_samples.py, common/shards/shard_set.py, common/shards/sharded_dataset.py,
  common/shards/tar_members.py, common/workers/held_descriptors.py,
  common/workers/process_lifetime.py, common/workers/start_watch.py.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes.audio.chunked import ChunkedAudioDataset
from recipes.audio.shard_utterances import ShardUtterances
from recipes.audio.spectrogram_inputs import (
    FORMAT,
    FORMAT_VERSION,
    cache_fingerprint,
    feature_settings,
    featurizer,
)
from recipes.common.caches.cache_builds import FolderBuild
from recipes.common.caches.cache_checks import (
    ItemChecks,
    VerifyMode,
    algorithm,
    check_damage,
    file_checksums,
    read_checked,
    write_item_sums,
)
from recipes.common.caches.cache_files import LazyMap, check_size, read_header, write_synced
from recipes.common.caches.packed_strings import resolve_index, resolve_indices
from recipes.common.loading.build_loader import build_loader
from recipes.common.shards.shard_set import ShardSet

_BUILD_HINT = "build_spectrogram_cache() or `recipes cache audio`"
_INFO = np.dtype([("file", "<i8"), ("start", "<f8"), ("frames", "<i8")])


class SpectrogramCacheError(ValueError):
    """A spectrogram cache that is missing, truncated, corrupt or built from other inputs."""


class SpectrogramCache(Dataset):
    """A map-style dataset of `(float32 [n_mels, F] features, info)` from a cache folder.

    `info` is `{"file", "start", "frames"}` with `frames` the valid feature frames (the rest
    of a padded window's frames come from zero padding). `lengths` are the frames per item,
    for `LengthBucketSampler`. Each process maps `features.bin` on first use; one truncated or
    replaced since `open` raises `SpectrogramCacheError` then (reopen the cache).
    """

    def __init__(
        self,
        path: Path,
        header: dict,
        offsets: np.ndarray,
        info: np.ndarray,
        sums: np.ndarray,
        verify: VerifyMode = "first_read",
    ):
        self.path = Path(path)
        self.header = header
        self.n_mels = int(header["n_mels"])
        self.offsets = offsets
        self.lengths = np.diff(offsets)
        self.info = info
        size = int(header["total_frames"]) * self.n_mels
        self._features = LazyMap(
            self.path / "features.bin",
            np.dtype(header["dtype"]).newbyteorder("<"),
            (size,),
            error=SpectrogramCacheError,
        )
        self.checks = ItemChecks(
            self.path / "features.bin",
            sums,
            header["checksum"],
            verify=verify,
            error=SpectrogramCacheError,
            hint=_BUILD_HINT,
        )

    @classmethod
    def open(
        cls,
        cache_dir: str | os.PathLike,
        *,
        fingerprint: str | None = None,
        verify: VerifyMode = "first_read",
    ) -> SpectrogramCache:
        """Opens and validates a cache folder.

        Raises:
            SpectrogramCacheError: missing, truncated, corrupt, damaged (an item found damaged
                when read is recorded in `damaged.json`), another version or other inputs.
        """
        path = Path(cache_dir)
        header = read_header(
            path,
            fmt=FORMAT,
            version=FORMAT_VERSION,
            fingerprint=fingerprint,
            error=SpectrogramCacheError,
            build_hint=_BUILD_HINT,
            fields=(
                "count",
                "total_frames",
                "n_mels",
                "dtype",
                "layout",
                "checksum",
                "file_checksums",
            ),
        )
        try:
            count = int(header["count"])
            total = int(header["total_frames"])
            itemsize = np.dtype(header["dtype"]).itemsize
            features_bytes = total * int(header["n_mels"]) * itemsize
        except (TypeError, ValueError):
            raise SpectrogramCacheError(
                f"{path}/header.json has invalid fields; rebuild the cache."
            ) from None
        check_size(path / "features.bin", features_bytes, SpectrogramCacheError)
        check_size(path / "offsets.bin", (count + 1) * 8, SpectrogramCacheError)
        check_size(path / "info.bin", count * _INFO.itemsize, SpectrogramCacheError)
        check_size(path / "checksums.bin", count * 8, SpectrogramCacheError)
        read = functools.partial(
            read_checked, path, header=header, error=SpectrogramCacheError, hint=_BUILD_HINT
        )
        offsets = read("offsets.bin", "<i8")
        info = read("info.bin", _INFO)
        sums = read("checksums.bin", "<u8")
        if offsets[0] != 0 or offsets[-1] != total or (np.diff(offsets) < 0).any():
            raise SpectrogramCacheError(f"{path}/offsets.bin is corrupt; rebuild the cache.")
        check_damage(
            path, ("features.bin",), SpectrogramCacheError, _BUILD_HINT
        )  # a read found damage: rebuild
        return cls(path, header, offsets, info, sums, verify)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def fingerprint(self) -> str:
        return self.header["fingerprint"]

    def thread_batches(self) -> bool:
        """Items are gathers from a memory map: `make_loader` reads batches in threads
        (`ThreadLoader`)."""
        return True

    @property
    def features(self) -> np.ndarray:
        """The memory map: `[N, n_mels, F]` for a fixed layout, else `[n_mels * total_frames]`."""
        flat = self._map()
        if self.header["layout"] == "fixed" and len(self):
            return flat.reshape(len(self), self.n_mels, int(self.lengths[0]))
        return flat

    def _map(self) -> np.ndarray:
        return self._features.array

    def _info(self, i: int) -> dict:
        row = self.info[i]
        return {
            "file": int(row["file"]),
            "start": float(row["start"]),
            "frames": int(row["frames"]),
        }

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict]:
        i = resolve_index(index, len(self), f"the {len(self)} items in {self.path}")
        block = self._map()[self.offsets[i] * self.n_mels : self.offsets[i + 1] * self.n_mels]
        if self.checks.needed(i):
            self.checks.check(i, block)
        features = torch.from_numpy(block.astype(np.float32)).view(self.n_mels, -1)
        return features, self._info(i)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, dict]]:
        """A batch with one gather from the memory map (fixed layout) and one float32 conversion."""
        if self.header["layout"] != "fixed":
            return [self[i] for i in indices]
        idx = resolve_indices(indices, len(self), f"the {len(self)} items in {self.path}")
        for i in self.checks.pending(
            idx
        ).tolist():  # each item's first read in this process, by default
            self.checks.check(i, self.features[i])
        order = np.argsort(idx, kind="stable")
        gathered = np.empty((len(idx), self.n_mels, int(self.lengths[0])), np.float32)
        gathered[order] = self.features[idx[order]]  # ascending file order, then float32
        batch = torch.from_numpy(gathered)
        return [(batch[k], self._info(int(i))) for k, i in enumerate(idx)]

    def __repr__(self) -> str:
        return (
            f"SpectrogramCache({str(self.path)!r}, n={len(self)}, n_mels={self.n_mels}, "
            f"layout={self.header['layout']}, dtype={self.header['dtype']})"
        )


class _Features:
    """Items `(index, [n_mels, F] features, valid feature frames, info)` of `block`, for the
    build."""

    def __init__(self, dataset, settings, block: range):
        self.dataset = dataset
        self.settings = settings
        self.block = block
        self._features = None

    def __len__(self) -> int:
        return len(self.block)

    def __getitem__(self, position: int):
        index = self.block[position]
        if self._features is None:
            s = self.settings
            self._features = featurizer(
                s["sample_rate"],
                n_fft=s["n_fft"],
                hop_length=s["hop_length"],
                n_mels=s["n_mels"],
                log=s["log"],
            )
        wave, info = self.dataset[index]
        feats = self._features(wave)
        valid = min(feats.shape[-1], 1 + info["frames"] // self.settings["hop_length"])
        return index, feats.numpy().astype(self.settings["dtype"]), valid, info


def _identity(batch):
    return batch


def build_spectrogram_cache(
    dataset: ChunkedAudioDataset | ShardUtterances | ShardSet,
    cache_dir: str | os.PathLike,
    *,
    n_fft: int = 400,
    hop_length: int = 160,
    n_mels: int = 80,
    log: bool = True,
    dtype: str = "float16",
    num_workers: int | None = None,
    progress: bool = True,
    distributed: bool | None = None,
) -> SpectrogramCache:
    """Computes (log-)mel features of every item of a `ChunkedAudioDataset` once.

    Features are computed in DataLoader workers with a tqdm bar, into a temp folder renamed
    into place when complete. A valid cache with the same fingerprint (files with sizes and
    mtimes, chunking, rate, feature parameters, format version) is reused.

    Args:
        dataset: a `ChunkedAudioDataset`; or audio shards: a `ShardSet` (`write_shards` samples
            with a "flac", "wav", ... field; one ragged item per sample at the samples' common
            rate, keyed on the index's sha256s) or a `ShardUtterances` over one (to resample,
            keep channels or name the field).
        cache_dir: the cache folder (replaced atomically when rebuilt).
        n_fft, hop_length, n_mels: `torchaudio.transforms.MelSpectrogram` parameters.
        log: store `log(mel + 1e-6)`.
        dtype: "float16" (default) or "float32".
        num_workers: feature workers per rank; `smart_num_workers()` when None.
        progress: show a progress bar (on rank 0).
        distributed: split the items over the ranks of the initialised process group, every
            rank of every node making the same call; None (the default): whenever a group of
            more than one rank is initialised; False: this process builds alone. Each node's
            folder (node-local or shared, found at run time) ends with the whole cache, the
            parts computed elsewhere received over the process group: byte-identical to one
            process's build.

    Returns:
        The opened `SpectrogramCache`: fixed `[N, n_mels, F]` when every item has the same
        length (padded or dropped windows), ragged otherwise (utterances, kept windows).

    Raises:
        TypeError: `dataset` is none of those (a path: open it as a dataset or `ShardSet` first).
        ShardAudioError, ShardFormatError: a shard sample without audio or at another rate, or a
            shard that differs from its index.
    """
    from tqdm import tqdm

    if isinstance(dataset, ShardSet):
        dataset = ShardUtterances(dataset)
    if not isinstance(dataset, (ChunkedAudioDataset, ShardUtterances)):
        raise TypeError(
            "`dataset` must be a ChunkedAudioDataset, a ShardSet or ShardUtterances, but is "
            f"{type(dataset).__name__} instead (for a folder of files: "
            "ChunkedAudioDataset(folder); of shards: ShardSet.open(folder))."
        )
    if dtype not in ("float16", "float32"):
        raise ValueError(f"`dtype` must be 'float16' or 'float32', but is {dtype!r} instead.")
    for name, value in (("n_fft", n_fft), ("hop_length", hop_length), ("n_mels", n_mels)):
        if value <= 0:
            raise ValueError(f"`{name}` must be positive, but is {value!r} instead.")
    settings = feature_settings(dataset, n_fft, hop_length, n_mels, log, dtype)
    fingerprint = cache_fingerprint(dataset, settings)
    target = Path(cache_dir)
    build = FolderBuild(target, distributed=distributed, inputs=fingerprint)
    if build.needed(
        lambda: SpectrogramCache.open(target, fingerprint=fingerprint), SpectrogramCacheError
    ):
        block = build.block(len(dataset))
        loader = build_loader(
            _Features(dataset, settings, block),
            num_workers=num_workers,
            batch_size=8,
            collate_fn=_identity,
        )
        lengths = np.zeros(len(block), np.int64)
        info = np.zeros(len(block), _INFO)
        with (
            build,
            open(build.part("features.bin"), "wb") as out,
            tqdm(
                total=len(dataset),
                disable=not progress or build.rank != 0,
                desc="computing features",
                unit="item",
            ) as bar,
        ):
            for batch in loader:  # in index order
                for index, feats, valid, item_info in batch:
                    out.write(
                        np.ascontiguousarray(
                            feats, dtype=np.dtype(dtype).newbyteorder("<")
                        ).tobytes()
                    )
                    lengths[index - block.start] = feats.shape[-1]
                    info[index - block.start] = (item_info["file"], item_info["start"], valid)
                bar.update(len(batch) * build.world)
            out.flush()
            os.fsync(out.fileno())
            write_synced(build.part("lengths.bin"), lengths.astype("<i8").tobytes())
            write_synced(build.part("info.bin"), info.tobytes())
            for name in ("features.bin", "lengths.bin", "info.bin"):
                build.concat(name)
            header = None
            if build.leader:  # in each folder (node-local disks: one per node)
                all_lengths = np.fromfile(build.path / "lengths.bin", "<i8")
                (build.path / "lengths.bin").unlink()
                offsets = np.concatenate(([0], np.cumsum(all_lengths))).astype("<i8")
                write_synced(build.path / "offsets.bin", offsets.tobytes())
                layout = "fixed" if len(np.unique(all_lengths)) <= 1 else "ragged"
                checksum = algorithm()
                write_item_sums(
                    build.path,
                    "features.bin",
                    offsets * n_mels * np.dtype(dtype).itemsize,
                    checksum,
                )
                header = {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "fingerprint": fingerprint,
                    "count": len(dataset),
                    "total_frames": int(offsets[-1]),
                    "layout": layout,
                    **settings,
                    "checksum": checksum,
                    "file_checksums": file_checksums(
                        build.path, ("offsets.bin", "info.bin", "checksums.bin"), checksum
                    ),
                }
            build.publish(header)
    return SpectrogramCache.open(target, fingerprint=fingerprint)
