"""Carrying a certificate along a pointwise size parameter (shape reuse, docs/verification.md §10).

A program P and a candidate G certified equivalent at one value of a size parameter d
(``batch``) are equivalent at another when d is *pointwise* in both: every tensor
dimension that depends on d (its *d axis*) is only ever mapped index to index — never
reduced over, never mixed with another dimension or another d index, never the
forloop's dimension — and nothing else about the two graphs changes between the two
sizes. Then every output element at d index i is one formal expression of the inputs'
elements at d index i and of the d-free inputs, the same expression at every size and
every i; equal expressions at the certified size are equal expressions at the new one.

:func:`carry` checks that precondition on the pair of pairs (P and G at the certified
size, P and G at the new size), walking each graph and its resized twin in lockstep:
the same operators, operands, attributes, imaps, fmaps, omaps and forloop range; the
same grid except along the one grid axis that splits the d axis; equal sizes except
along d axes; and every operator's d axis passing its index rule (its registry row's
``index``, :class:`mirage_cli.ops.Index`; an accumulator's follows from its
``AccumSpec``). It answers with a
:class:`Carry` or raises :class:`NotCarried` with the first reason. It is an analysis
of structure only: it never looks at values, so an operator it has no rule for is
not carried (fail closed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, assert_never

from mirage_cli import ops
from mirage_cli.ir import Attrs, AxisMap, BlockGraph, Graph, KernelOp, TensorType, attr
from mirage_cli.ops import Index
from mirage_cli.semantics.accum import Reduce


class NotCarried(Exception):
    """The precondition does not hold; the message says where and why."""


@dataclass(frozen=True)
class Carry:
    """A certificate at ``param = old`` holds at ``param = new``: ``axes`` names the
    program inputs that carry d and their d axis (the others are the same at both
    sizes)."""

    param: str
    old: int
    new: int
    axes: tuple[tuple[str, int], ...]

    def as_json(self) -> dict[str, Any]:
        return {"dimension": self.param, "from": self.old, "to": self.new,
                "axes": {name: ax for name, ax in self.axes}}


Ax = int | None  # a tensor's d axis, or None: it does not depend on d


def carry(prog_old: Graph, cand_old: Graph, prog_new: Graph, cand_new: Graph) -> Carry:
    """The precondition for carrying ``cand_old``'s certificate against ``prog_old``
    to ``cand_new`` against ``prog_new``; raises :class:`NotCarried` when it fails."""
    param, old, new = _param(prog_old, prog_new)
    for g in (cand_old, cand_new):
        if dict(g.params) != dict(prog_old.params if g is cand_old else prog_new.params):
            raise NotCarried("the candidate's sizes are not its program's")
    axes = _input_axes(prog_old, prog_new)
    for p, g in ((prog_old, cand_old), (prog_new, cand_new)):
        if [(i.value.name, i.value.type) for i in p.inputs] != \
                [(i.value.name, i.value.type) for i in g.inputs]:
            raise NotCarried("the candidate's inputs are not its program's")
    out_p = _walk(prog_old, prog_new, axes)
    out_g = _walk(cand_old, cand_new, axes)
    if [out_p[o] for o in prog_new.outputs] != [out_g[o] for o in cand_new.outputs]:
        raise NotCarried("an output's d axis differs between program and candidate")
    return Carry(param, old, new, tuple((n, a) for n, a in axes.items() if a is not None))


def tensor_axes(g: Graph, axes: dict[str, Ax]) -> dict[str, Ax]:
    """Every device tensor's d axis in one graph, given its inputs' (``axes``, by name):
    the walk of the graph with itself, i.e. the index rules alone. Raises
    :class:`NotCarried` where an operator is not pointwise along d. (The slab evaluation
    of :mod:`.slabs` cuts a graph along such an axis.)"""
    return _walk(g, g, axes)


def splitting_axis(bg: BlockGraph, env: dict[str, Ax]) -> int | None:
    """The grid axis of a custom kernel that splits the d axes of its loads (None: no
    grid axis does), given every device tensor's d axis ``env``."""
    return _splitter(bg, env)


