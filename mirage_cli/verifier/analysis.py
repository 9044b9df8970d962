"""Static facts of a µGraph that the probability bound needs.

Walks the graph once (both levels) with each operator's ``FieldSem.stat`` rule and
records: the degree (numerator, denominator) of every output as a rational function
of the inputs and random atoms; for every random function, how many keys it is
applied to per trial, their degree and whether they carry a Z_Q residue; how many
field inversions a trial performs and of what degree (the zero-divisor risk); and the
operators used (for the certificate). Element counts of block tensors count every
block and every forloop iteration.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from mirage_cli import ops
from mirage_cli.check import block_phases
from mirage_cli.ir import BlockGraph, Graph, TensorType
from mirage_cli.semantics.degrees import ITER, Stat, spread
from mirage_cli.semantics.fieldsem import FieldSem


@dataclass
class RandomUse:
    """One random function's use in a graph, per trial."""

    keys: int = 0
    key_degree: int = 1
    p_only: bool = False
    # Keys are 64-bit fingerprints of multisets (max): they can also collide as hashes.
    multiset: bool = False


@dataclass
class Profile:
    """What the bound needs to know about one graph."""

    outputs: list[Stat]
    random: dict[str, RandomUse] = field(default_factory=dict)
    inversions: int = 0          # sum over inversion sites of elements x degree
    operators: set[str] = field(default_factory=set)


def _sem(name: str) -> FieldSem:
    s = ops.get(name).field
    assert isinstance(s, FieldSem)
    return s


def profile(g: Graph) -> Profile:
    stats: dict[str, Stat] = {i.value.name: Stat(1, 0) for i in g.inputs}
    types = g.tensor_types()
    prof = Profile([])
    for op in g.ops:
        prof.operators.add(op.op)
        if op.block is not None:
            for v, s in zip(op.outputs, _block(op.block, stats, prof)):
                stats[v.name] = s
            continue
        ins = [types[i] for i in op.inputs]
        stats[op.outputs[0].name] = _apply(op.op, [stats[i] for i in op.inputs], ins,
                                           op.outputs[0].type, op.attrs, 1, 1, prof)
    prof.outputs = [stats[o] for o in g.outputs]
    return prof


def _apply(name: str, args: list[Stat], in_types: list[TensorType], out: TensorType,
           attrs: tuple, forloop: int, copies: int, prof: Profile) -> Stat:
    """One operator application, repeated ``copies`` times (blocks x iterations)."""
    s = _sem(name)
    opdef = ops.get(name)
    values = opdef.attr_values(attrs)
    result = s.stat(args, [t.shape for t in in_types], values, forloop)
    prof.operators.add(name)
    if s.random_fn is not None:
        use = prof.random.setdefault(s.random_fn, RandomUse())
        n = {"in": prod(in_types[0].shape), "out": prod(out.shape),
             "rows": prod(in_types[0].shape[:-1])}[s.keys_from]
        if opdef.accum is not None and s.keys_from == "in":
            n *= forloop
        use.keys += n * copies
        key = s.key_stat(args, [t.shape for t in in_types], values, forloop) \
            if s.key_stat is not None else args[0]
        # Two different keys N1/D1, N2/D2 collide iff N1 D2 - N2 D1 vanishes.
        use.key_degree = max(use.key_degree, key.num + key.den)
        use.p_only = use.p_only or any(a.p_only for a in args)
        use.multiset = use.multiset or s.keys_from == "in"
    if s.inverts is not None:
        count, degree = s.inverts(args, [t.shape for t in in_types])
        prof.inversions += count * copies * degree
    return result


def _block(bg: BlockGraph, kstats: dict[str, Stat], prof: Profile) -> list[Stat]:
    phases = block_phases(bg)
    stats: dict[str, Stat] = {bi.value.name: _load(kstats[bi.source], bi.fmap,
                                                    bi.value.type.rank) for bi in bg.inputs}
    types: dict[str, TensorType] = {bi.value.name: bi.value.type for bi in bg.inputs}
    # Grid axes a block tensor depends on: blocks that agree on those compute the same
    # formal values, so their random-function keys are not distinct.
    deps: dict[str, frozenset[int]] = {
        bi.value.name: frozenset(a for a in range(3) if bi.imap[a] is not None)
        for bi in bg.inputs}
    for op in bg.ops:
        out = op.outputs[0]
        deps[out.name] = frozenset().union(*(deps[i] for i in op.inputs))
        copies = prod(bg.grid[a] for a in deps[out.name]) * (
            bg.forloop if phases[out.name] == "loop" else 1)
        stats[out.name] = _apply(op.op, [stats[i] for i in op.inputs],
                                 [types[i] for i in op.inputs], out.type, op.attrs,
                                 bg.forloop, copies, prof)
        types[out.name] = out.type
    return [_store(stats[bo.source], bo.omap, bg.grid, bo.value.type.shape)
            for bo in bg.outputs]


def _load(s: Stat, fmap: int | None, rank: int) -> Stat:
    """A tile's denominator varies across iterations if the forloop splits an axis
    along which the device tensor's denominator varies."""
    if fmap is not None and fmap - rank in s.den_var:
        return s.with_axes(s.den_var | {ITER})
    return s


def _store(s: Stat, omap: tuple, grid: tuple[int, int, int], shape: tuple[int, ...]) -> Stat:
    """Blocks' tiles concatenated: the denominator may differ from block to block."""
    axes = set(s.den_var) - {ITER}
    axes |= {d - len(shape) for d, g in zip(omap, grid) if d is not None and g > 1}
    return s.with_axes(frozenset(axes) & spread(shape))
