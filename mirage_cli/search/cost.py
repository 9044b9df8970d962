"""A first cost model: rank candidate µGraphs before anything runs on a GPU.

For each kernel it counts device-memory bytes (each device tensor read once per
kernel that reads it, plus what it writes: repeated reads of a tile by many blocks are
assumed to hit L2 and are counted separately as ``l2_bytes``), FLOPs (a matmul is
``2*m*n*k``, any other operator one per output element), launches, and the shared
memory one block needs (tiles of loop loads twice, for double buffering, plus every
other tile). The predicted time is the sum over kernels of
``max(dram / BW, l2 / L2BW, flops / PEAK) / utilisation * (1 + 1/F) + waves * F * ITER
+ LAUNCH`` where utilisation is the fraction of SMs the grid occupies, ``F`` the
forloop range (one iteration's loads are not overlapped with compute: the pipeline
fill) and ``waves`` the number of rounds of blocks over the SMs. A kernel whose block does not fit in shared
memory makes the candidate infeasible. The constants describe an H100 SXM; a later
issue replaces them with measured ones and explains the ranking.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

from mirage_cli import arch as archs
from mirage_cli import ops
from mirage_cli.check import tile_type
from mirage_cli.ir import BlockGraph, Graph, KernelOp, TensorType

DRAM_BW = 3.35e12        # bytes/s
L2_BW = 10e12            # bytes/s, a round figure for L2 -> SM traffic
PEAK_FLOPS = 400e12      # f16 tensor-core FLOP/s actually reachable by small kernels
LAUNCH_S = 2.5e-6        # per kernel launch
ITER_S = 0.05e-6         # per forloop iteration and wave of blocks (synchronisation)
NUM_SMS = archs.get(archs.DEFAULT_ARCH).num_sms
# The same per-block limit the kernel planner allocates against.
SMEM_BYTES = archs.get(archs.DEFAULT_ARCH).smem_per_block


@dataclass(frozen=True)
class Cost:
    dram_bytes: int
    l2_bytes: int
    flops: int
    launches: int
    smem_bytes: int      # the largest block's shared memory
    min_blocks: int      # the smallest grid among custom kernels (0: none)
    fits: bool
    time_us: float

    def as_json(self) -> dict[str, object]:
        return {k: (round(v, 3) if isinstance(v, float) else v)
                for k, v in asdict(self).items()}


def op_flops(op: str, ins: list[TensorType], out: TensorType) -> int:
    """FLOPs of one operator, from the registry's ``cost`` slot."""
    return int(ops.get(op).cost(ins, out))


@dataclass(frozen=True)
class KernelCost:
    """One kernel's terms of the model (what :func:`estimate` sums), for ``explain``."""

    dram_bytes: int
    l2_bytes: int
    flops: int
    smem_bytes: int      # the model's count (the kernel plan's is in ``explain``)
    blocks: int
    forloop: int
    dram_us: float       # dram_bytes at DRAM_BW
    l2_us: float         # l2_bytes at L2_BW
    compute_us: float    # flops at PEAK_FLOPS
    util: float          # fraction of the SMs the grid occupies
    stream_us: float     # max(dram, l2, compute) / util * (1 + 1/forloop)
    sync_us: float       # waves * forloop * ITER_S
    launch_us: float
    time_us: float

    @property
    def binding(self) -> str:
        """The term that sets the kernel's time: memory (DRAM or L2), compute, or
        latency (launch and synchronisation exceed the streaming time)."""
        if self.launch_us + self.sync_us >= self.stream_us:
            return "latency"
        if self.compute_us >= max(self.dram_us, self.l2_us):
            return "compute"
        return "memory (DRAM)" if self.dram_us >= self.l2_us else "memory (L2)"


