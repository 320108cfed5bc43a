"""Lightning resumes our loaders exactly (issue 31; common/frameworks/lightning_glue.py).

The proof (slow tier): a tiny model trained by Lightning with `strategy="ddp"` on 2 CPU
processes (gloo), 64 samples, batch 4, 3 epochs, is killed right after a checkpoint (after 5
steps of epoch 1, or after epoch 0's last step), and a fresh pair of processes resumes it with
`ckpt_path`. Every rank's samples, counted per epoch across the kill, are the uninterrupted
run's in the same order, and over the ranks every sample is trained on exactly once per epoch:
with worker processes, with `configure_optimizers` reading `trainer.estimated_stepping_batches`
(OneCycleLR: Lightning #20550, where Lightning never loads the loader's state), on the thread
path (`ThreadLoader`), with `LengthBucketSampler` (`use_distributed_sampler=False`), and with a
`RobustLoader`. The runs are processes forked from an interpreter that has imported Lightning
(`tests/zygote.py`: nothing of the killed run survives in them), in the environment torchrun
sets. Without the DataModule, plain Lightning is exact mid-epoch, and loses samples under
OneCycleLR and after a checkpoint at an epoch's last step (so the harness sees a loss).

The fast tier: importing the glue imports no Lightning. The loaders' side (a state loaded, or
an epoch set, after `iter()`) is tested without Lightning in
tests/common/loading/test_late_state.py."""

from __future__ import annotations

import collections
import socket
from pathlib import Path

import pytest

RUN = "from tests.common.frameworks.lightning_resume_script import main; main()"
ROOT = Path(__file__).resolve().parents[3]
SAMPLES, BATCH, EPOCHS = 64, 4, 3
MID, LAST = "mid", "last"  # killed after 5 steps of epoch 1, or after epoch 0's last step


def _stop(at: str, ranks: int) -> tuple[str, ...]:
    """The script's `--stop-at EPOCH STEP`: a checkpoint there, then a kill."""
    return (
        ("--stop-at", "1", "5") if at == MID else ("--stop-at", "0", str(SAMPLES // BATCH // ranks))
    )


@pytest.fixture(scope="module")
def lightning_zygote():
    pytest.importorskip("lightning")
    from tests.zygote import Zygote

    server = Zygote(
        [
            "numpy",
            "torch",
            "recipes.common",
            "lightning.pytorch",
            "tests.common.frameworks.lightning_resume_script",
        ]
    )
    yield server
    server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(zygote, workdir: Path, *args: str, ranks: int = 2, check: bool = True) -> list:
    """The script on `ranks` processes, in torchrun's environment (Lightning takes the ranks
    from it instead of launching its own); their `Child`ren once they exited."""
    env = (
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(ranks),
            "LOCAL_WORLD_SIZE": str(ranks),
            "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": "lightning-resume",
            "OMP_NUM_THREADS": "1",
        }
        if ranks > 1
        else {"OMP_NUM_THREADS": "1"}
    )
    children = [
        zygote.python(
            RUN,
            "--workdir",
            workdir,
            *args,
            cwd=ROOT,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)} if ranks > 1 else env,
        )
        for r in range(ranks)
    ]
    for child in children:
        child.wait(timeout=240)
    if check:
        assert all(c.returncode == 0 for c in children), "\n".join(
            c.stderr[-3000:] for c in children
        )
    return children


def _epochs(workdir: Path, rank: int) -> dict[int, list[str]]:
    """Rank `rank`'s samples of each epoch, in the order its steps trained on them."""
    seen: dict[int, list[str]] = collections.defaultdict(list)
    for line in (workdir / f"samples-rank{rank}.txt").read_text().splitlines():
        epoch, *ids = line.split()
        seen[int(epoch)] += ids
    return dict(seen)


def _repeated_and_lost(got: list[str], want: list[str]) -> tuple[int, int]:
    have, expected = collections.Counter(got), collections.Counter(want)
    return sum((have - expected).values()), sum((expected - have).values())


@pytest.fixture(scope="module")
def uninterrupted(lightning_zygote, tmp_path_factory):
    """`uninterrupted(kind, ranks)`: the workdir of an uninterrupted run, launched once per
    kind and rank count for the module (the data's order does not depend on the schedule)."""
    done: dict[tuple[str, int], Path] = {}

    def run(kind: str, ranks: int) -> Path:
        if (kind, ranks) not in done:
            folder = tmp_path_factory.mktemp(f"{kind}-{ranks}") / "whole"
            _launch(lightning_zygote, folder, "--kind", kind, ranks=ranks)
            done[kind, ranks] = folder
        return done[kind, ranks]

    return run


