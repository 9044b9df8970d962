"""What the code generator knows about one operator: the ``cuda`` slot of its OpDef.

Each operator's entry in :mod:`mirage_cli.ops` holds a :class:`CudaSpec`; the lowering
dispatches on :attr:`CudaSpec.kind` (a closed set) and never on operator names.

- ``elementwise``: ``expr`` is a C expression over ``{0}``, ``{1}`` (f32 operands,
  already bound to locals) and attribute placeholders such as ``{scalar}``;
- ``reduce``: ``combine`` (``sum``/``max``) over one dimension, ``finish`` ``mean``
  divides by the reduced size;
- ``matmul``, ``rms``, ``rms_norm``, ``softmax``, ``concat``, ``sum_to``: structural
  kinds with their own lowering;
- ``accum``: a forloop accumulator (its data lives in ``OpDef.accum``);
- ``custom``: a fused kernel (lowered from its block graph).

``torch`` gives the PyTorch form of the operator, used only for benchmark baselines.

This module must not import :mod:`mirage_cli.ops` (ops imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

CudaKind = Literal["elementwise", "reduce", "matmul", "rms", "rms_norm", "softmax",
                   "concat", "sum_to", "accum", "custom"]

# f32 helper functions every generated file defines (see templates/prelude.cu.j2).
TorchFn = Callable[[Any, list[Any], dict[str, Any]], Any]


@dataclass(frozen=True)
class CudaSpec:
    kind: CudaKind
    expr: str | None = None
    combine: Literal["sum", "max"] | None = None
    finish: Literal["id", "mean"] = "id"
    torch: TorchFn | None = None


def elementwise(expr: str, torch: TorchFn) -> CudaSpec:
    return CudaSpec("elementwise", expr=expr, torch=torch)


def _t_reduce(name: str) -> TorchFn:
    def fn(t: Any, xs: list[Any], a: dict[str, Any]) -> Any:
        dim, keep = int(a["dim"]), bool(a.get("keepdim", False))
        if name == "max":
            return t.amax(xs[0], dim=dim, keepdim=keep)
        return getattr(t, name)(xs[0], dim=dim, keepdim=keep)
    return fn


def _t_rms(t: Any, xs: list[Any], a: dict[str, Any]) -> Any:
    x = xs[0]
    return t.sqrt((x.float() * x.float()).mean(dim=-1, keepdim=True) + float(a.get("eps", 0.0))
                  ).to(x.dtype)


def _t_rms_norm(t: Any, xs: list[Any], a: dict[str, Any]) -> Any:
    x = xs[0]
    w = xs[1] if len(xs) > 1 else None
    if w is not None and tuple(w.shape) == (x.shape[-1],):
        return t.nn.functional.rms_norm(x, (x.shape[-1],), w, eps=float(a.get("eps", 0.0)))
    y = t.nn.functional.rms_norm(x, (x.shape[-1],), eps=float(a.get("eps", 0.0)))
    return y * w if w is not None else y


CUDA_SPECS: dict[str, CudaSpec] = {
    "matmul": CudaSpec("matmul", torch=lambda t, xs, a: t.matmul(xs[0], xs[1])),
    "add": elementwise("({0} + {1})", lambda t, xs, a: xs[0] + xs[1]),
    "sub": elementwise("({0} - {1})", lambda t, xs, a: xs[0] - xs[1]),
    "mul": elementwise("({0} * {1})", lambda t, xs, a: xs[0] * xs[1]),
    "div": elementwise("({0} / {1})", lambda t, xs, a: xs[0] / xs[1]),
    "exp": elementwise("expf({0})", lambda t, xs, a: t.exp(xs[0])),
    "silu": elementwise("mg_silu({0})", lambda t, xs, a: t.nn.functional.silu(xs[0])),
    "gelu": elementwise("mg_gelu({0})", lambda t, xs, a: t.nn.functional.gelu(xs[0])),
    "relu": elementwise("fmaxf({0}, 0.0f)", lambda t, xs, a: t.relu(xs[0])),
    "sqrt": elementwise("sqrtf({0})", lambda t, xs, a: t.sqrt(xs[0])),
    "rsqrt": elementwise("rsqrtf({0})", lambda t, xs, a: t.rsqrt(xs[0])),
    "square": elementwise("({0} * {0})", lambda t, xs, a: xs[0] * xs[0]),
    "neg": elementwise("(-{0})", lambda t, xs, a: -xs[0]),
    "mul_scalar": elementwise("({0} * {scalar})",
                              lambda t, xs, a: xs[0] * float(a["scalar"])),
    "sum": CudaSpec("reduce", combine="sum", torch=_t_reduce("sum")),
    "mean": CudaSpec("reduce", combine="sum", finish="mean", torch=_t_reduce("mean")),
    "max": CudaSpec("reduce", combine="max", torch=_t_reduce("max")),
    "rms": CudaSpec("rms", torch=_t_rms),
    "rms_norm": CudaSpec("rms_norm", torch=_t_rms_norm),
    "softmax": CudaSpec("softmax",
                        torch=lambda t, xs, a: t.softmax(xs[0].float(), dim=int(a["dim"])
                                                         ).to(xs[0].dtype)),
    "concat": CudaSpec("concat", torch=lambda t, xs, a: t.cat(xs, dim=int(a["dim"]))),
    "sum_to": CudaSpec("sum_to"),
    "custom": CudaSpec("custom"),
}
ACCUM_SPEC = CudaSpec("accum")


def c_float(v: float) -> str:
    """A float constant as C source that round-trips exactly through f32."""
    r = repr(float(v))
    if r in ("inf", "-inf", "nan"):
        return {"inf": "__int_as_float(0x7f800000)", "-inf": "__int_as_float(0xff800000)",
                "nan": "__int_as_float(0x7fc00000)"}[r]
    if "e" not in r and "." not in r:
        r += ".0"
    return f"{r}f"
