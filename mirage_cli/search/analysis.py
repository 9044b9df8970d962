"""Abstract evaluation of whole µGraphs: expression and index labels of every tensor.

For the target program this also *discovers the indices*: each input dimension starts
with its own label and operators identify labels (a matmul's contracted dimensions, the
matching dimensions of an element-wise operator); a union-find merges them. The search
then splits a grid axis or the forloop along an index, which fixes every input's imap
and fmap at once (the way Mirage's published µGraphs split X, W1 and W2 alike).
Custom kernels are evaluated tile by tile with the forloop range passed to
accumulators, so a hand-written or found µGraph gets the expressions Mirage would give
it.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_cli import ops
from mirage_cli.ir import BlockGraph, Graph
from mirage_cli.search.abstract import FORLOOP_KEY, UNIT, AVal, Labels, apply, inp


class UnionFind:
    """Union-find over integer labels (``UNIT`` is never merged)."""

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}

    def find(self, x: int) -> int:
        if x == UNIT:
            return x
        root = x
        while self.parent.get(root, root) != root:
            root = self.parent[root]
        self.parent[x] = root
        return root

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb and UNIT not in (ra, rb):
            self.parent[max(ra, rb)] = min(ra, rb)


@dataclass(frozen=True)
class Analysis:
    """Every device tensor's abstract value (labels resolved), and each label's size."""

    values: dict[str, AVal]
    outputs: tuple[AVal, ...]
    label_sizes: dict[int, int]


def analyze(g: Graph) -> Analysis:
    """Abstract values of every device tensor of ``g``."""
    uf = UnionFind()
    env: dict[str, AVal] = {}
    counter = 0
    for i in g.inputs:
        t = i.value.type
        env[i.value.name] = AVal(inp(i.value.name), t, tuple(range(counter, counter + t.rank)))
        counter += t.rank
    for op in g.ops:
        if op.block is not None:
            for v, av in zip(op.outputs, eval_block(op.block, env, uf)):
                env[v.name] = AVal(av.term, v.type, av.labels)
            continue
        opdef = ops.get(op.op)
        av, unions = apply(op.op, [env[n] for n in op.inputs], opdef.attr_values(op.attrs))
        for a, b in unions:
            uf.union(a, b)
        env[op.outputs[0].name] = av
    resolved = {n: AVal(v.term, v.type, tuple(uf.find(x) for x in v.labels))
                for n, v in env.items()}
    sizes: dict[int, int] = {}
    for rv in resolved.values():
        for lab, n in zip(rv.labels, rv.type.shape):
            if lab != UNIT:
                sizes[lab] = max(sizes.get(lab, 1), n)
    return Analysis(resolved, tuple(resolved[n] for n in g.outputs), sizes)


def eval_block(bg: BlockGraph, env: dict[str, AVal], uf: UnionFind | None = None
               ) -> list[AVal]:
    """Abstract values of a custom kernel's stored tensors (tile labels kept)."""
    from mirage_cli.check import tile_type

    tiles: dict[str, AVal] = {}
    for bi in bg.inputs:
        src = env[bi.source]
        t = tile_type(src.type, bg.grid, bg.forloop, bi.imap, bi.fmap)
        tiles[bi.value.name] = AVal(src.term, t, src.labels)
    for op in bg.ops:
        opdef = ops.get(op.op)
        attrs = dict(opdef.attr_values(op.attrs))
        if opdef.is_accumulator:
            attrs[FORLOOP_KEY] = bg.forloop
        av, unions = apply(op.op, [tiles[n] for n in op.inputs], attrs)
        if uf is not None:
            for a, b in unions:
                uf.union(a, b)
        tiles[op.outputs[0].name] = av
    return [tiles[bo.source] for bo in bg.outputs]


def relabel(labels: Labels, uf: UnionFind) -> Labels:
    return tuple(uf.find(x) for x in labels)