def grids_at(prog_small: Graph, prog_new: Graph, cand_new: Graph
             ) -> list[tuple[int, int, int]] | None:
    """Each custom kernel's grid of ``cand_new`` moved to ``prog_small``'s sizes with
    every block's tiles kept: the grid axis that splits the d axis shrinks with it
    (16 blocks of one row at 2 x batch = 32 rows are 2 blocks at batch 1). None where
    the inputs' d axes do not all shrink by one ratio, a split grid does not scale to a
    whole number of blocks, or d is not pointwise in ``cand_new``. Only a proposal:
    :func:`carry` decides whether a certificate at ``prog_small`` carries."""
    try:
        axes = _input_axes(prog_small, prog_new)
        env = tensor_axes(cand_new, axes)
    except NotCarried:
        return None
    small, new = prog_small.tensor_types(), prog_new.tensor_types()
    ratios = {(small[n].shape[a], new[n].shape[a]) for n, a in axes.items() if a is not None}
    if len(ratios) != 1:
        return None
    (num, den), = ratios
    grids: list[tuple[int, int, int]] = []
    for op in cand_new.ops:
        if op.block is None:
            continue
        grid = list(op.block.grid)
        try:
            ax = splitting_axis(op.block, env)
        except NotCarried:
            return None
        if ax is not None:
            if grid[ax] * num % den:
                return None
            grid[ax] = grid[ax] * num // den
        grids.append((grid[0], grid[1], grid[2]))
    return grids


def why_not(prog_old: Graph, cand_old: Graph, prog_new: Graph, cand_new: Graph
            ) -> str | None:
    """The reason :func:`carry` refuses, or None when it carries."""
    try:
        carry(prog_old, cand_old, prog_new, cand_new)
    except NotCarried as e:
        return str(e)
    return None


def _param(old: Graph, new: Graph) -> tuple[str, int, int]:
    """The one size parameter whose value differs."""
    a, b = dict(old.params), dict(new.params)
    if set(a) != set(b):
        raise NotCarried("the two programs have different parameters")
    diff = [k for k in sorted(a) if a[k] != b[k]]
    if len(diff) != 1:
        raise NotCarried(f"{len(diff)} size parameters differ (one is carried)")
    return diff[0], a[diff[0]], b[diff[0]]


def _input_axes(old: Graph, new: Graph) -> dict[str, Ax]:
    """Each program input's d axis: the dimension whose size differs (at most one)."""
    axes: dict[str, Ax] = {}
    if [i.value.name for i in old.inputs] != [i.value.name for i in new.inputs]:
        raise NotCarried("the two programs have different inputs")
    for i, j in zip(old.inputs, new.inputs):
        s, t = i.value.type, j.value.type
        if s.rank != t.rank or s.dtype != t.dtype:
            raise NotCarried(f"input '{i.value.name}' changes rank or type")
        diff = [k for k in range(s.rank) if s.shape[k] != t.shape[k]]
        if len(diff) > 1:
            raise NotCarried(f"input '{i.value.name}' has {len(diff)} dimensions that "
                             f"depend on the parameter")
        axes[i.value.name] = diff[0] if diff else None
    return axes


def _same_sizes(what: str, s: TensorType, t: TensorType, ax: Ax) -> None:
    """Old and new type of one tensor: equal but for the size of its d axis."""
    if s.rank != t.rank or s.dtype != t.dtype or \
            any(s.shape[k] != t.shape[k] for k in range(s.rank) if k != ax):
        raise NotCarried(f"{what} changes a dimension other than its d axis "
                         f"({s} -> {t})")


# -- kernel level ---------------------------------------------------------------------


