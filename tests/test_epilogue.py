"""Epilogue folding (search/epilogue.py): an element-wise kernel that only finishes a
custom kernel's output moves into that kernel's epilogue, only where it computes
element by element; in a layer, the joined parts are certified anew."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from mirage_cli import interp
from mirage_cli.ir import Graph
from mirage_cli.parser import parse_text
from mirage_cli.search import epilogue, layer
from mirage_cli.search.driver import SearchOptions
from mirage_cli.verifier.api import Verifier

# The inputs every program here shares: X @ W, then a bias B.
INPUTS = """  input X: f32[2, 64];
  input W: f32[64, 32];
  input B: f32[32];
"""

PROGRAM = """program p() {
""" + INPUTS + """  M = matmul(X, W);
  Q = add(M, B);
  output Q;
}
"""

PRODUCER = """  M = custom(grid=(4, 1, 1), threads=128, forloop=2) {
    x = load X fmap(1);
    w = load W imap(x=1) fmap(0);
    m = matmul(x, w);
    s = acc_sum(m);
    store s -> M omap(x=1);
  }
"""

STITCHED = """program p() {
""" + INPUTS + PRODUCER + """  Q = custom(grid=(GRID, 1, 1), threads=128, forloop=1) {
    m = load M IMAP;
    b = load B BMAP;
    q = add(m, b);
    s = acc_sum(q);
    store s -> Q OMAP;
  }
  output Q;
}
"""


def stitched(grid: int = 1, imap: str = "", bmap: str = "", omap: str = "") -> str:
    return (STITCHED.replace("GRID", str(grid)).replace("IMAP", imap)
            .replace("BMAP", bmap).replace("OMAP", omap))


def _same(prog_text: str, g_text: str) -> None:
    prog, g = parse_text(prog_text, "p.mir"), parse_text(g_text, "g.mir")
    folded, folds = epilogue.fold(g)
    assert folds == (epilogue.Fold("M", "Q"),)
    assert [op.op for op in folded.ops] == ["custom"]
    (k,) = folded.ops
    assert k.block is not None and [o.value.name for o in k.block.outputs] == ["Q"]
    assert k.inputs == ("X", "W", "B") and k.plan is None
    ins = interp.random_inputs(prog, 5)
    np.testing.assert_allclose(interp.run(folded, ins)["Q"], interp.run(prog, ins)["Q"],
                               rtol=1e-12, atol=1e-12)
    assert Verifier(prog, seed=3).check(folded, trials=2).equivalent is True


def test_a_bias_add_of_one_block_folds_into_its_projection() -> None:
    _same(PROGRAM, stitched())


def test_a_bias_add_split_as_its_operand_folds() -> None:
    _same(PROGRAM, stitched(4, "imap(x=1)", "imap(x=0)", "omap(x=1)"))


def test_a_pre_defined_bias_add_folds_too() -> None:
    # what a part ships when its search leaves the add unfused (the Qwen layer's query
    # bias at batch 16)
    _same(PROGRAM, PROGRAM.replace("  M = matmul(X, W);\n", PRODUCER))


def test_a_consumer_that_does_not_compute_element_by_element_stays() -> None:
    # Block (x, y) adds B's tile (y, x) to M's tile (x, y): tiles of one shape, but not
    # the element-wise sum of the tensors, so the producer cannot take it over.
    g = parse_text(stitched(2, "imap(x=0, y=1)", "imap(x=1, y=0)", "omap(x=0, y=1)")
                   .replace("grid=(2, 1, 1), threads=128, forloop=1",
                            "grid=(2, 2, 1), threads=128, forloop=1")
                   .replace("input B: f32[32]", "input B: f32[2, 32]"), "g.mir")
    assert epilogue.fold(g)[1] == ()


def test_nothing_folds_where_the_stored_tensor_is_read_elsewhere() -> None:
    both = stitched().replace("  output Q;", "  output Q, M;")
    assert epilogue.fold(parse_text(both, "g.mir"))[1] == ()


def test_nothing_folds_where_the_chain_is_not_element_wise() -> None:
    summed = stitched().replace("    q = add(m, b);\n    s = acc_sum(q);\n",
                                "    q = add(m, b);\n    r = exp(q);\n"
                                "    t = sum(r, dim=1, keepdim=true);\n    s = acc_sum(t);\n")
    assert "t = sum(r" in summed
    assert epilogue.fold(parse_text(summed, "g.mir"))[1] == ()


def test_a_consumer_keeps_its_other_outputs() -> None:
    two = """program p() {
""" + INPUTS + """  input C: f32[2, 8];
""" + PRODUCER + """  (Q, R) = custom(grid=(1, 1, 1), threads=128, forloop=1) {
    m = load M;
    b = load B;
    c = load C;
    q = add(m, b);
    r = exp(c);
    s = acc_sum(q);
    t = acc_sum(r);
    store s -> Q;
    store t -> R;
  }
  output Q, R;
}
"""
    g = parse_text(two, "g.mir")
    folded, folds = epilogue.fold(g)
    assert folds == (epilogue.Fold("M", "Q"),)
    rest = folded.ops[1]
    assert rest.block is not None and [o.value.name for o in rest.block.outputs] == ["R"]
    assert rest.inputs == ("C",)
    ins = interp.random_inputs(g, 2)
    out, ref = interp.run(folded, ins), interp.run(g, ins)
    for n in ("Q", "R"):
        np.testing.assert_allclose(out[n], ref[n], rtol=1e-12, atol=1e-12)


LAYER = """program tiny() {
""" + INPUTS + """  M = matmul(X, W);
  Q = add(M, B);
  Q3 = reshape(Q, d0=2, d1=2, d2=16);
  E = exp(Q3);
  output E;
}
"""

PART0 = """program tiny_part0() {
  input X: f32[2, 64];
  input W: f32[64, 32];
""" + PRODUCER + """  output M;
}
"""

PART1 = """program tiny_part1() {
  input M: f32[2, 32];
  input B: f32[32];
  Q = custom(grid=(1, 1, 1), threads=128, forloop=1) {
    m = load M;
    b = load B;
    q = add(m, b);
    s = acc_sum(q);
    store s -> Q;
  }
  output Q;
}
"""


def _mapper(fused: dict[int, str]) -> layer.PartMapper:
    def run(tasks: list[layer.PartTask]) -> list[layer.PartResult]:  # type: ignore[override]
        out = []
        for t in tasks:
            src = fused.get(t.plan.index)
            g = parse_text(src, "f.mir") if src else t.graph
            verdict = {"equivalent": True, "certificate": {"bound": 1e-12}}
            out.append(layer.PartResult(t.plan, g, src is not None,
                                        verdict if src else None, 0.0, "test"))
        return out
    return run  # type: ignore[return-value]


def test_a_layer_folds_across_its_parts_and_certifies_them_joined() -> None:
    prog = parse_text(LAYER, "tiny.mir")
    plans = layer.plan_parts(prog, 1)
    assert [(p.start, p.stop) for p in plans][:2] == [(0, 1), (1, 2)]
    res = layer.optimise_layer(prog, SearchOptions(), 1.0, _mapper({0: PART0, 1: PART1}), 1)
    assert res.graph is not None and res.verdict["equivalent"]
    assert res.folds == ("Q (part 1) into the kernel of M (part 0)",)
    assert [op.op for op in res.graph.ops] == ["custom", "reshape", "exp"]
    # parts 0 and 1 were certified together (a real certificate, not the fakes' 1e-12)
    parts = res.verdict["parts"]
    assert len(parts) == 1 and parts[0]["certificate"]["bound"] != 1e-12
    assert "epilogue folded: Q (part 1) into the kernel of M (part 0)" in \
        layer.render_parts(res.as_json())


def test_a_fold_that_does_not_verify_is_not_shipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fold that changed the function (here: a wrong operator planted in the folded
    kernel) fails its joined certificate, and the layer ships as stitched."""
    real = epilogue.fold

    def wrong(g: Graph) -> tuple[Graph, tuple[epilogue.Fold, ...]]:
        folded, folds = real(g)
        k = folded.ops[0]  # the folded kernel subtracts the bias instead of adding it
        assert k.block is not None
        ops_ = tuple(dataclasses.replace(o, op="sub") if o.op == "add" else o
                     for o in k.block.ops)
        k = dataclasses.replace(k, block=dataclasses.replace(k.block, ops=ops_))
        return dataclasses.replace(folded, ops=(k, *folded.ops[1:])), folds

    monkeypatch.setattr(epilogue, "fold", wrong)
    prog = parse_text(LAYER, "tiny.mir")
    res = layer.optimise_layer(prog, SearchOptions(), 1.0, _mapper({0: PART0, 1: PART1}), 1)
    assert res.graph is not None and res.verdict["equivalent"] and res.folds == ()
    assert [op.op for op in res.graph.ops] == ["custom", "custom", "reshape", "exp"]
