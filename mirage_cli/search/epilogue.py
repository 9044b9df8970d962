"""Epilogue folding: an element-wise kernel that only finishes what another custom
kernel stores moves into that kernel's epilogue.

A stitched layer (:mod:`.layer`) can end a part with a custom kernel that stores a
tensor ``T`` and start the next with a kernel that only applies element-wise operators
to ``T`` and program inputs: the Qwen2-7B layer's query, key and value projections
(``QM = N1 @ WQ``, ...) and, across the partition's cut, their bias adds (``Q = QM +
BQ``, ...). Each part is the best its own search found, but the second kernel is a
launch of its own that reads ``T`` back from memory (on an H200 at batch 1, one block
adding the three biases ran 2.8 µs). :func:`fold` rewrites such a pair: the producer
loads the consumer's other inputs as tiles of its own grid (each a program input,
split as the producer splits ``T``, broadcast dimensions whole), applies the same
operators to the tile it stored as ``T``, and stores the result in ``T``'s place; the
consumer loses that output, and disappears when it has none left.

**When.** The consumer ``E`` is a custom kernel of one iteration, or a pre-defined
element-wise operator (taken as the one-block kernel that computes it). An output ``O`` of
``E`` folds when its stored tile is computed from block inputs by element-wise
operators and identity accumulators (``acc_sum`` of the one iteration) alone; exactly
one of those inputs, ``T``, is made by another custom kernel ``P``, and ``O`` has
``T``'s shape; every other input is a program input (so it exists before ``P`` runs);
``T`` is read by nothing but that chain (no other kernel, no other output of ``E``,
not a program output); and ``E`` computes element by element (each grid axis splits
``T`` and ``O`` along the same dimension, and every other input along the dimension it
broadcasts to, or not at all). ``P``'s plan is dropped: the planner plans the new
epilogue. Rounding: ``E`` rounded ``T`` to its dtype before adding; the fold adds in
f32 and rounds once, so the fold is never less accurate.

**Verification.** The fold is applied before the layer is verified; the operators it
joins come from two parts, and the caller (:func:`.layer.optimise_layer`) certifies
the joined parts against their joined sub-program. The extended producer is checked
as any parsed custom kernel is (:func:`mirage_cli.check.check_block`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from mirage_cli import ops
from mirage_cli.check import check_block, infer_op, tile_type
from mirage_cli.codegen.directfacts import is_alias
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import (
    AxisMap,
    BlockGraph,
    BlockInput,
    BlockOp,
    BlockOutput,
    Graph,
    KernelOp,
    TensorType,
    Value,
)


@dataclass(frozen=True)
class Fold:
    """``output`` (made by the kernel that read ``stored``) is now stored by the kernel
    that made ``stored``, which no longer stores it."""

    stored: str
    output: str


def fold(g: Graph) -> tuple[Graph, tuple[Fold, ...]]:
    """``g`` with every foldable output folded (module docstring), in kernel order."""
    done: list[Fold] = []
    while (step := _one_fold(g)) is not None:
        g, f = step
        done.append(f)
    return g, tuple(done)


def _one_fold(g: Graph) -> tuple[Graph, Fold] | None:
    producer = {v.name: i for i, op in enumerate(g.ops) for v in op.outputs}
    inputs = {i.value.name for i in g.inputs}
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(g.ops):
        for n in dict.fromkeys(op.inputs):
            readers.setdefault(n, []).append(i)
    types = g.tensor_types()
    for ei, kop in enumerate(g.ops):
        e = _as_custom(kop, types) if kop.block is None else kop
        if e is None or e.block is None or e.block.forloop != 1:
            continue
        for bo in e.block.outputs:
            chain = _chain(e.block, bo)
            if chain is None:
                continue
            ops_, leaves = chain
            made = [bi for bi in leaves if bi.source not in inputs]
            if len(made) != 1:
                continue
            t = made[0]
            pi = producer.get(t.source)
            if pi is None or g.ops[pi].block is None or pi == ei:
                continue
            if (readers.get(t.source) != [ei] or t.source in g.outputs
                    or _other_readers(e.block, t, ops_)):
                continue
            if not _elementwise(e.block, bo, leaves, t, types):
                continue
            if types[t.source].shape != bo.value.type.shape:
                continue
            new_p = _extended(g.ops[pi], t.source, bo, ops_, leaves, t, types)
            if new_p is None:
                continue
            new_e = _without(e, bo)
            out = list(g.ops)
            out[pi] = new_p
            if new_e is None:
                del out[ei]
            else:
                out[ei] = new_e
            return dataclasses.replace(g, ops=tuple(out)), Fold(t.source, bo.value.name)
    return None


def _as_custom(e: KernelOp, types: dict[str, TensorType]) -> KernelOp | None:
    """A pre-defined element-wise operator as the custom kernel of one block that
    computes it (the consumer a fold reads), or None for any other operator."""
    if not ops.get(e.op).elementwise or len(e.outputs) != 1:
        return None
    ins = tuple(BlockInput(Value(f"i{k}", types[n]), n, (None, None, None), None)
                for k, n in enumerate(e.inputs))
    out = e.outputs[0]
    op = BlockOp(e.op, tuple(bi.value.name for bi in ins), (Value("r", out.type),), e.attrs)
    bg = BlockGraph((1, 1, 1), 128, 1, ins, (op,),
                    (BlockOutput(out, "r", (None, None, None)),))
    return dataclasses.replace(e, op="custom", attrs=(), block=bg)


def _chain(bg: BlockGraph, bo: BlockOutput) -> tuple[list[BlockOp], list[BlockInput]] | None:
    """The operators (in block order) and block inputs that ``bo``'s tile is computed
    from, if they are all element-wise operators and identity accumulators."""
    by_out = {v.name: op for op in bg.ops for v in op.outputs}
    by_in = {bi.value.name: bi for bi in bg.inputs}
    need: set[str] = set()
    leaves: dict[str, BlockInput] = {}
    todo = [bo.source]
    while todo:
        n = todo.pop()
        if n in need or n in leaves:
            continue
        if n in by_in:
            leaves[n] = by_in[n]
            continue
        op = by_out[n]
        if not _foldable_op(op, bg):
            return None
        need.add(n)
        todo.extend(op.inputs)
    chain = [op for op in bg.ops if op.outputs[0].name in need]
    return chain, [bi for bi in bg.inputs if bi.value.name in leaves]


def _foldable_op(op: BlockOp, bg: BlockGraph) -> bool:
    """An element-wise operator, or an accumulator that returns its tile over the one
    iteration."""
    if ops.get(op.op).accum is not None:
        return bg.forloop == 1 and is_alias(op)
    return ops.get(op.op).elementwise and len(op.outputs) == 1


def _other_readers(bg: BlockGraph, t: BlockInput, chain: list[BlockOp]) -> bool:
    """Whether ``t``'s tile (or another load of its tensor) feeds anything but
    ``chain``."""
    names = {bi.value.name for bi in bg.inputs if bi.source == t.source}
    inside = {id(op) for op in chain}
    return any(id(op) not in inside and names & set(op.inputs) for op in bg.ops) or \
        any(bo.source in names for bo in bg.outputs)


def _elementwise(bg: BlockGraph, bo: BlockOutput, leaves: list[BlockInput],
                 t: BlockInput, types: dict[str, TensorType]) -> bool:
    """Whether the block graph computes ``bo`` element by element of ``t``'s tensor: a
    grid axis of more than one block splits ``t`` and the output along one dimension,
    and every other leaf along the dimension it broadcasts to that one (or not at
    all, where it is broadcast)."""
    out = bo.value.type
    for a, n in enumerate(bg.grid):
        if n == 1:
            continue
        d = bo.omap[a]
        if d is None or t.imap[a] != d:
            return False
        for bi in leaves:
            if bi is not t and bi.imap[a] != _broadcast_dim(types[bi.source], out, d):
                return False
    return True


def _broadcast_dim(w: TensorType, out: TensorType, d: int) -> int | None:
    """The dimension of ``w`` that numpy broadcasting aligns with dimension ``d`` of
    ``out``, None where ``w`` is broadcast along it (absent or of size 1)."""
    k = d - (out.rank - w.rank)
    return None if k < 0 or w.shape[k] == 1 else k


def _extended(p: KernelOp, stored: str, bo: BlockOutput, chain: list[BlockOp],
              leaves: list[BlockInput], t: BlockInput, types: dict[str, TensorType]
              ) -> KernelOp | None:
    """``p`` computing ``chain`` on the tile it stores as ``stored`` and storing the
    result in ``bo.value`` instead (None where the shapes do not come out)."""
    bg = p.block
    assert bg is not None
    store = next(o for o in bg.outputs if o.value.name == stored)
    taken = set(bg.tile_types()) | {bi.value.name for bi in bg.inputs}
    fresh = _fresh(taken)
    rename: dict[str, str] = {t.value.name: store.source}
    tile_types = bg.tile_types()
    new_inputs: list[BlockInput] = []
    for bi in leaves:
        if bi is t:
            continue
        imap = _imap_of(store.omap, bg.grid, types[bi.source], types[stored])
        try:
            tt = tile_type(types[bi.source], bg.grid, bg.forloop, imap, None, bi.source)
        except MirageError:  # a split that does not divide it
            return None
        name = fresh()
        new_inputs.append(BlockInput(Value(name, tt), bi.source, imap, None))
        rename[bi.value.name] = name
        tile_types[name] = tt
    new_ops: list[BlockOp] = []
    for op in chain:
        ins = tuple(rename[i] for i in op.inputs)
        if ops.get(op.op).accum is not None:  # the one iteration's identity: its input
            rename[op.outputs[0].name] = ins[0]
            continue
        try:
            tt = infer_op(ops.BLOCK, op.op, [tile_types[i] for i in ins], op.attrs)
        except MirageError:  # a shape the producer's tiles do not allow
            return None
        name = fresh()
        tile_types[name] = tt
        rename[op.outputs[0].name] = name
        new_ops.append(BlockOp(op.op, ins, (Value(name, tt),), op.attrs))
    final = rename[bo.source]
    outs = tuple(BlockOutput(bo.value, final, store.omap) if o is store else o
                 for o in bg.outputs)
    new_bg = dataclasses.replace(bg, inputs=bg.inputs + tuple(new_inputs),
                                 ops=bg.ops + tuple(new_ops), outputs=outs)
    try:
        check_block(new_bg, {**types, bo.value.name: bo.value.type})
    except MirageError:
        return None
    extra = tuple(bi.source for bi in new_inputs if bi.source not in p.inputs)
    kouts = tuple(bo.value if v.name == stored else v for v in p.outputs)
    return dataclasses.replace(p, inputs=p.inputs + tuple(dict.fromkeys(extra)),
                               outputs=kouts, block=new_bg, plan=None)


def _imap_of(omap: AxisMap, grid: tuple[int, int, int], w: TensorType, t: TensorType
             ) -> AxisMap:
    """The imap that splits ``w`` (broadcast against ``t``) as ``omap`` splits ``t``."""
    out = [None if n == 1 or d is None else _broadcast_dim(w, t, d)
           for n, d in zip(grid, omap)]
    return (out[0], out[1], out[2])


def _fresh(taken: set[str]) -> Callable[[], str]:
    """A source of tile names not in ``taken`` (which it extends)."""
    counter = itertools.count()

    def name() -> str:
        while True:
            n = f"f{next(counter)}"
            if n not in taken:
                taken.add(n)
                return n
    return name


def _without(e: KernelOp, bo: BlockOutput) -> KernelOp | None:
    """``e`` without output ``bo`` and what only it needed (None: nothing left)."""
    bg = e.block
    assert bg is not None
    outs = tuple(o for o in bg.outputs if o is not bo)
    if not outs:
        return None
    live = {o.source for o in outs}
    kept: list[BlockOp] = []
    for op in reversed(bg.ops):
        if any(v.name in live for v in op.outputs):
            kept.append(op)
            live.update(op.inputs)
    ins = tuple(bi for bi in bg.inputs if bi.value.name in live)
    new_bg = dataclasses.replace(bg, inputs=ins, ops=tuple(reversed(kept)), outputs=outs)
    sources = tuple(dict.fromkeys(bi.source for bi in ins))
    kouts = tuple(v for v in e.outputs if v.name != bo.value.name)
    return dataclasses.replace(e, inputs=sources, outputs=kouts, block=new_bg, plan=None)
