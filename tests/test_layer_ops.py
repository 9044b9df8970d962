"""Whole decoder layers (issue 14, item 1): the data-movement operators ``reshape`` and
``rotate_half``, and the Llama-3-8B and Qwen2-7B layer examples run by the float64
reference at reduced sizes, against an independent numpy transcription of the
Hugging Face layer (heads by slicing, rotate_half by slicing, repeat_kv, softmax)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mirage_cli import interp
from mirage_cli.diagnostics import MirageError
from mirage_cli.golden import run_cli
from mirage_cli.loading import load_graph
from mirage_cli.parser import parse_text
from mirage_cli.verifier.api import Verifier

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"batch": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 96,
         "kv": 8}


def _rms_norm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + rot * sin


def hf_layer(ins: dict[str, np.ndarray], eps: float, bias: bool) -> dict[str, np.ndarray]:
    """One decode step of a Llama/Qwen2 layer, written as the reference model code is:
    per sequence, per query head, with the KV head of ``head // group``."""
    x = ins["X"]
    b, d = x.shape[0], ins["COS"].shape[-1]
    n1 = _rms_norm(x, ins["G1"], eps)
    q, k, v = n1 @ ins["WQ"], n1 @ ins["WK"], n1 @ ins["WV"]
    if bias:
        q, k, v = q + ins["BQ"], k + ins["BK"], v + ins["BV"]
    heads, kv_heads = q.shape[1] // d, k.shape[1] // d
    group = heads // kv_heads
    cos, sin = ins["COS"].reshape(b, d), ins["SIN"].reshape(b, d)
    attn = np.zeros((b, heads * d))
    new_k = np.zeros((b, kv_heads, 1, d))
    for s in range(b):
        for kh in range(kv_heads):
            new_k[s, kh, 0] = _rope(k[s, kh * d:(kh + 1) * d], cos[s], sin[s])
        for hq in range(heads):
            kh = hq // group
            qh = _rope(q[s, hq * d:(hq + 1) * d], cos[s], sin[s])
            keys = np.concatenate([ins["KC"][s, kh].T, new_k[s, kh]], axis=0)  # [kv+1, d]
            vals = np.concatenate([ins["VC"][s, kh], v[s, None, kh * d:(kh + 1) * d]], axis=0)
            logits = keys @ qh / math.sqrt(128)  # the examples keep Llama's 1/sqrt(128)
            p = np.exp(logits - logits.max())
            attn[s, hq * d:(hq + 1) * d] = (p / p.sum()) @ vals
    h = x + attn @ ins["WO"]
    n2 = _rms_norm(h, ins["G2"], eps)
    u = n2 @ ins["W1"]
    y = h + ((u / (1 + np.exp(-u))) * (n2 @ ins["W3"])) @ ins["W2"]
    return {"Y": y, "KE": new_k, "V4": v.reshape(b, kv_heads, 1, d)}


@pytest.mark.parametrize(("name", "eps", "bias"), [("llama3_8b_layer", 1e-5, False),
                                                   ("qwen2_7b_layer", 1e-6, True)])
def test_layer_example_matches_the_model_code(name: str, eps: float, bias: bool) -> None:
    g = load_graph(str(ROOT / "examples" / f"{name}.mir"), SMALL)
    ins = interp.random_inputs(g, seed=1)
    got = interp.run(g, ins)
    want = hf_layer({k: v.astype(np.float64) for k, v in ins.items()}, eps, bias)
    for out in ("Y", "KE", "V4"):
        np.testing.assert_allclose(got[out], want[out], rtol=1e-9, atol=1e-9, err_msg=out)


@pytest.mark.parametrize("name", ["llama3_8b_layer", "qwen2_7b_layer"])
def test_layer_example_runs_from_the_command_line(name: str) -> None:
    defs = [a for k, v in SMALL.items() for a in ("-D", f"{k}={v}")]
    code, out, err = run_cli(("run", str(ROOT / "examples" / f"{name}.mir"), *defs, "--json"))
    assert code == 0, err
    outs = {o["name"]: o for o in json.loads(out)["outputs"]}
    assert outs["Y"]["shape"] == [2, 64] and outs["Y"]["nonfinite"] == 0
    assert outs["KE"]["shape"] == [2, 2, 1, 16]


@pytest.mark.parametrize("name", ["llama3_8b_layer", "qwen2_7b_layer"])
def test_layer_example_full_size_types(name: str) -> None:
    g = load_graph(str(ROOT / "examples" / f"{name}.mir"), {"batch": 8})
    types = g.tensor_types()
    hidden = 4096 if name.startswith("llama") else 3584
    assert types["Y"].shape == (8, hidden)
    assert types["P"].shape[-1] == 4096  # kv - 1 cached keys and the new one


ROT = """program rot(n = 8) {
  input X: f32[4, n];
  A = rotate_half(X);
  B = rotate_half(A);
  output B;
}
"""

NEG = """program neg(n = 8) {
  input X: f32[4, n];
  B = neg(X);
  output B;
}
"""

ONCE = """program once(n = 8) {
  input X: f32[4, n];
  B = rotate_half(X);
  output B;
}
"""


