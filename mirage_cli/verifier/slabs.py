"""Evaluating a graph slab by slab along an independent leading axis, to bound memory.

The verification checks run the program and its candidates at their full sizes. At
mha_decode's batch 16, K and V have 268 M elements each: one finite-field trial holds
them as three int64 residues each (12.9 GB), a float64 run as float64 (4.3 GB), and the
search used to run out of memory. Yet every output row of such a graph at index i of
its leading axis (heads x batch) is computed from the input rows at index i alone. Run
slab by slab, on rows ``[s*n, (s+1)*n)`` of every tensor that carries the axis, each
run holds 1/k of the inputs, and the outputs, written slab by slab into whole arrays,
are *exactly* those of one whole run (same values, bit for bit, in every precision):

- **The axis** is dim 0 of every input whose dim 0 is the largest input's; the other
  inputs are *axis-free* and passed whole to every slab. Which tensors carry it is the
  certificate carry's index analysis (:func:`.carry.tensor_axes`, docs/verification.md
  §10): every operator maps it index to index, never reduces or mixes along it, and a
  custom kernel splits it by at most one grid axis. That makes each slab's outputs the
  same *expressions* of its input rows as in the whole graph (§10's soundness argument).
- **The same floating-point operations.** So that float64 and native (f32) results are
  identical too, not only equal over the reals, this module also requires: the axis is
  dim 0 of every tensor that carries it (a slab is a contiguous block of rows); a
  kernel-level ``matmul`` carries it only as a batch dimension (result rank >= 3: every
  matrix product is the same call on the same matrices); every custom kernel that loads
  it splits it by a grid axis whose size the slab count divides (a slab runs whole
  blocks of the full kernel, on the same tiles; a kernel holding the whole axis in one
  block would see other tiles); and no ``reshape`` (its attributes are sizes).
- **The slab graph** is the graph with every tensor's axis size, and every splitting
  grid axis, divided by the count; tiles are unchanged.
- **The count** is the smallest divisor k of the axis size and of every splitting grid
  size for which one slab's axis-carrying inputs have at most ``SLAB_ELEMENTS``
  elements (the largest such divisor where none is small enough). k = 1, or a graph
  that cannot be cut, is evaluated whole, as before.

Random-function keys, ``max`` fingerprints and ``exp`` in the finite-field model
depend on values, never on positions, and a zero divisor met in any slab is met in the
whole graph: the field verdicts are unchanged as well (``Verifier`` in :mod:`.api`).
``tests/test_slabs.py`` checks the equality on small graphs in both interpreters'
precisions and in the field.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from mirage_cli import interp
from mirage_cli.interp import Precision
from mirage_cli.ir import Graph, KernelOp, TensorType, Value
from mirage_cli.verifier.carry import NotCarried, splitting_axis, tensor_axes

# The most elements of axis-carrying inputs one slab may hold: 2^25 keeps a slab's
# field residues (three int64 per element) under 1 GB, and every example but
# mha_decode in one piece at its default sizes. (mha_decode's K and V have 2^24
# elements per batch element each: with Q, just over 2^25, so it runs in slabs of 16
# of its 32 * batch heads.)
SLAB_ELEMENTS = 1 << 25

Ax = int | None  # a tensor's axis (0), or None: it does not carry it


@dataclass(frozen=True)
class Slabs:
    """``graph`` (one slab) run ``count`` times: run s on rows ``rows_of(s)`` of the
    inputs that carry the axis (``inputs``, by position) and on the others whole gives
    rows ``rows_of(s)`` of the outputs that carry it (``outputs``, by position); an
    axis-free output is the same in every run."""

    graph: Graph
    count: int
    rows: int  # the axis size of one slab
    inputs: tuple[bool, ...]
    outputs: tuple[bool, ...]

    def rows_of(self, s: int) -> slice:
        return slice(s * self.rows, (s + 1) * self.rows)


def plan(g: Graph, limit: int | None = None) -> Slabs | None:
    """How to evaluate ``g`` slab by slab, or None: in one piece (its axis-carrying
    inputs have at most ``limit`` elements, default ``SLAB_ELEMENTS``, or it cannot be
    cut)."""
    return _plan(g, SLAB_ELEMENTS if limit is None else limit)


@functools.lru_cache(maxsize=32)
def _plan(g: Graph, limit: int) -> Slabs | None:
    try:
        env, splits = _axes(g)
    except NotCarried:
        return None
    carrying = [i.value for i in g.inputs if env[i.value.name] == 0]
    size = carrying[0].type.shape[0]
    grids = [_grid(g.ops[n])[a] for n, a in splits.items()]
    count = _count(math.gcd(size, *grids), sum(math.prod(v.type.shape) for v in carrying),
                   limit)
    if count == 1:
        return None
    return Slabs(_slab_graph(g, env, splits, count), count, size // count,
                 tuple(env[i.value.name] == 0 for i in g.inputs),
                 tuple(env[o] == 0 for o in g.outputs))


def _axes(g: Graph) -> tuple[dict[str, Ax], dict[int, int]]:
    """Every device tensor's axis, and for each custom kernel that loads it (by
    operator position) the grid axis that splits it; raises NotCarried where the graph
    cannot be cut (see the module docstring)."""
    if not g.inputs or any(i.value.type.rank == 0 for i in g.inputs):
        raise NotCarried("an input has no leading dimension")
    size = max(g.inputs, key=lambda i: math.prod(i.value.type.shape)).value.type.shape[0]
    if size == 1:
        raise NotCarried("the largest input's leading dimension is 1")
    env = tensor_axes(g, {i.value.name: 0 if i.value.type.shape[0] == size else None
                          for i in g.inputs})
    if any(a not in (0, None) for a in env.values()):
        raise NotCarried("a tensor carries the axis elsewhere than at dim 0")
    if not any(env[o] == 0 for o in g.outputs):
        raise NotCarried("no output carries the axis")
    types = g.tensor_types()
    splits: dict[int, int] = {}
    for n, op in enumerate(g.ops):
        if op.op == "reshape":
            raise NotCarried("a reshape's attributes are sizes")
        if op.block is not None and any(env[bi.source] == 0 for bi in op.block.inputs):
            split = splitting_axis(op.block, env)
            if split is None:  # one block holds the whole axis: its tiles would change
                raise NotCarried("a custom kernel does not split the axis")
            splits[n] = split
        elif op.op == "matmul" and env[op.outputs[0].name] == 0 and \
                types[op.outputs[0].name].rank < 3:
            raise NotCarried("the axis is a matrix's rows")  # another BLAS call per slab
    return env, splits


def _grid(op: KernelOp) -> tuple[int, int, int]:
    assert op.block is not None
    return op.block.grid


def _count(common: int, elements: int, limit: int) -> int:
    """The smallest divisor of ``common`` that cuts ``elements`` into slabs of at most
    ``limit``, or ``common`` itself (the finest cut) when none does."""
    for k in range(1, common + 1):
        if common % k == 0 and elements // k <= limit:
            return k
    return common


def _slab_graph(g: Graph, env: dict[str, Ax], splits: dict[int, int], count: int) -> Graph:
    """``g`` with every tensor's axis size, and every splitting grid axis, divided by
    ``count``; block graphs' tiles unchanged."""
    def value(v: Value) -> Value:
        if env.get(v.name) != 0:
            return v
        t = v.type
        return replace(v, type=TensorType((t.shape[0] // count,) + t.shape[1:], t.dtype))

    def kernel(n: int, op: KernelOp) -> KernelOp:
        outs = tuple(value(v) for v in op.outputs)
        if op.block is None:
            return replace(op, outputs=outs)
        bg = op.block
        grid = list(bg.grid)
        if n in splits:
            grid[splits[n]] //= count
        stores = tuple(replace(bo, value=value(bo.value)) for bo in bg.outputs)
        return replace(op, outputs=outs, block=replace(bg, grid=(grid[0], grid[1], grid[2]),
                                                       outputs=stores))

    return replace(g, inputs=tuple(replace(i, value=value(i.value)) for i in g.inputs),
                   ops=tuple(kernel(n, op) for n, op in enumerate(g.ops)))


Run = Callable[[int], Sequence[np.ndarray | None]]  # slab number -> its results


def gather(slabs: Slabs, carries: Sequence[bool], run: Run) -> list[np.ndarray | None]:
    """Whole arrays from the slabs' results: ``run(s)`` gives slab s's arrays (by
    position; None where a result does not exist, in every slab alike); an array that
    carries the axis (``carries``) is written row block by row block into a whole
    array, one that does not is slab 0's (every slab computes it the same)."""
    whole: list[np.ndarray | None] = []
    for s in range(slabs.count):
        parts = run(s)
        if s == 0:
            whole = [None if x is None else
                     np.empty((slabs.rows * slabs.count,) + x.shape[1:], x.dtype) if c else x
                     for x, c in zip(parts, carries)]
        for out, x, c in zip(whole, parts, carries):
            if c and out is not None:
                out[slabs.rows_of(s)] = x
    return whole


# An input by name and its rows (``slice(None)``: whole); lets a caller build each
# slab's inputs (e.g. scaled, rounded) without building the whole input first.
Source = Callable[[str, slice], np.ndarray]


def source_of(arrays: dict[str, np.ndarray]) -> Source:
    """The rows of given whole arrays (views)."""
    return lambda name, rows: arrays[name][rows]


def run(g: Graph, source: Source, precision: Precision = "float64",
        limit: int | None = None, observe: interp.Observer | None = None
        ) -> dict[str, np.ndarray]:
    """``interp.run`` of ``g`` on the inputs ``source`` gives, slab by slab where
    :func:`plan` cuts it (``limit``: its argument): the same outputs, holding one
    slab's inputs and values at a time. ``observe`` sees each slab's intermediates
    (``interp.run``'s argument)."""
    names = [i.value.name for i in g.inputs]
    p = plan(g, limit)
    if p is None:
        return interp.run(g, {n: source(n, slice(None)) for n in names}, precision,
                          observe=observe)

    def one(s: int) -> list[np.ndarray]:
        ins = {n: source(n, p.rows_of(s) if c else slice(None))
               for n, c in zip(names, p.inputs)}
        outs = interp.run(p.graph, ins, precision, observe=observe)
        return [outs[o] for o in p.graph.outputs]

    outs = gather(p, p.outputs, one)
    return {o: x for o, x in zip(g.outputs, outs) if x is not None}  # (never None here)
