"""The running maximum (search/runmax.py, codegen/chain.py): a max-subtracted softmax
in one loop over its keys. A loop operator may read an accumulator's result (its
value over all iterations); the search finds such kernels from the program without
its maxima, verifies them against the program itself, and the chain emitter runs
them with a running maximum."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from codegen_cases import online_softmax_batched, online_softmax_chain

from mirage_cli import interp
from mirage_cli.check import loop_passes, online_reads
from mirage_cli.codegen.blockfacts import analyse, decompose
from mirage_cli.codegen.chainfacts import Chain, chain_form
from mirage_cli.codegen.emit import emit
from mirage_cli.codegen.lower import lower
from mirage_cli.codegen.nvrtc import compile_cuda
from mirage_cli.codegen.planner import knob_space, plan_kernel
from mirage_cli.commands.plan import planned
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.kplan import Knobs
from mirage_cli.loading import load_graph
from mirage_cli.parser import parse_text
from mirage_cli.search.design import CustomD, design_of
from mirage_cli.search.driver import Progress, SearchOptions, _enumerate
from mirage_cli.search.runmax import strip, with_running_max
from mirage_cli.search.tune import tune
from mirage_cli.verifier.api import Verifier
from mirage_cli.verifier.crosscheck import crosscheck
from mirage_cli.verifier.numerics import safety_check, scaled_inputs

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"batch": 1, "heads": 16, "d": 16, "seq": 128}

HEAD = """
program mqa_decode(batch = 1, heads = 16, d = 16, seq = 128) {
  input Q: f16[batch, heads, d];
  input K: f16[batch, d, seq];
  input V: f16[batch, seq, d];
  O = custom(grid=(1, 1, 1), threads=128, forloop=4) {
    q = load Q imap(x=0);
    k = load K imap(x=0) fmap(2);
    v = load V imap(x=0) fmap(1);
    a = matmul(q, k);
    s = mul_scalar(a, scalar=0.08838834764831845);
    m = acc_max_ld(s);
"""
TAIL = """
    l = acc_sum_ld(e);
    pv = matmul(e, v);
    o = acc_sum(pv);
    r = div(o, l);
    store r -> O omap(x=0);
  }
  output O;
}
"""
RUNNING = HEAD + "    t = sub(s, m);\n    e = exp(t);" + TAIL


def _program() -> Graph:
    return load_graph(str(ROOT / "examples" / "mqa_decode.mir"), SMALL)


def _graph(text: str) -> Graph:
    return parse_text(text, "<runmax>", {})


def _block(g: Graph):  # type: ignore[no-untyped-def]
    return next(op.block for op in g.ops if op.block is not None)


def test_a_loop_may_read_an_accumulator_result_meaning_its_final_value() -> None:
    g = _graph(RUNNING)
    bg = _block(g)
    assert online_reads(bg) == {"m"}
    passes = loop_passes(bg)
    assert passes["m"] == 0 and passes["e"] == 1 and passes["l"] == 1
    prog = _program()
    assert Verifier(prog, seed=0).certify(g).verdict == "equivalent"
    assert crosscheck(prog, g, 0).close
    # The loop meaning of the interpreter, literally: one iteration at a time.
    ins = interp.random_inputs(prog, 3)
    stacked = interp.run(g, ins, "float64")["O"]
    literal = interp.run(g, ins, "float64", stack_iterations=False)["O"]
    assert np.allclose(stacked, literal, rtol=1e-12, atol=0)


def test_a_loop_reading_a_value_computed_from_an_accumulator_is_refused() -> None:
    text = HEAD + "    m2 = mul_scalar(m, scalar=2.0);\n    t = sub(s, m2);\n    e = exp(t);" + TAIL
    with pytest.raises(MirageError, match="computed after the loop"):
        _graph(text)


def test_another_maximum_verifies_but_is_refused_as_unsafe() -> None:
    """The maximum of the raw score, not of the scaled one the exponent reads: the
    shift cancels between the sums, over the reals and in the finite field alike, so
    the certificate cannot tell; on large logits every exponential underflows and
    the result is NaN where the program's is finite, which the numerics check
    refuses (as the search does, driver.float_checks)."""
    prog = _program()
    g = _graph(RUNNING.replace("m = acc_max_ld(s);", "m = acc_max_ld(a);"))
    assert Verifier(prog, seed=0).certify(g).verdict == "equivalent"
    verdict = safety_check(prog, g, 0)
    assert not verdict.safe and "NaN" in verdict.reason
    assert safety_check(prog, _graph(RUNNING), 0).safe


def test_strip_takes_the_maxima_out_of_the_exponentials() -> None:
    stripped = strip(_program())
    assert stripped is not None
    assert [op.op for op in stripped.ops] == ["matmul", "mul_scalar", "exp", "sum", "div",
                                             "matmul"]
    explicit = parse_text("""
