"""The operator registry: every kernel and block operator, defined once.

Each :class:`OpDef` holds everything the compiler knows about one operator: where it
may appear (kernel level, block level), its arity and attributes, its shape/dtype rule
and its numpy semantics (the executable definition used by the reference
interpreter). Forloop accumulators also carry an :class:`AccumSpec`, a data
description of what they reduce, so every pass can treat them uniformly.

The same row carries every other pass's meaning, never a ``switch`` on operator
names in a pass: ``field`` (finite-field semantics, verifier), ``abstract`` (abstract
expression, search), ``cost`` (cost model), ``cuda`` (CUDA spelling and torch
baseline) and ``index`` (how result indices follow operand indices: the certificate
carry, ``verifier/carry.py``). Those meanings live on the floor below, :mod:`mirage_cli.semantics`; this
module imports nothing from ``search``, ``verifier`` or ``codegen`` (a test walks the
imports).

Adding an operator means adding one ``register(...)`` row here (plus a CUDA helper in
the prelude if it has no intrinsic); an accumulator is one ``AccumSpec``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass
from typing import assert_never

import numpy as np

from mirage_cli.ir import Attrs, AttrValue, DType, TensorType, attr
from mirage_cli.semantics import cuda as _cuda
from mirage_cli.semantics import degrees as _D
from mirage_cli.semantics import fieldsem as _F
from mirage_cli.semantics import flops as _fl
from mirage_cli.semantics import terms as _ab
from mirage_cli.semantics.accum import (
    AccumSpec,
    Combine,
    Finish,
    Pre,
    Reduce,
    np_accumulate,
    np_sum_to,
)
from mirage_cli.semantics.cuda import CudaSpec
from mirage_cli.semantics.fieldsem import FieldSem
from mirage_cli.semantics.terms import AbstractRule as Rule

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


class Scaling(enum.Enum):
    """How an operator's result follows its operands multiplied by one constant c (the
    rescaled split, ``search/online.py``, moves such factors exp(m_j - M) across it)."""

    ALL = "all"      # f(c·x, c·y) = c·f(x, y): scale every operand, the result scales
    EACH = "each"    # f(c·x, y) = f(x, c·y) = c·f(x, y): linear in each operand alone
    FIRST = "first"  # f(c·x, y) = c·f(x, y): linear in the first operand only


def linear_in(op: str, scaled: Sequence[bool]) -> bool:
    """Whether operator ``op`` is linear in its operands marked ``scaled`` (all by one
    factor c), the others fixed: its result then scales by c too. An accumulator is
    when it sums (no square, no finish); another operator by its ``scaling``."""
    opdef = get(op)
    if opdef.accum is not None:
        return opdef.accum.is_plain_sum and all(scaled)
    match opdef.scaling:
        case Scaling.ALL:
            return all(scaled)
        case Scaling.EACH:
            return sum(scaled) == 1
        case Scaling.FIRST:
            return bool(scaled) and scaled[0] and not any(scaled[1:])
        case _:
            return False


def is_maximum(op: str) -> bool:
    """Whether operator ``op`` takes the plain maximum of its operand over one
    dimension: a reduction over ``dim`` combining by max, or an accumulator that takes
    it over the last dimension and the iterations (nothing squared, nothing after)."""
    opdef = get(op)
    if opdef.accum is not None:
        return opdef.accum == ROW_MAX
    return opdef.cuda.kind == "reduce" and opdef.cuda.combine is Combine.MAX


# The accumulator of a row maximum over a loop (a running maximum's, search/runmax.py).
ROW_MAX = AccumSpec(Pre.ID, Reduce.LAST, Combine.MAX, Finish.ID)


def accumulator_of(spec: AccumSpec) -> str:
    """The block-level operator whose accumulator is ``spec``."""
    return next(name for name, d in REGISTRY.items() if d.accum == spec)


class Index(enum.Enum):
    """How an operator maps its operands' indices to its result's: what decides
    whether a size parameter is pointwise through it (``verifier/carry.py``, which
    holds the rule of each kind; docs/verification.md §10)."""

    POINTWISE = "pointwise"   # numpy broadcasting, each result index from the same index
    REDUCE_DIM = "reduce_dim"  # reduces attribute ``dim`` (kept as 1 with ``keepdim``)
    MIX_DIM = "mix_dim"       # same shape; mixes along attribute ``dim`` (softmax)
    MIX_LAST = "mix_last"     # mixes along the last dimension (rms, rms_norm, sum_to, ...)
    MATMUL = "matmul"         # batch dims broadcast; rows of A, columns of B; k reduced
    CONCAT = "concat"         # joins along attribute ``dim``
    RESHAPE = "reshape"       # row-major reshape


@dataclass(frozen=True)
class OpDef:
    """One operator: the single place where its facts live."""

    name: str
    levels: frozenset[str]
    arity: tuple[int, int]
    infer: InferFn
    numpy: NumpyFn | None
    _: KW_ONLY
    # The meanings each pass needs (all from mirage_cli.semantics): finite-field
    # semantics (verifier), abstract term (search; None for custom kernels, whose term
    # is their block graph's), FLOPs (cost model), CUDA spelling and torch baseline.
    field: FieldSem
    abstract: Rule | None
    cost: _fl.FlopFn
    cuda: CudaSpec
    attrs: tuple[AttrSpec, ...] = ()
    doc: str = ""
    # Set for forloop accumulators (block level only).
    accum: AccumSpec | None = None
    # True for element-wise operators (fusable into registers at thread level).
    elementwise: bool = False
    # Composite operators: how to write them in simpler ones (search).
    decompose: _ab.Decomposition | None = None
    # Mirage checkpoint names of this operator (importer); see ``mirage_names``.
    mirage: MirageNames = ()
    # How the result scales with its operands (None: not homogeneous of degree 1).
    scaling: Scaling | None = None
    # How result indices come from operand indices (certificate carry). None for an
    # accumulator (its ``accum`` spec says it) and a custom kernel (its block graph
    # does); any other operator without one is never carried.
    index: Index | None = None

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
    """Add one row. A row names every meaning (the type makes the slots required);
    an accumulator's ``AccumSpec`` was validated when it was built."""
    assert op.name not in REGISTRY, f"operator {op.name} registered twice"
    assert (op.accum is not None) == (op.cuda.kind == "accum"), \
        f"operator {op.name}: an accumulator needs an AccumSpec and the accum CUDA kind"
    # One source for each fact: an element-wise operator's index rule is pointwise,
    # an accumulator's follows from its AccumSpec.
    assert not op.elementwise or op.index is Index.POINTWISE, \
        f"operator {op.name}: an element-wise operator maps indices pointwise"
    assert op.accum is None or op.index is None, \
        f"operator {op.name}: an accumulator's index rule is its AccumSpec's"
    REGISTRY[op.name] = op
    return op


