"""What a block graph says, before any plan: the facts planning and emission share.

``decompose`` rewrites operators that would read an element twice into ones that read
it once; :class:`Analysis` records each tensor's type, phase (invariant, loop,
epilogue), consumers and producer; the predicates say which matmuls run on tensor
cores and which reductions are spread over the lanes of warps. Nothing here depends
on the knobs or the target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from mirage_cli import ops
from mirage_cli.check import block_phases
from mirage_cli.ir import BlockGraph, BlockOp, DType, TensorType, Value, make_attrs
from mirage_cli.semantics.accum import Finish


def decompose(bg: BlockGraph) -> BlockGraph:
    """Rewrite operators that read their input twice per element (``rms_norm``) into
    ones that read it once (``rms`` then ``div`` [then ``mul``]), so no element is
    recomputed per output."""
    new_ops: list[BlockOp] = []
    for op in bg.ops:
        if ops.get(op.op).cuda.kind != "rms_norm":
            new_ops.append(op)
            continue
        out, x, t = op.outputs[0], op.inputs[0], op.outputs[0].type
        r = Value(f"{out.name}__rms", TensorType(t.shape[:-1] + (1,), t.dtype))
        new_ops.append(BlockOp("rms", (x,), (r,), make_attrs(eps=dict(op.attrs).get("eps"))))
        if len(op.inputs) == 2:
            y = Value(f"{out.name}__n", t)
            new_ops.append(BlockOp("div", (x, r.name), (y,)))
            new_ops.append(BlockOp("mul", (y.name, op.inputs[1]), (out,)))
        else:
            new_ops.append(BlockOp("div", (x, r.name), (out,)))
    return dataclasses.replace(bg, ops=tuple(new_ops))


@dataclass
class Analysis:
    """Facts about a (decomposed) block graph that planning and emission share."""

    bg: BlockGraph
    types: dict[str, TensorType]
    phases: dict[str, str]
    uses: dict[str, list[BlockOp | None]]   # None: a store
    producer: dict[str, BlockOp] = field(default_factory=dict)


def analyse_at(bg: BlockGraph, threads: int) -> Analysis:
    """The analysis of ``bg``'s decomposed form (:func:`decompose`) run by ``threads``
    threads (which operators are tensor-core matmuls, and so the chain, depend on it)."""
    return analyse(decompose(dataclasses.replace(bg, threads=threads)))


def analyse(bg: BlockGraph) -> Analysis:
    types = bg.tile_types()
    uses: dict[str, list[BlockOp | None]] = {n: [] for n in types}
    for op in bg.ops:
        for i in op.inputs:
            uses[i].append(op)
    for bo in bg.outputs:
        uses[bo.source].append(None)
    producer = {op.outputs[0].name: op for op in bg.ops}
    return Analysis(bg, types, dict(block_phases(bg)), uses, producer)


def reads_once(consumer: BlockOp, operand: TensorType, types: Mapping[str, TensorType]) -> bool:
    """Whether ``consumer`` reads each element of this operand exactly once."""
    match ops.get(consumer.op).cuda.kind:
        case "elementwise":
            return types[consumer.outputs[0].name].shape == operand.shape
        case "gather" | "reduce" | "rms" | "sum_to" | "concat" | "accum":
            return True
        case "matmul" | "rms_norm" | "softmax" | "custom":
            return False
    raise AssertionError(consumer.op)


def is_mma(op: BlockOp, threads: int) -> bool:
    """f16/bf16 block matmuls run on tensor cores; f32 ones keep f32 FMAs."""
    return (ops.get(op.op).cuda.kind == "matmul" and threads % 32 == 0
            and op.outputs[0].type.dtype in (DType.F16, DType.BF16))


def direct_acc(op: BlockOp, a: Analysis) -> BlockOp | None:
    """The acc_sum that sums this loop matmul's result directly, if any."""
    users = a.uses[op.outputs[0].name]
    user = users[0] if len(users) == 1 else None
    spec = ops.get(user.op).accum if user is not None else None
    if (user is None or spec is None or not spec.is_plain_sum
            or spec.reduce is not ops.Reduce.NONE or a.phases[op.outputs[0].name] != "loop"):
        return None
    return user


def packed(name: str, a: Analysis) -> bool:
    """A tile computed before the loop or in each iteration (an element-wise operator's
    result, 16-bit, rows of whole 16-byte chunks) that only tensor-core matmuls read: it
    is written in its own dtype into shared memory with padded rows, where ``ldmatrix``
    reads it like a staged input (e.g. Q normalised before an attention loop, or each
    iteration's ``rms_norm(x) * w`` tile before the weight's). Kept in f32 instead, its
    mma fragments were gathered from unpadded rows: 8-way bank conflicts, which made a
    fused RMSNorm + projection at batch 16 11 µs slower than the projection alone on an
    H200 (docs/perf-log.md v18)."""
    op = a.producer.get(name)
    t = a.types[name]
    users = a.uses[name]
    return (op is not None and a.phases[name] in ("invariant", "loop")
            and ops.get(op.op).cuda.kind == "elementwise" and not ops.get(op.op).is_accumulator
            and t.dtype in (DType.F16, DType.BF16) and t.shape[-1] % 8 == 0
            and bool(users) and all(u is not None and is_mma(u, a.bg.threads) for u in users))


