"""Degree rules of the operators: the static facts the probability bound needs.

Every element of a tensor is, in the field model, a rational function N/D of the
inputs and the random atoms (random-function values, exponentials). :class:`Stat`
bounds deg N and deg D over all elements, and records the tensor axes along which the
denominator D may vary. That last fact keeps the bound tight: summing n terms that
share a denominator (a row divided by its norm, then multiplied by a matrix) keeps
degree (num, den), while n terms with n different denominators may need a common
denominator of degree n * den.

Axes are counted from the right (-1 is the last dimension) so that they align under
numpy broadcasting; ``ITER`` stands for the forloop iteration inside a block graph.
Every rule here over-approximates; docs/verification.md explains how they are used.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, assert_never

from mirage_cli.semantics.accum import AccumSpec, Finish, Pre, Reduce, is_extreme

Attrs = dict[str, Any]
Shape = tuple[int, ...]
ITER = 99  # pseudo-axis: varies across forloop iterations


@dataclass(frozen=True)
class Stat:
    """Degrees of numerator and denominator; ``p_only`` if the value has no meaning in
    Z_Q (downstream of exp); ``den_var``: axes along which the denominator may vary."""

    num: int
    den: int
    p_only: bool = False
    den_var: frozenset[int] = field(default_factory=frozenset)

    def with_axes(self, axes: frozenset[int]) -> Stat:
        return Stat(self.num, self.den, self.p_only, axes if self.den else frozenset())


StatFn = Callable[[Sequence[Stat], Sequence[Shape], Attrs, int], Stat]


def spread(shape: Shape, skip: int | None = None) -> frozenset[int]:
    """Axes (from the right) along which a tensor of ``shape`` is not broadcast."""
    n = len(shape)
    return frozenset(i - n for i, d in enumerate(shape) if d > 1 and i - n != skip)


def _p_only(ss: Sequence[Stat]) -> bool:
    return any(s.p_only for s in ss)


def _union(ss: Sequence[Stat]) -> frozenset[int]:
    out: frozenset[int] = frozenset()
    for s in ss:
        out |= s.den_var
    return out


def st_same(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    return ss[0]


def st_add(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    x, y = ss
    if x.den == 0 or y.den == 0:
        s = Stat(max(x.num + y.den, y.num + x.den), x.den + y.den, _p_only(ss))
    else:
        s = Stat(max(x.num + y.den, y.num + x.den), x.den + y.den, _p_only(ss))
    return s.with_axes(_union(ss))


def st_mul(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    x, y = ss
    return Stat(x.num + y.num, x.den + y.den, _p_only(ss)).with_axes(_union(ss))


def st_div(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    x, y = ss
    # The new denominator contains y's numerator, which varies wherever y does.
    axes = x.den_var | y.den_var | (spread(shapes[1]) if y.num else frozenset())
    return Stat(x.num + y.den, x.den + y.num, _p_only(ss)).with_axes(axes)


def st_square(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    s = ss[0]
    return Stat(2 * s.num, 2 * s.den, s.p_only, s.den_var)


def st_atom(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    """A random-function value: a fresh variable of degree 1."""
    return Stat(1, 0, False)


def st_inv_atom(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    return Stat(0, 1, False, spread(shapes[0]) | {ITER})


def st_exp(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    return Stat(1, 0, True)


def summed(s: Stat, n: int, varies: bool) -> Stat:
    """A sum of n terms of degree s. Polynomials keep their degree, and so do terms
    over one common denominator; n different denominators may multiply."""
    if s.den == 0 or n == 1 or not varies:
        return s
    return Stat(s.num + (n - 1) * s.den, n * s.den, s.p_only, s.den_var)


def _drop(axes: frozenset[int], axis: int, keep: bool) -> frozenset[int]:
    """Axes after reducing ``axis`` (negative); without keepdim, axes to its left shift."""
    out = set()
    for x in axes:
        if x == axis:
            continue
        out.add(x + 1 if (not keep and x < axis and x != ITER) else x)
    return frozenset(out)


def st_matmul(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    x, y = ss
    varies = -1 in x.den_var or -2 in y.den_var
    prod_ = st_mul(ss, shapes, a, f)
    axes = (x.den_var - {-1}) | (y.den_var - {-2, -1}) | ({-1} if -1 in y.den_var else set())
    return summed(prod_, shapes[0][-1], varies).with_axes(frozenset(axes))


def st_reduce(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    s = ss[0]
    rank = len(shapes[0])
    axis = int(a["dim"]) - rank
    r = summed(s, shapes[0][int(a["dim"])], axis in s.den_var)
    return r.with_axes(_drop(s.den_var, axis, bool(a.get("keepdim", False))))


def st_sum_to(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    s = ss[0]
    return summed(s, shapes[0][-1] // int(a["width"]), -1 in s.den_var)


def st_rms_norm(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    x = ss[0]
    # x / r with r a random atom per row (constant along the last dim).
    y = Stat(x.num, x.den + 1, x.p_only, x.den_var | spread(shapes[0], -1) | {ITER})
    return st_mul([y, ss[1]], shapes, a, f) if len(ss) == 2 else y


def st_softmax(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    axis = int(a["dim"]) - len(shapes[0])
    return Stat(1, 1, True, spread(shapes[0], axis))


def st_concat(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    axis = int(a["dim"]) - len(shapes[0])
    axes = _union(ss) | ({axis} if any(s.den for s in ss) else set())
    return Stat(max(s.num for s in ss), max(s.den for s in ss), _p_only(ss)).with_axes(axes)


def st_reshape(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    """A reshape moves elements between axes: a denominator that varied along any
    axis may vary along every axis of the result (over-approximated by all of them,
    the iteration pseudo-axis kept)."""
    s = ss[0]
    if not s.den:
        return s
    axes = frozenset(range(-4, 0)) | (s.den_var & {ITER})
    return Stat(s.num, s.den, s.p_only, axes)


def st_rms_key(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
    """The key of rms's random sqrt: mean of squares over the last dim (+ eps)."""
    s = st_square(ss[:1], shapes, a, f)
    return _plus_eps(summed(s, shapes[0][-1], -1 in s.den_var), a)