@contextmanager
def scratch_registry() -> Iterator[dict[str, OpDef]]:
    """Within the block, the registry is a copy that rows may be added to (tests of
    what adding an operator takes); the original comes back on exit."""
    saved = dict(REGISTRY)
    try:
        yield REGISTRY
    finally:
        REGISTRY.clear()
        REGISTRY.update(saved)


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


def infer_reshape(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    t = ts[0]
    given = [a.get(f"d{i}", 0) for i in range(4)]
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in given):
        raise ShapeError(f"reshape sizes must be positive integers, got {given}")
    if 0 in given and any(given[given.index(0):]):
        raise ShapeError("reshape: d0, d1, ... must be given in order without gaps")
    if not given[0]:
        raise ShapeError("reshape: d0 must be given (a tensor has rank 1 to 4)")
    shape = _F.reshape_dims(a)
    if math.prod(shape) != t.numel:
        raise ShapeError(f"cannot reshape {t} ({t.numel} elements) to {list(shape)} "
                         f"({math.prod(shape)} elements)")
    return TensorType(shape, t.dtype)


def infer_rotate_half(ts: Sequence[TensorType], a: dict[str, AttrValue]) -> TensorType:
    t = ts[0]
    if t.shape[-1] % 2:
        raise ShapeError(f"rotate_half needs an even last dimension, got {t}")
    return t


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
        match spec.reduce:
            case Reduce.LAST:
                return TensorType(t.shape[:-1] + (1,), t.dtype)
            case Reduce.TO_WIDTH:
                return TensorType(t.shape[:-1] + (_width(t, a),), t.dtype)
            case Reduce.NONE:
                return t
            case other:
                assert_never(other)
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