def kernel_costs(g: Graph) -> list[KernelCost]:
    """The model's terms for each kernel of ``g``, in launch order."""
    types = g.tensor_types()
    out: list[KernelCost] = []
    for op in g.ops:
        if op.block is None:
            k_dram, k_l2, k_flops, k_smem, blocks = _predefined(op, types)
        else:
            k_dram, k_l2, k_flops, k_smem, blocks = _custom(op.block, types)
        util = min(1.0, blocks / NUM_SMS)
        d_s, l_s, c_s = k_dram / DRAM_BW, k_l2 / L2_BW, k_flops / PEAK_FLOPS
        forloop = op.block.forloop if op.block is not None else 4
        waves = -(-blocks // NUM_SMS)
        # Loads of iteration i+1 overlap compute of iteration i, so one iteration's
        # loads are exposed (the pipeline fill), and each iteration synchronises.
        stream = max(d_s, l_s, c_s) / util * (1 + 1 / forloop)
        sync = waves * forloop * ITER_S
        out.append(KernelCost(k_dram, k_l2, k_flops, k_smem, blocks, forloop, d_s * 1e6,
                              l_s * 1e6, c_s * 1e6, util, stream * 1e6, sync * 1e6,
                              LAUNCH_S * 1e6, (stream + sync + LAUNCH_S) * 1e6))
    return out


def estimate(g: Graph) -> Cost:
    dram = l2 = flops = smem = 0
    time_s = 0.0
    min_blocks = 0
    fits = True
    for op, k in zip(g.ops, kernel_costs(g)):
        if op.block is not None:
            min_blocks = k.blocks if not min_blocks else min(min_blocks, k.blocks)
        fits &= k.smem_bytes <= SMEM_BYTES
        time_s += k.time_us * 1e-6
        dram, l2 = dram + k.dram_bytes, l2 + k.l2_bytes
        flops, smem = flops + k.flops, max(smem, k.smem_bytes)
    return Cost(dram, l2, flops, len(g.ops), smem, min_blocks, fits, time_s * 1e6)


# The tie rule (docs/search.md "How the choice is made"): candidates are ordered by
# feasibility, then predicted time; predictions within TIE_REL of the first of a run
# of candidates are ties (a model this coarse does not distinguish them: lora's
# designs differ in the fifth digit), ordered by fewer kernels, fewer DRAM bytes,
# fewer FLOPs, fewer L2 bytes, less shared memory, and last the canonical JSON text of
# the µGraph, so the order never depends on the order in which designs were found.
TIE_REL = 0.01
TIE_RULE = ("predicted times within 1% are ties, ordered by fewer kernels, then fewer "
            "DRAM bytes, then fewer FLOPs, then fewer L2 bytes, then less shared memory, "
            "then the canonical JSON text of the µGraph")

T = TypeVar("T")


def _tie_key(c: Cost, canonical: str) -> tuple[int, int, int, int, int, str]:
    return (c.launches, c.dram_bytes, c.flops, c.l2_bytes, c.smem_bytes, canonical)


def rank(items: Sequence[T], cost: Callable[[T], Cost], canonical: Callable[[T], str]
         ) -> list[T]:
    """``items`` best first by the tie rule above."""
    by_time = sorted(items, key=lambda x: (not cost(x).fits, cost(x).time_us,
                                           _tie_key(cost(x), canonical(x))))
    out: list[T] = []
    i = 0
    while i < len(by_time):
        first = cost(by_time[i])
        j = i + 1
        while (j < len(by_time) and cost(by_time[j]).fits == first.fits
               and cost(by_time[j]).time_us <= first.time_us * (1 + TIE_REL)):
            j += 1
        out += sorted(by_time[i:j], key=lambda x: _tie_key(cost(x), canonical(x)))
        i = j
    return out


def tie_breaker(a: Cost, b: Cost) -> str | None:
    """The first term of the tie rule that orders ``a`` before ``b`` when their
    predicted times tie, or None when they do not tie."""
    lo, hi = sorted((a.time_us, b.time_us))
    if a.fits != b.fits or hi > lo * (1 + TIE_REL):
        return None
    for name, x, y in (("kernels", a.launches, b.launches),
                       ("DRAM bytes", a.dram_bytes, b.dram_bytes),
                       ("FLOPs", a.flops, b.flops), ("L2 bytes", a.l2_bytes, b.l2_bytes),
                       ("shared memory", a.smem_bytes, b.smem_bytes)):
        if x != y:
            return name
    return "canonical text"


def _predefined(op: KernelOp, types: dict[str, TensorType]) -> tuple[int, int, int, int, int]:
    ins = [types[i] for i in op.inputs]
    out = op.outputs[0].type
    nbytes = sum(t.nbytes for t in ins) + out.nbytes
    # A library kernel uses enough blocks to fill the GPU unless the output is tiny.
    blocks = max(1, min(NUM_SMS, out.numel // 1024))
    return nbytes, nbytes, op_flops(op.op, ins, out), 0, blocks


def _custom(bg: BlockGraph, types: dict[str, TensorType]) -> tuple[int, int, int, int, int]:
    tiles: dict[str, TensorType] = {}
    loop_l2 = smem = 0
    sources: set[str] = set()
    for bi in bg.inputs:
        t = tile_type(types[bi.source], bg.grid, bg.forloop, bi.imap, bi.fmap)
        tiles[bi.value.name] = t
        sources.add(bi.source)
        reads = bg.forloop if bi.fmap is not None else 1
        loop_l2 += t.nbytes * reads
        smem += t.nbytes * (2 if bi.fmap is not None else 1)
    flops = 0
    for bop in bg.ops:
        ins = [tiles[i] for i in bop.inputs]
        out = bop.outputs[0].type
        tiles[bop.outputs[0].name] = out
        smem += out.nbytes
        if not ops.get(bop.op).is_accumulator:
            flops += op_flops(bop.op, ins, out)
    flops *= bg.forloop  # loop-body operators dominate; epilogue ops counted alike
    blocks = bg.num_blocks
    stored = sum(bo.value.type.nbytes for bo in bg.outputs)
    dram = sum(types[s].nbytes for s in sorted(sources)) + stored
    return dram, loop_l2 * blocks + stored, flops * blocks, smem, blocks
