"""Building µGraphs from Python, with types inferred as each node is added.

Used by the `.mir` frontend, the Mirage importer, the search and the tests, so that
every producer of µGraphs goes through the same inference and checks::

    b = GraphBuilder("rmsnorm_linear")
    x = b.input("X", (16, 4096), "f16")
    w = b.input("W", (4096, 6144), "f16")
    k = b.custom(grid=(256, 1, 1), threads=128, forloop=4)
    xt = k.load(x, imap=(None, None, None), fmap=1)
    wt = k.load(w, imap=(1, None, None), fmap=0)
    r = k.op("acc_rms_ld", xt)
    s = k.op("acc_sum", k.op("matmul", xt, wt))
    (z,) = k.finish(stores=[(k.op("div", s, r), "Z", (1, None, None))])
    b.output(z)
    g = b.build()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mirage_cli import ops
from mirage_cli.check import (
    check_block,
    check_graph,
    check_launch,
    infer_op,
    stored_type,
    tile_type,
)
from mirage_cli.diagnostics import MirageError, Span
from mirage_cli.ir import (
    Attrs,
    AttrValue,
    AxisMap,
    BlockGraph,
    BlockInput,
    BlockOp,
    BlockOutput,
    DType,
    Graph,
    Input,
    KernelOp,
    TensorType,
    Value,
    make_attrs,
)


def _normalized(name: str, attrs: Attrs) -> Attrs:
    opdef = ops.REGISTRY.get(name)
    return opdef.normalize(attrs) if opdef is not None else attrs


class GraphBuilder:
    """Accumulates a kernel graph; :meth:`build` checks and freezes it."""

    def __init__(self, name: str, params: Sequence[tuple[str, int]] = ()) -> None:
        self.name = name
        self.params = tuple(params)
        self.inputs: list[Input] = []
        self.ops: list[KernelOp] = []
        self.outputs: list[str] = []
        self._output_set: set[str] = set()  # membership in O(1): programs may have many
        self.types: dict[str, TensorType] = {}
        self._counter = 0

    def fresh(self, prefix: str = "t") -> str:
        """A tensor name not used yet (deterministic: a counter)."""
        while True:
            name = f"{prefix}{self._counter}"
            self._counter += 1
            if name not in self.types:
                return name

    def _define(self, v: Value) -> str:
        if v.name in self.types:
            raise MirageError(f"tensor '{v.name}' is defined twice", v.span)
        self.types[v.name] = v.type
        return v.name

    def input(self, name: str, shape: Sequence[int], dtype: str | DType,
              dims_src: Sequence[str] = (), span: Span | None = None,
              weight: bool = False) -> str:
        t = TensorType(tuple(int(d) for d in shape), DType(dtype))
        if not 1 <= t.rank <= 4:
            raise MirageError(f"input '{name}' has rank {t.rank}; tensors have rank 1 to 4",
                              span)
        v = Value(name, t, span)
        self.inputs.append(Input(v, tuple(dims_src) or tuple(str(d) for d in t.shape), weight))
        return self._define(v)

    def _types_of(self, names: Sequence[str], span: Span | None) -> list[TensorType]:
        from mirage_cli.diagnostics import did_you_mean

        for n in names:
            if n not in self.types:
                raise MirageError(f"undefined tensor '{n}'{did_you_mean(n, list(self.types))}",
                                  span)
        return [self.types[n] for n in names]

    def op(self, name: str, *inputs: str, out: str | None = None, span: Span | None = None,
           **attrs: AttrValue) -> str:
        """Add a pre-defined kernel operator; returns the output tensor's name."""
        return self.op_with(name, inputs, attrs, out=out, span=span)

    def op_with(self, name: str, inputs: Sequence[str], attrs: Mapping[str, AttrValue],
                out: str | None = None, span: Span | None = None) -> str:
        """:meth:`op` with the attributes as a mapping: for attributes read from a file,
        whose keys may be anything (``out``, ``span``) and must not meet the keyword
        arguments."""
        inputs = tuple(inputs)
        a = _normalized(name, make_attrs(**dict(attrs)))
        t = infer_op(ops.KERNEL, name, self._types_of(inputs, span), a, span)
        v = Value(out or self.fresh(), t, span)
        self._define(v)
        self.ops.append(KernelOp(name, tuple(inputs), (v,), a, span=span))
        return v.name

    def custom(self, grid: Sequence[int], threads: int, forloop: int,
               span: Span | None = None) -> BlockBuilder:
        g = tuple(int(x) for x in grid) + (1,) * (3 - len(grid))
        check_launch((g[0], g[1], g[2]), threads, forloop, span)
        return BlockBuilder(self, (g[0], g[1], g[2]), threads, forloop, span)

    def output(self, name: str, span: Span | None = None) -> None:
        self._types_of([name], span)
        if name in self._output_set:
            raise MirageError(f"output '{name}' is declared twice", span)
        self.outputs.append(name)
        self._output_set.add(name)

    def build(self) -> Graph:
        g = Graph(self.name, self.params, tuple(self.inputs), tuple(self.ops),
                  tuple(self.outputs))
        check_graph(g)
        return g


