"""Statistics of the columns of a matmul chain's B1, folded from its B fragments.

A chain kernel (:mod:`chain`) may compute, besides the chain, reductions over the K
dimension of its first matmul's B operand that its links read: qknorm's key norms,
``sqrt(mean(K * K))`` over the head dimension, one per score column. :func:`column_stats`
recognises them (:class:`ColumnStats`); where the layout has few warp groups
(:func:`in_fragments`) each warp folds them from the B fragments its first matmul loads
(:func:`init`, :func:`fold`, :func:`finish`) and the links read them from registers
(:func:`bind`); otherwise they are ordinary shared-memory tiles computed by all warps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mirage_cli import ops
from mirage_cli.codegen.blockfacts import Analysis, reduced_dim
from mirage_cli.codegen.expr import Lines, Local, Node, indent, unrolled
from mirage_cli.codegen.reduce import row_combine
from mirage_cli.ir import BlockOp, DType
from mirage_cli.semantics.cuda import c_init, c_update, c_warp

if TYPE_CHECKING:
    from mirage_cli.codegen.chainfacts import Chain
    from mirage_cli.codegen.chainplan import ChainLayout
    from mirage_cli.codegen.kernel import FusedKernel


# -- which tensors ---------------------------------------------------------------------


@dataclass(frozen=True)
class ColumnStats:
    """Reductions over the K dimension of the first matmul's B operand ``B1`` ([d, n]:
    one value per column, e.g. qknorm's key norms ``sqrt(mean(K * K, dim=d))``) that
    the links read, and every other tensor the loop computes besides the chain.

    Each warp computes them from the B fragments its first matmul loads anyway: a lane
    holds 4 elements of column ``lane / 4`` of each n8 tile per K step, so it folds
    ``pre`` of them into a partial, the column's 4 lanes combine by two shuffles, the
    ``post`` operators apply once per column, and each value a link reads is gathered
    (one shuffle per fragment column) to the lanes whose score fragments hold that
    column. No shared-memory tile and no barrier, but every warp group folds the same
    columns again: so with few groups only (:func:`in_fragments`); otherwise all warps
    compute them once into shared memory, before the chain's first matmul."""

    pre: tuple[BlockOp, ...]       # element-wise functions of B1 alone the reductions read
    reduces: tuple[BlockOp, ...]   # over B1's K dimension, keepdim: [.., 1, n]
    post: tuple[BlockOp, ...]      # element-wise functions of the per-column values
    read: tuple[str, ...]          # the per-column values links read


def column_stats(a: Analysis, ch: Chain) -> ColumnStats | None:
    """The loop's side tensors as :class:`ColumnStats`, or None if any is not one."""
    b1 = ch.first.inputs[1]
    shape = a.types[b1].shape
    kdim = len(shape) - 2
    col_shape = shape[:kdim] + (1,) + shape[-1:]
    inside = ch.members | {op.outputs[0].name for op in (ch.acc, *ch.row_accs)}
    side = [op for op in a.bg.ops if a.phases.get(op.outputs[0].name) == "loop"
            and op.outputs[0].name not in inside]
    of_b, cols = {b1}, set()
    pre, reduces, post = [], [], []
    for op in side:
        name, out = op.outputs[0].name, op.outputs[0].type.shape
        spec = ops.get(op.op)
        if spec.is_accumulator:
            return None
        red = reduced_dim(op, a.types)
        if spec.cuda.kind == "elementwise" and set(op.inputs) <= of_b and out == shape:
            pre.append(op)
            of_b.add(name)
        elif (spec.cuda.kind == "reduce" and op.inputs[0] in of_b and red is not None
              and red[0] == kdim and out == col_shape):
            reduces.append(op)
            cols.add(name)
        elif spec.cuda.kind == "elementwise" and set(op.inputs) <= cols and out == col_shape:
            post.append(op)
            cols.add(name)
        else:
            return None
    if not reduces:
        return None
    derived = {op.outputs[0].name for op in (*pre, *reduces, *post)}
    links = {op.outputs[0].name for op in ch.links}
    for name in derived:
        readers = {u.outputs[0].name if u is not None else None for u in a.uses[name]}
        if not readers <= derived | links:
            return None
    read = tuple(n for n in (op.outputs[0].name for op in (*reduces, *post))
                 if any(u is not None and u.outputs[0].name in links for u in a.uses[n]))
    return ColumnStats(tuple(pre), tuple(reduces), tuple(post), read)


# -- in fragments or in shared memory --------------------------------------------------


# Warp groups up to which each computes the statistics of B1's columns from its own B
# fragments rather than all warps once, through shared memory. Every warp group folds
# the same columns: on an H100 (docs/perf-log.md v26) qknorm_gqa with 2 groups ran
# 15.27 -> 13.97 us (64 query rows, 8192 keys, batch 2), with 4 the same (21.53 ->
# 21.77, head dim 128), with 8 slower (35.21 -> 38.55 at batch 8, 57.00 -> 63.35 at 16).
FRAGMENT_STATS_GROUPS = 2