def _plus_eps(s: Stat, a: Attrs) -> Stat:
    """N/D + eps = (N + eps D)/D: the numerator's degree is at least the denominator's."""
    if not float(a.get("eps", 0.0)):
        return s
    return Stat(max(s.num, s.den), s.den, s.p_only, s.den_var)


def st_accumulate(spec: AccumSpec) -> StatFn:
    """Sum over the iterations (and the last dim or groups of it): one common
    denominator unless it varies across iterations or along the reduced dim."""
    def st(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
        if is_extreme(spec.combine) or spec.finish is Finish.RMS:
            return Stat(1, 0, False)  # a random function's value: an atom
        match spec.pre:
            case Pre.SQUARE:
                s = st_square(ss, shapes, a, f)
            case Pre.ID:
                s = ss[0]
            case other:
                assert_never(other)
        n, varies = f * _reduced_per_tile(spec.reduce, shapes[0], a), ITER in s.den_var
        if spec.reduce is not Reduce.NONE:
            varies = varies or -1 in s.den_var
        r = summed(s, n, varies)
        axes = s.den_var - {ITER} - ({-1} if spec.reduce is Reduce.LAST else set())
        return r.with_axes(axes)
    return st


def _reduced_per_tile(reduce: Reduce, shape: Shape, a: Attrs) -> int:
    match reduce:
        case Reduce.NONE:
            return 1
        case Reduce.LAST:
            return shape[-1]
        case Reduce.TO_WIDTH:
            return shape[-1] // int(a["width"])
        case other:
            assert_never(other)


def st_acc_rms_key(spec: AccumSpec) -> StatFn:
    def st(ss: Sequence[Stat], shapes: Sequence[Shape], a: Attrs, f: int) -> Stat:
        s = st_square(ss, shapes, a, f)
        varies = ITER in s.den_var or (spec.reduce is Reduce.LAST and -1 in s.den_var)
        return _plus_eps(summed(s, f * _reduced_per_tile(spec.reduce, shapes[0], a),
                                varies), a)
    return st


# -- how many field inversions an operator performs (zero-divisor risk) ----------

def inv_divisor(ss: Sequence[Stat], shapes: Sequence[Shape]) -> tuple[int, int]:
    """(elements inverted, degree of each) for div: the divisor's numerator."""
    return _numel(shapes[1]), max(1, ss[1].num)


def inv_rows(ss: Sequence[Stat], shapes: Sequence[Shape]) -> tuple[int, int]:
    """One inversion of a degree-1 quantity (atom or sum of atoms) per row."""
    return _numel(shapes[0][:-1]), 1


def inv_all(ss: Sequence[Stat], shapes: Sequence[Shape]) -> tuple[int, int]:
    return _numel(shapes[0]), 1


def _numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