def scaled_operand(name: str, a: Analysis) -> tuple[str, str] | None:
    """``(tile, vector)`` where ``name`` is ``f(tile, vector)``, ``f`` an operator with
    an exact form on packed 16-bit pairs (registry ``CudaSpec.pair16``: ``mul``), of a
    block input ``tile`` of ``name``'s own shape and dtype and a block input ``vector``
    of one value per column (``[K]`` or ``[1, K]``), read only as the A operand of
    tensor-core matmuls in the loop (each iteration's ``x * w`` of a weighted RMSNorm
    before a projection). Its fragments are ``tile``'s, loaded by ``ldmatrix`` and
    combined with pairs of ``vector`` in registers (mma's "scaled" A path): no pass that
    writes the result into a shared-memory tile and no barrier before the matmul reads
    it, and the same bits as that tile held."""
    op = a.producer.get(name)
    t = a.types[name]
    if (op is None or ops.get(op.op).cuda.pair16 is None or len(op.inputs) != 2
            or a.phases[name] != "loop"
            or t.dtype not in (DType.F16, DType.BF16) or len(t.shape) != 2
            or t.shape[-1] % 16):
        return None
    users = a.uses[name]
    if not users or not all(u is not None and is_mma(u, a.bg.threads)
                            and u.inputs[0] == name and u.inputs[1] != name for u in users):
        return None
    for tile, vec in (op.inputs, op.inputs[::-1]):
        tt, tv = a.types[tile], a.types[vec]
        if (tile in a.producer or vec in a.producer or tt != t or tv.dtype != t.dtype
                or tv.shape not in ((t.shape[-1],), (1, t.shape[-1]))):
            continue
        return tile, vec
    return None


def stored_inverse(name: str, a: Analysis) -> bool:
    """An element-wise or row-reduction f32 tile that is only ever a broadcast divisor
    (``x / n`` with ``n`` one per column or row: qknorm_gqa's key norms, the norm of its
    queries) is stored as its reciprocal and its readers multiply: one division per
    stored element instead of one per element read. An IEEE single division is a
    reciprocal, several fused multiply-adds and a range check, issued for every element
    of the score tile in every iteration."""
    op = a.producer.get(name)
    users = a.uses[name]
    if (op is None or ops.get(op.op).cuda.kind not in ("elementwise", "reduce", "rms")
            or ops.get(op.op).is_accumulator or not users):
        return False
    t = a.types[name]
    return all(u is not None and ops.get(u.op).cuda.by_inverse is not None
               and u.inputs[0] != name and u.inputs[1] == name
               and a.types[u.outputs[0].name].numel > t.numel for u in users)


