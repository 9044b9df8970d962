"""Evaluating a whole µGraph over the finite fields, both levels, vectorised.

Pre-defined kernel operators apply their registry ``field`` semantics to whole device
tensors. A custom kernel is evaluated for every block and every forloop iteration at
once: each block input becomes one array of shape ``(gx, gy, gz, F, *tile)`` (a size-1
axis where the input is replicated over a grid axis or not split by the forloop),
obtained from the device tensor by a reshape and a transpose, because imap and fmap are
regular splits (grid split outermost, then forloop, as ``interp.py`` defines). Block
operators then act on these arrays with numpy broadcasting over the four leading axes;
an accumulator reduces the forloop axis to size 1, so the epilogue sees one value per
block; stores undo the split by omap. This computes exactly what the reference
interpreter's block-by-block loops compute (tests compare the two on random graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from mirage_cli import ops
from mirage_cli.ir import AxisMap, BlockGraph, Graph, KernelOp, TensorType
from mirage_cli.semantics.fieldsem import FieldSem, lift
from mirage_cli.semantics.values import FVal, TrialContext

LEAD = 4  # grid x, y, z and the forloop iteration


def sem(name: str) -> FieldSem:
    """The field semantics of operator ``name``, from the registry."""
    s = ops.get(name).field
    assert isinstance(s, FieldSem), f"operator {name} has no field semantics"
    return s


def evaluate(g: Graph, inputs: Sequence[FVal], ctx: TrialContext) -> list[FVal]:
    """The outputs of ``g`` (in order) for field inputs given by position."""
    env: dict[str, FVal] = {i.value.name: x for i, x in zip(g.inputs, inputs)}
    types = g.tensor_types()
    for op in g.ops:
        for v, r in zip(op.outputs, _kernel_op(op, env, types, ctx)):
            env[v.name] = r
    return [env[o] for o in g.outputs]


def _kernel_op(op: KernelOp, env: dict[str, FVal], types: dict[str, TensorType],
               ctx: TrialContext) -> list[FVal]:
    if op.block is not None:
        return evaluate_block(op.block, env, types, ctx)
    opdef = ops.get(op.op)
    return [sem(op.op).eval([env[i] for i in op.inputs], opdef.attr_values(op.attrs), ctx)]


def _map_residues(x: FVal, fn: Callable[[np.ndarray], np.ndarray]) -> FVal:
    """The same reshaping applied to every residue ``x`` has."""
    def part(i: int) -> Callable[[], np.ndarray | None]:
        def f() -> np.ndarray | None:
            v = x.get(i)
            return None if v is None else fn(v)
        return f
    return FVal(part(0), part(1), part(2))


def split_input(x: np.ndarray, grid: tuple[int, int, int], forloop: int, imap: AxisMap,
                fmap: int | None) -> np.ndarray:
    """Device tensor -> ``(gx|1, gy|1, gz|1, F|1, *tile)`` by imap/fmap (a view)."""
    expanded: list[int] = []
    labels: list[object] = []
    for d, n in enumerate(x.shape):
        axes = [a for a in range(3) if imap[a] == d]
        for a in axes:
            expanded.append(grid[a])
            labels.append(("g", a))
            n //= grid[a]
        if fmap == d:
            expanded.append(forloop)
            labels.append("f")
            n //= forloop
        expanded.append(n)
        labels.append(("d", d))
    y = x.reshape(expanded)
    leading: tuple[object, ...] = (("g", 0), ("g", 1), ("g", 2), "f")
    order = [labels.index(k) for k in leading if k in labels]
    y = y.transpose(order + [labels.index(("d", d)) for d in range(x.ndim)])
    # Insert size-1 axes for grid axes / forloop that do not split this input.
    for pos, k in enumerate(leading):
        if k not in labels:
            y = np.expand_dims(y, pos)
    return y


def join_output(t: np.ndarray, grid: tuple[int, int, int], omap: AxisMap) -> np.ndarray:
    """``(gx|1, gy|1, gz|1, 1, *tile)`` -> the device tensor, concatenating by omap."""
    t = np.broadcast_to(t, tuple(grid) + t.shape[3:4] + t.shape[4:])[:, :, :, 0]
    rank = t.ndim - 3
    order: list[int] = []
    shape: list[int] = []
    for d in range(rank):
        size = t.shape[3 + d]
        for a in range(3):
            if omap[a] == d:
                order.append(a)
                size *= grid[a]
        order.append(3 + d)
        shape.append(size)
    unmapped = [a for a in range(3) if omap[a] is None]  # grid size 1 (checked)
    t = t.transpose(unmapped + order)
    return np.ascontiguousarray(t).reshape(shape)


def evaluate_block(bg: BlockGraph, env: dict[str, FVal], kernel_types: dict[str, TensorType],
                   ctx: TrialContext) -> list[FVal]:
    """A custom kernel's outputs, all blocks and iterations at once."""
    bctx = ctx.at_lead(LEAD)
    vals: dict[str, FVal] = {}
    ranks: dict[str, int] = {}
    for bi in bg.inputs:
        vals[bi.value.name] = _map_residues(env[bi.source], _splitter(bg, bi.imap, bi.fmap))
        ranks[bi.value.name] = bi.value.type.rank
    for op in bg.ops:
        opdef = ops.get(op.op)
        args = [vals[i] for i in op.inputs]
        if opdef.is_accumulator:
            args = [_map_residues(args[0], _iterations(bg.forloop))]
        elif len(args) > 1:
            args = _align_ranks(args, [ranks[i] for i in op.inputs])
        out = op.outputs[0]
        vals[out.name] = sem(op.op).eval(args, opdef.attr_values(op.attrs), bctx)
        ranks[out.name] = out.type.rank
    return [_map_residues(vals[bo.source], _joiner(bg, bo.omap)) for bo in bg.outputs]


Reshape = Callable[[np.ndarray], np.ndarray]


def _splitter(bg: BlockGraph, imap: AxisMap, fmap: int | None) -> Reshape:
    return lambda a: split_input(a, bg.grid, bg.forloop, imap, fmap)


def _joiner(bg: BlockGraph, omap: AxisMap) -> Reshape:
    return lambda a: join_output(a, bg.grid, omap)


def _iterations(forloop: int) -> Reshape:
    """An accumulator sees its input once per iteration, even a loop-invariant one."""
    def full(a: np.ndarray) -> np.ndarray:
        if a.shape[3] == forloop:
            return a
        return np.broadcast_to(a, a.shape[:3] + (forloop,) + a.shape[4:])
    return full


def _align_ranks(args: list[FVal], ranks: list[int]) -> list[FVal]:
    """numpy broadcasting aligns the tile dims from the right; pad lower-rank tiles
    with size-1 dims after the four leading axes."""
    top = max(ranks)
    out = []
    for x, r in zip(args, ranks):
        if r < top:
            pad = top - r
            x = _map_residues(x, _padder(pad))
        out.append(x)
    return out


def _padder(pad: int) -> Reshape:
    return lambda a: a.reshape(a.shape[:LEAD] + (1,) * pad + a.shape[LEAD:])


__all__ = ["evaluate", "evaluate_block", "join_output", "lift", "split_input"]
