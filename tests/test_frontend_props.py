"""Property tests: random valid µGraphs round-trip through .mir and .ugraph.json, and
the interpreter's result does not depend on how a custom kernel is split."""

from __future__ import annotations

import numpy as np
import pytest
from graphgen import graphs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mirage_cli import interp, serialize
from mirage_cli.builder import GraphBuilder
from mirage_cli.ir import Graph
from mirage_cli.parser import parse_text
from mirage_cli.printer import print_graph

SETTINGS = settings(max_examples=100, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@SETTINGS
@given(graphs())
def test_print_parse_round_trip(g: Graph) -> None:
    text = print_graph(g)
    back = parse_text(text, "<printed>")
    assert back == g
    assert print_graph(back) == text


@SETTINGS
@given(graphs())
def test_json_round_trip(g: Graph) -> None:
    text = serialize.dumps(g)
    assert serialize.loads(text) == g
    assert serialize.dumps(parse_text(print_graph(g))) == text


def _program(m: int, k: int, n: int, dtype: str) -> Graph:
    b = GraphBuilder("rmsnorm_linear")
    x = b.input("X", (m, k), dtype)
    w = b.input("W", (k, n), dtype)
    b.output(b.op("matmul", b.op("rms_norm", x), w, out="Z"))
    return b.build()


def _fused(m: int, k: int, n: int, dtype: str, gx: int, gy: int, f: int) -> Graph:
    """RMSNorm+MatMul as one kernel: x splits N, y splits M, the forloop splits K."""
    b = GraphBuilder("rmsnorm_linear_fused")
    x = b.input("X", (m, k), dtype)
    w = b.input("W", (k, n), dtype)
    kb = b.custom((gx, gy, 1), 128, f)
    xt = kb.load(x, (None, 0, None), 1)
    wt = kb.load(w, (1, None, None), 0)
    r = kb.op("acc_rms_ld", xt)
    s = kb.op("acc_sum", kb.op("matmul", xt, wt))
    (z,) = kb.finish([(kb.op("div", s, r), "Z", (1, 0, None))])
    b.output(z)
    return b.build()


splits = st.tuples(st.sampled_from((1, 2, 4)), st.sampled_from((1, 2, 4)),
                   st.sampled_from((1, 2, 4, 8)))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from((4, 8)), st.sampled_from((8, 16)), st.sampled_from((4, 8)),
       splits, splits, st.integers(0, 2**16))
def test_split_does_not_change_float64_result(m: int, k: int, n: int, s1: tuple[int, ...],
                                              s2: tuple[int, ...], seed: int) -> None:
    ref = _program(m, k, n, "f32")
    ins = interp.random_inputs(ref, seed)
    want = interp.run(ref, ins)["Z"]
    for gx, gy, f in (s1, s2):
        got = interp.run(_fused(m, k, n, "f32", gx, gy, f), ins)["Z"]
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(("f16", "bf16", "f32")), splits, st.integers(0, 2**16))
def test_native_precision_close_to_float64(dtype: str, s: tuple[int, ...], seed: int) -> None:
    g = _fused(8, 16, 8, dtype, *s)
    ins = interp.random_inputs(g, seed)
    exact = interp.run(g, ins, "float64")["Z"]
    native = interp.run(g, ins, "native")["Z"]
    tol = {"f16": 1e-2, "bf16": 3e-2, "f32": 1e-5}[dtype]
    assert np.isfinite(native).all()
    assert np.linalg.norm(native - exact) <= tol * np.linalg.norm(exact)


ROW_REDUCTIONS = {"acc_sum_ld": "sum", "acc_mean_ld": "mean", "acc_max_ld": "max",
                  "acc_rms_ld": "rms"}


def _row_reduction(acc: str, m: int, k: int, gy: int, f: int, dtype: str) -> Graph:
    """One accumulator over whole rows: grid y splits the rows, the forloop the columns."""
    b = GraphBuilder("rows")
    x = b.input("X", (m, k), dtype)
    kb = b.custom((1, gy, 1), 64, f)
    r = kb.op(acc, kb.load(x, (None, 0, None), 1))
    (z,) = kb.finish([(r, "Z", (None, 0, None))])
    b.output(z)
    return b.build()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(ROW_REDUCTIONS)), st.sampled_from((2, 4, 8)),
       st.sampled_from((8, 16)), st.sampled_from((1, 2)), st.sampled_from((1, 2, 4, 8)),
       st.integers(0, 2**16))
def test_row_accumulators_match_kernel_reductions(acc: str, m: int, k: int, gy: int, f: int,
                                                  seed: int) -> None:
    g = _row_reduction(acc, m, k, gy, f, "f32")
    b = GraphBuilder("ref")
    x = b.input("X", (m, k), "f32")
    op = ROW_REDUCTIONS[acc]
    b.output(b.op(op, x) if op == "rms" else b.op(op, x, dim=1, keepdim=True))
    ref = b.build()
    ins = interp.random_inputs(g, seed)
    got = interp.run(g, ins)["Z"]
    want = next(iter(interp.run(ref, ins).values()))
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    # and the same with the whole row in one iteration and one block
    one = interp.run(_row_reduction(acc, m, k, 1, 1, "f32"), ins)["Z"]
    np.testing.assert_allclose(got, one, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(graphs(max_steps=4), st.data())
def test_fmt_keeps_every_comment(g: Graph, data: st.DataObject) -> None:
    from mirage_cli.comments import format_source, scan_comments

    lines = print_graph(g).splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        if data.draw(st.integers(0, 3)) == 0:
            out.append(f"# own {i}")
        if data.draw(st.booleans()):
            out.append("")
        out.append(line + (f"   # end {i}" if data.draw(st.integers(0, 2)) == 0 else ""))
    if data.draw(st.booleans()):
        out.append("# last")
    text = "\n".join(out) + "\n"
    once = format_source(text, "c.mir")
    assert format_source(once, "c.mir") == once
    assert [c.text for c in scan_comments(once) if c.text] == \
        [c.text for c in scan_comments(text) if c.text]
    assert parse_text(once) == g


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # overflow to inf in f16 is allowed
@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(graphs(max_steps=4))
def test_interpreter_output_shapes_match_inferred_types(g: Graph) -> None:
    ins = interp.random_inputs(g, 0)
    types = g.tensor_types()
    for precision in ("float64", "native"):
        out = interp.run(g, ins, precision)  # type: ignore[arg-type]
        assert list(out) == list(g.outputs)
        for name, arr in out.items():
            assert arr.shape == types[name].shape