program p(n = 64) {
  input X: f32[4, n];
  M = max(X, dim=1, keepdim=true);
  D = sub(X, M);
  E = exp(D);
  Z = sum(E, dim=1, keepdim=true);
  P = div(E, Z);
  output P;
}""", "<p>", {})
    out = strip(explicit)
    assert out is not None and [op.op for op in out.ops] == ["exp", "sum", "div"]
    plain = load_graph(str(ROOT / "examples" / "gqa.mir"), {"batch": 1})
    assert strip(plain) is None


def test_the_search_finds_running_maxima_and_their_split() -> None:
    """Designs of the stripped program given a running maximum: one kernel looping
    over the keys, and its split over blocks (each block's chunk rescaled when the
    chunks are added); each verifies against the program and is safe on large
    logits."""
    prog = _program()
    designs, _ = _enumerate(prog, SearchOptions(max_block_ops=9, max_grid_axes=1), None, 1,
                            Progress(), lambda p: None)
    found: dict[int, Graph] = {}
    for d in designs:
        fits = tune(prog, d, max_steps=0)
        if fits and any(online_reads(op.block) for op in fits[0][2].ops if op.block):
            found.setdefault(d.num_kernels, fits[0][2])
    assert set(found) == {1, 2}
    for g in found.values():
        assert Verifier(prog, seed=0).certify(g).verdict == "equivalent"
        assert safety_check(prog, g, 0).safe


def test_with_running_max_needs_an_exponential_in_the_loop() -> None:
    prog = _program()
    d, _ = design_of(_graph(RUNNING))
    step = d.steps[0]
    assert isinstance(step, CustomD)
    # The kernel without its maximum gets it back, as the same operators.
    stripped = _graph(HEAD.replace("    m = acc_max_ld(s);\n", "") + "    e = exp(s);" + TAIL)
    sd, st = design_of(stripped)
    back = with_running_max(prog, sd, st)
    assert back is not None
    assert [o.op for o in back.steps[0].ops] == [o.op for o in step.ops]  # type: ignore[union-attr]
    # A kernel whose exponentials are all after the loop has none to give one.
    after = _graph("""