def np_rotate_half(x: np.ndarray) -> np.ndarray:
    """[x1, x2] -> [-x2, x1] over the last dim (the rotary embedding's rotate_half)."""
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


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

# Each row below is the whole definition of one operator: shape rule, numpy meaning,
# finite-field meaning (verifier), abstract term (search), cost, CUDA spelling and torch
# baseline (codegen, bench). The meanings they name live in mirage_cli.semantics.
# Transcendental functions count their instructions in the CUDA math library as FLOPs
# per element (expf 8, sqrtf/rsqrtf 4, SiLU's expf and divide 14, GELU's erff 28).
# The generated code evaluates exp by one ex2.approx (mg_exp, fewer instructions); the
# model keeps expf's count, with which its simt_slowdown was fitted.


def elementwise(name: str, arity: int, fn: Callable[..., np.ndarray], abstract: Rule,
                field: FieldSem, cuda: str, torch: _cuda.TorchFn, doc: str,
                mirage: MirageNames = (), by_inverse: str | None = None,
                scaling: Scaling | None = None, flops: int = 1,
                pair16: str | None = None) -> OpDef:
    """The row of an element-wise operator of ``arity`` operands (numpy broadcasting);
    ``cuda`` is its C spelling over ``{0}``, ``{1}`` (see :mod:`mirage_cli.semantics.cuda`),
    ``by_inverse`` that of a division given operand 1's reciprocal, ``pair16`` its exact
    form on packed 16-bit pairs (``CudaSpec.pair16``), ``flops`` the operations per
    element (the cost model's element-wise term)."""
    cost = _fl.per_element if flops == 1 else _fl.per_element_times(flops)
    return OpDef(name, BOTH, (arity, arity), infer_binary if arity == 2 else infer_unary,
                 lambda xs, a: fn(*xs), field=field, abstract=abstract,
                 cost=cost, cuda=_cuda.elementwise(cuda, torch, by_inverse, pair16),
                 elementwise=True, index=Index.POINTWISE, mirage=mirage, doc=doc,
                 scaling=scaling)


def _kn_tb(n: str) -> MirageNames:
    return mirage_names(f"kn_{n}_op", f"tb_{n}_op")


register(OpDef("matmul", BOTH, (2, 2), infer_matmul, _binary(np.matmul),
               field=FieldSem(_F.ev_matmul, _D.st_matmul, _F.EXACT), abstract=_ab.MATMUL,
               cost=_fl.contraction,
               cuda=CudaSpec("matmul", torch=lambda t, xs, a: t.matmul(xs[0], xs[1])),
               mirage=_kn_tb("matmul"), scaling=Scaling.EACH, index=Index.MATMUL,
               doc="matrix product, batched over leading dims (numpy broadcasting)"))
register(elementwise("add", 2, np.add, _ab.elementwise(_ab.add, "add"),
                     FieldSem(_F.ring(lambda x, y, m: (x + y) % m), _D.st_add, _F.EXACT),
                     "({0} + {1})", lambda t, xs, a: xs[0] + xs[1],
                     "element-wise add with numpy broadcasting", _kn_tb("add"),
                     scaling=Scaling.ALL))
register(elementwise("sub", 2, np.subtract, _ab.SUB,
                     FieldSem(_F.ring(lambda x, y, m: (x - y) % m), _D.st_add, _F.EXACT),
                     "({0} - {1})", lambda t, xs, a: xs[0] - xs[1],
                     "element-wise sub with numpy broadcasting",
                     mirage_names("tb_sub_op"),  # no kernel-level sub in Mirage
                     scaling=Scaling.ALL))
register(elementwise("mul", 2, np.multiply, _ab.elementwise(_ab.mul, "mul"),
                     FieldSem(_F.ring(lambda x, y, m: x * y % m), _D.st_mul, _F.EXACT),
                     "({0} * {1})", lambda t, xs, a: xs[0] * xs[1],
                     "element-wise mul with numpy broadcasting", _kn_tb("mul"),
                     scaling=Scaling.EACH, pair16="mg_hmul2"))
register(elementwise("div", 2, np.divide, _ab.elementwise(_ab.div, "div"),
                     FieldSem(_F.ev_div, _D.st_div, _F.RATIONAL, inverts=_D.inv_divisor),
                     "mg_div({0}, {1})", lambda t, xs, a: xs[0] / xs[1],
                     "element-wise div with numpy broadcasting", _kn_tb("div"),
                     by_inverse="({0} * {1})", scaling=Scaling.FIRST))
