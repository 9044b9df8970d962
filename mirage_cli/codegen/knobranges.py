"""The legal values of a block graph's plan knobs, and the defaults that depend only
on the block graph and the target: thread count, K-split warps, store width, the
forloop split over a cluster, staggering. Read by :mod:`planner` (which resolves the
knobs and lays the kernel out) and by the tuner through :func:`planner.knob_space`.
"""

from __future__ import annotations

from collections.abc import Mapping

from mirage_cli import arch as archs
from mirage_cli.codegen import chainplan
from mirage_cli.codegen.blockfacts import (
    Analysis,
    analyse,
    decompose,
    direct_acc,
    is_mma,
    mma_tiles,
)
from mirage_cli.ir import BlockGraph, BlockOp, DType, TensorType

VEC_BYTES = 16
MMA_ACC_REGS_MAX = 64  # mma accumulator registers per thread


def vec_elems(t: TensorType, *row_lengths: int) -> int:
    """Elements per 16-byte access along the last dimension, or 1 if rows do not align."""
    v = VEC_BYTES // t.dtype.nbytes
    return v if all(n % v == 0 for n in (t.shape[-1],) + row_lengths) else 1


def default_ksplit(a: Analysis, arch: archs.Arch) -> int:
    """2 when the grid fills at most half the SMs and the forloop splits into halves of
    8 or more iterations, else 1: a small grid's blocks then stream twice as many
    columns per row of the weight (wider pieces, half the re-reads of the shared
    operand) and the cluster still fills the GPU. Measured on an H200 (docs/perf-log.md
    v7): rmsnorm_linear grid 64 with the split ran 17.5 / 20.3 / 23.5 µs at batch 1 /
    8 / 16, grid 128 without it 20.7 / 23.6 / 29.7, grid 64 without it 22.0 / 25.3 /
    34.6. Splits of 4 lost (grid 32: 27–47 µs): a block's wider tile leaves room for
    fewer pipeline stages. Short loops do not pay for the cluster's combine (lora at
    batch 16, grid 64, 4 iterations per block: 8.3 µs against 5.9 unsplit). Larger
    default clusters for small grids (qknorm_gqa at batch 1: 34.3 µs with 4 against
    64.7 with 2) were withdrawn (v14): the cost model, which reads the default plan,
    then ranked grids of 2 to 4 blocks with clusters of 8 first for large weights."""
    gx, gy, gz = a.bg.grid
    blocks = gx * gy * gz
    if (2 not in ksplit_range(a, arch.name) or 2 * blocks > arch.num_sms
            or a.bg.forloop // 2 < 8):
        return 1
    return 2


def default_threads(bg: BlockGraph, target: str = "sm_90") -> int:
    """The block graph's thread count; kernels without tensor-core work get enough
    threads for one 16-byte access per thread over their largest tile (up to 512), so
    row-wise kernels with few blocks still keep many loads in flight. Tensor-core
    kernels are judged on the graph the planner lays out (norms and softmax
    decomposed), so that a chain fed by a normalised operand is seen as one; a chain's
    count depends on whether ``target`` runs it as wgmma (sm_90)."""
    if any(is_mma(op, bg.threads) for op in bg.ops):
        a = analyse(decompose(bg))
        mmas = [op for op in a.bg.ops if is_mma(op, bg.threads)]
        chained = (chainplan.chain_threads(a, wgmma=target == "sm_90") if len(mmas) == 2
                   else None)
        if chained is not None:
            return chained
        if any(_result_in_smem(op, a) for op in mmas):
            return ELEMENT_THREADS
        # Streaming matmuls issue many instructions per byte (copies, fragment loads):
        # with one block per SM, 8 warps issue faster than 4 (docs/perf-log.md).
        heavy = max(ksteps(op, a) for op in mmas) >= 16
        return max(bg.threads, 256) if heavy else bg.threads
    largest = max([bi.value.type.numel for bi in bg.inputs] + [1])
    t = bg.threads
    while t < 512 and t * 2 * 8 <= largest:
        t *= 2
    return t


# Threads of a kernel whose matmul result goes through shared memory as an f32 tile:
# what follows it (scaling, row statistics, exp, a second matmul's scalar operand
# loads) is element work over the whole tile, one element per thread at a time. On an
# H100 (docs/perf-log.md v20) 128 / 256 / 512 threads ran mha_decode's score kernel at
# batch 8 in 308 / 233 / 192 µs and qknorm_gqa's one-kernel form at batch 16 in 359 /
# 104 / 86 µs.
ELEMENT_THREADS = 512


def _result_in_smem(op: BlockOp, a: Analysis) -> bool:
    """Whether the planner homes this forloop mma's result in shared memory at the block
    graph's threads: not summed by a forloop accumulator, or too many m16n8 tiles per
    warp for the accumulator's registers (the planner's rule in ``layout.mma_plans``). A
    matmul after the loop runs once: its home does not make the kernel element-bound."""
    if a.phases[op.outputs[0].name] != "loop":
        return False
    return direct_acc(op, a) is None or not acc_in_registers(op, a.bg.threads // 32)


def mma_tiles_per_warp(op: BlockOp, warps: int) -> int:
    """m16n8 tiles of ``op``'s result each of ``warps`` warps computes."""
    return -(-mma_tiles(op.outputs[0].type) // warps)


def acc_in_registers(op: BlockOp, warps: int) -> bool:
    """Whether ``op``'s accumulator fragments, spread over ``warps`` warps, fit the
    registers the planner gives them (``MMA_ACC_REGS_MAX``, 4 per m16n8 tile)."""
    return 4 * mma_tiles_per_warp(op, warps) <= MMA_ACC_REGS_MAX


def ksteps(op: BlockOp, a: Analysis) -> int:
    K = a.types[op.inputs[0]].shape[-1]
    return K // 16 if K % 16 == 0 else 1


def kwarps_range(a: Analysis) -> list[int]:
    """Warp counts that can split K of every accumulated mma of the kernel."""
    W = a.bg.threads // 32
    accs = [op for op in a.bg.ops if is_mma(op, a.bg.threads) and direct_acc(op, a)]
    if not accs:
        return [1]
    return [kw for kw in range(1, W + 1) if W % kw == 0
            and all(ksteps(op, a) % kw == 0 for op in accs)]


def store_vec(t: TensorType, d: TensorType) -> int:
    """Elements per 16-byte store of a block output whose tile is ``t`` in device tensor
    ``d``, or 1. The tile's row length must be a multiple of the vector (so omap offsets
    along the last dimension are too) and so must the device tensor's; f32 tiles are
    stored one element at a time (a 16-bit tile stored into an f32 tensor, as two
    16-byte stores: ``mg_st8(float*)``)."""
    return 1 if t.dtype is DType.F32 else vec_elems(t, d.shape[-1])


def vec_range(a: Analysis, dev: Mapping[str, TensorType]) -> list[int]:
    """Store widths of the block outputs: 1, or the 16-byte vector of those outputs that
    allow one (the others are stored one element at a time, ``stores.store``)."""
    sizes = {store_vec(a.types[bo.source], dev[bo.value.name]) for bo in a.bg.outputs} - {1}
    return [1] + sorted(sizes) if len(sizes) == 1 else [1]


# A forloop whose inputs hold at most this many bytes streams little from DRAM: its
# time is latency and the L2 lines every block requests at once (default_stagger).
STAGGER_MAX_LOOP_BYTES = 8 << 20


def default_stagger(a: Analysis, dev: Mapping[str, TensorType]) -> int:
    """1 where staggering is legal, every block reads the same tile of some loop input
    (no grid split), and the loop's inputs are small (at most
    ``STAGGER_MAX_LOOP_BYTES``), else 0. Such a kernel waits on the L2 lines that all
    its blocks request at the same iteration; starting block b at iteration b mod F
    spreads them. A kernel that streams a large weight keeps its blocks in step, which
    the DRAM pages favour. Measured on an H200 (docs/perf-log.md v5, v11): lora
    (2.4 MB) 4.3 / 4.3 / 4.6 µs staggered against 4.5 / 4.7 / 4.8 at batch 1 / 8 / 16;
    gated_mlp (67 MB) 25% slower staggered."""
    if 1 not in stagger_range(a):
        return 0
    loop = [bi for bi in a.bg.inputs if bi.fmap is not None]
    shared = any(all(d is None for d in bi.imap) for bi in loop)
    return 1 if shared and not streams(a, dev) else 0


def streams(a: Analysis, dev: Mapping[str, TensorType]) -> bool:
    """Whether the forloop streams more than ``STAGGER_MAX_LOOP_BYTES`` of inputs from
    DRAM (a weight), rather than waiting on the latency of a few small tiles."""
    loop = [bi for bi in a.bg.inputs if bi.fmap is not None]
    return sum(dev[bi.source].nbytes for bi in loop) > STAGGER_MAX_LOOP_BYTES


def stagger_range(a: Analysis) -> list[int]:
    """Staggering needs more than one iteration and more than one block; every
    accumulator combines with sum, max or min, so any iteration order gives the same
    value (up to float rounding)."""
    gx, gy, gz = a.bg.grid
    return [0, 1] if a.bg.forloop > 1 and gx * gy * gz > 1 else [0]


# The largest thread-block cluster every sm_90 GPU launches (the portable size).
MAX_CLUSTER = 8


def ksplit_range(a: Analysis, target: str) -> list[int]:
    """Cluster sizes that can split the forloop: sm_90, a grid with no z axis (the
    cluster's blocks go there), and only accumulator results stored (each block of the
    cluster holds partial sums until they are combined). Every size up to the portable
    cluster that divides the forloop, not powers of two alone: a weight of 5120 columns
    in 128-column tiles is 40 tiles, so clusters of 2 launch 80 blocks on 132 SMs and
    clusters of 3 launch 120 (a Llama-3.2-3B QKV projection); 4608 columns (Qwen2-7B's
    QKV) over 28 iterations split by 7 likewise. The planner's default stays 2 or 1
    (:func:`default_ksplit`); measured selection and pins reach the others."""
    bg = a.bg
    stored_after_loop = all(a.phases[bo.source] == "epilogue" for bo in bg.outputs)
    if target != "sm_90" or bg.grid[2] != 1 or not stored_after_loop:
        return [1]
    return [1] + [k for k in range(2, MAX_CLUSTER + 1) if bg.forloop % k == 0]
