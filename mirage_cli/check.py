"""Type inference and structural checks of µGraphs (DESIGN.md §3).

Owns the rules that involve more than one operator: tiling of block inputs by
imap/fmap, concatenation of block outputs by omap, which block operators run inside
the forloop and which after it (the epilogue), and the well-formedness of a whole
graph (names defined once and before use, outputs produced). Per-operator rules come
from the registry. Every violation is a :class:`MirageError` at the offending node.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from mirage_cli import ops
from mirage_cli.diagnostics import MirageError, Span, did_you_mean
from mirage_cli.ir import (
    GRID_AXES,
    Attrs,
    AttrValue,
    AxisMap,
    BlockGraph,
    DType,
    Graph,
    TensorType,
)

Phase = Literal["loop", "epilogue", "invariant"]


def infer_op(level: str, name: str, types: Sequence[TensorType], attrs: Attrs,
             span: Span | None = None) -> TensorType:
    """The result type of operator ``name`` at ``level``, or a located error."""
    opdef = ops.REGISTRY.get(name)
    if opdef is None or level not in opdef.levels or name == "custom":
        allowed = [n for n in ops.names(level) if n != "custom"]
        raise MirageError(f"unknown {level} operator '{name}'{did_you_mean(name, allowed)}",
                          span)
    lo, hi = opdef.arity
    if not lo <= len(types) <= hi:
        want = str(lo) if lo == hi else f"{lo} to {hi}"
        raise MirageError(f"'{name}' takes {want} operand(s), got {len(types)}", span)
    values = check_attrs(opdef, attrs, span)
    try:
        return opdef.infer(types, values)
    except ops.ShapeError as e:
        raise MirageError(f"{name}: {e}", span) from None


def check_attrs(opdef: ops.OpDef, attrs: Attrs, span: Span | None) -> dict[str, AttrValue]:
    """Attribute names and types of one operator use; returns values with defaults."""
    known = {s.name: s for s in opdef.attrs}
    for key, value in attrs:
        spec = known.get(key)
        if spec is None:
            hint = did_you_mean(key, list(known))
            raise MirageError(f"'{opdef.name}' has no attribute '{key}'{hint}", span)
        ok = (isinstance(value, bool) if spec.kind is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool)
              if spec.kind is float else
              isinstance(value, spec.kind) and not isinstance(value, bool))
        if not ok:
            raise MirageError(f"attribute '{key}' of '{opdef.name}' must be "
                              f"{spec.kind.__name__}, got {value!r}", span)
    for spec in opdef.attrs:
        if spec.required and all(k != spec.name for k, _ in attrs):
            raise MirageError(f"'{opdef.name}' needs attribute '{spec.name}'", span)
    return opdef.attr_values(attrs)


def _check_axis_map(amap: AxisMap, rank: int, grid: tuple[int, int, int], what: str,
                    span: Span | None) -> None:
    seen: dict[int, str] = {}
    for axis, dim in zip(GRID_AXES, amap):
        if dim is None:
            continue
        if not 0 <= dim < rank:
            raise MirageError(f"{what} maps grid axis {axis} to dimension {dim}, "
                              f"but the tensor has rank {rank} (dimensions 0..{rank - 1})",
                              span)
        if dim in seen:
            raise MirageError(f"{what} maps grid axes {seen[dim]} and {axis} to the same "
                              f"dimension {dim}", span)
        seen[dim] = axis


def tile_type(src: TensorType, grid: tuple[int, int, int], forloop: int, imap: AxisMap,
              fmap: int | None, source: str = "tensor", span: Span | None = None
              ) -> TensorType:
    """The tile one block sees in one iteration: ``src`` split by imap over the grid,
    then by fmap over the forloop iterations."""
    _check_axis_map(imap, src.rank, grid, f"imap of '{source}'", span)
    shape = list(src.shape)
    for axis, g, dim in zip(GRID_AXES, grid, imap):
        if dim is None:
            continue
        if shape[dim] % g:
            raise MirageError(f"dimension {dim} of '{source}' (size {shape[dim]}) is not "
                              f"divisible by grid.{axis} = {g}", span)
        shape[dim] //= g
    if fmap is not None:
        if not 0 <= fmap < src.rank:
            raise MirageError(f"fmap of '{source}' names dimension {fmap}, but the tensor "
                              f"has rank {src.rank}", span)
        if shape[fmap] % forloop:
            raise MirageError(f"dimension {fmap} of '{source}' (size {shape[fmap]} per block)"
                              f" is not divisible by forloop = {forloop}", span)
        shape[fmap] //= forloop
    return TensorType(tuple(shape), src.dtype)


def stored_type(tile: TensorType, grid: tuple[int, int, int], omap: AxisMap,
                target: str = "output", span: Span | None = None,
                dtype: DType | None = None) -> TensorType:
    """The device tensor that the blocks' tiles concatenate into under ``omap``, of
    ``dtype`` (default: the tile's; the store converts each element)."""
    _check_axis_map(omap, tile.rank, grid, f"omap of '{target}'", span)
    shape = list(tile.shape)
    for axis, g, dim in zip(GRID_AXES, grid, omap):
        if dim is None:
            if g > 1:
                raise MirageError(f"omap of '{target}' does not map grid axis {axis} "
                                  f"(size {g}): blocks along it would overwrite each other",
                                  span)
            continue
        shape[dim] *= g
    return TensorType(tuple(shape), dtype or tile.dtype)


def block_phases(bg: BlockGraph) -> dict[str, Phase]:
    """Which block tensors are computed per iteration (``loop``), once after the
    loop (``epilogue``), or are loop-invariant inputs usable in both (``invariant``).

    A loop operator may read an accumulator's result itself (not a value computed
    from it): it then means the accumulator's value over *all* iterations, as if the
    loop ran once for that accumulator and again for the rest (:func:`loop_passes`).
    That is how a µGraph says "subtract the row maximum" inside a loop over the
    row's chunks; the online form (a running maximum, the sums rescaled when it
    grows) is the code generator's way to run both passes as one."""
    phases: dict[str, Phase] = {}
    for bi in bg.inputs:
        phases[bi.value.name] = "loop" if bi.fmap is not None else "invariant"
    results = {op.outputs[0].name for op in bg.ops if ops.get(op.op).is_accumulator}
    for op in bg.ops:
        opdef = ops.get(op.op)
        in_phases = {phases[i] for i in op.inputs}
        if opdef.is_accumulator:
            if "epilogue" in in_phases:
                raise MirageError(f"accumulator '{op.op}' is applied to '{op.inputs[0]}', "
                                  f"which is already computed after the forloop", op.span)
            phase: Phase = "epilogue"
        elif "epilogue" in in_phases:
            if "loop" in in_phases:
                late = [i for i in op.inputs if phases[i] == "epilogue" and i not in results]
                if late:
                    loop_in = [i for i in op.inputs if phases[i] == "loop"]
                    raise MirageError(
                        f"'{op.op}' mixes '{loop_in[0]}' (computed in every forloop "
                        f"iteration) with '{late[0]}', computed after the loop; accumulate "
                        f"'{loop_in[0]}' first (a loop operator may read an accumulator's "
                        f"result itself, not a value computed from it)", op.span)
                phase = "loop"
            else:
                phase = "epilogue"
        elif "loop" in in_phases:
            phase = "loop"
        else:
            phase = "invariant"
        for v in op.outputs:
            phases[v.name] = phase
    return phases


def loop_passes(bg: BlockGraph) -> dict[str, int]:
    """The pass of every loop value and accumulator result (see :func:`block_phases`):
    0 for what the loop computes from its inputs alone; one more than the latest pass
    of the accumulator results a loop value reads (directly or through other loop
    values); an accumulator's result is in its input's pass. Evaluating the loop once
    per pass, each pass reading the results of the earlier ones, gives the block
    graph's meaning."""
    phases = block_phases(bg)
    level: dict[str, int] = {}
    for op in bg.ops:
        out = op.outputs[0].name
        if ops.get(op.op).is_accumulator:
            level[out] = level.get(op.inputs[0], 0)
        elif phases[out] == "loop":
            level[out] = max([level.get(i, 0) + (1 if phases[i] == "epilogue" else 0)
                              for i in op.inputs], default=0)
    return level


def online_reads(bg: BlockGraph) -> set[str]:
    """The accumulator results that loop operators read (their value over all
    iterations: :func:`block_phases`)."""
    phases = block_phases(bg)
    return {i for op in bg.ops if phases[op.outputs[0].name] == "loop"
            and not ops.get(op.op).is_accumulator
            for i in op.inputs if phases[i] == "epilogue"}


def check_launch(grid: tuple[int, int, int], threads: int, forloop: int,
                 span: Span | None = None) -> None:
    """A custom kernel's grid, threads and forloop are positive: checked before any of
    its loads divides a tensor by them."""
    for n, what in ((forloop, "forloop"), (threads, "threads")):
        if n < 1:
            raise MirageError(f"{what} must be positive, got {n}", span)
    if any(g < 1 for g in grid):
        raise MirageError(f"grid dimensions must be positive, got {grid}", span)


def check_block(bg: BlockGraph, kernel_types: dict[str, TensorType],
                span: Span | None = None) -> None:
    """Validate one block graph against the device tensors it reads."""
    check_launch(bg.grid, bg.threads, bg.forloop, span)
    if bg.threads % 32:
        raise MirageError(f"threads per block must be a multiple of 32, got {bg.threads}",
                          span)
    types: dict[str, TensorType] = {}

    def define(name: str, t: TensorType, where: Span | None) -> None:
        if name in types:
            raise MirageError(f"block tensor '{name}' is defined twice", where)
        types[name] = t

    for bi in bg.inputs:
        if bi.source not in kernel_types:
            raise MirageError(f"undefined tensor '{bi.source}'"
                              f"{did_you_mean(bi.source, list(kernel_types))}", bi.span)
        t = tile_type(kernel_types[bi.source], bg.grid, bg.forloop, bi.imap, bi.fmap,
                      bi.source, bi.span)
        _expect(bi.value.type, t, bi.value.name, bi.span)
        define(bi.value.name, t, bi.span)
    for op in bg.ops:
        _check_uses(op.inputs, types, op.span)
        t = infer_op(ops.BLOCK, op.op, [types[i] for i in op.inputs], op.attrs, op.span)
        if len(op.outputs) != 1:
            raise MirageError(f"'{op.op}' produces one tensor", op.span)
        _expect(op.outputs[0].type, t, op.outputs[0].name, op.span)
        define(op.outputs[0].name, t, op.span)
    phases = block_phases(bg)
    if not any(ops.get(op.op).is_accumulator for op in bg.ops):
        raise MirageError("a custom kernel needs at least one forloop accumulator "
                          "(acc_sum, acc_rms_ld, ...) before its outputs", span)
    if not bg.outputs:
        raise MirageError("a custom kernel must store at least one output", span)
    for bo in bg.outputs:
        _check_uses((bo.source,), types, bo.span)
        if phases[bo.source] == "loop":
            raise MirageError(f"'{bo.source}' is computed in every forloop iteration; "
                              f"store an accumulated value instead", bo.span)
        t = stored_type(types[bo.source], bg.grid, bo.omap, bo.value.name, bo.span,
                        bo.value.type.dtype)
        _expect(bo.value.type, t, bo.value.name, bo.span)


def _check_uses(names: Sequence[str], types: dict[str, TensorType], span: Span | None
                ) -> None:
    for n in names:
        if n not in types:
            raise MirageError(f"undefined tensor '{n}'{did_you_mean(n, list(types))}", span)


def _expect(declared: TensorType, inferred: TensorType, name: str, span: Span | None
            ) -> None:
    if declared != inferred:
        raise MirageError(f"'{name}' is declared as {declared} but computes {inferred}", span)


def check_graph(g: Graph) -> None:
    """Validate a whole kernel graph; raises the first :class:`MirageError`."""
    types: dict[str, TensorType] = {}
    for name, _ in g.params:
        if not name.isidentifier():
            raise MirageError(f"bad parameter name '{name}'")
    for inp in g.inputs:
        v = inp.value
        if v.name in types:
            raise MirageError(f"tensor '{v.name}' is defined twice", v.span)
        if not 1 <= v.type.rank <= 4 or any(d < 1 for d in v.type.shape):
            raise MirageError(f"input '{v.name}' has shape {list(v.type.shape)}; tensors "
                              f"have rank 1 to 4 and positive dimensions", v.span)
        types[v.name] = v.type
    for op in g.ops:
        _check_uses(op.inputs, types, op.span)
        if op.op == "custom":
            if op.block is None:
                raise MirageError("custom operator without a block graph", op.span)
            check_block(op.block, types, op.span)
            stored = [bo.value for bo in op.block.outputs]
            if tuple(stored) != op.outputs:
                raise MirageError("custom kernel outputs disagree with its stores", op.span)
        else:
            t = infer_op(ops.KERNEL, op.op, [types[i] for i in op.inputs], op.attrs, op.span)
            if len(op.outputs) != 1:
                raise MirageError(f"'{op.op}' produces one tensor", op.span)
            _expect(op.outputs[0].type, t, op.outputs[0].name, op.span)
        for v in op.outputs:
            if v.name in types:
                raise MirageError(f"tensor '{v.name}' is defined twice", v.span or op.span)
            if not 1 <= v.type.rank <= 4:
                raise MirageError(f"'{v.name}' has rank {v.type.rank}; tensors have rank "
                                  f"1 to 4", v.span or op.span)
            types[v.name] = v.type
    if not g.outputs:
        raise MirageError(f"program '{g.name}' declares no output")
    _check_uses(g.outputs, types, None)
    if len(set(g.outputs)) != len(g.outputs):
        raise MirageError("an output is declared twice")
