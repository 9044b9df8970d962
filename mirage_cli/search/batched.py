"""A grid-vectorised evaluator of µGraphs, for verifying search candidates quickly.

Computes exactly what :mod:`mirage_cli.interp` computes (DESIGN.md §3), but runs every
block of a custom kernel at once: a block input becomes one array with three leading
axes over the grid's blocks (imap splits turned into reshapes, replicated axes into
size-1 axes that numpy broadcasts), block operators apply the registry's numpy
semantics to those batched tiles (a ``dim`` attribute shifted past the three block
axes), and stores undo the reshapes.
The interpreter loops over blocks in Python, which takes minutes on attention-sized
grids; this takes milliseconds. ``tests/test_search.py`` checks the two agree.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mirage_cli import ops
from mirage_cli.check import block_phases
from mirage_cli.ir import AxisMap, BlockGraph, Graph


def run(g: Graph, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Evaluate ``g`` in float64; outputs by name."""
    env = {i.value.name: np.asarray(inputs[i.value.name], dtype=np.float64) for i in g.inputs}
    for op in g.ops:
        if op.block is not None:
            for v, r in zip(op.outputs, _custom(op.block, env)):
                env[v.name] = r
            continue
        opdef = ops.get(op.op)
        assert opdef.numpy is not None
        with np.errstate(all="ignore"):
            env[op.outputs[0].name] = np.asarray(
                opdef.numpy([env[i] for i in op.inputs], opdef.attr_values(op.attrs)),
                dtype=np.float64)
    return {n: env[n] for n in g.outputs}


def _load(x: np.ndarray, grid: tuple[int, int, int], imap: AxisMap) -> np.ndarray:
    """(gx|1, gy|1, gz|1, *tile): three block axes, of size 1 where the tensor is
    replicated (numpy broadcasting then shares it among blocks without copies)."""
    shape: list[int] = []
    for d, n in enumerate(x.shape):
        axes = [a for a in range(3) if imap[a] == d]
        if axes:
            shape += [grid[axes[0]], n // grid[axes[0]]]
        else:
            shape.append(n)
    y = x.reshape(shape)
    # Positions of each grid axis's split in y, and of the tile dims.
    pos: dict[int, int] = {}
    tile: list[int] = []
    k = 0
    for d in range(x.ndim):
        axes = [a for a in range(3) if imap[a] == d]
        if axes:
            pos[axes[0]] = k
            k += 1
        tile.append(k)
        k += 1
    lead = []
    for a in range(3):
        if a in pos:
            lead.append(pos[a])
    y = np.transpose(y, lead + tile)
    full = [grid[a] if a in pos else 1 for a in range(3)]
    return y.reshape(full + [y.shape[i] for i in range(len(lead), y.ndim)])


def _store(t: np.ndarray, grid: tuple[int, int, int], omap: AxisMap) -> np.ndarray:
    tile = t.shape[3:]
    y = np.broadcast_to(t, list(grid) + list(tile))
    # Bring each mapped grid axis next to (before) its output dim, then merge.
    order: list[int] = []
    out_shape: list[int] = []
    for d, n in enumerate(tile):
        axes = [a for a in range(3) if omap[a] == d]
        order += axes + [3 + d]
        out_shape.append(n * (grid[axes[0]] if axes else 1))
    unmapped = [a for a in range(3) if a not in order]  # grid size 1 (checked)
    y = np.transpose(y, unmapped + order)
    return y.reshape(out_shape)


def _custom(bg: BlockGraph, env: dict[str, np.ndarray]) -> list[np.ndarray]:
    phases = block_phases(bg)
    parts = {bi.value.name: _load(env[bi.source], bg.grid, bi.imap) for bi in bg.inputs}
    fmaps = {bi.value.name: bi.fmap for bi in bg.inputs}
    values = {n: p for n, p in parts.items() if fmaps[n] is None}
    _eval(bg, values, phases, "invariant")
    collected: dict[str, list[np.ndarray]] = {}
    for i in range(bg.forloop):
        it = dict(values)
        for name, part in parts.items():
            dim = fmaps[name]
            if dim is not None:
                step = part.shape[dim + 3] // bg.forloop
                sl = [slice(None)] * part.ndim
                sl[dim + 3] = slice(i * step, (i + 1) * step)
                it[name] = part[tuple(sl)]
        _eval(bg, it, phases, "loop")
        for op in bg.ops:
            if ops.get(op.op).is_accumulator:
                collected.setdefault(op.outputs[0].name, []).append(it[op.inputs[0]])
    for op in bg.ops:
        opdef = ops.get(op.op)
        if opdef.is_accumulator:
            assert opdef.numpy is not None
            stacked = np.stack(collected[op.outputs[0].name])
            values[op.outputs[0].name] = np.asarray(
                opdef.numpy([stacked], opdef.attr_values(op.attrs)), dtype=np.float64)
    _eval(bg, values, phases, "epilogue")
    return [_store(values[bo.source], bg.grid, bo.omap) for bo in bg.outputs]


def _eval(bg: BlockGraph, values: dict[str, np.ndarray], phases: dict[str, str],
          phase: str) -> None:
    for op in bg.ops:
        opdef = ops.get(op.op)
        if opdef.is_accumulator or phases[op.outputs[0].name] != phase:
            continue
        assert opdef.numpy is not None
        args = [values[i] for i in op.inputs]
        rank = max(a.ndim for a in args)
        # Same-rank tiles behind the block axis (a lower-rank operand broadcasts
        # against the tile dims, as it would without the block axis).
        args = [a.reshape(a.shape[:3] + (1,) * (rank - a.ndim) + a.shape[3:])
                for a in args]
        attrs = dict(opdef.attr_values(op.attrs))
        if "dim" in attrs:
            attrs["dim"] = int(attrs["dim"]) + 3  # past the block axes
        with np.errstate(all="ignore"):
            values[op.outputs[0].name] = np.asarray(opdef.numpy(args, attrs), dtype=np.float64)
