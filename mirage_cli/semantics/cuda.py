"""What the code generator knows about one operator: the ``cuda`` slot of its OpDef.

Each operator's row in :mod:`mirage_cli.ops` holds a :class:`CudaSpec`; the lowering
dispatches on :attr:`CudaSpec.kind` (a closed set) and never on operator names.

- ``elementwise``: ``expr`` is a C expression over ``{0}``, ``{1}`` (f32 operands,
  already bound to locals) and attribute placeholders such as ``{scalar}``;
- ``gather``: data movement (kernel-only ``reshape``, ``rotate_half``): the one operand
  is read at the index the ``gather`` function computes from the output index, and the
  template it returns wraps the value (a sign, for ``rotate_half``);
- ``reduce``: ``combine`` (a :class:`Combine`) over one dimension, ``finish`` ``mean``
  divides by the reduced size;
- ``matmul``, ``rms``, ``rms_norm``, ``softmax``, ``concat``, ``sum_to``: structural
  kinds with their own lowering;
- ``accum``: a forloop accumulator (its data lives in ``OpDef.accum``);
- ``custom``: a fused kernel (lowered from its block graph).

``torch`` gives the PyTorch form of the operator, used only for benchmark baselines.

This module is on the floor below the registry: it imports only its neighbour
:mod:`mirage_cli.semantics.accum`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, assert_never

from mirage_cli.semantics.accum import Combine, Finish

CudaKind = Literal["elementwise", "gather", "reduce", "matmul", "rms", "rms_norm",
                   "softmax", "concat", "sum_to", "accum", "custom"]

# f32 helper functions every generated file defines (see templates/prelude.cu.j2).
TorchFn = Callable[[Any, list[Any], dict[str, Any]], Any]
# (output index expressions, operand shape, output shape, attributes) ->
# (operand index expressions, C template over {0}, the operand's value).
GatherFn = Callable[[list[str], tuple[int, ...], tuple[int, ...], dict[str, Any]],
                    tuple[list[str], str]]


@dataclass(frozen=True)
class CudaSpec:
    kind: CudaKind
    expr: str | None = None
    combine: Combine | None = None
    finish: Finish = Finish.ID
    torch: TorchFn | None = None
    gather: GatherFn | None = None
    # A division by operand 1: the same value from operand 1's reciprocal, so that a
    # kernel dividing many elements by one value computes the reciprocal once.
    by_inverse: str | None = None
    # The prelude function (``{stem}_f16`` / ``{stem}_bf16``) that applies the operator
    # to two packed pairs of 16-bit values, each result rounded once to the dtype, with
    # the bits of the f32 result rounded on store (a product of two 16-bit values is
    # exact in f32): an mma operand so computed stays in registers (mma's "scaled" A).
    pair16: str | None = None


def elementwise(expr: str, torch: TorchFn, by_inverse: str | None = None,
                pair16: str | None = None) -> CudaSpec:
    return CudaSpec("elementwise", expr=expr, torch=torch, by_inverse=by_inverse,
                    pair16=pair16)


def t_reduce(name: str) -> TorchFn:
    def fn(t: Any, xs: list[Any], a: dict[str, Any]) -> Any:
        dim, keep = int(a["dim"]), bool(a.get("keepdim", False))
        if name == "max":
            return t.amax(xs[0], dim=dim, keepdim=keep)
        return getattr(t, name)(xs[0], dim=dim, keepdim=keep)
    return fn


def t_rms(t: Any, xs: list[Any], a: dict[str, Any]) -> Any:
    x = xs[0]
    return t.sqrt((x.float() * x.float()).mean(dim=-1, keepdim=True) + float(a.get("eps", 0.0))
                  ).to(x.dtype)


def t_rms_norm(t: Any, xs: list[Any], a: dict[str, Any]) -> Any:
    x = xs[0]
    w = xs[1] if len(xs) > 1 else None
    if w is not None and tuple(w.shape) == (x.shape[-1],):
        return t.nn.functional.rms_norm(x, (x.shape[-1],), w, eps=float(a.get("eps", 0.0)))
    y = t.nn.functional.rms_norm(x, (x.shape[-1],), eps=float(a.get("eps", 0.0)))
    return y * w if w is not None else y


def gather_reshape(idx: list[str], sx: tuple[int, ...], so: tuple[int, ...],
                   a: dict[str, Any]) -> tuple[list[str], str]:
    """Row-major reshape: the output index flattened, then unflattened in the
    operand's shape (64-bit, so that no product of sizes wraps)."""
    terms = [f"(long long)({i}) * {st}" for i, st, n in zip(idx, _strides(so), so) if n > 1]
    flat = " + ".join(terms) or "0LL"
    total = math.prod(sx)
    return [("0" if n == 1 else f"(int)((({flat}) / {st})" + (")" if st * n == total
                                                             else f" % {n})"))
            for st, n in zip(_strides(sx), sx)], "{0}"


def gather_rotate_half(idx: list[str], sx: tuple[int, ...], so: tuple[int, ...],
                       a: dict[str, Any]) -> tuple[list[str], str]:
    """rotate_half over the last dim d = 2h: out[j] = -x[j + h] for j < h, else
    x[j - h]; both halves read one index, ``(j + h) % d``."""
    d = sx[-1]
    h, j = d // 2, idx[-1]
    return idx[:-1] + [f"(({j} + {h}) % {d})"], f"(({j}) < {h} ? -({{0}}) : ({{0}}))"


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def t_rotate_half(t: Any, xs: list[Any], a: dict[str, Any]) -> Any:
    x = xs[0]
    h = x.shape[-1] // 2
    return t.cat((-x[..., h:], x[..., :h]), dim=-1)


ACCUM_SPEC = CudaSpec("accum")


# -- how each accumulator combine is spelled in C (exhaustive over Combine) ----------

NEG_INF = "__int_as_float(0xff800000)"
POS_INF = "__int_as_float(0x7f800000)"


def c_init(combine: Combine) -> str:
    """The identity of ``combine``, the initial value of its running state."""
    match combine:
        case Combine.SUM:
            return "0.0f"
        case Combine.MAX:
            return NEG_INF
        case Combine.MIN:
            return POS_INF
        case other:
            assert_never(other)


def c_update(slot: str, v: str, combine: Combine) -> str:
    """The statement folding ``v`` into the running state ``slot``."""
    match combine:
        case Combine.SUM:
            return f"{slot} += {v};"
        case Combine.MAX:
            return f"{slot} = fmaxf({slot}, {v});"
        case Combine.MIN:
            return f"{slot} = fminf({slot}, {v});"
        case other:
            assert_never(other)


def c_warp(combine: Combine, v: str, lanes: int = 32) -> str:
    """``v`` combined over the 32 lanes of a warp, or over aligned groups of ``lanes``
    lanes (the prelude's shuffle helpers; min as the negated max of the negations, exact
    in floating point)."""
    w = "" if lanes == 32 else f", {lanes}"
    match combine:
        case Combine.SUM:
            return f"mg_warp_sum({v}{w})"
        case Combine.MAX:
            return f"mg_warp_max({v}{w})"
        case Combine.MIN:
            return f"(-mg_warp_max(-({v}){w}))"
        case other:
            assert_never(other)


def c_float(v: float) -> str:
    """A float constant as C source that round-trips exactly through f32."""
    r = repr(float(v))
    if r in ("inf", "-inf", "nan"):
        return {"inf": "__int_as_float(0x7f800000)", "-inf": "__int_as_float(0xff800000)",
                "nan": "__int_as_float(0x7fc00000)"}[r]
    if "e" not in r and "." not in r:
        r += ".0"
    return f"{r}f"
