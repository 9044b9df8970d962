"""Finite-field semantics of the operators: the library behind ``OpDef.field``.

Every operator of the registry gets a :class:`FieldSem` here (``ops.py`` stores it in
the operator's ``field`` slot; this module never imports ``ops``). A FieldSem says
- ``eval``: how the operator acts on :class:`FVal` residues (mod P and mod Q);
- ``stat``: how it transforms the static facts used by the probability bound (degree
  of numerator and denominator as a rational function, and whether the value still has
  a meaning in Z_Q);
- ``treatment``: how the operator is modelled, as printed in certificates.

Models (docs/verification.md derives the bound):
- ``add sub mul neg square matmul sum mean concat sum_to mul_scalar`` and the sum/mean
  accumulators are exact field arithmetic; ``reshape`` and ``rotate_half`` move
  residues (with a sign) and are exact too (constants are exact dyadic rationals);
- ``div`` multiplies by the field inverse; a zero divisor is flagged and the trial is
  discarded and replaced;
- ``exp`` maps a residue a in Z_Q to g^a in Z_P (g of order Q, fresh per trial);
- ``silu gelu relu sqrt`` are random functions (fresh per trial, shared by both sides)
  of their argument's residues; ``rsqrt`` is 1/sqrt and ``rms`` is sqrt(mean(x^2)+eps)
  with that same random sqrt; ``max`` (and ``acc_max``) is a random function of the
  multiset of the elements reduced, so splitting the reduction over blocks or
  iterations does not change it, while any value-dependent identity of max does not
  verify.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any, assert_never

import numpy as np

from mirage_cli.semantics import field as F
from mirage_cli.semantics.accum import AccumSpec, Finish, Pre, Reduce, is_extreme
from mirage_cli.semantics.degrees import (
    Stat,
    StatFn,
    st_acc_rms_key,
    st_accumulate,
    st_atom,
)
from mirage_cli.semantics.values import MODULI, FVal, TrialContext, Unsupported

Attrs = dict[str, Any]
Shape = tuple[int, ...]


EvalFn = Callable[[Sequence[FVal], Attrs, TrialContext], FVal]


@dataclass(frozen=True)
class FieldSem:
    """The finite-field meaning of one operator."""

    eval: EvalFn
    stat: StatFn
    treatment: str
    # Random function family this operator draws from (None: exact arithmetic).
    random_fn: str | None = None
    keys_from: str = "out"
    # Field inversions it performs: (elements, degree) from operand stats and shapes.
    inverts: Callable[[Sequence[Stat], Sequence[Shape]], tuple[int, int]] | None = None
    # Keys per application of the random function: "out" elements, "in" elements,
    # or "rows" (elements of the input without its last dim).
    # Degree of the random function's key, when it is not the operand itself.
    key_stat: StatFn | None = None
    # Evaluates exp, so the bound rests on the generic-exponent model (api.py states it).
    uses_exp: bool = False


# ---------------------------------------------------------------------------
# Lifting residue functions to FVal
# ---------------------------------------------------------------------------

Res = np.ndarray


def lift(fn: Callable[..., Res]) -> Callable[[Sequence[FVal]], FVal]:
    """Apply ``fn(*residues, m)`` to every residue; a residue exists iff every
    operand has it."""
    def apply(xs: Sequence[FVal]) -> FVal:
        def part(i: int) -> Callable[[], Res | None]:
            def f() -> Res | None:
                vs = [x.get(i) for x in xs]
                if any(v is None for v in vs):
                    if i == 0:
                        raise Unsupported("a value has no meaning in Z_P")
                    return None
                return fn(*vs, MODULI[i])
            return f
        return FVal(part(0), part(1), part(2))
    return apply


def ring(fn: Callable[..., Res]) -> EvalFn:
    lifted = lift(fn)
    return lambda xs, a, ctx: lifted(xs)


def _inv(ctx: TrialContext) -> Callable[[Res, int], Res]:
    def inv(x: Res, m: int) -> Res:
        r, zero = F.inverse(x, m)
        ctx.note_zero(zero)
        return r
    return inv


def ev_div(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    inv = _inv(ctx)
    return lift(lambda x, y, m: x * inv(y, m) % m)(xs)


def ev_mul_scalar(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    s = a["scalar"]
    return lift(lambda x, m: x * F.const(s, m) % m)(xs)


def ev_exp(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    (x,) = xs
    return FVal(lambda: ctx.exp(x.q_required), lambda: None, lambda: None)


def random_fn(name: str, x: FVal, ctx: TrialContext) -> FVal:
    """The random function ``name`` of this trial applied element-wise to ``x``."""
    cache: list[tuple[Res, Res, Res]] = []

    def values() -> tuple[Res, Res, Res]:
        if not cache:
            cache.append(F.hash_to_fields(F.hash_key(ctx.salt(name), x.p, x.q, x.r)))
        return cache[0]
    return FVal(lambda: values()[0], lambda: values()[1], lambda: values()[2])


def ev_random(name: str) -> EvalFn:
    return lambda xs, a, ctx: random_fn(name, xs[0], ctx)


def ev_rsqrt(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    inv = _inv(ctx)
    return lift(inv)([random_fn("sqrt", xs[0], ctx)])


def reduce_sum(x: FVal, axes: tuple[int, ...], keepdims: bool = True) -> FVal:
    return lift(lambda v, m: v.sum(axis=axes, keepdims=keepdims) % m)([x])


def scale(x: FVal, count: int) -> FVal:
    """x / count for an integer count (exact: count < Q is invertible)."""
    return lift(lambda v, m: v * pow(count % m, m - 2, m) % m)([x])


def mean_over(x: FVal, axes: tuple[int, ...], keepdims: bool = True) -> FVal:
    """Sum over ``axes`` divided by the number of elements summed (known only once
    a residue is computed, so that no residue is computed just for its shape)."""
    def fn(v: Res, m: int) -> Res:
        count = prod(v.shape[a] for a in axes)
        return v.sum(axis=axes, keepdims=keepdims) % m * pow(count % m, m - 2, m) % m
    return lift(fn)([x])


def multiset_max(x: FVal, axes: tuple[int, ...], keepdims: bool, ctx: TrialContext,
                 name: str = "max") -> FVal:
    """max (or min, by ``name``) over ``axes`` as a random function of the multiset of
    elements reduced: a 64-bit fingerprint (sum of per-element hashes, wrapping) fed to a
    random function named ``name``, so max and min never agree."""
    def key() -> FVal:
        h = F.hash_key(ctx.salt(f"{name}.element"), x.p, x.q, x.r)
        with np.errstate(over="ignore"):
            s = h.sum(axis=axes, keepdims=keepdims, dtype=np.uint64)
        return FVal.of(s.view(np.int64), None)
    return random_fn(name, key(), ctx)


def _axis(ctx: TrialContext, a: Attrs) -> int:
    return ctx.axis(int(a["dim"]))


def ev_sum(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    return reduce_sum(xs[0], (_axis(ctx, a),), bool(a.get("keepdim", False)))


def ev_mean(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    return mean_over(xs[0], (_axis(ctx, a),), bool(a.get("keepdim", False)))


def ev_max(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    return multiset_max(xs[0], (_axis(ctx, a),), bool(a.get("keepdim", False)), ctx)


def rms_of(x: FVal, eps: float, ctx: TrialContext, axes: tuple[int, ...]) -> FVal:
    """sqrt(mean(x^2 over axes) + eps), with the trial's random sqrt."""
    ms = mean_over(lift(lambda v, m: v * v % m)([x]), axes)
    if eps:
        ms = lift(lambda v, m: (v + F.const(eps, m)) % m)([ms])
    return random_fn("sqrt", ms, ctx)


