"""The operator registry: every kernel and block operator, defined once.

Each :class:`OpDef` holds everything the compiler knows about one operator: where it
may appear (kernel level, block level), its arity and attributes, its shape/dtype rule
and its numpy semantics (the executable definition used by the reference
interpreter). Forloop accumulators also carry an :class:`AccumSpec`, a data
description of what they reduce, so every pass can treat them uniformly.

Later stages extend the same entries, never a ``switch`` on operator names in a pass:
``field`` (finite-field semantics, verifier), ``abstract`` (abstract expression,
search), ``cost`` (cost model) and ``cuda`` (code emission). A test checks every entry
is complete.

Adding an operator means adding one ``register(OpDef(...))`` call here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np

from mirage_cli.ir import Attrs, AttrValue, DType, TensorType, attr

KERNEL = "kernel"
BLOCK = "block"


class ShapeError(Exception):
    """An operator's shape or dtype rule rejected its operands (no location yet;
    the caller attaches the span of the statement)."""


@dataclass(frozen=True)
class AttrSpec:
    """An attribute an operator accepts: its name, Python type and default
    (``required`` when there is none)."""

    name: str
    kind: type
    default: AttrValue | None = None
    required: bool = False


@dataclass(frozen=True)
class AccumSpec:
    """What a forloop accumulator computes from the tiles ``x_i`` of iterations
    ``i = 0..F-1``.

    result = finish( combine_i reduce(pre(x_i)) ), where
    - ``pre``: ``id`` or ``square`` (element-wise, before reducing);
    - ``reduce``: ``none``, ``last`` (the tile's last dim, kept as size 1) or
      ``to_width`` (the last dim summed in groups down to ``width``);
    - ``combine``: ``sum`` or ``max`` over iterations;
    - ``finish``: ``id``, ``mean`` (divide by the number of elements reduced) or
      ``rms`` (sqrt of that mean plus the operator's ``eps`` attribute, default 0:
      ``sqrt(sum / count + eps)``, RMSNorm's denominator).
    """

    pre: Literal["id", "square"]
    reduce: Literal["none", "last", "to_width"]
    combine: Literal["sum", "max"]
    finish: Literal["id", "mean", "rms"]


# Names under which Mirage's checkpoints (kn_*/tb_* ``op_type``) spell an operator, each
# with the attributes the name implies (e.g. ``kn_reduction_1_op`` is sum over dim 1,
# kept as size 1). Read by the importer (:mod:`mirage_cli.importers.mirage`).
MirageNames = tuple[tuple[str, Attrs], ...]


def mirage_names(*names: str, **attrs: AttrValue) -> MirageNames:
    """Mirage op_type names that all mean this operator with ``attrs``."""
    return tuple((n, tuple(sorted(attrs.items()))) for n in names)


def _mirage_per_dim(fmt: tuple[str, ...], **attrs: AttrValue) -> MirageNames:
    """Mirage names with the dimension in the name (``kn_reduction_{d}_op``, d = 0..2)."""
    return tuple(e for d in range(3) for e in mirage_names(*(f.format(d=d) for f in fmt),
                                                           dim=d, **attrs))


NumpyFn = Callable[[Sequence[np.ndarray], dict[str, AttrValue]], np.ndarray]
InferFn = Callable[[Sequence[TensorType], dict[str, AttrValue]], TensorType]


@dataclass(frozen=True)
class OpDef:
    """One operator: the single place where its facts live."""

    name: str
    levels: frozenset[str]
    arity: tuple[int, int]
    infer: InferFn
    numpy: NumpyFn | None
    attrs: tuple[AttrSpec, ...] = ()
    doc: str = ""
    # Set for forloop accumulators (block level only).
    accum: AccumSpec | None = None
    # True for element-wise operators (fusable into registers at thread level).
    elementwise: bool = False
    # Extension slots, filled by the stages that need them (see module docstring).
    field: Any = None
    abstract: Any = None
    cost: Any = None
    cuda: Any = None
    # Composite operators: how to write them in simpler ones (search).
    decompose: Any = None
    # Mirage checkpoint names of this operator (importer); see ``mirage_names``.
    mirage: MirageNames = ()

    @property
    def is_accumulator(self) -> bool:
        return self.accum is not None

    def normalize(self, attrs: Attrs) -> Attrs:
        """Canonical attributes: floats as float, values equal to the default dropped,
        sorted by name. Unknown names are kept for the checker to report."""
        kinds = {s.name: s for s in self.attrs}
        out = []
        for key, value in attrs:
            spec = kinds.get(key)
            if spec is not None and spec.kind is float and isinstance(value, int) \
                    and not isinstance(value, bool):
                value = float(value)
            if spec is not None and spec.default is not None and value == spec.default \
                    and type(value) is type(spec.default):
                continue
            out.append((key, value))
        return tuple(sorted(out))

    def attr_values(self, attrs: Attrs) -> dict[str, AttrValue]:
        """Attribute values with defaults filled in."""
        values: dict[str, AttrValue] = {}
        for spec in self.attrs:
            v = attr(attrs, spec.name)
            if v is None and spec.default is not None:
                v = spec.default
            if v is not None:
                values[spec.name] = v
        return values


REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    assert op.name not in REGISTRY, f"operator {op.name} registered twice"
    REGISTRY[op.name] = op
    return op


def get(name: str) -> OpDef:
    return REGISTRY[name]


def names(level: str) -> tuple[str, ...]:
    """Sorted names of the operators allowed at ``level`` (kernel or block)."""
    return tuple(sorted(n for n, op in REGISTRY.items() if level in op.levels))


BOTH = frozenset({KERNEL, BLOCK})
KERNEL_ONLY = frozenset({KERNEL})
BLOCK_ONLY = frozenset({BLOCK})

# ---------------------------------------------------------------------------
# Shape rules
# ---------------------------------------------------------------------------


def _same_dtype(ts: Sequence[TensorType]) -> DType:
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise ShapeError("dtype mismatch: " + " vs ".join(str(t) for t in ts))
    return ts[0].dtype


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """numpy broadcasting of two shapes, or ShapeError naming both."""
    out: list[int] = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and 1 not in (da, db):
            raise ShapeError(f"shapes {list(a)} and {list(b)} do not broadcast")
        out.append(max(da, db))
    return tuple(reversed(out))


def _check_dim(t: TensorType, dim: AttrValue) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < t.rank:
        raise ShapeError(f"dim {dim} is out of range for {t} (rank {t.rank})")
    return dim


def infer_unary(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    return ts[0]


def infer_binary(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    dtype = _same_dtype(ts)
    return TensorType(broadcast_shape(ts[0].shape, ts[1].shape), dtype)


def infer_matmul(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    x, y = ts
    if x.rank < 2 or y.rank < 2:
        raise ShapeError(f"needs operands of rank >= 2, got {x} and {y}")
    if x.shape[-1] != y.shape[-2]:
        raise ShapeError(f"shape mismatch: {list(x.shape)} @ {list(y.shape)} "
                         f"(inner dimensions {x.shape[-1]} and {y.shape[-2]} differ)")
    dtype = _same_dtype(ts)
    try:
        batch = broadcast_shape(x.shape[:-2], y.shape[:-2])
    except ShapeError:
        raise ShapeError(f"batch dimensions do not broadcast: "
                         f"{list(x.shape)} @ {list(y.shape)}") from None
    return TensorType(batch + (x.shape[-2], y.shape[-1]), dtype)


def infer_reduce(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    t = ts[0]
    dim = _check_dim(t, a["dim"])
    if a.get("keepdim", False):
        shape = t.shape[:dim] + (1,) + t.shape[dim + 1:]
    else:
        if t.rank == 1:
            raise ShapeError(f"reducing the only dimension of {t} needs keepdim=true")
        shape = t.shape[:dim] + t.shape[dim + 1:]
    return TensorType(shape, t.dtype)


def infer_rms(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    t = ts[0]
    return TensorType(t.shape[:-1] + (1,), t.dtype)


def infer_rms_norm(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    if len(ts) == 2:
        _same_dtype(ts)
        if broadcast_shape(ts[0].shape, ts[1].shape) != ts[0].shape:
            raise ShapeError(f"rms_norm weight {ts[1]} does not broadcast to {ts[0]}")
    return ts[0]


def infer_softmax(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    _check_dim(ts[0], a["dim"])
    return ts[0]


def infer_concat(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    x, y = ts
    dtype = _same_dtype(ts)
    dim = _check_dim(x, a["dim"])
    if x.rank != y.rank or any(i != dim and p != q for i, (p, q) in
                               enumerate(zip(x.shape, y.shape))):
        raise ShapeError(f"concat along dim {dim} needs equal other dimensions: "
                         f"{list(x.shape)} and {list(y.shape)}")
    shape = x.shape[:dim] + (x.shape[dim] + y.shape[dim],) + x.shape[dim + 1:]
    return TensorType(shape, dtype)


def _width(t: TensorType, a: dict[str, AttrValue]) -> int:
    width = a["width"]
    if not isinstance(width, int) or width <= 0 or t.shape[-1] % width:
        raise ShapeError(f"cannot reduce last dimension {t.shape[-1]} of {t} to width {width}: "
                         f"{width} does not divide {t.shape[-1]}")
    return width


def infer_sum_to(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    t = ts[0]
    return TensorType(t.shape[:-1] + (_width(t, a),), t.dtype)


def infer_accum(spec: AccumSpec) -> InferFn:
    def infer(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
        t = ts[0]
        if spec.reduce == "last":
            return TensorType(t.shape[:-1] + (1,), t.dtype)
        if spec.reduce == "to_width":
            return TensorType(t.shape[:-1] + (_width(t, a),), t.dtype)
        return t
    return infer


def infer_custom(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    raise ShapeError("custom kernels are typed by their block graph")  # see check.py

# ---------------------------------------------------------------------------
# numpy semantics (inputs are float32 or float64 arrays; results in the same type)
# ---------------------------------------------------------------------------


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[x.dtype])(x) if x.size else x


def np_silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def np_gelu(x: np.ndarray) -> np.ndarray:
    """Exact (erf) GELU, as PyTorch's default."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def np_rms(x: np.ndarray, eps: float = 0.0) -> np.ndarray:
    return np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_sum_to(x: np.ndarray, width: int) -> np.ndarray:
    """Sum the last dimension in groups down to ``width``: out[..., j] is the sum of
    x[..., g*width + j] over g (block g's columns are concatenated in order)."""
    groups = x.shape[-1] // width
    return x.reshape(x.shape[:-1] + (groups, width)).sum(axis=-2)


def np_accumulate(spec: AccumSpec, tiles: np.ndarray, width: int | None,
                  eps: float = 0.0) -> np.ndarray:
    """Apply an accumulator to ``tiles``, the per-iteration tiles stacked on axis 0
    (``eps`` is added under the square root of an ``rms`` finish)."""
    v = tiles * tiles if spec.pre == "square" else tiles
    count = tiles.shape[0]
    if spec.reduce == "last":
        count *= tiles.shape[-1]
        v = (v.max if spec.combine == "max" else v.sum)(axis=-1, keepdims=True)
    elif spec.reduce == "to_width":
        assert width is not None
        count *= tiles.shape[-1] // width
        v = np_sum_to(v, width)
    v = v.max(axis=0) if spec.combine == "max" else v.sum(axis=0)
    if spec.finish == "mean":
        return v / count
    if spec.finish == "rms":
        return np.sqrt(v / count + eps)
    return v


def _unary(fn: Callable[[np.ndarray], np.ndarray]) -> NumpyFn:
    return lambda xs, a: fn(xs[0])


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> NumpyFn:
    return lambda xs, a: fn(xs[0], xs[1])


def _np_reduce(fn: Callable[..., np.ndarray]) -> NumpyFn:
    return lambda xs, a: fn(xs[0], axis=int(a["dim"]), keepdims=bool(a.get("keepdim", False)))


def _np_rms_norm(xs: Sequence[np.ndarray], a: dict[str, AttrValue]) -> np.ndarray:
    y = xs[0] / np_rms(xs[0], float(a.get("eps", 0.0)))
    return y * xs[1] if len(xs) == 2 else y


def _np_softmax(xs: Sequence[np.ndarray], a: dict[str, AttrValue]) -> np.ndarray:
    dim = int(a["dim"])
    x = xs[0]
    e = np.exp(x - x.max(axis=dim, keepdims=True))
    return e / e.sum(axis=dim, keepdims=True)


def _np_accum(spec: AccumSpec) -> NumpyFn:
    # Called by the interpreter with one input: the iterations' tiles stacked on axis 0.
    return lambda xs, a: np_accumulate(spec, xs[0], a.get("width"),  # type: ignore[arg-type]
                                       float(a.get("eps", 0.0)))  # type: ignore[arg-type]

# ---------------------------------------------------------------------------
# The operators
# ---------------------------------------------------------------------------


_DIM = AttrSpec("dim", int, required=True)
_KEEPDIM = AttrSpec("keepdim", bool, default=False)
_EPS = AttrSpec("eps", float, default=0.0)
_WIDTH = AttrSpec("width", int, required=True)

register(OpDef("matmul", BOTH, (2, 2), infer_matmul, _binary(np.matmul),
               mirage=mirage_names("kn_matmul_op", "tb_matmul_op"),
               doc="matrix product, batched over leading dims (numpy broadcasting)"))
# Mirage's element-wise operators (rsqrt and neg have no Mirage counterpart).
_MIRAGE_ELEMENTWISE: dict[str, MirageNames] = {
    n: mirage_names(f"kn_{n}_op", f"tb_{n}_op")
    for n in ("add", "mul", "div", "exp", "silu", "gelu", "relu", "sqrt", "square")}
_MIRAGE_ELEMENTWISE["sub"] = mirage_names("tb_sub_op")  # no kernel-level sub in Mirage
for _name, _fn in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                   ("div", np.divide)):
    register(OpDef(_name, BOTH, (2, 2), infer_binary, _binary(_fn), elementwise=True,
                   mirage=_MIRAGE_ELEMENTWISE.get(_name, ()),
                   doc=f"element-wise {_name} with numpy broadcasting"))
for _name, _ufn in (("exp", np.exp), ("silu", np_silu), ("gelu", np_gelu),
                    ("relu", lambda x: np.maximum(x, 0.0)), ("sqrt", np.sqrt),
                    ("rsqrt", lambda x: 1.0 / np.sqrt(x)), ("square", np.square),
                    ("neg", np.negative)):
    register(OpDef(_name, BOTH, (1, 1), infer_unary, _unary(_ufn), elementwise=True,
                   mirage=_MIRAGE_ELEMENTWISE.get(_name, ()), doc=f"element-wise {_name}"))
register(OpDef("mul_scalar", BOTH, (1, 1), infer_unary,
               lambda xs, a: xs[0] * float(a["scalar"]),  # type: ignore[arg-type]
               attrs=(AttrSpec("scalar", float, required=True),), elementwise=True,
               mirage=mirage_names("kn_mul_scalar_op", "tb_mul_scalar_op"),
               doc="multiply by a constant"))
register(OpDef("sum", BOTH, (1, 1), infer_reduce, _np_reduce(np.sum),
               attrs=(_DIM, _KEEPDIM), doc="sum over one dimension",
               mirage=_mirage_per_dim(("kn_reduction_{d}_op", "tb_reduction_{d}_op"),
                                      keepdim=True)))
register(OpDef("mean", BOTH, (1, 1), infer_reduce, _np_reduce(np.mean),
               attrs=(_DIM, _KEEPDIM), doc="mean over one dimension"))
register(OpDef("max", BOTH, (1, 1), infer_reduce, _np_reduce(np.max),
               attrs=(_DIM, _KEEPDIM), doc="maximum over one dimension"))
register(OpDef("rms", BOTH, (1, 1), infer_rms,
               lambda xs, a: np_rms(xs[0], float(a.get("eps", 0.0))),  # type: ignore[arg-type]
               attrs=(_EPS,), doc="sqrt(mean(x^2) + eps) over the last dim, kept as size 1"))
register(OpDef("rms_norm", BOTH, (1, 2), infer_rms_norm, _np_rms_norm, attrs=(_EPS,),
               mirage=mirage_names("kn_rms_norm_op", "tb_rms_norm_op"),
               doc="x / rms(x, eps) over the last dim, times the optional weight g"))
register(OpDef("softmax", KERNEL_ONLY, (1, 1), infer_softmax, _np_softmax, attrs=(_DIM,),
               doc="exp(x) / sum(exp(x)) over dim"))
register(OpDef("concat", BOTH, (2, 2), infer_concat,
               lambda xs, a: np.concatenate(list(xs), axis=int(a["dim"])),  # type: ignore[arg-type]
               attrs=(_DIM,), doc="concatenation along dim",
               mirage=_mirage_per_dim(("kn_concat_{d}_op", "tb_concat_{d}_op"))))
register(OpDef("sum_to", BLOCK_ONLY, (1, 1), infer_sum_to,
               lambda xs, a: np_sum_to(xs[0], int(a["width"])),  # type: ignore[arg-type]
               attrs=(_WIDTH,), doc="sum the last dim in groups down to width"))
register(OpDef("custom", KERNEL_ONLY, (1, 64), infer_custom, None,
               doc="a custom kernel: a block graph run by every block of a grid"))

ACCUMULATORS: dict[str, AccumSpec] = {
    "acc_sum": AccumSpec("id", "none", "sum", "id"),
    "acc_mean": AccumSpec("id", "none", "sum", "mean"),
    "acc_rms": AccumSpec("square", "none", "sum", "rms"),
    "acc_max": AccumSpec("id", "none", "max", "id"),
    "acc_sum_ld": AccumSpec("id", "last", "sum", "id"),
    "acc_mean_ld": AccumSpec("id", "last", "sum", "mean"),
    "acc_rms_ld": AccumSpec("square", "last", "sum", "rms"),
    "acc_max_ld": AccumSpec("id", "last", "max", "id"),
    "acc_sum_to": AccumSpec("id", "to_width", "sum", "id"),
}
# Mirage's forloop accumulators: checkpoints before March 2025 spell them tb_accum_*,
# later ones tb_forloop_accum_* (include/mirage/type.h). acc_sum_to's width is the
# block graph's reduction_dimx, supplied by the importer.
_MIRAGE_ACCUM: dict[str, MirageNames] = {
    name: mirage_names(f"tb_accum_{kind}_op", f"tb_forloop_accum_{kind}_op")
    for name, kind in (("acc_sum", "nored"), ("acc_sum_ld", "red_ld_sum"),
                       ("acc_mean_ld", "red_ld_mean"), ("acc_rms_ld", "red_ld_rms"),
                       ("acc_sum_to", "redtox_ld_sum"))}
_MIRAGE_ACCUM["acc_max"] = mirage_names("tb_forloop_accum_max_op")  # added after the rename


def _accum_attrs(spec: AccumSpec) -> tuple[AttrSpec, ...]:
    """A width for ``to_width``; an eps for an rms finish (RMSNorm's eps, so that a
    real model's normalisation fuses into the kernel that walks the hidden dim)."""
    return (((_WIDTH,) if spec.reduce == "to_width" else ())
            + ((_EPS,) if spec.finish == "rms" else ()))


for _name, _spec in ACCUMULATORS.items():
    register(OpDef(_name, BLOCK_ONLY, (1, 1), infer_accum(_spec), _np_accum(_spec),
                   attrs=_accum_attrs(_spec), accum=_spec,
                   mirage=_MIRAGE_ACCUM.get(_name, ()),
                   doc=f"forloop accumulator: {_spec}"))

# ---------------------------------------------------------------------------
# Search: abstract expressions (slot ``abstract``) and decompositions of composite
# operators (slot ``decompose``); the rule library is mirage_cli.search.abstract.
# ---------------------------------------------------------------------------

from mirage_cli.search import abstract as _ab
from mirage_cli.search import flops as _fl

_ABSTRACT: dict[str, Any] = {
    "matmul": _ab.MATMUL,
    "add": _ab.elementwise(_ab.add, "add"),
    "sub": _ab.SUB,
    "mul": _ab.elementwise(_ab.mul, "mul"),
    "div": _ab.elementwise(_ab.div, "div"),
    "exp": _ab.unary("exp"),
    "silu": _ab.unary("silu"),
    "gelu": _ab.unary("gelu"),
    "relu": _ab.unary("relu"),
    "sqrt": _ab.unary("sqrt"),
    "rsqrt": _ab.RSQRT,
    "square": _ab.SQUARE,
    "neg": _ab.unary("neg"),
    "mul_scalar": _ab.MUL_SCALAR,
    "sum": _ab.REDUCE_SUM,
    "mean": _ab.REDUCE_MEAN,
    "max": _ab.REDUCE_MAX,
    "rms": _ab.RMS,
    "rms_norm": _ab.composite(_ab.decompose_rms_norm),
    "softmax": _ab.composite(_ab.decompose_softmax),
    "concat": _ab.CONCAT,
    "sum_to": _ab.SUM_TO,
    "custom": None,  # a custom kernel's expression is its block graph's
    **{_name: _ab.accumulator(_spec) for _name, _spec in ACCUMULATORS.items()},
}
_DECOMPOSE: dict[str, Any] = {
    "rms_norm": _ab.decompose_rms_norm,
    "softmax": _ab.decompose_softmax,
}
# Cost model (mirage_cli.search.cost): FLOPs per operator; per element unless listed.
_FLOPS: dict[str, Any] = {"matmul": _fl.contraction, "rms": _fl.rms_like,
                          "rms_norm": _fl.rms_like}
for _name, _rule in _ABSTRACT.items():
    REGISTRY[_name] = replace(REGISTRY[_name], abstract=_rule,
                              decompose=_DECOMPOSE.get(_name),
                              cost=_FLOPS.get(_name, _fl.per_element))

# Finite-field semantics (the verifier's ``field`` slot): the table and its arithmetic
# library live in mirage_cli/verifier/semantics.py, which does not import this module.
from mirage_cli.verifier import semantics as _field

for _name, _op in list(REGISTRY.items()):
    _sem = (_field.accumulator_sem(_op.accum) if _op.accum is not None else
            _field.custom_sem() if _name == "custom" else _field.SEMANTICS[_name])
    REGISTRY[_name] = replace(_op, field=_sem)

# ---------------------------------------------------------------------------
# CUDA emission (slot ``cuda``): see mirage_cli/codegen/cudaspec.py
# ---------------------------------------------------------------------------

# No import cycle: cudaspec imports nothing from this module.
from mirage_cli.codegen import cudaspec as _cudaspec

for _name, _def in list(REGISTRY.items()):
    REGISTRY[_name] = replace(
        _def, cuda=_cudaspec.ACCUM_SPEC if _def.is_accumulator else _cudaspec.CUDA_SPECS[_name])
