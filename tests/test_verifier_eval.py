"""Finite-field evaluation: the vectorised block evaluator computes what the
reference interpreter's block-by-block, iteration-by-iteration loops define, on
many random custom kernels; field arithmetic is exact; every operator has field
semantics in the registry."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from mirage_cli import ops
from mirage_cli.builder import GraphBuilder
from mirage_cli.check import block_phases
from mirage_cli.interp import _block_slices
from mirage_cli.ir import BlockGraph, Graph
from mirage_cli.semantics import field as F
from mirage_cli.semantics.fieldsem import FieldSem
from mirage_cli.semantics.values import FVal, TrialContext
from mirage_cli.verifier.api import Verifier
from mirage_cli.verifier.evaluate import LEAD, evaluate, sem


def test_every_operator_has_field_semantics() -> None:
    for name, opdef in ops.REGISTRY.items():
        assert isinstance(opdef.field, FieldSem), name
        assert opdef.field.treatment, name


def test_matmul_mod_is_exact() -> None:
    rng = np.random.default_rng(1)
    for m in (F.P, F.Q):
        a = rng.integers(0, m, (3, 40), dtype=np.int64)
        b = rng.integers(0, m, (40, 5), dtype=np.int64)
        want = np.array([[sum(int(a[i, k]) * int(b[k, j]) for k in range(40)) % m
                          for j in range(5)] for i in range(3)], dtype=np.int64)
        assert np.array_equal(F.matmul_mod(a, b, m), want)
    big = np.full((1, 5000), F.P - 1, dtype=np.int64)
    assert int(F.matmul_mod(big, big.T, F.P)[0, 0]) == 5000 % F.P  # (-1)^2 * 5000


def _matmul_exact(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    """The reference: Python integers (object arrays), reduced at the end."""
    return (np.matmul(a.astype(object), b.astype(object)) % m).astype(np.int64)


@pytest.mark.parametrize("case", range(24))
def test_matmul_mod_plans_and_slabs_are_exact(case: int, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """Every plan (limbs on either side, chunks), broadcast batches and slabs split
    over batch entries and rows, against Python integers; also registered bounds."""
    rng = np.random.default_rng(100 + case)
    m = (F.P, F.Q)[case % 2]
    bits_a, bits_b = [(22, 22), (31, 22), (22, 31), (31, 31), (12, 31), (31, 5)][case % 6]
    batch_a, batch_b = [((), ()), ((3,), (3,)), ((2, 1), (1, 3)), ((4,), ())][case % 4]
    rows, k, cols = [(3, 7, 5), (70, 40, 300), (1, 4100, 2), (130, 9, 50)][(case // 4) % 4]
    # Small slabs, so that batches, rows and reduction chunks are all split.
    monkeypatch.setattr(F, "MM_SLAB", 1 << 10)
    a = rng.integers(0, min(m, 1 << bits_a), batch_a + (rows, k), dtype=np.int64)
    b = rng.integers(0, min(m, 1 << bits_b), batch_b + (k, cols), dtype=np.int64)
    if case % 3 == 0:
        a[..., 0, :] = min(m, 1 << bits_a) - 1  # the largest values
        b[..., :, 0] = min(m, 1 << bits_b) - 1
    if case % 5 == 0:
        F.register_bits(a, bits_a)
    want = _matmul_exact(a, b, m)
    got = F.matmul_mod(a, b, m)
    assert got.shape == want.shape and np.array_equal(got, want)
    # Views of an array with a registered bound use that bound, exactly.
    if case % 5 == 0:
        at = np.swapaxes(a, -1, -2)
        bt = np.swapaxes(b, -1, -2)
        assert np.array_equal(F.matmul_mod(bt, at, m), np.swapaxes(want, -1, -2))


def test_matmul_mod_of_empty_operands() -> None:
    z = F.matmul_mod(np.zeros((2, 3, 0), np.int64), np.zeros((0, 4), np.int64), F.P)
    assert z.shape == (2, 3, 4) and not z.any()
    assert F.matmul_mod(np.zeros((0, 3), np.int64), np.ones((3, 4), np.int64), F.Q).shape == (0, 4)


def test_exp_table_in_slabs_matches_pow() -> None:
    ctx = TrialContext(5, 1)
    rng = np.random.default_rng(7)
    a = rng.integers(0, F.Q, (3, F.SLAB + 11), dtype=np.int64)
    a[0, :4] = [0, 1, F.Q - 1, 1 << 15]
    g = F.subgroup_generator(5, 1)
    e = ctx.exp(a[:, ::1].T)  # a non-contiguous view
    want = [pow(g, int(x), F.P) for x in a.T.reshape(-1)[::997]]
    assert [int(x) for x in e.reshape(-1)[::997]] == want
    assert e.shape == a.T.shape


def test_exp_is_a_homomorphism_and_inverse_flags_zero() -> None:
    ctx = TrialContext(3, 0)
    a = np.array([5, F.Q - 5, 17, 0], dtype=np.int64)
    e = ctx.exp(a)
    assert int(e[0] * e[1] % F.P) == 1 and int(e[3]) == 1
    assert int(ctx.exp(np.array([22]))[0]) == int(e[0] * e[2] % F.P)
    assert int(F.pow_mod(e[2:3], F.Q, F.P)[0]) == 1
    inv, zero = F.inverse(np.array([0, 3], dtype=np.int64), F.P)
    assert zero and int(inv[1] * 3 % F.P) == 1 and not F.inverse(inv[1:], F.P)[1]


def test_constants_are_exact_dyadic_rationals() -> None:
    assert F.const(0.125, F.P) * 8 % F.P == 1
    assert F.const(-1.5, F.Q) * 2 % F.Q == F.Q - 3


# -- the oracle: interp.py's loops, with field semantics --------------------------


def _unit(a: np.ndarray) -> np.ndarray:
    return a.reshape((1,) * LEAD + a.shape)


def _each(x: FVal, fn) -> FVal:  # type: ignore[no-untyped-def]
    """``fn`` applied to every residue ``x`` has."""
    vs = [x.get(i) for i in range(3)]
    return FVal.of(*[None if v is None else fn(v) for v in vs])  # type: ignore[arg-type]


def _slice(x: FVal, sl: tuple) -> FVal:
    return _each(x, lambda v: v[sl])


def loop_block(bg: BlockGraph, env: dict[str, FVal], ctx: TrialContext) -> list[np.ndarray]:
    """A custom kernel evaluated block by block and iteration by iteration."""
    bctx = ctx.at_lead(LEAD)
    outs = [np.zeros(bo.value.type.shape, dtype=np.int64) for bo in bg.outputs]
    phases = block_phases(bg)
    for block in itertools.product(*(range(n) for n in bg.grid)):
        parts = {bi.value.name: _slice(env[bi.source], tuple(_block_slices(
            bi.imap, bg.grid, block, env[bi.source].p.shape))) for bi in bg.inputs}
        fmaps = {bi.value.name: bi.fmap for bi in bg.inputs}
        vals = {n: _lift_unit(p) for n, p in parts.items() if fmaps[n] is None}
        _run_phase(bg, vals, bctx, phases, "invariant")
        collected: dict[str, list[FVal]] = {}
        for i in range(bg.forloop):
            it = dict(vals)
            for n, part in parts.items():
                d = fmaps[n]
                if d is not None:
                    step = part.p.shape[d] // bg.forloop
                    sl = [slice(None)] * part.p.ndim
                    sl[d] = slice(i * step, (i + 1) * step)
                    it[n] = _lift_unit(_slice(part, tuple(sl)))
            _run_phase(bg, it, bctx, phases, "loop")
            for op in bg.ops:
                if ops.get(op.op).is_accumulator:
                    collected.setdefault(op.outputs[0].name, []).append(it[op.inputs[0]])
        for op in bg.ops:
            if ops.get(op.op).is_accumulator:
                xs = collected[op.outputs[0].name]
                parts = [[x.get(i) for x in xs] for i in range(3)]
                stacked = FVal.of(*[None if p[0] is None else np.concatenate(p, axis=3)
                                    for p in parts])  # type: ignore[arg-type]
                vals[op.outputs[0].name] = sem(op.op).eval(
                    [stacked], ops.get(op.op).attr_values(op.attrs), bctx)
        _run_phase(bg, vals, bctx, phases, "epilogue")
        for out, bo in zip(outs, bg.outputs):
            sl = _block_slices(bo.omap, bg.grid, block, out.shape)  # type: ignore[arg-type]
            out[tuple(sl)] = vals[bo.source].p.reshape(vals[bo.source].p.shape[LEAD:])
    return outs


def _lift_unit(x: FVal) -> FVal:
    return _each(x, _unit)


def _run_phase(bg: BlockGraph, vals: dict[str, FVal], ctx: TrialContext,
               phases: dict[str, str], phase: str) -> None:
    for op in bg.ops:
        opdef = ops.get(op.op)
        if opdef.is_accumulator or phases[op.outputs[0].name] != phase:
            continue
        vals[op.outputs[0].name] = sem(op.op).eval([vals[i] for i in op.inputs],
                                                   opdef.attr_values(op.attrs), ctx)


# -- random kernels ----------------------------------------------------------------

UNARY = ("exp", "silu", "square", "neg", "relu")
BINARY = ("add", "mul", "sub", "div")
ACCS = ("acc_sum", "acc_mean", "acc_rms", "acc_max", "acc_sum_ld", "acc_mean_ld",
        "acc_rms_ld", "acc_max_ld", "acc_sum_to")


def random_kernel(seed: int) -> Graph:
    """A random single-kernel graph over 8x8 inputs with random grid, forloop, maps."""
    r = random.Random(seed)
    b = GraphBuilder(f"rand{seed}")
    names = [b.input(f"I{i}", (8, 8), "f32") for i in range(3)]
    axes = r.sample(range(3), 2)
    grid = [1, 1, 1]
    for a in axes:
        grid[a] = r.choice((1, 2))
    forloop = r.choice((1, 2, 4))
    k = b.custom(tuple(grid), 128, forloop)
    maps = [r.sample([0, 1], 2) for _ in names]
    tiles = []
    for n, (d0, d1) in zip(names, maps):
        imap = [None, None, None]
        imap[axes[0]], imap[axes[1]] = d0, d1
        tiles.append(k.load(n, tuple(imap), r.choice((None, 0, 1))))  # type: ignore[arg-type]
    by_shape: dict[tuple, list[str]] = {}
    for t in tiles:
        by_shape.setdefault(k.types[t].shape, []).append(t)
    group = max(by_shape.values(), key=len)
    v = group[0]
    for _ in range(r.randint(1, 4)):
        if r.random() < 0.5:
            v = k.op(r.choice(BINARY), v, r.choice(group))
        else:
            u = r.choice(UNARY)
            if u == "exp" and "exp" in _chain(k, v):
                u = "square"
            v = k.op(u, v)
    shape = k.types[v].shape
    if shape[0] == shape[1] and r.random() < 0.4:
        v = k.op("matmul", v, r.choice(group))
    acc = r.choice(ACCS)
    a = k.op(acc, v, width=2) if acc == "acc_sum_to" else k.op(acc, v)
    if r.random() < 0.5:
        a = k.op(r.choice(("square", "neg", "silu")), a)
    omap = [None, None, None]
    perm = r.sample([0, 1], 2)
    omap[axes[0]], omap[axes[1]] = perm
    (o,) = k.finish([(a, "O", tuple(omap))])  # type: ignore[arg-type]
    b.output(o)
    return b.build()


def _chain(k, v: str) -> set[str]:  # type: ignore[no-untyped-def]
    """Operators on the path to v (exp must not be nested)."""
    seen, todo = set(), [v]
    while todo:
        n = todo.pop()
        for op in k.ops:
            if op.outputs[0].name == n:
                seen.add(op.op)
                todo.extend(op.inputs)
    return seen


@pytest.mark.parametrize("seed", range(80))
def test_vectorised_block_equals_loops(seed: int) -> None:
    g = random_kernel(seed)
    v = Verifier(g, seed=seed)
    ins = v.trial_inputs(0)
    ctx = TrialContext(seed, 0)
    (fast,) = evaluate(g, ins, ctx)
    env = {i.value.name: x for i, x in zip(g.inputs, ins)}
    (slow,) = loop_block(g.ops[0].block, env, TrialContext(seed, 0))  # type: ignore[arg-type]
    assert np.array_equal(fast.p, slow)


def test_same_seed_same_certificate() -> None:
    from verifier_corpus import EQUIVALENT

    _, a, b = next(e for e in EQUIVALENT if e[0] == "gqa flash decoding")
    c1 = Verifier(a(), seed=11).certify(b()).to_json()
    c2 = Verifier(a(), seed=11).certify(b()).to_json()
    assert c1 == c2 and c1["bound"] <= 2.0 ** -40
    assert c1["finite_field"]["trials"] >= 1 and c1["seed"] == 11
    c3 = Verifier(a(), seed=12).certify(b()).to_json()
    assert c3["seed"] == 12 and c3["verdict"] == "equivalent"


def _unary_prog(name: str, body) -> Graph:  # type: ignore[no-untyped-def]
    b = GraphBuilder(name)
    x = b.input("X", (4, 8), "f32")
    b.output(body(b, x))
    return b.build()


def test_nested_exp_is_undecided_not_silently_accepted() -> None:
    g = _unary_prog("a", lambda b, x: b.op("exp", b.op("exp", x)))
    cert = Verifier(g).certify(g)
    assert cert.field_verdict.equivalent is None and "nested" in cert.field_verdict.reason
    assert cert.crosscheck is not None and cert.crosscheck.close
    assert cert.verdict == "undecided" and cert.disagreement
    assert cert.exit_code == 1


def test_division_by_a_formal_zero_is_undecided() -> None:
    g = _unary_prog("a", lambda b, x: b.op("div", x, b.op("sub", x, x)))
    v = Verifier(g).check(g, trials=2)
    assert v.equivalent is None and v.discarded > 0 and "zero" in v.reason


def test_zero_divisor_trial_is_discarded_not_compared() -> None:
    # x * y / y vs x: equal whenever y != 0; a trial with y = 0 must not count.
    b = GraphBuilder("a")
    x, y = b.input("X", (4, 8), "f32"), b.input("Y", (4, 8), "f32")
    b.output(b.op("div", b.op("mul", x, y), y))
    a = b.build()
    b = GraphBuilder("b")
    x, y = b.input("X", (4, 8), "f32"), b.input("Y", (4, 8), "f32")
    b.output(b.op("add", x, b.op("mul_scalar", y, scalar=0.0)))
    ver = Verifier(a)
    ins = ver.trial_inputs(0)
    ins[1].p[0, 0] = 0  # force a zero divisor in trial 0
    verdict = ver.check(b.build(), trials=2)
    assert verdict.equivalent is True and verdict.discarded == 1 and verdict.trials == 2


def test_trial_bound_parts() -> None:
    from verifier_corpus import EQUIVALENT

    _, a, b = next(e for e in EQUIVALENT if e[0] == "gated MLP fused")
    tb = Verifier(a()).trial_bound(b())
    assert tb.degree == 3 and tb.collisions > 0 and tb.per_trial < 2.0 ** -20
    assert tb.trials_for(2.0 ** -40) == 2


def test_bit_bounds_follow_views_and_are_dropped_with_their_array() -> None:
    import gc

    from mirage_cli.verifier.evaluate import split_input

    x = np.arange(8 * 16, dtype=np.int64).reshape(8, 16) * 7919
    assert F.bit_bound(x) == int(x.max()).bit_length()
    F.register_bits(x, 40)
    for imap, fmap in (((1, None, None), 0), ((None, 0, None), 1), ((None, None, None), None)):
        v = split_input(x, (2, 2, 1), 2, imap, fmap)  # type: ignore[arg-type]
        assert F.bit_bound(v) == 40
    assert F.bit_bound(x[1:, 3::2].T) == 40
    assert F.bit_bound(x.copy()) == int(x.max()).bit_length()  # a copy is not a view
    key = id(x)
    assert key in F._BOUNDS
    del x, v
    gc.collect()
    assert key not in F._BOUNDS


def test_exp_assumption_stated_exactly_when_exp_is_used():
    from mirage_cli.builder import GraphBuilder
    from mirage_cli.verifier.api import Verifier

    for op, attrs, expected in (("exp", {}, True), ("softmax", {"dim": 1}, True),
                                ("square", {}, False)):
        b = GraphBuilder(op)
        b.output(b.op(op, b.input("X", (4, 8), "f32"), **attrs))
        g = b.build()
        cert = Verifier(g, seed=0).certify(g, crosscheck_float64=False)
        stated = any("generic-exponent" in a for a in cert.assumptions)
        assert stated is expected, op
