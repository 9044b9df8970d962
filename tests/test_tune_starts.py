"""The tuner's descent starts from several tunings (docs/perf-log.md v20), and the
driver ranks designs by a tuning that fits (v21)."""

from __future__ import annotations

import dataclasses
from math import prod
from pathlib import Path

import pytest

from mirage_cli.loading import graphs_from_text, load_graph
from mirage_cli.search import cost, driver
from mirage_cli.search import tune as tuner
from mirage_cli.search.design import design_of
from tests.test_chain import QKNORM_ONE_KERNEL

ROOT = Path(__file__).resolve().parent.parent


def _design(stem: str, batch: int = 8):  # type: ignore[no-untyped-def]
    fused = load_graph(str(ROOT / "examples" / "mugraphs" / f"{stem}_fused.mir"))
    program = load_graph(str(ROOT / "examples" / f"{stem}.mir"), {"batch": batch})
    design, _ = design_of(fused)
    return program, design


def test_rebalanced_starts_keep_the_block_count() -> None:
    program, design = _design("qknorm_gqa")
    every = tuner.starts(program, design)
    assert len(set(every)) == len(every)
    starts = every[:1 + tuner.REBALANCED_STARTS]
    for k in range(len(starts[0])):
        grids = [s[k][0] for s in starts]
        assert len({prod(g) for g in grids}) == 1
        # Each start spreads the blocks more evenly: the largest axis shrinks.
        assert [max(g) for g in grids] == sorted((max(g) for g in grids), reverse=True)


def test_the_last_start_has_looping_grids_on_half_the_sms() -> None:
    program, design = _design("rmsnorm_linear")
    every = tuner.starts(program, design)
    first, halved = every[0], every[-1]
    assert halved == tuner._halved(first, design) != first
    half = cost.profile().num_sms // 2
    for (grid, forloop), (grid0, forloop0) in zip(halved, first):
        assert prod(grid) <= half < prod(grid0) and forloop == forloop0
        assert all(b % a == 0 for a, b in zip(grid, grid0))


def test_a_one_axis_grid_has_one_start() -> None:
    assert tuner._rebalanced((64, 1, 1), 1) == (64, 1, 1)
    assert tuner._rebalanced((4, 2, 1), 2) == (4, 2, 1)   # already within a factor 2


def test_more_starts_find_a_better_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    # qknorm_gqa's two-kernel design at batch 1: one descent from the first start
    # stops at a local optimum that a rebalanced start beats, where the descent moves
    # one size at a time (moving a factor between axes, it reaches that one as well).
    # (At batch 8 it did too until the model priced a loop's invariant tiles,
    # revision 33.)
    program, design = _design("qknorm_gqa", 1)
    monkeypatch.setattr(tuner, "_transfers", lambda grid, axes: [])
    monkeypatch.setattr(tuner, "REBALANCED_STARTS", 0)
    one = tuner.tune(program, design)[0][0].time_us
    monkeypatch.setattr(tuner, "REBALANCED_STARTS", 2)
    more = tuner.tune(program, design)[0][0].time_us
    assert more < one


# qknorm_gqa's one-kernel design (tests/test_chain.py) at the example's 4096 keys.
ONE_KERNEL = QKNORM_ONE_KERNEL.replace("seq = 512", "seq = 4096").replace(
    "forloop=8", "forloop=64")


def _batch1() -> tuple[object, object, object]:
    program = load_graph(str(ROOT / "examples" / "qknorm_gqa.mir"), {"batch": 1})
    split, _ = design_of(load_graph(str(ROOT / "examples" / "mugraphs" /
                                        "qknorm_gqa_fused.mir")))
    one, _ = design_of(graphs_from_text(ONE_KERNEL, "one.mir")[0])
    return program, split, one


def test_a_design_whose_first_tuning_does_not_fit_is_ranked_by_one_that_does() -> None:
    program, split, _ = _batch1()
    first = tuner.tune(program, split, max_steps=0)[0][0]
    assert not first.fits
    fitting = tuner.first_fitting(program, split)[0][0]
    assert fitting.fits


def test_the_driver_tunes_a_design_whose_first_tuning_does_not_fit() -> None:
    # qknorm_gqa at batch 1: the split (flash-decoding) form's first tuning does not
    # fit shared memory; with only one design tuned fully, ranking by the first tuning
    # alone tuned the one-kernel design and never the split one, predicted 2x faster.
    # The split form's first fitting tuning, (2, 32, 2) x 2, has too few keys per
    # iteration for the chain's registers: its second matmul reads f32 scores, which
    # the model prices as gathered (scalar_copy_slowdown) and then ranks after the
    # one-kernel design. That term is not what this test is about: without it, the
    # ranking by the first fitting tuning picks the split form.
    program, split, one = _batch1()
    options = driver.SearchOptions(tune_designs=1)
    base = cost.profile()
    cost.use_profile(dataclasses.replace(base, scalar_copy_slowdown=1.0))
    try:
        ranked = driver._ranked(program, [one, split], options, driver.Progress(),
                                lambda p: None)
        best_design, _, best_graph, best_cost = ranked[0]
        assert best_design == split
        assert len(best_graph.ops) == 2
        assert best_cost.time_us < tuner.tune(program, one)[0][0].time_us
    finally:
        cost.use_profile(base)


def test_the_descent_moves_a_factor_of_two_between_grid_axes() -> None:
    """A transfer keeps the blocks and changes the tiles' shape."""
    moved = tuner._transfers((8, 2, 8), 3)
    assert (16, 2, 4) in moved and (4, 2, 16) in moved and (8, 4, 4) in moved
    assert all(prod(g) == 8 * 2 * 8 for g in moved)
    assert all(min(g) >= 2 for g in moved)         # no split axis falls to 1 block
    assert tuner._transfers((2, 2, 1), 2) == []    # no axis with a factor to give
    assert tuner._transfers((64, 1, 1), 1) == []   # one split axis


