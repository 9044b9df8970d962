"""Slab by slab evaluation (verifier/slabs.py): a graph cut along its independent
leading axis gives exactly the outputs of the whole graph, in float64, in native
precision and in the finite field, and the checks built on it (the float64
cross-check, the numerics safety check, the field verifier's certificate) give the same
results as whole runs; graphs that mix the axis are not cut. Also the pieces that let a
slab be drawn alone: rows of a field input, and the standard normal draw in chunks."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from mirage_cli import interp
from mirage_cli.builder import GraphBuilder
from mirage_cli.dtypes import round_to
from mirage_cli.ir import Graph
from mirage_cli.loading import load_graph
from mirage_cli.verifier import crosscheck, numerics, slabs
from mirage_cli.verifier.api import Verifier, _random_input, draw_uniform

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graphgen import graphs

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"batch": 4, "rows": 16, "d": 64, "seq": 64}  # (the fused kernel sums to d = 64)


def _gqa() -> tuple[Graph, Graph]:
    """gqa and its two-kernel flash-decoding µGraph (forloops, accumulators, a grid
    axis over the 2 * batch groups), at small sizes: 8 groups."""
    return (load_graph(str(ROOT / "examples" / "gqa.mir"), SIZES),
            load_graph(str(ROOT / "examples" / "mugraphs" / "gqa_fused.mir"), SIZES))


def _mha() -> Graph:
    return load_graph(str(ROOT / "examples" / "mha_decode.mir"),
                      {"batch": 2, "heads": 4, "d": 8, "seq": 32})


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    """Equal bit for bit (NaN where NaN), same dtypes and shapes."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and
        np.array_equal(a[k], b[k], equal_nan=True) for k in a)


# -- the plan ---------------------------------------------------------------------------


def test_the_plan_cuts_the_attention_programs_and_their_kernels() -> None:
    prog, fused = _gqa()
    for g in (prog, fused, _mha()):
        p = slabs.plan(g, 1)
        assert p is not None and p.count == 8 and p.rows == 1
        assert p.inputs == (True, True, True) and p.outputs == (True,)
        types = p.graph.tensor_types()
        assert all(types[i.value.name].shape == (1,) + i.value.type.shape[1:]
                   for i in g.inputs)
    p = slabs.plan(fused, 1)
    assert p is not None
    # The grid axis over the groups shrinks with the slab, the others and the tiles don't.
    assert [op.block.grid for op in p.graph.ops if op.block] == [(1, 16, 4), (1, 16, 1)]
    assert [bi.value.type for op in p.graph.ops if op.block for bi in op.block.inputs] == \
        [bi.value.type for op in fused.ops if op.block for bi in op.block.inputs]


