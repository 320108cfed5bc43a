"""`recipes.bench.resume_compare` (issue #19): `make_loader` resumes exactly in every situation
of the comparison; torchdata's column is recorded beside it, never asserted (it is not ours)."""

from __future__ import annotations

import sys

import pytest

from recipes.bench import resume_compare
from recipes.bench.resume_compare import SITUATIONS, compare_resume, format_table


def _assert_exact(results) -> None:
    for (loader, key), outcome in results.items():
        if loader != "recipes":
            continue
        assert outcome.error is None, (key, outcome.error)
        assert (outcome.repeated, outcome.lost, outcome.order) == (0, 0, True), (key, outcome.notes)


@pytest.fixture
def without_torchdata(monkeypatch):
    """torchdata unimportable, as in an environment that never installed it."""
    monkeypatch.setitem(sys.modules, "torchdata", None)
    monkeypatch.setitem(sys.modules, "torchdata.stateful_dataloader", None)


def test_recipes_column_runs_without_torchdata(without_torchdata, capsys):
    assert not resume_compare.torchdata_available()
    resume_compare.main(["--situations", "a,e"])
    out = capsys.readouterr().out
    assert "torchdata is not installed" in out
    assert "| (a) mid-epoch 0, non-persistent | 0/0/yes |" in out
    assert "| (e) saved after the last batch, before StopIteration | 0/0/yes |" in out
    with pytest.raises(ImportError, match="pip install --no-deps"):
        compare_resume(loaders=["torchdata"], situations=["a"])


@pytest.mark.slow
def test_recipes_exact_in_every_situation_beside_torchdata(record_property):
    pytest.importorskip("torchdata.stateful_dataloader")
    results = compare_resume(loaders=["recipes", "torchdata"], situations=list(SITUATIONS))
    table = format_table(results)
    record_property("resume_compare", table)  # torchdata's column: a record, not a claim
    print(table)
    _assert_exact(results)
