"""The matmul chains of a block graph, the attention family: two block matmuls joined
through element-wise operators (:class:`Chain`, found by :func:`chain_form`), whose
score tile :mod:`chain` keeps in mma fragments, and the running maximum a loop may
carry through them (:class:`Online`). Facts of the block graph alone, like
:mod:`blockfacts`: no knob or target; :mod:`chainplan` lays a chain out over warps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mirage_cli import ops
from mirage_cli.check import online_reads
from mirage_cli.codegen.blockfacts import Analysis, direct_acc, is_mma, packed
from mirage_cli.codegen.expr import numel
from mirage_cli.ir import BlockOp

if TYPE_CHECKING:
    from mirage_cli.codegen.colstats import ColumnStats


@dataclass(frozen=True)
class Chain:
    """Two block matmuls joined through element-wise operators, the attention family:
    ``first = matmul(A, B1)`` ([R, d] @ [d, n]); element-wise operators on [R, n]
    tiles (``links``, in block order) derive ``p``; ``second = matmul(p, B2)``
    ([R, n] @ [n, e]) feeds the plain sum ``acc``; ``row_accs`` accumulate link values
    along their rows. The first matmul's result and the links live in the registers of
    mma fragments: the accumulator fragments of the first become, packed to 16 bits,
    the A fragments of the second."""

    first: BlockOp
    links: tuple[BlockOp, ...]
    second: BlockOp
    acc: BlockOp
    row_accs: tuple[BlockOp, ...]
    online: Online | None = None  # the running maximum the loop reads, if any
    cols: ColumnStats | None = None  # statistics of B1's columns (chainplan.chain_of)

    @property
    def members(self) -> frozenset[str]:
        """The tensors that live in fragments (first, links, second)."""
        return frozenset(op.outputs[0].name for op in (self.first, *self.links, self.second))


def chain_form(a: Analysis) -> Chain | str:
    """The block graph's matmul chain, or the first reason it has none."""
    bg = a.bg
    mms = [op for op in bg.ops if is_mma(op, bg.threads)]
    if len(mms) != 2:
        return "not exactly two tensor-core matmuls"
    first, second = mms
    if any(a.phases[m.outputs[0].name] != "loop" for m in mms):
        return "a matmul is not computed in the forloop"
    loaded = {bi.value.name for bi in bg.inputs}
    for operand in (first.inputs[0], first.inputs[1], second.inputs[1]):
        if operand not in loaded and not (operand == first.inputs[0] and packed(operand, a)):
            return f"matmul operand {operand} is computed, not loaded"
    ta, tb1, tb2 = (a.types[n] for n in (first.inputs[0], first.inputs[1], second.inputs[1]))
    score = first.outputs[0].type.shape
    lead = score[:-2]
    # One batch dimension, or several of which at most one is not 1 (a 4-D attention's
    # (batch, KV head) tile of one head): a warp's matrix is then one index.
    if sum(d > 1 for d in lead) > 1 or any(t.shape[:-2] != lead and numel(t.shape[:-2]) != 1
                            for t in (ta, tb1, tb2)):
        return "the matmul tiles' batch dimensions are not one shared (or broadcast) one"
    R, n = score[-2:]
    # Fewer than 16 rows (a decode GQA's 4 or 7 query heads per KV head) fill one
    # 16-row tile: A's missing rows are read as zeros, and nothing of them is stored.
    short = R < 16 and first.inputs[0] in loaded
    if (R % 16 and not short) or ta.shape[-1] % 16 or n % 16 or tb2.shape[-1] % 8:
        return "tile sizes are not multiples of the mma shape"
    if len({ta.dtype, tb1.dtype, tb2.dtype, second.outputs[0].type.dtype}) != 1:
        return "operands of different dtypes"
    links, members = _links(a, first, second)
    if links is None:
        return "the second matmul's A operand is not an element-wise function of the first's result"
    acc = direct_acc(second, a)
    if acc is None:
        return "the second matmul's result does not feed a plain sum accumulator"
    row_accs = []
    for name in members:
        for user in a.uses[name]:
            if user is None:
                return f"{name} is stored"
            if user.outputs[0].name in members or user is second:
                continue
            spec = ops.get(user.op).accum
            if spec is None or spec.reduce is not ops.Reduce.LAST:
                return f"{name} is read by {user.op}, which has no fragment form"
            row_accs.append(user)
    for op in bg.ops:
        if ops.get(op.op).is_accumulator and op is not acc and op not in row_accs:
            return f"accumulator {op.op} is outside the chain"
    order = {id(op): i for i, op in enumerate(bg.ops)}
    row_accs.sort(key=lambda op: order[id(op)])
    ch = Chain(first, links, second, acc, tuple(row_accs))
    online = online_form(a, ch)
    if isinstance(online, str):
        return online
    return dataclasses.replace(ch, online=online)


