"""The OpenCV fork fix, proven in a subprocess with a timeout (a hang fails one test)."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, threading
    import cv2, numpy as np, torch
    from torch.utils.data import DataLoader
    from recipes.common import make_loader
    from recipes.vision import ImageFolderFast, uint8_collate

    # The parent uses OpenCV with a thread pool, from several threads, before forking.
    cv2.setNumThreads(4)
    big = np.random.default_rng(0).integers(0, 255, (1500, 2000, 3), np.uint8)
    def busy():
        for _ in range(20):
            cv2.GaussianBlur(cv2.resize(big, (1000, 750)), (9, 9), 0)
    threads = [threading.Thread(target=busy) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert cv2.getNumThreads() == 4

    class Probe(ImageFolderFast):
        def __getitem__(self, i):
            image, target = super().__getitem__(i)
            return image, cv2.getNumThreads()

    ds = Probe(sys.argv[1], size=64)
    loader = make_loader(ds, profile="production", num_workers=2, batch_size=4,
                         collate_fn=uint8_collate, multiprocessing_context="fork", timeout=60)
    threads_seen = set()
    n = 0
    for images, threads_in_worker in loader:
        n += len(images)
        threads_seen |= set(threads_in_worker.tolist())
    print("decoded", n, "threads", sorted(threads_seen))
""")


@pytest.mark.slow  # a long run (5 s): in the full suite (CI); the default run keeps headroom
def test_parent_opencv_threads_then_forked_workers_decode(image_tree):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(image_tree)], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "decoded 12 threads [1]" in out.stdout  # completed; single-threaded inside workers