register(elementwise("exp", 1, np.exp, _ab.unary("exp"),
                     FieldSem(_F.ev_exp, _D.st_exp, "exp(a) = g^a: Z_Q additive -> Z_P "
                              "multiplicative, g of order Q drawn per trial", uses_exp=True),
                     "mg_exp({0})", lambda t, xs, a: t.exp(xs[0]), "element-wise exp",
                     _kn_tb("exp"), flops=8))
register(elementwise("silu", 1, np_silu, _ab.unary("silu"), _F.random_sem("silu"),
                     "mg_silu({0})", lambda t, xs, a: t.nn.functional.silu(xs[0]),
                     "element-wise silu", _kn_tb("silu"), flops=14))
register(elementwise("gelu", 1, np_gelu, _ab.unary("gelu"), _F.random_sem("gelu"),
                     "mg_gelu({0})", lambda t, xs, a: t.nn.functional.gelu(xs[0]),
                     "element-wise gelu", _kn_tb("gelu"), flops=28))
register(elementwise("relu", 1, lambda x: np.maximum(x, 0.0), _ab.unary("relu"),
                     _F.random_sem("relu"), "fmaxf({0}, 0.0f)",
                     lambda t, xs, a: t.relu(xs[0]), "element-wise relu", _kn_tb("relu")))
register(elementwise("sqrt", 1, np.sqrt, _ab.unary("sqrt"), _F.random_sem("sqrt"),
                     "sqrtf({0})", lambda t, xs, a: t.sqrt(xs[0]), "element-wise sqrt",
                     _kn_tb("sqrt"), flops=4))
register(elementwise("rsqrt", 1, lambda x: 1.0 / np.sqrt(x), _ab.RSQRT,
                     FieldSem(_F.ev_rsqrt, _D.st_inv_atom, "1 / (the random sqrt of this "
                              "trial)", random_fn="sqrt", inverts=_D.inv_all),
                     "rsqrtf({0})", lambda t, xs, a: t.rsqrt(xs[0]), "element-wise rsqrt",
                     flops=4))
register(elementwise("square", 1, np.square, _ab.SQUARE,
                     FieldSem(_F.ring(lambda x, m: x * x % m), _D.st_square, _F.EXACT),
                     "({0} * {0})", lambda t, xs, a: xs[0] * xs[0], "element-wise square",
                     _kn_tb("square")))
register(elementwise("neg", 1, np.negative, _ab.unary("neg"),
                     FieldSem(_F.ring(lambda x, m: -x % m), _D.st_same, _F.EXACT),
                     "(-{0})", lambda t, xs, a: -xs[0], "element-wise neg",
                     scaling=Scaling.ALL))
register(OpDef("mul_scalar", BOTH, (1, 1), infer_unary,
               lambda xs, a: xs[0] * float(a["scalar"]),  # type: ignore[arg-type]
               field=FieldSem(_F.ev_mul_scalar, _D.st_same, _F.EXACT + " (the scalar as an "
                              "exact dyadic rational)"),
               abstract=_ab.MUL_SCALAR, cost=_fl.per_element,
               cuda=_cuda.elementwise("({0} * {scalar})",
                                      lambda t, xs, a: xs[0] * float(a["scalar"])),
               attrs=(AttrSpec("scalar", float, required=True),), elementwise=True,
               index=Index.POINTWISE,
               mirage=_kn_tb("mul_scalar"), scaling=Scaling.ALL,
               doc="multiply by a constant"))
register(OpDef("sum", BOTH, (1, 1), infer_reduce, _np_reduce(np.sum),
               field=FieldSem(_F.ev_sum, _D.st_reduce, _F.EXACT), abstract=_ab.REDUCE_SUM,
               cost=_fl.per_element,
               cuda=CudaSpec("reduce", combine=Combine.SUM, torch=_cuda.t_reduce("sum")),
               attrs=(_DIM, _KEEPDIM), doc="sum over one dimension", scaling=Scaling.ALL,
               index=Index.REDUCE_DIM,
               mirage=_mirage_per_dim(("kn_reduction_{d}_op", "tb_reduction_{d}_op"),
                                      keepdim=True)))
