"""Worker init for DataLoader workers: the OpenCV fork fix and per-worker seeding.

Use when: any DataLoader with `num_workers > 0` (`make_loader` installs it for you).
Cost: a few microseconds once per worker start.
Adapt here: add your library's thread pools to `single_threaded_libraries`.
Trade-off: single-threaded decoders inside workers; parallelism comes from the workers.

Why each step:
- OpenCV keeps a thread pool (pthreads/OpenMP). A fork copies its locks but not its threads,
  so a worker whose parent used cv2 can wait forever on a lock nobody will release
  (pytorch#1355, #1838, #45198). `cv2.setNumThreads(0)` makes cv2 run inline in the worker,
  and OpenCL is switched off because its runtime is not fork-safe either.
- `torch.set_num_threads(1)`: N workers x M intra-op threads oversubscribe the cores.
- Python `random` and NumPy's global state are copied by fork, so every worker would draw the
  same augmentations (pytorch#5059). PyTorch gives each worker `base_seed + worker_id` as its
  torch seed; we seed `random` and NumPy from it (different per worker and per epoch, and
  reproducible when the loader has a seeded `generator`).
- Hugging Face tokenizers use a Rust thread pool; after fork it can deadlock, so parallelism
  is turned off in the worker (the parent's tokenizer stays parallel).
- Workers die with their parent. PyTorch's worker watchdog only runs between batches: a worker
  blocked writing a large (numpy, pickled) batch into a full pipe never gets back to it, and
  outlives a SIGKILLed parent (the OOM killer's usual victim) for good, holding its memory
  and the parent's stdout. On Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)` has the kernel kill
  the worker when its parent dies; elsewhere a daemon thread checks the parent every second.
  (Linux ties the signal to the thread that started the worker: iterate loaders from a thread
  that lives as long as the loader, as the main thread does.)
- The cyclic garbage collector writes into every object it examines, so a full collection in a
  forked worker copies every page of the parent's objects it holds (copy on write), once, at
  whichever epoch the worker's allocations first trigger one: USS stepped 1.5 MB a worker at
  epoch 2 or 3 of an ImageFolderFast run, then flat. `gc.freeze()` in the worker (a list
  splice, O(1)) sets the inherited objects aside from every collection; what the worker
  allocates itself is collected as usual.
Copy with: common/workers/process_lifetime.py.
"""

from __future__ import annotations

import gc
import os
import random
import sys

import numpy as np
import torch

from recipes.common.workers.process_lifetime import die_with_parent


def worker_init(worker_id: int) -> None:
    """Makes a DataLoader worker fork-safe and seeds its random generators.

    Pass as `DataLoader(worker_init_fn=worker_init)`, or call it first in your own init.

    Args:
        worker_id: the worker's index, as DataLoader passes it.
    """
    die_with_parent()
    if torch.utils.data.get_worker_info() is not None:  # a worker: never the loop's own process
        keep_inherited_pages_shared()
    single_threaded_libraries()
    seed = torch.initial_seed()  # base_seed + worker_id, set by DataLoader before this call
    random.seed(seed)
    np.random.seed(seed % 2**32)


def keep_inherited_pages_shared() -> None:
    """Sets the objects a forked child inherited aside from its garbage collector (`gc.freeze`),
    so that no collection writes into, and so copies, the parent's pages."""
    gc.freeze()


def single_threaded_libraries() -> None:
    """Thread pools of the libraries a forked process inherits, made single-threaded (torch,
    tokenizers, OpenCV: see the module doc)."""
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    cv2 = sys.modules.get("cv2")
    if cv2 is None:
        # The parent never loaded OpenCV, so no pool was copied: nothing to repair, and no
        # import here (it costs 20 ms to a second in a fresh worker, wasted on text loaders).
        # If the dataset imports cv2 later, these make it start single-threaded, without OpenCL.
        os.environ["OPENCV_FOR_THREADS_NUM"] = "1"
        os.environ["OPENCV_OPENCL_RUNTIME"] = "disabled"
        return
    cv2.setNumThreads(0)
    cv2.ocl.setUseOpenCL(False)


class ChainedWorkerInit:
    """`worker_init`, then the user's own `worker_init_fn` (picklable for spawn workers)."""

    def __init__(self, user_fn):
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        worker_init(worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)