def _killed_and_resumed(
    zygote, folder: Path, kind: str, *extra: str, at: str = MID, ranks: int
) -> Path:
    _launch(zygote, folder, "--kind", kind, *_stop(at, ranks), *extra, ranks=ranks)
    for rank in range(ranks):
        seen = _epochs(folder, rank)
        if at == MID:
            assert len(seen[1]) == 5 * BATCH  # killed after 5 steps of epoch 1
        else:
            assert (
                sorted(seen) == [0] and len(seen[0]) == SAMPLES // ranks
            )  # killed after epoch 0's last step
    _launch(zygote, folder, "--kind", kind, "--resume", *extra, ranks=ranks)
    return folder


CASES = [
    ("workers", False, MID, 2),
    ("workers", True, MID, 2),
    ("threads", True, MID, 2),
    ("bucket", True, MID, 2),
    ("bucket-threads", True, MID, 2),
    ("robust", True, MID, 2),
    ("workers", True, LAST, 2),
    ("bucket", False, LAST, 2),
    ("robust", False, LAST, 2),
    ("workers", False, LAST, 1),
]


@pytest.mark.slow  # 3 launches each (4-10 s)
@pytest.mark.parametrize(
    "kind, onecycle, at, ranks",
    CASES,
    ids=[f"{k}-{'onecycle' if o else 'plain'}-{a}-{r}ranks" for k, o, a, r in CASES],
)
def test_a_killed_run_resumes_every_sample_once_in_the_uninterrupted_order(
    kind, onecycle, at, ranks, lightning_zygote, uninterrupted, tmp_path
):
    whole = uninterrupted(kind, ranks)
    extra = ("--onecycle",) if onecycle else ()
    crashed = _killed_and_resumed(
        lightning_zygote, tmp_path / "crashed", kind, *extra, at=at, ranks=ranks
    )
    for rank in range(ranks):
        want, got = _epochs(whole, rank), _epochs(crashed, rank)
        assert sorted(got) == list(range(EPOCHS))
        for epoch in range(EPOCHS):
            assert _repeated_and_lost(got[epoch], want[epoch]) == (0, 0), (rank, epoch)
            assert got[epoch] == want[epoch], (rank, epoch)  # and in the same order
        assert (
            want[0] != want[1] != want[2]
        )  # each epoch its own order (set_epoch reached the sampler)
    for epoch in range(EPOCHS):  # over the ranks, each sample exactly once per epoch
        counts = collections.Counter(
            i for rank in range(ranks) for i in _epochs(crashed, rank)[epoch]
        )
        assert counts == collections.Counter(str(i) for i in range(SAMPLES)), epoch


@pytest.mark.slow  # one process x 3 launches (~6 s)
def test_plain_lightning_resumes_a_make_loader_loader_exactly(
    lightning_zygote, uninterrupted, tmp_path
):
    """No DataModule of ours: Lightning's own checkpoint of the loader's state (2.2+) is exact."""
    whole = _epochs(uninterrupted("plain", 1), 0)
    got = _epochs(_killed_and_resumed(lightning_zygote, tmp_path / "crashed", "plain", ranks=1), 0)
    assert [got[e] for e in range(EPOCHS)] == [whole[e] for e in range(EPOCHS)]
    assert all(_repeated_and_lost(got[e], whole[e]) == (0, 0) for e in range(EPOCHS))


@pytest.mark.slow  # one process x 3 launches (~6 s)
def test_plain_lightning_loses_samples_when_onecycle_reads_the_steps(
    lightning_zygote, uninterrupted, tmp_path
):
    """Lightning #20550, as the DataModule's docs describe it: without LoaderDataModule the
    loader's state is never loaded. If this fails, Lightning fixed it: update
    docs/frameworks/lightning.md and lightning_glue.py's docstring."""
    whole = _epochs(uninterrupted("plain", 1), 0)
    got = _epochs(
        _killed_and_resumed(lightning_zygote, tmp_path / "crashed", "plain", "--onecycle", ranks=1),
        0,
    )
    repeated, lost = _repeated_and_lost(got[1], whole[1])
    assert repeated == lost > 0, (repeated, lost)