def in_fragments(ch: Chain, lay: ChainLayout) -> bool:
    """Whether the chain computes its column statistics from its B fragments."""
    return ch.cols is not None and lay.groups <= FRAGMENT_STATS_GROUPS


def values(ch: Chain, lay: ChainLayout) -> frozenset[str]:
    """The per-column values a chain computes from its B fragments (none where the
    layout has more warp groups)."""
    if ch.cols is None or not in_fragments(ch, lay):
        return frozenset()
    return frozenset(op.outputs[0].name for op in (*ch.cols.reduces, *ch.cols.post))


# -- emission --------------------------------------------------------------------------


def init(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """Each reduction's partial for column ``mg_g`` of each of this warp's n8 tiles."""
    if ch.cols is None or not k.frag_stats:
        return []
    lines: Lines = []
    for op in ch.cols.reduces:
        name, comb = op.outputs[0].name, row_combine(op, 1)[0]
        lines += [f"float mg_cs_{name}[{lay.score_tiles}];"]
        lines += unrolled("j", lay.score_tiles, [f"mg_cs_{name}[j] = {c_init(comb)};"])
    return lines


def fold(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """At one K step: the 4 elements of B1 this lane holds per n8 tile (column
    ``mg_g``, 2 registers of two 16-bit elements), through ``pre``, into the partials."""
    if ch.cols is None or not k.frag_stats:
        return []
    b = ch.first.inputs[1]
    shape = k.a.types[b].shape
    unpack = "mg_unpack_f16" if k.a.types[b].dtype is DType.F16 else "mg_unpack_bf16"
    saved = k.em.nodes[b]
    lines: Lines = []
    for j in range(lay.score_tiles):
        body = ["float mg_u[4];", f"{unpack}(rb{j}_0, mg_u[0], mg_u[1]);",
                f"{unpack}(rb{j}_1, mg_u[2], mg_u[3]);"]
        for u in range(4):
            k.em.nodes[b] = Node(shape, Local(f"mg_u[{u}]"))
            for op in ch.cols.reduces:
                st, v = k.em.value(op.inputs[0], ["0"] * len(shape))
                comb = row_combine(op, 1)[0]
                body += st + [c_update(f"mg_cs_{op.outputs[0].name}[{j}]", v, comb)]
        lines += ["{"] + indent(body) + ["}"]
    k.em.nodes[b] = saved
    return lines


def finish(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """The partials combined over each column's 4 lanes, finished, the ``post``
    operators applied, and every value a link reads gathered into ``mg_cg_{name}_{j}_{e}``:
    column ``2 * mg_t + e`` of n8 tile ``j``, the columns of this lane's score elements
    (a divisor stored as its reciprocal, blockfacts.stored_inverse)."""
    if ch.cols is None or not k.frag_stats:
        return []
    b = ch.first.inputs[1]
    d = k.a.types[b].shape[-2]
    lines: Lines = []
    for op in ch.cols.reduces:
        name = op.outputs[0].name
        comb, fin = row_combine(op, d)
        lines += unrolled("j", lay.score_tiles, [
            f"mg_cs_{name}[j] = {c_warp(comb, f'mg_cs_{name}[j]', 4)};",
            f"mg_cs_{name}[j] = {fin.format(f'mg_cs_{name}[j]')};"])
    idx = ["0"] * len(k.a.types[b].shape)
    for j in range(lay.score_tiles):
        for op in ch.cols.reduces:
            name = op.outputs[0].name
            k.em.nodes[name] = Node(op.outputs[0].type.shape, Local(f"mg_cs_{name}[{j}]"))
        for op in ch.cols.post:
            name = op.outputs[0].name
            st, e = k.em.apply(op, idx)
            lines += st + [f"const float mg_c_{name}_{j} = {e};"]
            k.em.nodes[name] = Node(op.outputs[0].type.shape, Local(f"mg_c_{name}_{j}"))
        for name in ch.cols.read:
            st, v = k.em.value(name, idx)
            lines += st + [f"const float mg_cv_{name}_{j} = {k.em.as_stored(name, v)};"]
            lines += [f"const float mg_cg_{name}_{j}_{e} = __shfl_sync(0xffffffffu, "
                      f"mg_cv_{name}_{j}, (2 * mg_t + {e}) * 4);" for e in (0, 1)]
    return lines


def bind(k: FusedKernel, ch: Chain, j: int, i: int) -> None:
    """The values links read, at element ``i`` of score fragment ``j``, as the
    registers :func:`finish` gathered them into."""
    for name in ch.cols.read if ch.cols is not None and k.frag_stats else ():
        k.em.nodes[name] = Node(k.a.types[name].shape, Local(f"mg_cg_{name}_{j}_{i & 1}"))