def _walk(old: Graph, new: Graph, axes: dict[str, Ax]) -> dict[str, Ax]:
    """Every device tensor's d axis, walking the two sizes of one graph in lockstep."""
    env = dict(axes)
    to, tn = old.tensor_types(), new.tensor_types()
    if len(old.ops) != len(new.ops) or old.outputs != new.outputs:
        raise NotCarried("the graph is not the same at both sizes")
    for a, b in zip(old.ops, new.ops):
        _same_op(a, b)
        if a.block is not None and b.block is not None:
            env.update(_block(a.block, b.block, env, to, tn))
            continue
        got = [_rule(a.op, a.attrs, [env[i] for i in a.inputs], [to[i].shape for i in a.inputs],
                     to[a.outputs[0].name].shape),
               _rule(b.op, b.attrs, [env[i] for i in b.inputs], [tn[i].shape for i in b.inputs],
                     tn[b.outputs[0].name].shape)]
        if got[0] != got[1]:
            raise NotCarried(f"'{a.op}' maps the d axis differently at the two sizes")
        env[a.outputs[0].name] = got[0]
    for name, ax in env.items():
        _same_sizes(f"tensor '{name}'", to[name], tn[name], ax)
    return env


def _same_op(a: KernelOp, b: KernelOp) -> None:
    if (a.op, a.inputs, [v.name for v in a.outputs]) != \
            (b.op, b.inputs, [v.name for v in b.outputs]) or (a.block is None) != (b.block is None):
        raise NotCarried(f"operator '{a.op}' differs between the two sizes")
    # A reshape's attributes are its result's shape, compared as the result's type.
    if a.op != "reshape" and a.attrs != b.attrs:
        raise NotCarried(f"operator '{a.op}' has other attributes at the other size")


# -- index rules ----------------------------------------------------------------------


Shape = tuple[int, ...]


def _rule(name: str, attrs: Attrs, axes: Sequence[Ax], shapes: Sequence[Shape],
          out: Shape) -> Ax:
    """The d axis of an operator's result, or NotCarried where it is not pointwise."""
    if all(a is None for a in axes):
        return None  # nothing here depends on d
    opdef = ops.get(name)
    if opdef.accum is not None:
        return _accum(name, opdef.accum.reduce, axes[0], shapes[0])
    kind = opdef.index  # the registry's index rule (element-wise: pointwise)
    if kind is None:
        raise NotCarried(f"operator '{name}' has no index rule")
    match kind:
        case Index.POINTWISE:
            return _broadcast(name, axes, shapes)
        case Index.REDUCE_DIM:
            return _reduce(name, attrs, axes[0])
        case Index.MIX_DIM:
            return _not_along(name, axes[0], int(attr(attrs, "dim", -1)))  # type: ignore[arg-type]
        case Index.MIX_LAST:
            p = _broadcast(name, axes, shapes)
            return _not_along(name, p, len(out) - 1)
        case Index.MATMUL:
            return _matmul(axes, shapes)
        case Index.CONCAT:
            return _concat(attrs, axes)
        case Index.RESHAPE:
            return _reshape(axes[0], shapes[0], out)
        case other:
            assert_never(other)


def _not_along(name: str, ax: Ax, dim: int) -> Ax:
    if ax == dim:
        raise NotCarried(f"'{name}' mixes along the d axis")
    return ax


def _accum(name: str, reduce: Reduce, ax: Ax, shape: Shape) -> Ax:
    match reduce:
        case Reduce.NONE:
            return ax
        case Reduce.LAST | Reduce.TO_WIDTH:
            return _not_along(name, ax, len(shape) - 1)
        case other:
            assert_never(other)


def _broadcast(name: str, axes: Sequence[Ax], shapes: Sequence[Shape]) -> Ax:
    """numpy broadcasting: the operands that carry d carry it at one aligned position
    with equal sizes; every other operand is 1 there (broadcast along d, never the
    other way round)."""
    rank = max(len(s) for s in shapes)
    pos = {rank - len(s) + a for a, s in zip(axes, shapes) if a is not None}
    if len(pos) != 1:
        raise NotCarried(f"'{name}' aligns d axes with other dimensions")
    p = pos.pop()
    sizes = {s[a] for a, s in zip(axes, shapes) if a is not None}
    if len(sizes) != 1:
        raise NotCarried(f"'{name}' broadcasts one d index over several")
    for a, s in zip(axes, shapes):
        k = p - (rank - len(s))
        if a is None and k >= 0 and s[k] != 1:
            raise NotCarried(f"'{name}' pairs the d axis with a dimension of an operand "
                             f"that does not depend on d")
    return p