def test_gqa_reaches_the_grid_a_transfer_away(monkeypatch: pytest.MonkeyPatch) -> None:
    """gqa at batch 8: descending one size at a time stopped at a tuning next to a
    better one two moves away (through a grid the model rates worse). The model's
    landscape as it was found, its chains at the mma.sync rate (with the wgmma rate the
    plain descent reaches gqa's best too)."""
    program, design = _design("gqa")
    base = cost.profile()
    cost.use_profile(dataclasses.replace(base, chain_wgmma_flops=None))
    try:
        best = tuner.tune(program, design)[0][0].time_us
        monkeypatch.setattr(tuner, "_transfers", lambda grid, axes: [])
        without = tuner.tune(program, design)[0][0].time_us
    finally:
        cost.use_profile(base)
    assert best < without


def test_the_tuning_sweep_tool_writes_fitting_tunings_best_first() -> None:
    """tools/tuning_sweep.py: power-of-two grids within the block bounds (each split
    axis at least 2 blocks), instantiated by the builder, fitting, best predicted
    first."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tuning_sweep",
                                                  ROOT / "tools" / "tuning_sweep.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    gs = tool.grids(2, 96, 528)
    assert gs and all(g[0] >= 2 and g[1] >= 2 and g[2] == 1 and 96 <= prod(g) <= 528
                      for g in gs)
    program = load_graph(str(ROOT / "examples" / "gqa.mir"), {"batch": 1})
    design, _ = design_of(load_graph(str(ROOT / "examples" / "mugraphs" / "gqa_fused.mir"),
                                     {"batch": 1}))
    found = tool.sweep(program, design, (128, 128), [8])
    assert found and [us for us, _, _ in found] == sorted(us for us, _, _ in found)
    assert all(prod(t[0][0]) == 128 and t[0][1] == 8 for _, t, _ in found)


def test_the_start_splits_rows_into_whole_16_byte_vectors() -> None:
    """At n = 2560 the fused RMSNorm + linear started at 128 blocks of 20 columns
    (40-byte rows, copied element by element), was ranked by that tuning's 48 us and
    never tuned; the start now keeps whole 16-byte vectors per row (64 blocks of 40
    columns), and the first fitting tuning is the one the descent improves on."""
    program = load_graph(str(ROOT / "examples" / "rmsnorm_linear.mir"),
                         {"batch": 1, "hidden": 2048, "n": 2560})
    shipped = load_graph(str(ROOT / "examples" / "mugraphs" / "rmsnorm_linear_fused.mir"))
    design, _ = design_of(shipped)
    first = tuner.start(program, design)
    assert first == (((64, 1, 1), 32),)
    (c, t, _), *_ = tuner.first_fitting(program, design)
    assert t == first and c.time_us < 10
    assert tuner.tune(program, design)[0][0].time_us <= c.time_us
    # The example's 6144 columns start as before: 256 blocks of 24 (48-byte rows).
    example = load_graph(str(ROOT / "examples" / "rmsnorm_linear.mir"), {"batch": 8})
    assert tuner.start(example, design)[0][0] == (256, 1, 1)
    assert tuner._vector_elements(design.steps[0], program.tensor_types()) == [8, 1, 1]


def test_the_tuning_in_worker_processes_ranks_as_in_one(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """``_ranked`` tunes in ``jobs`` forked processes: the same ranking, tunings and
    costs as in one process; a budget already spent tunes nothing and leaves no
    worker behind."""
    import multiprocessing as mp

    prog = load_graph(str(ROOT / "examples" / "lora.mir"), {"batch": 2, "hidden": 64,
                                                            "n": 256})
    pool = driver.search(prog, driver.SearchOptions()).pool
    assert pool is not None and len(pool) >= driver.PARALLEL_TUNE_MIN
    forks: list[str | None] = []
    real = mp.get_context
    monkeypatch.setattr(driver.mp, "get_context",
                        lambda method=None: forks.append(method) or real(method))

    def ranked(jobs: int, deadline: float | None = None) -> tuple[list[object], str]:
        progress = driver.Progress()
        r = driver._ranked(prog, pool, driver.SearchOptions(), progress, lambda p: None,
                           deadline=deadline, jobs=jobs)
        return [(d, t, c) for d, t, _, c in r], progress.clock

    one, _ = ranked(1)
    assert one and not forks
    assert ranked(2) == (one, "") and forks and set(forks) == {"fork"}
    assert ranked(2, deadline=0.0) == ([], "tuning (budget)")
    assert not mp.active_children()


def test_a_start_fills_the_sms_where_the_descent_from_the_others_stops_short() -> None:
    """gated_mlp at hidden 2560 and 6912 columns: the descent from the first start stops
    at 36 tiles of 192 columns (72 blocks); the start on the grid that fills the most
    SMs (54 tiles of 128 columns, split two ways: 108 blocks) reaches a tiling the
    model prices lower (docs/perf-log.md v52)."""
    program, design = _design("gated_mlp")
    program = load_graph(str(ROOT / "examples" / "gated_mlp.mir"),
                         {"batch": 8, "hidden": 2560, "n": 6912})
    types = program.tensor_types()
    first = tuner.start(program, design)
    filled = tuner._filled(first, design, types)
    assert filled in tuner.starts(program, design)
    ((grid, _),) = filled
    assert grid == (54, 1, 1) and 6912 // 54 % 8 == 0
    best = tuner.tune(program, design)[0]
    assert best[1][0][0] == (54, 1, 1)
    without = [t for t in tuner.starts(program, design) if t != filled]
    assert all(t[0][0][0] != 54 for t in without)