def test_the_count_is_the_smallest_that_fits() -> None:
    prog, fused = _gqa()
    elements = sum(int(np.prod(i.value.type.shape)) for i in prog.inputs)
    assert slabs.plan(prog, elements) is None  # fits: one piece
    p = slabs.plan(fused, elements // 4)
    assert p is not None and (p.count, p.rows) == (4, 2)
    p = slabs.plan(fused, elements // 3)  # 3 does not divide 8
    assert p is not None and p.count == 4


def _row_sum() -> Graph:
    """Every row replaced by the sum of the rows (reduces over the axis)."""
    g = GraphBuilder("p", (("batch", 4),))
    g.input("X", (4, 8), "f32", ("batch", "8"))
    g.op("sum", "X", out="S", dim=0, keepdim=True)
    g.op("add", "X", "S", out="O")
    g.output("O")
    return g.build()


def _rows_of_a_matmul() -> Graph:
    """The axis as a matrix's rows: a slab would be another matrix product."""
    g = GraphBuilder("p", (("batch", 4),))
    g.input("X", (4, 8), "f32", ("batch", "8"))
    g.input("W", (8, 2), "f32", ("8", "2"))
    g.op("matmul", "X", "W", out="O")
    g.output("O")
    return g.build()


def _whole_axis_in_a_block() -> Graph:
    """A kernel whose one block loads every row: its tile would shrink with a slab."""
    g = GraphBuilder("p", (("batch", 4),))
    g.input("X", (4, 8), "f32", ("batch", "8"))
    k = g.custom((1, 2, 1), 128, 1)
    x = k.op("acc_sum", k.load("X", (None, 1, None)))
    k.finish([(k.op("mul_scalar", x, scalar=2.0), "O", (None, 1, None))])
    g.output("O")
    return g.build()


def _reshaped() -> Graph:
    g = GraphBuilder("p", (("batch", 4),))
    g.input("X", (4, 8), "f32", ("batch", "8"))
    g.op("reshape", "X", out="R", d0=4, d1=2, d2=4)
    g.op("mul_scalar", "R", out="O", scalar=2.0)
    g.output("O")
    return g.build()


def _split_rows() -> Graph:
    """The kernel of ``_whole_axis_in_a_block`` with the rows split by grid.x: cut."""
    g = GraphBuilder("p", (("batch", 4),))
    g.input("X", (4, 8), "f32", ("batch", "8"))
    g.input("B", (1, 8), "f32", ("1", "8"))  # axis-free, passed whole to every slab
    k = g.custom((4, 2, 1), 128, 1)
    x = k.op("acc_sum", k.load("X", (0, 1, None)))
    y = k.op("add", x, k.load("B", (None, 1, None)))
    k.finish([(y, "O", (0, 1, None))])
    g.output("O")
    return g.build()


@pytest.mark.parametrize("build", [_row_sum, _rows_of_a_matmul, _whole_axis_in_a_block,
                                   _reshaped])
def test_a_graph_that_would_change_is_not_cut(build: object) -> None:
    assert callable(build)
    assert slabs.plan(build(), 1) is None


def test_an_axis_free_input_goes_whole_to_every_slab() -> None:
    g = _split_rows()
    p = slabs.plan(g, 1)
    assert p is not None and p.count == 4 and p.inputs == (True, False)
    ins = interp.random_inputs(g, 3)
    for prec in ("float64", "native"):
        assert _same(slabs.run(g, slabs.source_of(ins), prec), interp.run(g, ins, prec))


# -- exactly the whole graph's values ---------------------------------------------------


@pytest.mark.parametrize("precision", ["float64", "native"])
def test_slabs_give_the_whole_graphs_outputs(precision: interp.Precision) -> None:
    prog, fused = _gqa()
    for g in (prog, fused, _mha()):
        for which in numerics.regimes(g) + (numerics.Inputs(),):
            src = numerics.hostile_source(g, 0, which)
            with np.errstate(all="ignore"):  # f16 overflows on inputs held constant
                whole = interp.run(g, numerics.hostile_inputs(g, 0, which), precision)
                for limit in (1, 3000, 20000):
                    assert _same(slabs.run(g, src, precision, limit), whole)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(graphs())
def test_random_graphs_cut_or_not_give_the_same_outputs(g: Graph) -> None:
    """Any graph the plan cuts (about a third of these) gives the whole graph's
    outputs bit for bit, in both precisions and in the field."""
    p = slabs.plan(g, 1)
    if p is None:
        return
    ins = interp.random_inputs(g, 1)
    with np.errstate(all="ignore"):
        for prec in ("float64", "native"):
            assert _same(slabs.run(g, slabs.source_of(ins), prec, 1),
                         interp.run(g, ins, prec))
    assert _field_run(g, 1) == _field_run(g, 1 << 62)


def _field_run(g: Graph, limit: int) -> object:
    """A field trial's outputs (mod P, and mod Q in trial 0), zero flag and reason,
    as comparable lists, with slabs of at most ``limit`` elements."""
    saved = slabs.SLAB_ELEMENTS
    slabs.SLAB_ELEMENTS = limit
    try:
        res = []
        for t in (0, 1):
            outs, zero, why, second = Verifier(g, 0)._run(g, t)
            res.append(([x.tolist() for x in outs or []], zero, why,
                        [None if x is None else x.tolist() for x in second]))
        return res
    finally:
        slabs.SLAB_ELEMENTS = saved


# -- the checks built on it -------------------------------------------------------------


def _checks(prog: Graph, cand: Graph) -> dict[str, object]:
    """Every verdict and record of the three checks, as JSON-like values."""
    cert = Verifier(prog, seed=0).certify(cand)
    cc = crosscheck.crosscheck(prog, cand, 0)
    safety = numerics.safety_check(prog, cand, 0)
    return {"certificate": cert.to_json(), "crosscheck": dataclasses.asdict(cc) | {
        "inputs": None, "outputs_a": [x.tolist() for x in cc.outputs_a],
        "outputs_b": [x.tolist() for x in cc.outputs_b]}, "safety": safety.as_json()}


def test_the_checks_are_the_same_cut_or_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    prog, fused = _gqa()
    numerics._RUNS.clear()
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", 1 << 62)
    whole = _checks(prog, fused)
    numerics._RUNS.clear()
    monkeypatch.setattr(slabs, "SLAB_ELEMENTS", 1)
    assert slabs.plan(prog) is not None and slabs.plan(fused) is not None
    assert _checks(prog, fused) == whole
    assert whole["certificate"]["verdict"] == "equivalent"  # type: ignore[index]
    assert whole["safety"]["verdict"] == "safe"  # type: ignore[index]


def test_a_wrong_candidate_is_rejected_cut_or_whole(monkeypatch: pytest.MonkeyPatch
                                                    ) -> None:
    """The field's counterexample (output, first index, count) is the same."""
    prog, _ = _gqa()
    wrong = load_graph(str(ROOT / "examples" / "gqa.mir"), SIZES)
    ops = list(wrong.ops)
    ops[1] = dataclasses.replace(ops[1], op="silu")  # exp -> silu
    wrong = dataclasses.replace(wrong, ops=tuple(ops))
    results = []
    for limit in (1 << 62, 1):
        monkeypatch.setattr(slabs, "SLAB_ELEMENTS", limit)
        results.append(Verifier(prog, seed=0).certify(wrong).to_json())
    assert results[0] == results[1]
    assert results[0]["verdict"] != "equivalent"


# -- drawing a slab alone ----------------------------------------------------------------


@pytest.mark.parametrize("shape, rows", [((6, 5, 3), slice(2, 5)), ((7, 3), slice(1, 2)),
                                         ((4, 1), slice(3, 4)), ((5, 2, 2), slice(0, 5))])
def test_rows_of_a_field_input_are_those_of_the_whole_draw(shape: tuple[int, ...],
                                                            rows: slice) -> None:
    """Odd and even starts (two elements per generator word), whole and partial."""
    whole = _random_input(3, 1, 2, shape)
    part = _random_input(3, 1, 2, shape, rows)
    for i in range(3):
        assert np.array_equal(part.get(i), whole.get(i)[rows])  # type: ignore[index]
    rng = np.random.default_rng([0, 1])
    flat = draw_uniform(rng, (101,))
    for skip in (0, 1, 2, 37, 100):
        assert np.array_equal(draw_uniform(np.random.default_rng([0, 1]), (101 - skip,), skip),
                              flat[skip:])


def test_the_normal_draw_in_chunks_is_the_draw_at_once(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    g = GraphBuilder("p", ())
    g.input("A", (5, 7), "f16", ("5", "7"))
    g.input("B", (3, 11), "bf16", ("3", "11"))
    g.input("C", (13,), "f32", ("13",))
    g.op("mul_scalar", "A", out="O", scalar=1.0)
    g.output("O")
    prog = g.build()
    monkeypatch.setattr(interp, "DRAW_CHUNK", 4)
    got = interp.random_inputs(prog, 9)
    rng = np.random.default_rng(9)
    for i in prog.inputs:
        t = i.value.type
        want = round_to(t.dtype, rng.standard_normal(t.shape).astype(np.float32))
        assert got[i.value.name].dtype == want.dtype
        assert np.array_equal(got[i.value.name], want)