def test_rotate_half_twice_is_negation_and_once_is_not() -> None:
    v = Verifier(parse_text(NEG, "neg.mir"), seed=0)
    assert v.check(parse_text(ROT, "rot.mir"), trials=2).equivalent is True
    assert v.check(parse_text(ONCE, "once.mir"), trials=2).equivalent is False


RESHAPE_RT = """program rt() {
  input X: f32[6, 8];
  A = reshape(X, d0=2, d1=3, d2=8);
  B = reshape(A, d0=6, d1=8);
  output B;
}
"""

TRANSPOSE = """program tr() {
  input X: f32[6, 8];
  A = reshape(X, d0=8, d1=6);
  B = reshape(A, d0=6, d1=8);
  C = rotate_half(B);
  output C;
}
"""


def test_reshape_round_trip_is_the_identity_and_a_rotation_is_not() -> None:
    ident = parse_text("program id() {\n  input X: f32[6, 8];\n  output X;\n}\n", "id.mir")
    v = Verifier(ident, seed=0)
    assert v.check(parse_text(RESHAPE_RT, "rt.mir"), trials=2).equivalent is True
    assert v.check(parse_text(TRANSPOSE, "tr.mir"), trials=2).equivalent is False
    x = np.arange(48.0).reshape(6, 8)
    assert np.array_equal(interp.run(parse_text(RESHAPE_RT, "rt.mir"), {"X": x})["B"], x)


@pytest.mark.parametrize(("call", "message"), [
    ("reshape(X, d0=5, d1=8)", "cannot reshape f32[6, 8] (48 elements) to [5, 8]"),
    ("reshape(X, d0=48, d2=1)", "without gaps"),
    ("reshape(Y, d0=0)", "d0 must be given"),
    ("rotate_half(Y)", "even last dimension"),
])
def test_shape_errors_are_located(call: str, message: str) -> None:
    src = (f"program p() {{\n  input X: f32[6, 8];\n  input Y: f32[2, 3];\n"
           f"  Z = {call};\n  output Z;\n}}\n")
    with pytest.raises(MirageError) as e:
        parse_text(src, "p.mir")
    assert message in str(e.value)
    assert e.value.span is not None and e.value.span.line == 4


ROTARY = """program rot() {
  input Q: f32[2, 4, 16];
  input C: f32[2, 1, 16];
  input S: f32[2, 1, 16];
  R = rotate_half(Q);
  A = mul(Q, C);
  B = mul(R, S);
  E = add(A, B);
  output E;
}
"""


def _rotary_kernel(imap: str) -> str:
    return f"""program rotk() {{
  input Q: f32[2, 4, 16];
  input C: f32[2, 1, 16];
  input S: f32[2, 1, 16];
  E = custom(grid=(2, 2, 1), threads=128, forloop=1) {{
    q = load Q {imap};
    c = load C imap(x=0);
    s = load S imap(x=0);
    r = rotate_half(q);
    a = mul(q, c);
    b = mul(r, s);
    e = add(a, b);
    t = acc_sum(e);
    store t -> E omap(x=0, y=1);
  }}
  output E;
}}
"""


def test_rotate_half_in_a_block_rotates_the_tile() -> None:
    """In a block graph rotate_half rotates the tile's last dimension: with whole heads
    per block the rotary embedding is one kernel, equal to the program; a grid that
    split the head dimension would compute another function, which verification
    rejects."""
    prog = parse_text(ROTARY, "rot.mir")
    whole = parse_text(_rotary_kernel("imap(x=0, y=1)"), "k.mir")
    ins = interp.random_inputs(prog, 4)
    np.testing.assert_allclose(interp.run(whole, ins)["E"], interp.run(prog, ins)["E"],
                               rtol=1e-12, atol=1e-12)
    assert Verifier(prog, seed=2).check(whole, trials=2).equivalent is True
    cut = parse_text(_rotary_kernel("imap(x=0, y=2)").replace(
        "store t -> E omap(x=0, y=1)", "store t -> E omap(x=0, y=2)").replace(
        "c = load C imap(x=0);", "c = load C imap(x=0, y=2);").replace(
        "s = load S imap(x=0);", "s = load S imap(x=0, y=2);"), "cut.mir")
    assert Verifier(prog, seed=2).check(cut, trials=2).equivalent is False


def test_a_gather_never_reads_a_register_at_another_element() -> None:
    """The emitter refuses to read a node held in registers (one element per thread)
    at another index, which rotate_half in a block graph would otherwise compile to."""
    from mirage_cli.codegen.expr import Emitter, Local, Node, Stored
    from mirage_cli.ir import BlockOp, DType, TensorType, Value

    em = Emitter()
    em.nodes["x"] = Node((1, 16), Local("reg_x"))
    op = BlockOp("rotate_half", ("x",), (Value("r", TensorType((1, 16), DType.F32)),))
    with pytest.raises(AssertionError, match="held in registers"):
        em.apply(op, ["0", "j"])
    em.nodes["x"] = Node((1, 16), Stored("p", "0", (16, 1), "float"))
    _, e = em.apply(op, ["0", "j"])
    assert "((j + 8) % 16)" in e
