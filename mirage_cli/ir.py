"""The µGraph IR: every node type of the compiler, as frozen dataclasses.

A µGraph is a *kernel graph* (a DAG over device tensors) whose ``custom`` operators
each hold a *block graph* (one fused kernel, run by every thread block of a grid).
DESIGN.md §3 is the normative description; this module only holds data. Shape and
dtype rules live in the operator registry (:mod:`mirage_cli.ops`), structural checks
in :mod:`mirage_cli.check`, and the executable semantics in :mod:`mirage_cli.interp`.

Conventions:
- tuples, never lists, so every node is hashable and comparable;
- ``str`` enums so the JSON stays stable;
- source spans are carried for diagnostics but excluded from equality;
- change a node with :func:`dataclasses.replace`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from mirage_cli.diagnostics import Span
from mirage_cli.kplan import KernelPlan


class DType(str, enum.Enum):
    """Element type of a tensor. Arithmetic on f16/bf16 accumulates in f32."""

    F16 = "f16"
    BF16 = "bf16"
    F32 = "f32"

    @property
    def nbytes(self) -> int:
        return 4 if self is DType.F32 else 2


GRID_AXES = ("x", "y", "z")

# An attribute value. Floats are kept as written (repr round-trips exactly).
AttrValue = int | float | bool | str


@dataclass(frozen=True)
class TensorType:
    """Shape (rank 1-4) and element type of a device tensor or block tile."""

    shape: tuple[int, ...]
    dtype: DType

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.nbytes

    def __str__(self) -> str:
        return f"{self.dtype.value}[{', '.join(str(d) for d in self.shape)}]"


@dataclass(frozen=True)
class Value:
    """A named tensor produced by an input or an operator, with its inferred type."""

    name: str
    type: TensorType
    span: Span | None = field(default=None, compare=False, repr=False)


Attrs = tuple[tuple[str, AttrValue], ...]


def make_attrs(**kwargs: AttrValue | None) -> Attrs:
    """Canonical attribute tuple: sorted by key, ``None`` values dropped."""
    return tuple(sorted((k, v) for k, v in kwargs.items() if v is not None))


def attr(attrs: Attrs, key: str, default: AttrValue | None = None) -> AttrValue | None:
    for k, v in attrs:
        if k == key:
            return v
    return default


# ---------------------------------------------------------------------------
# Block level (one custom kernel)
# ---------------------------------------------------------------------------

# imap/omap: for each grid axis (x, y, z), a tensor dimension or None (replicate).
AxisMap = tuple[int | None, int | None, int | None]
REPLICATE: AxisMap = (None, None, None)


@dataclass(frozen=True)
class BlockInput:
    """A tile of device tensor ``source``: split by ``imap`` over the grid and by
    ``fmap`` over the forloop iterations (grid split outermost)."""

    value: Value
    source: str
    imap: AxisMap
    fmap: int | None
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class BlockOp:
    """A block operator (including forloop accumulators) acting on tiles."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[Value, ...]
    attrs: Attrs = ()
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class BlockOutput:
    """Stores tile ``source`` into device tensor ``value``; ``omap`` says which
    dimension of the output each grid axis concatenates along."""

    value: Value
    source: str
    omap: AxisMap
    span: Span | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class BlockGraph:
    """The thread-block graph of a custom kernel."""

    grid: tuple[int, int, int]
    threads: int
    forloop: int
    inputs: tuple[BlockInput, ...]
    ops: tuple[BlockOp, ...]
    outputs: tuple[BlockOutput, ...]

    @property
    def num_blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    def tile_types(self) -> dict[str, TensorType]:
        """Every tile's type (the block inputs', then each operator's result), by name."""
        types = {bi.value.name: bi.value.type for bi in self.inputs}
        for op in self.ops:
            for v in op.outputs:
                types[v.name] = v.type
        return types


# ---------------------------------------------------------------------------
# Kernel level
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Input:
    """A program input. ``dims_src`` keeps each dimension as written in `.mir`
    (e.g. ``"batch"``) so that printing keeps the program parametric. ``weight``: the
    user declares that the kernel launched just before a call, in the same stream,
    does not write it (a model's weights), so the generated code may start reading it
    before that kernel has finished (docs/language.md)."""

    value: Value
    dims_src: tuple[str, ...] = ()
    weight: bool = False


@dataclass(frozen=True)
class KernelOp:
    """A kernel operator. ``op == "custom"`` carries a block graph in ``block``."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[Value, ...]
    attrs: Attrs = ()
    block: BlockGraph | None = None
    span: Span | None = field(default=None, compare=False, repr=False)
    # The thread level of a custom kernel (DESIGN.md §2), once planned; None: the
    # code generator plans it with default knobs.
    plan: KernelPlan | None = None


@dataclass(frozen=True)
class Graph:
    """A kernel graph: a named program over device tensors (a µGraph)."""

    name: str
    params: tuple[tuple[str, int], ...]
    inputs: tuple[Input, ...]
    ops: tuple[KernelOp, ...]
    outputs: tuple[str, ...]

    def tensor_types(self) -> dict[str, TensorType]:
        """Every device tensor's type, by name."""
        types = {i.value.name: i.value.type for i in self.inputs}
        for op in self.ops:
            for v in op.outputs:
                types[v.name] = v.type
        return types

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.value.name for i in self.inputs)

    @property
    def is_fused(self) -> bool:
        return any(op.op == "custom" for op in self.ops)