def ev_rms(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    return rms_of(xs[0], float(a.get("eps", 0.0)), ctx, (-1,))


def ev_rms_norm(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    r = ev_rms(xs[:1], a, ctx)
    y = ev_div([xs[0], r], a, ctx)
    return lift(lambda u, w, m: u * w % m)([y, xs[1]]) if len(xs) == 2 else y


def ev_softmax(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    e = ev_exp(xs, a, ctx)
    return ev_div([e, reduce_sum(e, (_axis(ctx, a),))], a, ctx)


def ev_concat(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    axis = _axis(ctx, a)

    def cat(x: Res, y: Res, m: int) -> Res:
        x, y = _broadcast_lead(x, y, axis)
        return np.concatenate([x, y], axis=axis)
    return lift(cat)(xs)


def _broadcast_lead(x: Res, y: Res, axis: int) -> tuple[Res, Res]:
    """Broadcast every axis but ``axis`` (leading block axes may differ in size)."""
    shape = [max(i, j) for i, j in zip(x.shape, y.shape)]
    sx, sy = list(shape), list(shape)
    sx[axis], sy[axis] = x.shape[axis], y.shape[axis]
    return np.broadcast_to(x, sx), np.broadcast_to(y, sy)


def reshape_dims(a: Attrs) -> Shape:
    """The target shape of ``reshape``: its ``d0..d3`` attributes, absent (0) ones
    dropped (the shape rule admits only trailing absent ones)."""
    return tuple(int(a.get(f"d{i}", 0)) for i in range(4) if int(a.get(f"d{i}", 0)))


def ev_reshape(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    """Row-major reshape: the same residues in the same order (exact)."""
    shape = reshape_dims(a)
    return lift(lambda v, m: v.reshape(v.shape[:ctx.lead] + shape))(xs)


def ev_rotate_half(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    """[x1, x2] -> [-x2, x1] over the last dim: a signed permutation (exact)."""
    def rot(v: Res, m: int) -> Res:
        h = v.shape[-1] // 2
        return np.concatenate([(-v[..., h:]) % m, v[..., :h]], axis=-1)
    return lift(rot)(xs)


def sum_to(v: Res, width: int, m: int) -> Res:
    groups = v.shape[-1] // width
    return v.reshape(v.shape[:-1] + (groups, width)).sum(axis=-2) % m


def ev_sum_to(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    w = int(a["width"])
    return lift(lambda v, m: sum_to(v, w, m))(xs)


def ev_accumulate(spec: AccumSpec) -> EvalFn:
    """An accumulator: its input holds every iteration's tile on axis ``ctx.lead - 1``;
    the result keeps that axis as size 1."""
    def ev(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
        x = _pre(spec.pre, xs[0])
        it = ctx.lead - 1
        if is_extreme(spec.combine):  # AccumSpec admits only reduce none/last here
            return multiset_max(x, (it, -1) if spec.reduce is Reduce.LAST else (it,), True,
                                ctx, spec.combine.value)
        axes: tuple[int, ...]
        match spec.reduce:
            case Reduce.TO_WIDTH:
                w = int(a["width"])
                x = lift(lambda v, m: _sum_groups(v, w, m))([x])
                axes = (it, -2)
            case Reduce.LAST:
                axes = (it, -1)
            case Reduce.NONE:
                axes = (it,)
            case other:
                assert_never(other)
        match spec.finish:
            case Finish.ID:
                return _squeeze_groups(reduce_sum(x, axes), spec)
            case Finish.MEAN:
                return _squeeze_groups(mean_over(x, axes), spec)
            case Finish.RMS:
                ms = _squeeze_groups(mean_over(x, axes), spec)
                eps = float(a.get("eps", 0.0))
                if eps:  # the same key as rms / rms_norm with this eps
                    ms = lift(lambda v, m: (v + F.const(eps, m)) % m)([ms])
                return random_fn("sqrt", ms, ctx)
            case finish:
                assert_never(finish)
    return ev


def _pre(pre: Pre, x: FVal) -> FVal:
    match pre:
        case Pre.ID:
            return x
        case Pre.SQUARE:
            return lift(lambda v, m: v * v % m)([x])
        case other:
            assert_never(other)


def _sum_groups(v: Res, width: int, m: int) -> Res:
    """[..., groups*width] -> [..., groups, width] (summed by the caller)."""
    return v.reshape(v.shape[:-1] + (v.shape[-1] // width, width))


def _squeeze_groups(x: FVal, spec: AccumSpec) -> FVal:
    if spec.reduce is not Reduce.TO_WIDTH:
        return x
    return lift(lambda v, m: v.reshape(v.shape[:-2] + v.shape[-1:]))([x])


def ev_matmul(xs: Sequence[FVal], a: Attrs, ctx: TrialContext) -> FVal:
    return lift(F.matmul_mod)(xs)


# ---------------------------------------------------------------------------
# The table (looked up by ops.py)
# ---------------------------------------------------------------------------

EXACT = "exact field arithmetic"
RATIONAL = "field inverse; a zero divisor discards the trial"

def random_sem(name: str) -> FieldSem:
    """An element-wise operator modelled as a random function named ``name``."""
    return FieldSem(ev_random(name), st_atom, "random function per trial, shared by "
                    "both sides", random_fn=name)


MAX_SEM = FieldSem(ev_max, st_atom, "random function of the multiset of elements "
                   "reduced, per trial, shared by both sides", random_fn="max",
                   keys_from="in")


def custom_sem() -> FieldSem:
    """The ``custom`` operator: evaluated structurally by the block-graph evaluator
    (:mod:`mirage_cli.verifier.evaluate`), never through this entry's functions."""
    def structural(*_: Any) -> Any:
        raise AssertionError("custom kernels are evaluated by verifier.evaluate")
    return FieldSem(structural, structural, "its block graph, vectorised over blocks and "
                    "iterations")


def accumulator_sem(spec: AccumSpec) -> FieldSem:
    """A forloop accumulator from its ``AccumSpec``."""
    ev, st = ev_accumulate(spec), st_accumulate(spec)
    if is_extreme(spec.combine):
        return FieldSem(ev, st, "random function of the multiset of elements reduced "
                        f"(as {spec.combine.value})", random_fn=spec.combine.value,
                        keys_from="in")
    match spec.finish:
        case Finish.RMS:
            return FieldSem(ev, st, "random sqrt of (the mean of squares + eps)",
                            random_fn="sqrt", key_stat=st_acc_rms_key(spec))
        case Finish.ID | Finish.MEAN:
            return FieldSem(ev, st, EXACT)
        case other:
            assert_never(other)


def numel(shape: Shape) -> int:
    return prod(shape)