class BlockBuilder:
    """Accumulates the block graph of one custom kernel of a :class:`GraphBuilder`."""

    def __init__(self, parent: GraphBuilder, grid: tuple[int, int, int], threads: int,
                 forloop: int, span: Span | None) -> None:
        self.parent = parent
        self.grid = grid
        self.threads = threads
        self.forloop = forloop
        self.span = span
        self.inputs: list[BlockInput] = []
        self.ops: list[BlockOp] = []
        self.types: dict[str, TensorType] = {}
        self._counter = 0

    def fresh(self, prefix: str = "b") -> str:
        while True:
            name = f"{prefix}{self._counter}"
            self._counter += 1
            if name not in self.types:
                return name

    def _define(self, v: Value) -> str:
        if v.name in self.types:
            raise MirageError(f"block tensor '{v.name}' is defined twice", v.span)
        self.types[v.name] = v.type
        return v.name

    def load(self, source: str, imap: AxisMap = (None, None, None), fmap: int | None = None,
             out: str | None = None, span: Span | None = None) -> str:
        (src_t,) = self.parent._types_of([source], span)
        t = tile_type(src_t, self.grid, self.forloop, imap, fmap, source, span)
        v = Value(out or self.fresh(), t, span)
        self._define(v)
        self.inputs.append(BlockInput(v, source, imap, fmap, span))
        return v.name

    def op(self, name: str, *inputs: str, out: str | None = None, span: Span | None = None,
           **attrs: AttrValue) -> str:
        return self.op_with(name, inputs, attrs, out=out, span=span)

    def op_with(self, name: str, inputs: Sequence[str], attrs: Mapping[str, AttrValue],
                out: str | None = None, span: Span | None = None) -> str:
        """:meth:`op` with the attributes as a mapping (see GraphBuilder.op_with)."""
        from mirage_cli.diagnostics import did_you_mean

        inputs = tuple(inputs)
        for n in inputs:
            if n not in self.types:
                raise MirageError(f"undefined block tensor '{n}'"
                                  f"{did_you_mean(n, list(self.types))}", span)
        a = _normalized(name, make_attrs(**attrs))
        t = infer_op(ops.BLOCK, name, [self.types[i] for i in inputs], a, span)
        v = Value(out or self.fresh(), t, span)
        self._define(v)
        self.ops.append(BlockOp(name, tuple(inputs), (v,), a, span))
        return v.name

    def finish(self, stores: Sequence[tuple[str, str | None, AxisMap]] |
               Sequence[tuple[str, str | None, AxisMap, Span | None]] |
               Sequence[tuple[str, str | None, AxisMap, Span | None, str | DType | None]]
               ) -> tuple[str, ...]:
        """Store tiles into new device tensors and add the custom kernel to the parent.

        ``stores``: (block tensor, device tensor name or None for a fresh one, omap[,
        span[, dtype]]); the dtype of the device tensor (None: the tile's; a store
        converts, docs/ir.md). Returns the device tensor names.
        """
        outputs: list[BlockOutput] = []
        for store in stores:
            source, target, omap = store[0], store[1], store[2]
            span = store[3] if len(store) > 3 else None  # type: ignore[misc]
            dtype = store[4] if len(store) > 4 else None  # type: ignore[misc]
            if source not in self.types:
                raise MirageError(f"undefined block tensor '{source}'", span)
            name = target or self.parent.fresh()
            t = stored_type(self.types[source], self.grid, omap, name, span,
                            DType(dtype) if dtype is not None else None)
            outputs.append(BlockOutput(Value(name, t, span), source, omap, span))
        bg = BlockGraph(self.grid, self.threads, self.forloop, tuple(self.inputs),
                        tuple(self.ops), tuple(outputs))
        check_block(bg, self.parent.types, self.span)
        values = tuple(bo.value for bo in outputs)
        for v in values:
            self.parent._define(v)
        self.parent.ops.append(KernelOp("custom", tuple(dict.fromkeys(
            bi.source for bi in self.inputs)), values, (), bg, self.span))
        return tuple(v.name for v in values)
