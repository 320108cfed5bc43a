"""A small `recipes bench vision` in the default run, with conservative ratios.

Each claim is checked on a best-of-3 round measured in turns; a round that misses it is
measured again, up to 3 rounds, with the same threshold: on a busy machine (CI runs the whole
suite) a noisy neighbour slows one loader of a round more than the others (68% against a 70%
floor once, 77-92% in every quiet run), while a regression misses in every round.
"""

import pytest

from recipes.bench.images.eval_rows import compare
from recipes.testing import make_image_folder


def in_one_of(rounds: int, measure, check):
    """`check(measure())` passes in one of `rounds` rounds; the last round's failure is raised."""
    for left in range(rounds - 1, -1, -1):
        rows = measure()
        try:
            return check(rows)
        except AssertionError:
            if not left:
                raise


@pytest.fixture(scope="module")
def bench_tree(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("bench"), classes=4, per_class=40, seed=2)


@pytest.mark.slow  # a long run (16 s): in the full suite (CI)
def test_cold_beats_the_baseline_and_warm_is_3x(bench_tree):
    def check(measured):
        rows, _, notes = measured
        baseline, decode_only, cold, cold_threads, warm, threads = (row.items_per_s for row in rows)
        assert all(row.items == 160 for row in rows)
        assert cold > baseline and cold_threads > baseline, rows
        # make_loader's defaults decode in threads on every core; the worker path leaves one to the
        # loop
        assert cold_threads > cold and decode_only > cold_threads, rows
        assert "resize the crop" in notes[0] and "hand-over" in notes[0]
        assert warm >= 3 * baseline, rows
        # make_loader's defaults on the cache: eval-view rows read by threads (measured ~40x here)
        assert threads >= 8 * baseline and threads > warm, rows

    in_one_of(
        3,
        lambda: compare(
            bench_tree,
            size=224,
            batch_size=16,
            workers=1,
            repeat=3,  # best of 3, in turns
            peers=False,
        ),
        check,
    )


# a long run (12 s): the train rows of `recipes bench vision`; the eval rows run in the fast tier
@pytest.mark.slow
def test_train_rows_beat_the_baseline_and_region_decode_is_no_slower(bench_tree, tmp_path):
    from recipes.bench.images.train_rows import compare_train
    from recipes.vision.decoding.region_decode import region_decode_available

    def check(rows):
        assert all(row.items == 160 for row in rows)
        baseline, whole = rows[0].items_per_s, rows[1].items_per_s
        assert whole > baseline, rows
        warm_workers, warm_threads = rows[-2].items_per_s, rows[-1].items_per_s
        # crops over the cached whole images, make_loader's defaults (threads): measured ~7x here
        assert warm_threads >= 3 * baseline and warm_threads > warm_workers, rows
        rows = rows[:-2]
        if region_decode_available():
            assert len(rows) == 3
            # Measured 1.09-1.16x per worker (entropy decoding above the crop is not skippable);
            # a conservative floor against a regression, on a noisy 2-core machine.
            assert rows[2].items_per_s >= 0.9 * whole, rows

    in_one_of(
        3,
        lambda: compare_train(
            bench_tree,
            size=224,
            batch_size=16,
            workers=1,
            repeat=3,  # best of 3, in turns
            device="cpu",
            warm_dir=tmp_path,
        ),
        check,
    )


@pytest.mark.slow  # a long run (about 40 s with the set's generation): in the full suite (CI)
def test_on_photographs_the_cold_thread_path_nears_the_decode_limit_and_beats_workers(tmp_path):
    """Issue #30 on the photographic set: `make_loader`'s choice for cold decoding (threads)
    is the faster path (the rule validated by evidence) and reaches >= 70% of the decode-only
    limit. Measured 81.8% and 4.48x torchvision at 720 images (docs/benchmarks.md); the baseline
    floor here is a conservative guard against a regression on a noisy 2-core machine."""
    from recipes.testing import make_photo_folder

    root = make_photo_folder(tmp_path / "photos", images=192, classes=4, seed=3)

    def check(measured):
        rows = measured[0]
        baseline, decode_only, cold_workers, cold_threads = (row.items_per_s for row in rows[:4])
        assert cold_threads >= 0.7 * decode_only, rows
        assert cold_threads > cold_workers, rows
        assert cold_threads >= 2 * baseline, rows

    in_one_of(
        3,
        lambda: compare(
            root, size=224, batch_size=16, workers=1, repeat=3, peers=False
        ),  # best of 3
        check,
    )