register(OpDef("mean", BOTH, (1, 1), infer_reduce, _np_reduce(np.mean),
               field=FieldSem(_F.ev_mean, _D.st_reduce,
                              _F.EXACT + " (times the inverse of the count)"),
               abstract=_ab.REDUCE_MEAN, cost=_fl.per_element,
               cuda=CudaSpec("reduce", combine=Combine.SUM, finish=Finish.MEAN,
                             torch=_cuda.t_reduce("mean")),
               attrs=(_DIM, _KEEPDIM), index=Index.REDUCE_DIM,
               doc="mean over one dimension"))
register(OpDef("max", BOTH, (1, 1), infer_reduce, _np_reduce(np.max),
               field=_F.MAX_SEM, abstract=_ab.REDUCE_MAX, cost=_fl.per_element,
               cuda=CudaSpec("reduce", combine=Combine.MAX, torch=_cuda.t_reduce("max")),
               attrs=(_DIM, _KEEPDIM), index=Index.REDUCE_DIM,
               doc="maximum over one dimension"))
register(OpDef("rms", BOTH, (1, 1), infer_rms,
               lambda xs, a: np_rms(xs[0], float(a.get("eps", 0.0))),  # type: ignore[arg-type]
               field=FieldSem(_F.ev_rms, _D.st_atom, "random sqrt of (mean of squares + eps)",
                              random_fn="sqrt", keys_from="rows", key_stat=_D.st_rms_key),
               abstract=_ab.RMS, cost=_fl.rms_like, cuda=CudaSpec("rms", torch=_cuda.t_rms),
               attrs=(_EPS,), index=Index.MIX_LAST,
               doc="sqrt(mean(x^2) + eps) over the last dim, kept as size 1"))
register(OpDef("rms_norm", BOTH, (1, 2), infer_rms_norm, _np_rms_norm,
               field=FieldSem(_F.ev_rms_norm, _D.st_rms_norm, "x / random sqrt of (mean of "
                              "squares + eps), times g", random_fn="sqrt", keys_from="rows",
                              inverts=_D.inv_rows, key_stat=_D.st_rms_key),
               abstract=_ab.composite(_ab.decompose_rms_norm, get),
               decompose=_ab.decompose_rms_norm, cost=_fl.rms_like,
               cuda=CudaSpec("rms_norm", torch=_cuda.t_rms_norm), attrs=(_EPS,),
               mirage=_kn_tb("rms_norm"), index=Index.MIX_LAST,
               doc="x / rms(x, eps) over the last dim, times the optional weight g"))
register(OpDef("softmax", KERNEL_ONLY, (1, 1), infer_softmax, _np_softmax,
               field=FieldSem(_F.ev_softmax, _D.st_softmax, "exp (as above) divided by its "
                              "sum", inverts=_D.inv_rows, uses_exp=True),
               abstract=_ab.composite(_ab.decompose_softmax, get),
               decompose=_ab.decompose_softmax, cost=_fl.per_element,
               cuda=CudaSpec("softmax", torch=lambda t, xs, a: t.softmax(
                   xs[0].float(), dim=int(a["dim"])).to(xs[0].dtype)),
               attrs=(_DIM,), index=Index.MIX_DIM, doc="exp(x) / sum(exp(x)) over dim"))
register(OpDef("concat", BOTH, (2, 2), infer_concat,
               lambda xs, a: np.concatenate(list(xs), axis=int(a["dim"])),  # type: ignore[arg-type]
               field=FieldSem(_F.ev_concat, _D.st_concat, _F.EXACT), abstract=_ab.CONCAT,
               cost=_fl.per_element,
               cuda=CudaSpec("concat", torch=lambda t, xs, a: t.cat(xs, dim=int(a["dim"]))),
               attrs=(_DIM,), index=Index.CONCAT, doc="concatenation along dim",
               mirage=_mirage_per_dim(("kn_concat_{d}_op", "tb_concat_{d}_op"))))
