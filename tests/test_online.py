"""The rescaled split move (search/online.py): max-subtracted softmax attention split
over key chunks as FlashDecoding, verified, and never less safe than its program."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mirage_cli import interp
from mirage_cli.ir import DType, Graph
from mirage_cli.loading import load_graph
from mirage_cli.search.design import CustomD, Design, OpD, design_of, instantiate
from mirage_cli.search.driver import SearchOptions, _splits, search
from mirage_cli.search.online import online_split
from mirage_cli.verifier.api import Verifier
from mirage_cli.verifier.crosscheck import crosscheck
from mirage_cli.verifier.numerics import Inputs, hostile_inputs, safety_check, scaled_inputs

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"batch": 1, "heads": 4, "d": 64, "seq": 512}
MAXIMA = ("max", "acc_max_ld")

# The one-kernel whole-row design the generator finds for mha_decode (one block per
# head, every key in the block, forloop 1), written out.
WHOLE_ROW = """
program mha_decode(batch = 1, heads = 4, d = 64, seq = 512) {
  input Q: f16[heads * batch, 1, d];
  input K: f16[heads * batch, d, seq];
  input V: f16[heads * batch, seq, d];
  O = custom(grid=(4, 1, 1), threads=128, forloop=1) {
    q = load Q imap(x=0);
    k = load K imap(x=0);
    v = load V imap(x=0);
    a = matmul(q, k);
    s = mul_scalar(a, scalar=0.08838834764831845);
    m = acc_max_ld(s);
    x = sub(s, m);
    e = exp(x);
    o = matmul(e, v);
    l = sum(e, dim=2, keepdim=true);
    r = div(o, l);
    store r -> O omap(x=0);
  }
  output O;
}
"""


def _program(name: str, **sizes: int) -> Graph:
    return load_graph(str(ROOT / "examples" / f"{name}.mir"), {**SMALL, **sizes})


def _online(prog: Graph) -> tuple[Design, Graph]:
    from mirage_cli.parser import parse_text
    from mirage_cli.search.tune import tune

    design, tuning = design_of(parse_text(WHOLE_ROW, "<whole-row>", {}))
    od = online_split(prog, design, tuning)
    assert od is not None
    best = tune(prog, od)
    assert best, "no tuning instantiates the online design"
    return od, best[0][2]


def _producers(g: Graph, k: int) -> dict[str, str]:
    bg = g.ops[k].block
    assert bg is not None
    return {o.outputs[0].name: o.op for o in bg.ops}


def _exp_arguments_are_max_shifted(g: Graph) -> bool:
    """Every exp of every kernel reads ``sub(x, y)`` with ``y`` a maximum."""
    for k, op in enumerate(g.ops):
        bg = op.block
        assert bg is not None
        made = {o.outputs[0].name: o for o in bg.ops}
        prod = _producers(g, k)
        for o in bg.ops:
            if o.op != "exp":
                continue
            arg = made.get(o.inputs[0])
            if arg is None or arg.op != "sub" or prod.get(arg.inputs[1]) not in MAXIMA:
                return False
    return True


def test_online_split_of_attention_is_two_kernels_certified_and_keeps_every_max():
    prog = _program("mha_decode")
    od, g = _online(prog)
    assert len(od.steps) == 2 and all(isinstance(s, CustomD) for s in od.steps)
    k1, k2 = od.steps
    assert isinstance(k1, CustomD) and isinstance(k2, CustomD)
    assert k1.axes == 2 and k2.axes == 1  # kernel 1 adds the key-chunk axis
    assert g.ops[0].block is not None and g.ops[0].block.grid[1] >= 2
    assert _exp_arguments_are_max_shifted(g)
    cert = Verifier(prog, seed=0).certify(g)
    assert cert.verdict == "equivalent"
    assert crosscheck(prog, g, 0).close
    assert safety_check(prog, g, 0).safe


def test_online_split_on_mqa_and_gqa_rows():
    """Several query rows per block (MQA: 4 heads share one KV head) split the same
    way; the combine weights each row's chunks with that row's maximum."""
    prog = _program("mqa_decode")
    found = [sd for d in _one_kernel_designs(prog) for sd in _splits(prog, d)
             if len(sd.steps) == 2 and any("_online" in s.name for s in sd.steps[0].stores)]
    assert found
    from mirage_cli.search.tune import tune
    g = tune(prog, found[0])[0][2]
    assert _exp_arguments_are_max_shifted(g)
    assert Verifier(prog, seed=0).certify(g).verdict == "equivalent"


def _one_kernel_designs(prog: Graph) -> list[Design]:
    from mirage_cli.search.driver import Progress, _enumerate

    designs, _ = _enumerate(prog, SearchOptions(max_kernel_ops=1, max_block_ops=9,
                                                max_grid_axes=1), None, 1, Progress(),
                            lambda p: None)
    return list(designs)


def test_online_candidate_stays_finite_on_large_logits_and_dropping_the_max_is_rejected():
    prog = _program("mha_decode")
    od, g = _online(prog)
    ins = scaled_inputs(prog, 0, 16.0)
    logits = np.matmul(ins["Q"].astype(np.float64), ins["K"]) * 128 ** -0.5
    assert np.abs(logits).max() > 100  # the inputs do reach logits beyond +-100
    out = interp.run(g, ins, "native")["O"]
    ref = interp.run(prog, ins, "float64")["O"]
    assert np.isfinite(out).all() and np.isfinite(interp.run(prog, ins, "native")["O"]).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 1e-2
    # The mutant without the max: exp of the unshifted logits in kernel 1, chunk
    # weights exp(m_j - m_j) = 1 in kernel 2. Equal over the reals and in the finite
    # field, and it overflows (inf / inf) where the program is finite.
    mutant = instantiate(prog, _drop_max(od), _tuning(g))
    assert mutant is not None
    assert Verifier(prog, seed=0).check(mutant, trials=1).equivalent is True
    verdict = safety_check(prog, mutant)
    assert not verdict.safe and verdict.scale == 16.0 and "NaN" in verdict.reason
    assert not np.isfinite(interp.run(mutant, ins, "native")["O"]).all()
    assert not _exp_arguments_are_max_shifted(mutant)


def test_partials_are_kept_in_f32_and_in_f16_they_are_rejected():
    """Kernel 1 stores its partial results in f32 and kernel 2 converts its result to
    the program's f16. The same design with f16 partials (the program's dtype)
    verifies and passes random inputs, but a constant V of 16384 overflows a chunk's
    sum of them where the program's result, their weighted average, is 16384: the
    numerics check rejects it."""
    prog = _program("mha_decode")
    od, g = _online(prog)
    assert [v.type.dtype for v in g.ops[0].outputs] == [DType.F32] * len(g.ops[0].outputs)
    assert g.ops[1].outputs[0].type.dtype is DType.F16
    assert safety_check(prog, g).safe
    narrow = Design(tuple(replace(k, stores=tuple(replace(st, dtype=None) for st in k.stores))
                          for k in od.steps if isinstance(k, CustomD)), od.outputs)
    mutant = instantiate(prog, narrow, _tuning(g))
    assert mutant is not None and mutant.ops[0].outputs[0].type.dtype is DType.F16
    assert Verifier(prog, seed=0).check(mutant, trials=1).equivalent is True
    assert crosscheck(prog, mutant, 0).close
    verdict = safety_check(prog, mutant)
    assert not verdict.safe and verdict.failed_on.startswith("V = 16384")
    assert "infinite" in verdict.reason
    ins = hostile_inputs(prog, 0, Inputs(constant=2))
    assert np.allclose(interp.run(prog, ins, "native")["O"], 16384.0)
    assert np.allclose(interp.run(g, ins, "native")["O"], 16384.0)


def _tuning(g: Graph) -> tuple[tuple[tuple[int, int, int], int], ...]:
    return design_of(g)[1]


def _drop_max(od: Design) -> Design:
    k1, k2 = od.steps
    assert isinstance(k1, CustomD) and isinstance(k2, CustomD)
    n1 = len(k1.loads)
    ops1 = list(k1.ops)
    for i, o in enumerate(ops1):
        if o.op == "exp":  # exp(sub(s, m)) -> exp(s)
            shifted = ops1[o.args[0] - n1]
            ops1[i] = OpD("exp", (shifted.args[0],), ())
    ops2 = list(k2.ops)
    for i, o in enumerate(ops2):
        if o.op == "sub":  # exp(m_j - M) -> exp(m_j - m_j)
            ops2[i] = OpD("sub", (o.args[0], o.args[0]), ())
    return replace(od, steps=(replace(k1, ops=tuple(ops1)), replace(k2, ops=tuple(ops2))))


def test_search_ships_the_online_form_when_whole_rows_do_not_fit():
    """At 4096 keys a whole row of K does not fit one block: the search's answer is
    the two-kernel rescaled form, certified and checked like every candidate."""
    prog = _program("mha_decode", seq=4096)
    res = search(prog, SearchOptions(max_block_ops=9, max_grid_axes=1, top=1))
    assert res.candidates
    best = res.candidates[0]
    assert best.design.num_kernels == 2
    assert any("_online" in o.name for o in best.graph.ops[0].outputs)
    assert best.verdict["numerics"]["verdict"] == "safe"
    assert best.verdict["float64"]["verdict"] == "close"
    assert _exp_arguments_are_max_shifted(best.graph)


@pytest.mark.gpu
def test_online_candidate_runs_on_the_gpu_finite_on_large_logits():
    """The generated CUDA of the rescaled split (both kernels, as `mirage opt` ships
    them at reduced sizes) against float64, on inputs whose logits pass +-100."""
    from mirage_cli.codegen.runner import gpu_available

    if not gpu_available():
        pytest.skip("no CUDA GPU")
    from mirage_cli.codegen.bench import build
    from mirage_cli.codegen.runner import Device

    for name in ("mha_decode", "mqa_decode"):
        prog = _program(name, seq=4096)
        res = search(prog, SearchOptions(max_block_ops=9, max_grid_axes=1, top=1))
        assert res.candidates and res.candidates[0].design.num_kernels == 2
        loaded = build(Device(0), res.candidates[0].graph)
        ins = scaled_inputs(prog, 0, 16.0)
        try:
            out = loaded.run(ins)["O"]
        finally:
            loaded.unload()
        ref = interp.run(prog, ins, "float64")["O"]
        assert np.isfinite(out).all()
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) <= 1e-2
        # V constant: each chunk's partial sum of V far exceeds f16's range; the
        # result, a weighted average of V, is V.
        loaded = build(Device(0), res.candidates[0].graph)
        try:
            out = loaded.run(hostile_inputs(prog, 0, Inputs(constant=2)))["O"]
        finally:
            loaded.unload()
        assert np.allclose(out, 16384.0, rtol=1e-3)


# A one-kernel mqa_decode design whose grid splits the batch only: every query row of a
# batch element (its 4 heads) in one block, all keys in its loop (WHOLE_ROW's kernel).
ROWS_WHOLE = (WHOLE_ROW.replace("mha_decode(batch = 1,", "mqa_decode(batch = 2,")
              .replace("[heads * batch, 1, d]", "[batch, heads, d]")
              .replace("[heads * batch, d, seq]", "[batch, d, seq]")
              .replace("[heads * batch, seq, d]", "[batch, seq, d]")
              .replace("grid=(4, 1, 1)", "grid=(2, 1, 1)"))


def test_a_combine_over_seven_rows_is_tuned():
    """Seven query heads per key/value head (Qwen2-7B's grouped attention): the
    combine's rows axis has no power-of-two size, and the tuner's start moves it to a
    divisor of the rows it stores, so the split's rows design is tuned at all."""
    from mirage_cli.parser import parse_text
    from mirage_cli.search.tune import tune

    prog = _program("mqa_decode", batch=2, heads=7)
    design, tuning = design_of(parse_text(ROWS_WHOLE, "<rows-whole>", {"heads": 7}))
    split = online_split(prog, design, tuning, rows=True)
    assert split is not None
    tuned = tune(prog, split)
    assert tuned, "no valid tuning"
    assert {t[1][1][0][1] for t in tuned} == {7}  # the combine's rows: all seven a block
    assert Verifier(prog, seed=0).certify(tuned[0][2]).verdict == "equivalent"


def test_the_combine_may_split_the_rows_that_the_kernel_keeps_whole():
    """``rows=True``: kernel 2 spreads the rows (each combined on its own) over one more
    grid axis than kernel 1's batch axis, so a design reading K and V once per batch
    element still has a combine that fills the GPU; certified like the plain form. A
    kernel whose grid already splits the rows has no such variant."""
    from mirage_cli.parser import parse_text
    from mirage_cli.search.tune import tune

    prog = _program("mqa_decode", batch=2)
    design, tuning = design_of(parse_text(ROWS_WHOLE, "<rows-whole>", {}))
    plain = online_split(prog, design, tuning)
    split = online_split(prog, design, tuning, rows=True)
    assert plain is not None and split is not None
    assert [s.axes for s in plain.steps] == [2, 1]  # type: ignore[union-attr]
    assert [s.axes for s in split.steps] == [2, 2]  # type: ignore[union-attr]
    g = tune(prog, split)[0][2]
    k2 = g.ops[1].block
    assert k2 is not None and k2.grid[1] >= 2  # the rows, over the combine's second axis
    assert _exp_arguments_are_max_shifted(g)
    assert Verifier(prog, seed=0).certify(g).verdict == "equivalent"
    assert crosscheck(prog, g, 0).close and safety_check(prog, g, 0).safe
    # The maximum's spread (m_j + 0 * q, stored after the loop) reads the queries
    # where it is stored: no pass over them before the loop, no shared-memory tile.
    from mirage_cli.commands.plan import planned
    zero = next(o.outputs[0].name for o in g.ops[0].block.ops  # type: ignore[union-attr]
                if o.op == "mul_scalar" and dict(o.attrs)["scalar"] == 0.0)
    plan = planned(g, "sm_90", []).ops[0].plan
    assert plan is not None and next(t for t in plan.tiles if t.name == zero).home == "inline"
    by_rows = ROWS_WHOLE.replace("grid=(2, 1, 1)", "grid=(2, 2, 1)").replace(
        "q = load Q imap(x=0)", "q = load Q imap(x=0, y=1)").replace(
        "store r -> O omap(x=0)", "store r -> O omap(x=0, y=1)")
    d2, t2 = design_of(parse_text(by_rows, "<rows-split>", {}))
    assert online_split(prog, d2, t2) is not None
    assert online_split(prog, d2, t2, rows=True) is None
