"""`recipes bench step` (issue 39): each path beside a simulated step holding the GIL."""

import pytest


@pytest.mark.slow  # about 30 s: the photographic set, its cache, 4 paths x 4 runs
def test_recipes_bench_step_prints_every_path_beside_every_step(capsys):
    from recipes.cli import main

    assert (
        main(
            [
                "bench",
                "step",
                "--images",
                "96",
                "--size",
                "96",
                "--batch-size",
                "16",
                "--batches",
                "24",
                "--gil",
                "0,3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [
        line.split("|")[1:-1]
        for line in out.splitlines()
        if line.startswith("| ") and " ms of " in line
    ]
    assert len(rows) == 12  # 2 steps holding the GIL and the longest off it, x 4 paths
    assert sum("off the GIL" in r[0] for r in rows) == 4
    assert {r[1].strip() for r in rows} == {
        "make_loader default",
        "isolated threads (path='isolated')",
        "in-process threads (path='threads')",
        "2 worker processes (path='workers')",
    }
    for r in rows:
        assert float(r[2].replace(",", "")) > 0 and 0 < float(r[4].strip().rstrip("%")) <= 200
        assert 0 < float(r[5].strip().rstrip("%")) <= 100  # the CPU ceiling, of ideal
    assert "make_loader's default:" in out


@pytest.mark.slow  # about 6 s of timed steps: in the full suite (CI)
def test_the_simulated_step_holds_the_gil_for_its_share_and_sleeps_the_rest():
    import threading
    import time

    from recipes.bench.harness.beside_step import SimulatedStep

    counts = [0]
    stop = threading.Event()

    def spin():  # a Python thread: it runs only while the step's thread lets go of the GIL
        while not stop.is_set():
            counts[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:

        def share(step):
            counts[0] = 0
            start, cpu = time.perf_counter(), time.thread_time()
            for _ in range(20):
                step(None)
            cpus.append(time.thread_time() - cpu)
            return counts[0], time.perf_counter() - start

        cpus = []
        free, free_s = share(SimulatedStep(0.0, 0.004))
        held, held_s = share(SimulatedStep(0.004, 0.004))
        off, off_s = share(SimulatedStep(0.004, 0.004, held=False))
    finally:
        stop.set()
        thread.join()
    assert free_s >= 0.08 and held_s >= 0.08 and off_s >= 0.08  # 20 steps of 4 ms each
    # The held steps are a fixed amount of work: 4 ms of the loop thread's CPU each, however
    # often the other thread takes the GIL meanwhile (the step then lasts longer, as a real one).
    assert cpus[1] >= 0.08 and cpus[2] >= 0.08 and cpus[0] < 0.04
    assert (
        held < free and held < off
    )  # the GIL held for the whole step leaves the other thread less