@pytest.mark.slow  # one process x 3 launches (~6 s)
def test_plain_lightning_loses_an_epoch_after_a_checkpoint_at_an_epochs_last_step(
    lightning_zygote, uninterrupted, tmp_path
):
    """Lightning calls `iter()` before `set_epoch`, and resumed after an epoch's last step it
    starts the next epoch on the loader's (empty) rest of the old one: a loader that counts
    its own epochs (make_loader(shuffle=True), no sampler) cannot tell. The DataModule's
    DistributedSampler can (the case above). If this fails, update the docs as above."""
    whole = _epochs(uninterrupted("plain", 1), 0)
    got = _epochs(
        _killed_and_resumed(lightning_zygote, tmp_path / "crashed", "plain", at=LAST, ranks=1), 0
    )
    assert (
        len(got.get(1, [])) == 0
        and sum(len(v) for v in got.values()) == sum(len(v) for v in whole.values()) - 64
    )


@pytest.mark.slow  # 2 processes, stopped at setup (~3 s)
def test_a_batch_sampler_of_ours_under_lightnings_samplers_is_refused_naming_the_setting(
    lightning_zygote, tmp_path
):
    children = _launch(
        lightning_zygote, tmp_path, "--kind", "bucket", "--lightning-samplers", check=False
    )
    assert all(c.returncode != 0 for c in children)
    assert "use_distributed_sampler=False" in children[0].stderr
    assert "LengthBucketSampler" in children[0].stderr


def test_importing_the_glue_imports_no_lightning(zygote):
    code = (
        "import sys\nimport recipes.common.frameworks.lightning_glue as glue\nassert not "
        "any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules), [m for "
        "m in sys.modules if 'lightning' in m][:5]\nassert callable(glue.check_sampler_kept) and "
        "glue.LoaderDataModuleMixin.train_loader\n"
    )
    child = zygote.python(code)
    assert child.wait(timeout=60) == 0, child.stderr


@pytest.mark.slow  # 2 processes, then 1 and 3 (~20 s)
@pytest.mark.parametrize("kind, ranks", [("workers", 1), ("workers", 3), ("bucket", 3)])
def test_a_resume_on_another_rank_count_finishes_the_epoch_once(
    lightning_zygote, tmp_path, kind, ranks
):
    """Killed after 5 steps of epoch 1 on 2 ranks, resumed from the checkpoint on 1 or 3:
    Lightning counts the epoch's steps on from the 5 it restored and the loader's length is
    those 5 plus its rest (the ElasticDistributedSampler's, or LengthBucketSampler's), so every
    sample of epoch 1 is trained on once over both runs (at most ranks - 1 samples repeated to pad
    the new deal; batches for LengthBucketSampler), and epoch 2 once on the new ranks."""
    folder = tmp_path / "crashed"
    _launch(lightning_zygote, folder, "--kind", kind, *_stop(MID, 2), ranks=2)
    before = [_epochs(folder, rank) for rank in range(2)]
    for log in folder.glob("samples-rank*.txt"):
        log.rename(log.with_suffix(".before"))
    _launch(lightning_zygote, folder, "--kind", kind, "--resume", ranks=ranks)
    after = [_epochs(folder, rank) for rank in range(ranks)]
    every = collections.Counter(str(i) for i in range(SAMPLES))
    for epoch in (1, 2):
        counts = collections.Counter(i for seen in after for i in seen.get(epoch, []))
        if epoch == 1:
            counts += collections.Counter(i for seen in before for i in seen[1])
        padding = (ranks - 1) * (
            BATCH if kind == "bucket" else 1
        )  # a batch sampler pads with whole batches
        assert set(counts) == set(every) and sum(counts.values()) - SAMPLES <= padding, (
            epoch,
            counts - every,
        )
        assert (
            len({len(seen.get(epoch, [])) for seen in after}) == 1
        )  # equal steps on the new ranks


@pytest.mark.slow
def test_a_loader_without_length_warns(tmp_path):
    """A loader without a length, which Lightning reads one batch ahead of, is warned about."""
    from lightning.pytorch import Trainer
    from torch.utils.data import IterableDataset

    from recipes.common import LoaderWarning
    from recipes.common.frameworks import lightning_glue as glue

    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
    )

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    stream = glue.LoaderDataModule(Stream(), batch_size=4)
    stream.trainer = trainer
    with pytest.warns(LoaderWarning, match="one batch ahead"):
        stream.train_dataloader()