def _reduce(name: str, attrs: Attrs, ax: Ax) -> Ax:
    dim = attr(attrs, "dim")
    assert isinstance(dim, int) and ax is not None
    if dim == ax:
        raise NotCarried(f"'{name}' reduces over the d axis")
    return ax if attr(attrs, "keepdim", False) or dim > ax else ax - 1


def _matmul(axes: Sequence[Ax], shapes: Sequence[Shape]) -> Ax:
    """Rows of A and columns of B are pointwise, batch dims broadcast, k is reduced;
    d on both a row and a column would pair two d indices."""
    (a, b), (sa, sb) = axes, shapes
    rank = max(len(sa), len(sb))
    if a == len(sa) - 1 or b == len(sb) - 2:
        raise NotCarried("matmul reduces over the d axis")
    if a == len(sa) - 2 and b is not None or b == len(sb) - 1 and a is not None:
        raise NotCarried("matmul pairs the d axis of one operand with another dimension")
    if a == len(sa) - 2:
        return rank - 2
    if b == len(sb) - 1:
        return rank - 1
    return _broadcast("matmul", axes, [sa[:-2], sb[:-2]])


def _concat(attrs: Attrs, axes: Sequence[Ax]) -> Ax:
    if axes[0] != axes[1]:
        raise NotCarried("concat joins a tensor that depends on d with one that does not")
    return _not_along("concat", axes[0], int(attr(attrs, "dim", -1)))  # type: ignore[arg-type]


def _reshape(ax: Ax, shape: Shape, out: Shape) -> Ax:
    """Pointwise only when every dimension up to and including the d axis is kept."""
    assert ax is not None
    if out[:ax + 1] != shape[:ax + 1]:
        raise NotCarried("reshape mixes the d axis with other dimensions")
    return ax


# -- block level ----------------------------------------------------------------------

Tile = tuple[Ax, int | None]  # (d axis of the tile, the grid axis that splits it)


def _block(old: BlockGraph, new: BlockGraph, env: dict[str, Ax],
           to: dict[str, TensorType], tn: dict[str, TensorType]) -> dict[str, Ax]:
    """The d axes of a custom kernel's outputs. Every block runs one block graph; the
    one grid axis that splits d (if any) gives each block a run of d indices, and the
    block graph must map them pointwise to the same run of its outputs."""
    if old.forloop != new.forloop or \
            (len(old.inputs), len(old.ops), len(old.outputs)) != \
            (len(new.inputs), len(new.ops), len(new.outputs)):
        raise NotCarried("a custom kernel differs between the two sizes")
    split = _splitter(old, env)
    for g in range(3):
        if g != split and old.grid[g] != new.grid[g]:
            raise NotCarried("a custom kernel's grid changes along a dimension other than d")
    tiles = _loads(old, new, env, split)
    _block_ops(old, new, tiles)
    out: dict[str, Ax] = {}
    for so, sn in zip(old.outputs, new.outputs):
        if (so.source, so.value.name, so.omap) != (sn.source, sn.value.name, sn.omap):
            raise NotCarried("a custom kernel stores differently at the two sizes")
        out[so.value.name] = _store(tiles[so.source], so.omap, split)
    return out


TileTypes = dict[str, tuple[Tile, TensorType, TensorType]]  # tile, old and new type


