"""The tuner's descent starts from several tunings (docs/perf-log.md v20)."""

from __future__ import annotations

from math import prod
from pathlib import Path

import pytest

from mirage_cli.loading import load_graph
from mirage_cli.search import tune as tuner
from mirage_cli.search.design import design_of

ROOT = Path(__file__).resolve().parent.parent


def _design(stem: str):  # type: ignore[no-untyped-def]
    fused = load_graph(str(ROOT / "examples" / "mugraphs" / f"{stem}_fused.mir"))
    program = load_graph(str(ROOT / "examples" / f"{stem}.mir"), {"batch": 8})
    design, _ = design_of(fused)
    return program, design


def test_rebalanced_starts_keep_the_block_count() -> None:
    program, design = _design("qknorm_gqa")
    starts = tuner.starts(program, design)
    assert len(starts) == 1 + tuner.REBALANCED_STARTS
    assert len(set(starts)) == len(starts)
    for k in range(len(starts[0])):
        grids = [s[k][0] for s in starts]
        assert len({prod(g) for g in grids}) == 1
        # Each start spreads the blocks more evenly: the largest axis shrinks.
        assert [max(g) for g in grids] == sorted((max(g) for g in grids), reverse=True)


def test_a_one_axis_grid_has_one_start() -> None:
    assert tuner._rebalanced((64, 1, 1), 1) == (64, 1, 1)
    assert tuner._rebalanced((4, 2, 1), 2) == (4, 2, 1)   # already within a factor 2


def test_more_starts_find_a_better_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    # qknorm_gqa's two-kernel design at batch 8: one descent from the first start
    # stops at a local optimum that a rebalanced start beats.
    program, design = _design("qknorm_gqa")
    monkeypatch.setattr(tuner, "REBALANCED_STARTS", 0)
    one = tuner.tune(program, design)[0][0].time_us
    monkeypatch.setattr(tuner, "REBALANCED_STARTS", 2)
    more = tuner.tune(program, design)[0][0].time_us
    assert more < one