register(OpDef("reshape", KERNEL_ONLY, (1, 1), infer_reshape,
               lambda xs, a: xs[0].reshape(_F.reshape_dims(a)),
               field=FieldSem(_F.ev_reshape, _D.st_reshape, _F.EXACT + " (residues moved)"),
               abstract=_ab.RESHAPE, cost=_fl.per_element,
               cuda=CudaSpec("gather", gather=_cuda.gather_reshape,
                             torch=lambda t, xs, a: xs[0].reshape(_F.reshape_dims(a))),
               attrs=tuple(AttrSpec(f"d{i}", int, required=i == 0,
                                    default=None if i == 0 else 0) for i in range(4)),
               index=Index.RESHAPE,
               doc="row-major reshape to [d0, d1, d2, d3] (trailing ones may be omitted); "
                   "kernel level only: a layer is cut here (search/layer.py)"))
register(OpDef("rotate_half", BOTH, (1, 1), infer_rotate_half,
               _unary(np_rotate_half),
               field=FieldSem(_F.ev_rotate_half, _D.st_same,
                              _F.EXACT + " (a signed permutation)"),
               abstract=_ab.ROTATE_HALF, cost=_fl.per_element, index=Index.MIX_LAST,
               cuda=CudaSpec("gather", gather=_cuda.gather_rotate_half,
                             torch=_cuda.t_rotate_half),
               doc="[x1, x2] -> [-x2, x1] over the even last dim (rotary embeddings: "
                   "x * cos + rotate_half(x) * sin); in a block graph, of the tile's last "
                   "dim (a block holding whole heads rotates each)"))
register(OpDef("sum_to", BLOCK_ONLY, (1, 1), infer_sum_to,
               lambda xs, a: np_sum_to(xs[0], int(a["width"])),  # type: ignore[arg-type]
               field=FieldSem(_F.ev_sum_to, _D.st_sum_to, _F.EXACT), abstract=_ab.SUM_TO,
               cost=_fl.per_element, cuda=CudaSpec("sum_to"),
               attrs=(_WIDTH,), index=Index.MIX_LAST,
               doc="sum the last dim in groups down to width",
               scaling=Scaling.ALL))
register(OpDef("custom", KERNEL_ONLY, (1, 64), infer_custom, None, field=_F.custom_sem(),
               abstract=None,  # a custom kernel's expression is its block graph's
               cost=_fl.per_element, cuda=CudaSpec("custom"),
               doc="a custom kernel: a block graph run by every block of a grid"))


def accumulator(name: str, spec: AccumSpec, mirage: MirageNames = ()) -> OpDef:
    """The row of a forloop accumulator: every meaning follows from its ``AccumSpec``
    (validated when the spec is built), so one spec is the whole definition of one."""
    return OpDef(name, BLOCK_ONLY, (1, 1), infer_accum(spec), _np_accum(spec),
                 field=_F.accumulator_sem(spec), abstract=_ab.accumulator(spec),
                 cost=_fl.per_element, cuda=_cuda.ACCUM_SPEC, attrs=_accum_attrs(spec),
                 accum=spec, mirage=mirage, doc=f"forloop accumulator: {spec}")


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
    return (((_WIDTH,) if spec.reduce is Reduce.TO_WIDTH else ())
            + ((_EPS,) if spec.finish is Finish.RMS else ()))


ACCUMULATORS: dict[str, AccumSpec] = {
    "acc_sum": AccumSpec(Pre.ID, Reduce.NONE, Combine.SUM, Finish.ID),
    "acc_mean": AccumSpec(Pre.ID, Reduce.NONE, Combine.SUM, Finish.MEAN),
    "acc_rms": AccumSpec(Pre.SQUARE, Reduce.NONE, Combine.SUM, Finish.RMS),
    "acc_max": AccumSpec(Pre.ID, Reduce.NONE, Combine.MAX, Finish.ID),
    "acc_sum_ld": AccumSpec(Pre.ID, Reduce.LAST, Combine.SUM, Finish.ID),
    "acc_mean_ld": AccumSpec(Pre.ID, Reduce.LAST, Combine.SUM, Finish.MEAN),
    "acc_rms_ld": AccumSpec(Pre.SQUARE, Reduce.LAST, Combine.SUM, Finish.RMS),
    "acc_max_ld": AccumSpec(Pre.ID, Reduce.LAST, Combine.MAX, Finish.ID),
    "acc_sum_to": AccumSpec(Pre.ID, Reduce.TO_WIDTH, Combine.SUM, Finish.ID),
}
for _name, _spec in ACCUMULATORS.items():
    register(accumulator(_name, _spec, _MIRAGE_ACCUM.get(_name, ())))