def _loads(old: BlockGraph, new: BlockGraph, env: dict[str, Ax], split: int | None
           ) -> TileTypes:
    tiles: TileTypes = {}
    for a, b in zip(old.inputs, new.inputs):
        if (a.source, a.imap, a.fmap, a.value.name) != (b.source, b.imap, b.fmap, b.value.name):
            raise NotCarried("a custom kernel loads differently at the two sizes")
        tile = _load(env[a.source], a.imap, a.fmap, split)
        _same_sizes(f"tile '{a.value.name}'", a.value.type, b.value.type, tile[0])
        tiles[a.value.name] = (tile, a.value.type, b.value.type)
    return tiles


def _block_ops(old: BlockGraph, new: BlockGraph, tiles: TileTypes) -> None:
    for a, b in zip(old.ops, new.ops):
        if (a.op, a.inputs, a.attrs, [v.name for v in a.outputs]) != \
                (b.op, b.inputs, b.attrs, [v.name for v in b.outputs]):
            raise NotCarried(f"block operator '{a.op}' differs between the two sizes")
        ins = [tiles[i] for i in a.inputs]
        tile = _block_op(a.op, a.attrs, [t for t, _, _ in ins],
                         [[x.shape for _, x, _ in ins], [y.shape for _, _, y in ins]],
                         [a.outputs[0].type.shape, b.outputs[0].type.shape])
        _same_sizes(f"tile '{a.outputs[0].name}'", a.outputs[0].type, b.outputs[0].type,
                    tile[0])
        tiles[a.outputs[0].name] = (tile, a.outputs[0].type, b.outputs[0].type)


def _splitter(bg: BlockGraph, env: dict[str, Ax]) -> int | None:
    """The grid axis that splits d axes (at most one), from the loads' imaps."""
    axes = {g for bi in bg.inputs for g in range(3)
            if env[bi.source] is not None and bi.imap[g] == env[bi.source]}
    if len(axes) > 1:
        raise NotCarried("more than one grid axis splits the d axis")
    return axes.pop() if axes else None


def _load(ax: Ax, imap: AxisMap, fmap: int | None, split: int | None) -> Tile:
    if ax is None:
        if split is not None and imap[split] is not None:
            raise NotCarried("the grid axis that splits d also splits a tensor that does "
                             "not depend on d")
        return None, None
    if fmap == ax:
        raise NotCarried("the forloop iterates over the d axis")
    for g in range(3):
        if imap[g] == ax and g != split or g == split and imap[g] not in (ax, None):
            raise NotCarried("a grid axis splits the d axis of one input and another "
                             "dimension of another")
    return ax, split if split is not None and imap[split] == ax else None


def _block_op(name: str, attrs: Attrs, ins: Sequence[Tile], shapes: Sequence[list[Shape]],
              outs: Sequence[Shape]) -> Tile:
    """A block operator on tiles: the kernel rule at both sizes, and every operand that
    carries d split by the same grid axis (the same run of d indices)."""
    splits = {s for a, s in ins if a is not None}
    if len(splits) > 1:
        raise NotCarried(f"'{name}' combines tiles holding different runs of d indices")
    axes = [a for a, _ in ins]
    got = {_rule(name, attrs, axes, shapes[k], outs[k]) for k in (0, 1)}
    if len(got) != 1:
        raise NotCarried(f"'{name}' maps the d axis differently at the two sizes")
    ax = got.pop()
    return ax, (splits.pop() if splits else None) if ax is not None else None


def _store(entry: tuple[Tile, TensorType, TensorType], omap: AxisMap, split: int | None) -> Ax:
    """A stored tile's d axis is its output's, and the blocks along the splitting grid
    axis must concatenate along it (the block that read d indices i..j writes them)."""
    ax, by = entry[0]
    if ax is None:
        if split is not None and omap[split] is not None:
            raise NotCarried("blocks along the grid axis that splits d store a result "
                             "that does not depend on d")
        return None
    if by != split or (split is not None and omap[split] != ax) or \
            any(omap[g] == ax for g in range(3) if g != split):
        raise NotCarried("a result's d axis is not stored by the grid axis that split it")
    return ax