def _links(a: Analysis, first: BlockOp, second: BlockOp
           ) -> tuple[tuple[BlockOp, ...] | None, set[str]]:
    """The element-wise operators from the first matmul's result to the second's A
    operand (None if it is not such a function), and the tensors on that path."""
    shape = first.outputs[0].type.shape
    members = {first.outputs[0].name}
    links: list[BlockOp] = []
    for op in a.bg.ops:
        if not any(i in members for i in op.inputs) or op is second:
            continue
        if ops.get(op.op).is_accumulator:
            continue
        if ops.get(op.op).cuda.kind != "elementwise" or op.outputs[0].type.shape != shape:
            return None, members
        links.append(op)
        members.add(op.outputs[0].name)
    if second.inputs[0] not in members or second.inputs[1] in members:
        return None, members
    return tuple(links), members


@dataclass(frozen=True)
class Online:
    """A chain whose loop reads the final value of a row maximum ``acc`` (the online
    softmax: ``P = f(exp(x - max x))``), emitted with a running maximum.

    Each iteration computes ``x`` (the ``early`` links, those ``x`` needs) at every
    fragment element, the tile's row maxima (the 4 lanes of a row agree by
    shuffles), then the new running maximum ``m'``; the ``rescaled`` accumulators
    (the output and the row sums of values linear in ``exp(x - m)``) are multiplied by
    ``exp(m - m')`` before the rest of the links read ``m'``. That equals the
    two-pass meaning of the block graph (check.block_phases) because those values
    are linear in ``exp(x - m)``: a sum of ``exp(x_i - m) * y_i`` times
    ``exp(m - m')`` is the same sum of ``exp(x_i - m') * y_i``."""

    acc: BlockOp
    arg: str                       # x, the value whose row maximum ``acc`` is
    early: tuple[BlockOp, ...]     # the links computed before the maximum is known
    rescaled: frozenset[str]       # accumulators multiplied by exp(m - m')


def online_form(a: Analysis, ch: Chain) -> Online | str | None:
    """The chain's running maximum (None where the loop reads no accumulator result),
    or why the chain cannot carry what its loop reads."""
    reads = online_reads(a.bg)
    if not reads:
        return None
    maxima = [op for op in ch.row_accs if op.outputs[0].name in reads]
    if len(maxima) != 1 or len(reads) != 1 or not ops.is_maximum(maxima[0].op):
        return "the loop reads an accumulator result other than one row maximum"
    acc = maxima[0]
    m, x = acc.outputs[0].name, acc.inputs[0]
    first = ch.first.outputs[0].name
    early_names = _ancestors(ch, x) if x != first else set()
    early = tuple(op for op in ch.links if op.outputs[0].name in early_names)
    kind = {first: "free", **{n: "free" for n in early_names}}
    for op in ch.links:
        out = op.outputs[0].name
        if out in early_names:
            continue
        ins = [kind.get(i, "outside") for i in op.inputs]
        stale = [i for i in op.inputs if kind.get(i) == "free" and i != x]
        if stale:
            return f"{op.op} reads {stale[0]}, which the running maximum's pass overwrites"
        if op.op == "sub" and list(op.inputs) == [x, m]:
            kind[out] = "shifted"
        elif op.op == "exp" and ins == ["shifted"]:
            kind[out] = "scaled"
        elif "shifted" in ins or m in op.inputs:
            return f"{op.op} reads x - max other than through exp"
        elif "scaled" in ins and ops.linear_in(op.op, [k == "scaled" for k in ins]):
            kind[out] = "scaled"
        elif "scaled" in ins:
            return f"{op.op} is not linear in exp(x - max)"
        else:
            kind[out] = "free"
    if kind.get(ch.second.inputs[0]) != "scaled":
        return "the second matmul's operand is not linear in exp(x - max)"
    rescaled = {ch.acc.outputs[0].name}
    overwritten = (early_names | {first}) - {x}  # gone from the registers after the max
    for op in ch.row_accs:
        k, src = kind.get(op.inputs[0]), op.inputs[0]
        if op is acc:
            continue
        if k == "scaled" and ops.linear_in(op.op, [True]):
            rescaled.add(op.outputs[0].name)
        elif k != "free" or src in overwritten:
            return f"{op.op} of {src} cannot follow the running maximum"
    return Online(acc, x, early, frozenset(rescaled))


def _ancestors(ch: Chain, x: str) -> set[str]:
    """``x`` and the links it is computed from."""
    by_out = {op.outputs[0].name: op for op in ch.links}
    out, todo = set(), [x]
    while todo:
        n = todo.pop()
        if n in by_out and n not in out:
            out.add(n)
            todo.extend(by_out[n].inputs)
    return out


def tile_rows_of(ch: Chain) -> int:
    """Rows of the score tile (of one matrix of a batched tile) as the 16-row mma tiles
    cover them: a short tile (fewer than 16 rows) fills one."""
    return max(16, ch.first.outputs[0].type.shape[-2])


def real_rows(ch: Chain) -> int:
    """Rows of the score tile that exist (a short tile's padding rows do not)."""
    return ch.first.outputs[0].type.shape[-2]


def clamped_row(ch: Chain, r: str) -> str:
    """Row ``r`` of the score tile for reading a per-row tile: a short tile's padding
    rows read its last real row (their values are discarded, never stored)."""
    if real_rows(ch) < tile_rows_of(ch):
        return f"min({r}, {real_rows(ch) - 1})"
    return r