program mqa_decode(batch = 1, heads = 16, d = 16, seq = 128) {
  input Q: f16[batch, heads, d];
  input K: f16[batch, d, seq];
  input V: f16[batch, seq, d];
  O = custom(grid=(1, 1, 1), threads=128, forloop=2) {
    q = load Q imap(x=0) fmap(2);
    k = load K imap(x=0) fmap(1);
    v = load V imap(x=0);
    qk = matmul(q, k);
    a = acc_sum(qk);
    e = exp(a);
    o = matmul(e, v);
    l = sum(e, dim=2, keepdim=true);
    r = div(o, l);
    store r -> O omap(x=0);
  }
  output O;
}""")
    ad, at = design_of(after)
    assert with_running_max(prog, ad, at) is None


@pytest.mark.parametrize("case", [online_softmax_chain, online_softmax_batched],
                         ids=lambda f: f.__name__)
def test_a_running_maximum_is_planned_only_as_a_register_chain(case) -> None:  # type: ignore[no-untyped-def]
    g = case()
    bg = _block(g)
    space = knob_space(bg, g.tensor_types(), "sm_90")
    assert space["chain"] == [1] and space["ksplit"] == [1] and space["ldmatrix"] == [1]
    ch = chain_form(analyse(decompose(bg)))
    assert isinstance(ch, Chain) and ch.online is not None
    for knob in ("kwarps", "threads", "stagger"):  # what the running maximum's code reads
        for value in space[knob]:
            cu, _ = emit(lower(planned(g, "sm_90", [Knobs(**{knob: value})]), "sm_90"))
            assert "mg_tm[" in cu  # the tile's row maxima, each iteration
            res = compile_cuda(cu, f"{g.name}.cu", "sm_90")
            assert all(r.spill_stores == 0 and r.stack == 0 for r in res.resources), \
                (knob, value, res.resources)


def test_column_split_warps_merge_their_maxima() -> None:
    g = online_softmax_chain()
    cu, _ = emit(lower(planned(g, "sm_90", [Knobs(kwarps=2, threads=128)]), "sm_90"))
    assert "buf_" in cu and cu.count("fmaxf(buf_") >= 1


def test_a_running_maximum_without_a_chain_is_a_located_refusal() -> None:
    """Twenty query rows per block (not whole 16-row mma tiles; fewer than 16 fill one
    padded tile): the loop cannot be emitted, and the planner says why rather than
    generating the two-pass meaning wrongly."""
    text = RUNNING.replace("heads = 16", "heads = 20")
    g = _graph(text)
    with pytest.raises(MirageError, match="running maximum.*multiples of the mma shape"):
        plan_kernel(_block(g), g.tensor_types(), "sm_90")


@pytest.mark.gpu
def test_running_maxima_on_the_gpu_stay_finite_on_large_logits() -> None:
    """The generated online loop against float64 on inputs whose logits pass +-100."""
    from mirage_cli.codegen.bench import build
    from mirage_cli.codegen.runner import Device, gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU")
    prog = load_graph(str(ROOT / "examples" / "mqa_decode.mir"),
                      {"batch": 2, "heads": 32, "d": 64, "seq": 1024})
    g = _graph(RUNNING.replace("batch = 1, heads = 16, d = 16, seq = 128",
                               "batch = 2, heads = 32, d = 64, seq = 1024")
               .replace("grid=(1, 1, 1)", "grid=(2, 1, 1)").replace("forloop=4", "forloop=16"))
    ins = scaled_inputs(prog, 0, 16.0)
    loaded = build(Device(0), g)
    try:
        out = loaded.run(ins)["O"].astype(np.float64)
    finally:
        loaded.unload()
    ref = interp.run(prog, ins, "float64")["O"]
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 1e-2


def test_a_chain_reading_what_the_running_maximum_overwrote_is_refused() -> None:
    """The fragment registers hold ``x`` once the tile's maximum is taken: a row sum of
    the raw score beside a maximum of the scaled one has no register left to read."""
    from mirage_cli.builder import GraphBuilder

    b = GraphBuilder("stale")
    q = b.input("Q", (2, 32, 32), "f16")
    kk = b.input("K", (2, 32, 128), "f16")
    v = b.input("V", (2, 128, 16), "f16")
    k = b.custom((2, 1, 1), 128, 4)
    qt, kt = k.load(q, (0, None, None)), k.load(kk, (0, None, None), 2)
    vt = k.load(v, (0, None, None), 1)
    a = k.op("matmul", qt, kt)
    x = k.op("mul_scalar", a, scalar=2.0)
    e = k.op("exp", k.op("sub", x, k.op("acc_max_ld", x)))
    raw = k.op("acc_sum_ld", a)
    o = k.op("acc_sum", k.op("matmul", e, vt))
    (r,) = k.finish([(k.op("add", k.op("div", o, k.op("acc_sum_ld", e)), raw), "O",
                      (0, None, None))])
    b.output(r)
    g = b.build()
    assert "cannot follow the running maximum" in str(chain_form(analyse(decompose(_block(g)))))
    with pytest.raises(MirageError, match="cannot follow the running maximum"):
        plan_kernel(_block(g), g.tensor_types(), "sm_90")


def test_explain_names_the_running_maximum() -> None:
    from mirage_cli.search.explain import _design

    g = _graph(RUNNING)
    d = _design(0, g.ops[0])
    assert d["running"] == ["acc_max_ld"]
    plain = _design(0, load_graph(str(ROOT / "examples" / "mugraphs" / "gqa_fused.mir"),
                                  {"batch": 1}).ops[0])
    assert "running" not in plain
