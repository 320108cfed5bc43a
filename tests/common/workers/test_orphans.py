"""Workers never outlive their parent (issue #10): SIGKILL the parent while its workers send
large batches, then no worker may be alive 10 s later."""

import os
import signal
import sys
import textwrap
import time

import psutil
import pytest

LOADER_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from recipes.common import make_loader

    class Big:
        def __len__(self):
            return 100_000
        def __getitem__(self, i):
            return np.full((256, 256, 3), i % 251, np.uint8)

    if __name__ == "__main__":
        loader = make_loader(
            Big(), batch_size=32, num_workers=2, collate_fn=lambda items: np.stack(items)
        )
        it = iter(loader)
        for _ in range(3):
            next(it)
        print(" ".join(str(w.pid) for w in it._workers), flush=True)
        time.sleep(600)  # the workers fill the pipe and block writing: the repro of issue #10
""")

CACHE_SCRIPT = textwrap.dedent("""
    import shutil, sys, time, threading
    from recipes.testing import make_image_folder
    from recipes.vision import ImageFolderFast, build_image_cache
    import psutil

    if __name__ == "__main__":
        root = make_image_folder(sys.argv[1], classes=2, per_class=1, size=(640, 480), seed=3)
        # 300 images to decode, 2 to encode: copies are free to make
        for folder in sorted(root.iterdir()):
            (image,) = folder.iterdir()
            for k in range(149):
                shutil.copyfile(image, folder / f"copy{k:03d}{image.suffix}")
        ds = ImageFolderFast(root, size=224)
        def report():
            while not psutil.Process().children():
                time.sleep(0.01)
            time.sleep(0.5)
            print(" ".join(str(c.pid) for c in psutil.Process().children()), flush=True)
        threading.Thread(target=report, daemon=True).start()
        build_image_cache(ds, sys.argv[2], num_workers=1, progress=False)
        time.sleep(600)
""")


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_parent_and_watch(zygote, script, *args):
    parent = zygote.python(script, *args)
    try:
        deadline = time.monotonic() + 120
        while not parent.stdout.endswith("\n"):  # the parent reports its workers' pids in one line
            assert time.monotonic() < deadline and parent.poll() is None, parent.stderr[-3000:]
            time.sleep(0.02)
        pids = [int(p) for p in parent.stdout.split()]
        assert pids, "the parent reported no worker"
        assert all(_alive(p) for p in pids)
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        survivors = [p for p in pids if _alive(p)]
        return survivors
    # clean up what a failure left: only this test's processes (other tests' workers live here too)
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in locals().get("pids", []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_loader_workers_die_with_a_killed_parent(zygote):
    assert _kill_parent_and_watch(zygote, LOADER_SCRIPT) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.slow  # 6 s
def test_cache_build_workers_die_with_a_killed_parent(tmp_path, zygote):
    assert _kill_parent_and_watch(zygote, CACHE_SCRIPT, tmp_path / "tree", tmp_path / "cache") == []