def mma_tiles(t: TensorType) -> int:
    """m16n8 tiles covering an output tile (batch dims included)."""
    n = 1
    for d in t.shape[:-2]:
        n *= d
    return n * -(-t.shape[-2] // 16) * -(-t.shape[-1] // 8)


def reduced_dim(op: BlockOp, types: Mapping[str, TensorType]) -> tuple[int, int] | None:
    """(reduced dimension, its length) of a row reduction operator, else None."""
    spec = ops.get(op.op).cuda
    xs = types[op.inputs[0]].shape
    if spec.kind == "rms":
        return len(xs) - 1, xs[-1]
    if spec.kind == "reduce":
        d = int(dict(op.attrs)["dim"])
        return d, xs[d]
    return None


def row_reduction(op: BlockOp, a: Analysis, threads: int) -> bool:
    """Reductions along the contiguous last dimension, or with fewer results than
    threads, are spread over the lanes of one or more warps per result."""
    red = reduced_dim(op, a.types)
    if red is None or red[1] < 32:
        return False
    return red[0] == len(a.types[op.inputs[0]].shape) - 1 or op.outputs[0].type.numel < threads


def acc_row_reduction(op: BlockOp, a: Analysis) -> bool:
    """Accumulators that reduce the tile's last dimension (of 32 or more) over lanes."""
    spec = ops.get(op.op).accum
    assert spec is not None
    return spec.reduce is ops.Reduce.LAST and a.types[op.inputs[0]].shape[-1] >= 32


def threads_per_row(rows: int, threads: int) -> int:
    """Whole warps per row: every warp works even when there are fewer rows than warps."""
    warps = threads // 32
    per = warps // rows if 0 < rows < warps and warps % rows == 0 else 1
    return 32 * per


# Lanes per result of a reduction along a strided (not the last) dimension: a warp then
# reads 8 consecutive rows of 4 adjacent columns, which rows padded to 72 16-bit
# elements spread over 32 distinct banks. A whole warp per result read 32 rows of one
# column instead (4-way bank conflicts, 5 shuffles per result); qknorm_gqa's key norms
# over a [64, 64] K tile at 128 threads were 16 such passes, every iteration.
STRIDED_LANES = 8


def fused_finish(op: BlockOp, a: Analysis) -> BlockOp | None:
    """The element-wise operator that alone reads row reduction ``op``'s result, reads
    nothing else and has its shape, in the same phase (qknorm's ``sqrt`` of the mean of
    squares): the reduction's leader lanes write its value too, so it needs no pass of
    its own and no barrier after one. None if there is no such operator."""
    name = op.outputs[0].name
    users = a.uses[name]
    if len(users) != 1 or users[0] is None:
        return None
    u = users[0]
    spec = ops.get(u.op)
    if (spec.cuda.kind != "elementwise" or spec.is_accumulator or set(u.inputs) != {name}
            or u.outputs[0].type.shape != op.outputs[0].type.shape
            or a.phases[u.outputs[0].name] != a.phases[name]):
        return None
    return u


def lanes_per_result(op: BlockOp, a: Analysis, threads: int) -> int:
    """Threads that share one result of a row reduction (``row_reduction``): whole warps
    per row (``threads_per_row``), but a row of fewer than 32 chunks of 8 elements gets
    no more lanes than it has chunks (a power of two of them). A warp per 64-long row
    read 2 elements per lane and combined them by 5 shuffles, 16 rows one after another
    for qknorm_gqa's 128 queries at 256 threads; 8 lanes read a chunk each, combine by 3
    shuffles, and a warp takes 4 rows at once (its kernel at batch 8 on an H100: 26.97
    -> 25.45 µs, docs/perf-log.md v29)."""
    red = reduced_dim(op, a.types)
    assert red is not None
    if red[0] != len(a.types[op.inputs[0]].shape) - 1:
        return STRIDED_LANES
    whole = threads_per_row(op.outputs[0].type.numel, threads)
    chunks = red[1] // ROW_VEC
    if not 1 <= chunks < 32 or red[1] % ROW_VEC:
        return whole  # a long row keeps its warps (a block's few long rows, all of them)
    return min(whole, 1 << (chunks.bit_length() - 1))


# -- row kernels with their rows in registers (codegen/rowregs.py) --------------------

ROW_VEC = 8  # elements per 16-byte chunk of a 16-bit tile


def row_tile(a: Analysis) -> tuple[int, int] | None:
    """(R, L) when every tensor is an [R, L] tile, a per-row [R, 1] result, or an [L]
    row every row shares (a norm's weight)."""
    shapes = {t.shape for t in a.types.values()}
    full = {s for s in shapes if len(s) == 2 and s[1] != 1}
    if len(full) != 1:
        return None
    R, L = next(iter(full))
    return (R, L) if shapes <= {(R, L), (R, 1), (L,)} else None


def rows_in_registers(a: Analysis, dev: Mapping[str, TensorType], threads: int
                      ) -> str | None:
    """None when the block graph can keep its rows in registers with ``threads``
    threads, else the first reason it cannot."""
    bg = a.bg
    if bg.forloop != 1:
        return "the forloop has more than one iteration"
    shape = row_tile(a)
    if shape is None:
        return "not every tensor is an [R, L] tile or a per-row [R, 1] result"
    R, L = shape
    if L % ROW_VEC or (L // ROW_VEC) % threads:
        return f"a row of {L} elements is not a multiple of {ROW_VEC} x {threads} threads"
    if R * L // ROW_VEC // threads > 8:
        return "more than 8 chunks per thread"
    for bi in bg.inputs:
        t = bi.value.type
        if t.shape not in ((R, L), (L,)) or t.dtype is DType.F32 \
                or dev[bi.source].shape[-1] % ROW_VEC:
            return f"input {bi.value.name} is not a 16-bit [R, L] tile or [L] row"
    for bo in bg.outputs:
        if a.types[bo.source].shape != (R, L) or bo.value.type.dtype is DType.F32:
            return f"output {bo.value.name} is not a 16-bit [R, L] tile"
    for op in bg.ops:
        if row_kind(op, a) is None:
            return f"operator {op.op} has no register form"
    return None


def row_kind(op: BlockOp, a: Analysis) -> str | None:
    """'elementwise', 'row' (a reduction along the last dimension) or 'alias' (an
    accumulator of one iteration that returns its input), else None."""
    reg = ops.get(op.op)
    if reg.is_accumulator:
        spec = reg.accum
        assert spec is not None
        if spec.reduce is ops.Reduce.NONE and spec.finish is Finish.ID \
                and spec.pre is ops.Pre.ID:
            return "alias"
        # Of one iteration, a row accumulator is a row reduction (acc_rms_ld: a norm).
        row = a.bg.forloop == 1 and spec.reduce is ops.Reduce.LAST
        return "row" if row else None
    kind = reg.cuda.kind
    if kind == "elementwise":
        return "elementwise"
    red = reduced_dim(op, a.types)
    if kind in ("rms", "reduce") and red is not None and red[0] == 1:
        keep = kind == "rms" or bool(reg.attr_values(op.attrs).get("keepdim", False))
        return "row" if keep else None
    return None
