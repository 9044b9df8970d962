"""The cost model: rank candidate µGraphs before anything runs on a GPU.

For each kernel it counts device-memory bytes (each device tensor read once per
kernel that reads it, plus what it writes: repeated reads of a tile by many blocks are
assumed to hit L2 and are counted separately as ``l2_bytes``), FLOPs (a matmul is
``2*m*n*k``, any other operator one per output element), launches, and the shared
memory one block needs (the model's own count: tiles of loop loads twice, for double
buffering, plus every other tile). The predicted time is the sum over kernels of
``a * ((max(M, C) + X / F) * (1 + p/S²) + simt * SLOW / FMA / u) + b * waves * F * ITER
+ c * LAUNCH`` with ``M = max(dram / BW, l2 / L2BW) / u^e`` and ``C = flops / PEAK / u``,
plus ``d`` once per
µGraph, where ``simt`` counts a custom kernel's element-wise FLOPs as its blocks run
them (per iteration in the loop: every block along N recomputes what it reads), ``SLOW``
is the profile's ``simt_slowdown``, ``u`` (the
utilisation) is the fraction of SMs the grid occupies, ``e`` the profile's
``mem_util_exp`` (memory streams nearly as fast on part of the GPU; for a kernel whose
plan copies with bulk tensor copies, ``L2BW`` and ``e`` are the profile's ``bulk_l2_bw``
and ``bulk_mem_util_exp`` where it gives them), ``F`` the forloop
iterations one block runs, ``X`` what the first of them exposes (the pipeline fill:
``max(M, C)``, one iteration's loads before any compute overlaps them, or for a matmul
chain ``min(M, C)``, see :func:`_fill_s`) and ``waves`` the number of rounds of blocks
over the SMs. ``PEAK`` is
the profile's ``mma_flops``, or its ``chain_mma_flops`` for a kernel whose plan keeps a
matmul chain in registers (``chain=1``, the attention family). Blocks and
iterations are the launched ones: a plan that splits the forloop over a cluster of ``ksplit`` blocks launches ``ksplit`` times the µGraph's
blocks, each running ``F / ksplit`` iterations. ``S`` is the plan's pipeline depth
and ``p`` the profile's ``stage_penalty`` (loops only). A block matmul's FLOPs count
its K in whole tensor-core steps of 16, and a loop whose plan copies an input element
by element (a tile row that is not a multiple of 16 bytes) has its memory term
multiplied by the profile's ``scalar_copy_slowdown``, as is the tensor-core term of a
block matmul whose K tile is not a multiple of 16 or whose plan reads an operand from
an f32 tile in shared memory (its mma fragments are gathered element by element:
:func:`_gathered_mmas`). A block reads DRAM no faster
than ``block_stream_bw``, and blocks run in rounds of those resident at once: a grid of
fewer blocks than SMs reads in proportion to its blocks, and a grid a little larger
than the resident blocks pays a tail round at the few blocks' own rate. A loop's
invariant tiles, waited for before its first iteration, add their load once per round
of blocks at one block per SM, else once.

The figures (bandwidths, peak, launch and iteration costs, SM count) and the
coefficients ``a, b, c, d`` come from a device profile (:mod:`mirage_cli.profiles`,
``--target``; fitted by ``mirage calibrate --fit``). The model reads each custom
kernel's plan (:func:`mirage_cli.codegen.planner.plan_kernel`: the one the µGraph
carries, else the planner's default): its threads and shared memory set the
occupancy, and a kernel with no plan that fits (shared memory, the planner's limits)
or whose plan exceeds the profile's shared memory is a constraint violation: the
candidate is infeasible and ``explain`` names the violation.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

from mirage_cli import arch as archs
from mirage_cli import ops
from mirage_cli import profiles as device_profiles
from mirage_cli.check import tile_type
from mirage_cli.codegen import matmul_tiling
from mirage_cli.codegen.aliasing import aliasing
from mirage_cli.codegen.joins import joined_ops, joins, shifted_names
from mirage_cli.codegen.plan import SWIZZLE_SPANS, swizzled
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import BlockGraph, Graph, KernelOp, TensorType, Value
from mirage_cli.kplan import KernelPlan
from mirage_cli.profiles import Profile, target_option  # noqa: F401 - re-exported

_ACTIVE: list[Profile] = []
# The per-block limit of the default architecture, for messages that name it (the
# model itself checks against the active profile's ``smem_per_block``).
SMEM_BYTES = archs.get(archs.DEFAULT_ARCH).smem_per_block


def profile() -> Profile:
    """The device profile the model uses now (``--target``; default sm_90/h200)."""
    if not _ACTIVE:
        _ACTIVE.append(device_profiles.load(device_profiles.DEFAULT_TARGET))
    return _ACTIVE[0]


def use_profile(target: str | Profile) -> Profile:
    """Make ``target`` the model's profile (a command's ``--target``)."""
    p = target if isinstance(target, Profile) else device_profiles.load(target)
    _ACTIVE[:] = [p]
    return p


@dataclass(frozen=True)
class Cost:
    dram_bytes: int
    l2_bytes: int
    flops: int
    launches: int
    smem_bytes: int      # the largest block's shared memory (the model's count)
    min_blocks: int      # the smallest grid among custom kernels (0: none)
    fits: bool
    time_us: float
    violations: tuple[str, ...] = ()   # why it does not fit (the plan's constraints)

    def as_json(self) -> dict[str, object]:
        d = {k: (round(v, 3) if isinstance(v, float) else v)
             for k, v in asdict(self).items() if k != "violations"}
        if self.violations:
            d["violations"] = list(self.violations)
        return d


def op_flops(op: str, ins: list[TensorType], out: TensorType) -> int:
    """FLOPs of one operator, from the registry's ``cost`` slot."""
    return int(ops.get(op).cost(ins, out))


@dataclass(frozen=True)
class KernelCost:
    """One kernel's terms of the model (what :func:`estimate` sums), for ``explain``."""

    dram_bytes: int
    l2_bytes: int
    flops: int
    smem_bytes: int      # the model's count (the tie rule's term)
    blocks: int
    forloop: int
    dram_us: float       # dram_bytes at the profile's DRAM bandwidth
    l2_us: float         # l2_bytes at its L2 bandwidth
    compute_us: float    # flops at its peak
    util: float          # fraction of the SMs the grid occupies
    stream_us: float     # fit.stream * ((max(mem, compute) + fill / forloop) * depth
    #                      + element-wise FLOPs * simt_slowdown / fma_flops / util)
    sync_us: float       # fit.sync * waves * forloop * iter_us
    launch_us: float     # fit.launch * launch_us
    time_us: float
    plan_smem: int = 0   # shared memory of the kernel plan (0: none, pre-defined)
    threads: int = 0     # threads per block of the plan (0: pre-defined)
    per_sm: int = 1      # blocks resident per SM at the plan's threads and shared memory
    waves: int = 1
    violation: str = ""  # why the kernel cannot run as planned ("": it can)
    launched: bool = True  # False: a reshape that shares its input's buffer
    # What one block's own streaming rate bounds the kernel to (``_block_rounds_s``;
    # 0 where the profile has no such rate). Part of ``stream_us`` for a kernel launched
    # alone; a member of a grouped launch leaves it to the launch (:func:`grouped_us`).
    block_us: float = 0.0
    # fit.cluster_us once where the plan splits the forloop over a cluster (ksplit >
    # 1): the cluster's barrier and the partials' combine after the loop. A fitted
    # coefficient (``mirage calibrate --fit``), 0 in a profile that has none: lora's
    # 64-block kernel at batch 1, 8 and 16 ran 1.0-1.4 us slower split over clusters
    # of 2 than whole on an H200, where the other terms priced the two alike
    # (docs/perf-log.md v48).
    cluster_us: float = 0.0

    @property
    def binding(self) -> str:
        """The term that sets the kernel's time: memory (DRAM or L2), compute, or
        latency (launch and synchronisation exceed the streaming time)."""
        if not self.launched:
            return "nothing (launches no kernel)"
        if self.launch_us + self.sync_us + self.cluster_us >= self.stream_us:
            return "latency"
        if self.compute_us >= max(self.dram_us, self.l2_us):
            return "compute"
        return "memory (DRAM)" if self.dram_us >= self.l2_us else "memory (L2)"


@dataclass(frozen=True)
class PlanFacts:
    """What the model reads from a custom kernel's plan."""

    smem: int = 0
    threads: int = 0
    ksplit: int = 1     # forloop split over the blocks of a cluster
    stages: int = 1     # pipeline depth of the loop's copies
    scalar: bool = False  # a loop input is copied element by element (vec 1)
    bulk: bool = False    # loop inputs come by bulk tensor copies (TMA)
    chain: bool = False   # a matmul chain kept in registers (knob chain=1)
    # Block matmuls (by output) with an operand gathered element by element from an
    # f32 tile (plan path "direct", :func:`_gathered_mmas`).
    direct: frozenset[str] = frozenset()
    # The chain's matmuls run as wgmma (knob wgmma=1) and its loop does nothing else
    # (no side work, chainplan.side_work).
    wgmma: bool = False
    # A loop input comes by bulk copies in boxes of 32-byte rows (the narrowest swizzle).
    narrow: bool = False
    # A loop input comes by bulk copies in unswizzled boxes (plan.swizzled is false).
    plain: bool = False
    violation: str = ""


def _plan_facts(op: KernelOp, types: dict[str, TensorType], p: Profile,
                joined: frozenset[str] = frozenset(), shifted: frozenset[str] = frozenset()
                ) -> PlanFacts:
    """The facts of a custom kernel's plan (the one it carries, else the default, with
    the ``joined`` concatenations it reads staged, the ``shifted`` ones shifted:
    codegen/joins.py)."""
    assert op.block is not None
    if op.plan is not None:
        facts = _facts(op.block, op.plan)
    else:
        planned = _default_plan(op.block, tuple(sorted(types.items())), p.arch, joined,
                                shifted)
        if isinstance(planned, str):
            return PlanFacts(violation=f"no kernel plan fits: {planned}")
        facts = planned
    if facts.smem > p.smem_per_block:
        return dataclasses.replace(facts, violation=(
            f"the plan's shared memory {facts.smem} B exceeds the {p.smem_per_block} B "
            f"per block"))
    return facts


@functools.lru_cache(maxsize=4096)
def _default_plan(bg: BlockGraph, types: tuple[tuple[str, TensorType], ...], arch: str,
                  joined: frozenset[str] = frozenset(), shifted: frozenset[str] = frozenset()
                  ) -> PlanFacts | str:
    """The facts of the planner's default plan, or why there is none (cached: the tuner
    costs the same kernel many times)."""
    from mirage_cli.codegen.planner import plan_kernel

    try:
        plan = plan_kernel(bg, dict(types), arch, joined=joined, shifted=shifted)
    except MirageError as e:
        return e.message
    return _facts(bg, plan)


def _facts(bg: BlockGraph, plan: KernelPlan) -> PlanFacts:
    k = plan.knobs
    inputs = {bi.value.name for bi in bg.inputs if bi.fmap is not None}
    scalar = any(t.name in inputs and t.home == "smem" and t.vec == 1 for t in plan.tiles)
    bulk = any(t.swizzle for t in plan.tiles)
    return PlanFacts(plan.smem_bytes, plan.threads, k.ksplit or 1, k.stages or 1, scalar,
                     bulk, k.chain == 1, _gathered_mmas(bg, plan),
                     wgmma=k.wgmma == 1 and not _side_work(bg, plan.threads),
                     narrow=any(t.swizzle == NARROW_SWIZZLE for t in plan.tiles),
                     plain=any(t.swizzle and not swizzled(t.swizzle) for t in plan.tiles))


# The narrowest swizzle span (bytes of a bulk-copy box's row): see the profile's
# ``narrow_box_slowdown``.
NARROW_SWIZZLE = SWIZZLE_SPANS[-1]


def _side_work(bg: BlockGraph, threads: int) -> bool:
    """Whether the loop of ``bg``'s matmul chain (at ``threads``, its plan's) also
    computes tensors the chain reads (chainplan.side_work); False without a chain."""
    from mirage_cli.codegen.blockfacts import analyse_at
    from mirage_cli.codegen.chainplan import chain_of, side_work

    a = analyse_at(bg, threads)
    ch = chain_of(a)
    return ch is not None and side_work(a, ch)


def _gathered_mmas(bg: BlockGraph, plan: KernelPlan) -> frozenset[str]:
    """The block matmuls (by output) whose plan reads an operand ``direct`` from a tile
    computed into shared memory as f32: each fragment element is a scalar load and a
    conversion. A staged input read ``direct`` (a weight brought by bulk tensor
    copies, as the streaming matmuls' B) is 16-bit already and was fitted as it is."""
    tiles = {t.name: t for t in plan.tiles}
    staged = {bi.value.name for bi in bg.inputs}

    def f32_tile(name: str) -> bool:
        t = tiles.get(name)
        return (name not in staged and t is not None and t.home == "smem"
                and t.pitch == 0 and not t.swizzle)

    by_output = {op.outputs[0].name: op for op in bg.ops}
    out = set()
    for m in plan.mmas:
        a, b = by_output[m.output].inputs[:2]
        if (m.a_path == "direct" and f32_tile(a)) or (m.b_path == "direct" and f32_tile(b)):
            out.add(m.output)
    return frozenset(out)


def kernel_costs(g: Graph, p: Profile | None = None,
                 co_blocks: dict[int, int] | None = None) -> list[KernelCost]:
    """The model's terms for each kernel of ``g``, in launch order (under ``p``, by
    default the active profile). ``co_blocks``: for a kernel (by op index) that shares
    a launch, the launched blocks of the launch's other members."""
    p = p or profile()
    types = g.tensor_types()
    found = joins(g, p.arch)
    free = aliasing(g).free | joined_ops(g, found)
    # A pre-defined matmul runs as a generated custom kernel: cost that kernel.
    mine = [frozenset(found) & set(op.inputs) for op in g.ops]
    co = co_blocks or {}
    return [NOT_LAUNCHED if i in free else
            _kernel_cost(lowered(op, types), types, p, mine[i], shifted_names(found, mine[i]),
                         co.get(i, 0))
            for i, op in enumerate(g.ops)]


def grouped_us(members: Sequence[KernelCost]) -> float:
    """The model's time of ``members`` (costed with each other's blocks as their
    ``co_blocks``) run as one launch: one grid whose blocks stream the members' bytes
    side by side, so their streaming adds up (each at the whole grid's share of the
    SMs), bounded below by the slowest member's own blocks (they run at once, not in
    turn); the longest loop's synchronisation, and one launch. The Qwen layer's key
    and value projections, tuned alone, ran 128 blocks of 8 columns each beside the
    query projection's 112, and the three 16.1 us; with 16 to 32 blocks of 32 or 64
    columns each, 13.1 to 13.7 (docs/perf-log.md v46)."""
    if len(members) == 1:
        return members[0].time_us
    stream = max(sum(m.stream_us for m in members), max(m.block_us for m in members))
    return stream + max(m.sync_us for m in members) + max(m.launch_us for m in members) \
        + max(m.cluster_us for m in members)


# A reshape whose tensors share one buffer (codegen/aliasing.py), a concatenation read
# in its parts (codegen/joins.py): no kernel, no cost.
NOT_LAUNCHED = KernelCost(0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                          launched=False)


def _kernel_cost(op: KernelOp, types: dict[str, TensorType], p: Profile,
                 joined: frozenset[str] = frozenset(), shifted: frozenset[str] = frozenset(),
                 co_blocks: int = 0) -> KernelCost:
    fit = p.fit
    facts = PlanFacts()
    elem_flops = simt_flops = invariant = 0
    if op.block is None:
        k_dram, k_l2, k_flops, k_smem, blocks = _predefined(op, types, p.num_sms)
    else:
        facts = _plan_facts(op, types, p, joined, shifted)
        c = _custom(op.block, types, facts.direct)
        k_dram, k_l2, k_flops, k_smem, blocks = c.dram, c.l2, c.flops, c.smem, c.blocks
        elem_flops, simt_flops, invariant = c.gathered, c.simt, c.invariant
    plan_smem, threads, ksplit, stages = facts.smem, facts.threads, facts.ksplit, \
        facts.stages
    # A forloop split over a cluster launches ksplit blocks per µGraph block, each
    # running forloop / ksplit iterations.
    blocks *= ksplit
    # A member of a grouped launch shares the SMs with its other members' co_blocks.
    util = min(1.0, (blocks + co_blocks) / p.num_sms)
    # Element-by-element copies (a tile width that is not a multiple of 16 bytes) and
    # mma fragments gathered element by element (a K tile that is not a multiple of
    # 16) run many times slower than 16-byte copies and ldmatrix.
    slow = p.scalar_copy_slowdown or 1.0
    # Bulk tensor copies have their own receive rate and partial-grid exponent where
    # the profile gives them (fitted to cp.async kernels, the common ones priced a
    # bulk-copy weight stream 1.3-1.55x its measured time on an H200, and a 64-block
    # GQA kernel that ran 39.3 us behind a 256-block one that ran 46.3; perf-log v35).
    l2_rate = (p.bulk_l2_bw or p.l2_bw) if facts.bulk else p.l2_bw
    util_exp = p.mem_util_exp
    if facts.bulk and p.bulk_mem_util_exp is not None:
        util_exp = p.bulk_mem_util_exp
    d_s, l_s = k_dram / p.dram_bw, k_l2 / l2_rate
    # A chain kept in registers has its own tensor-core rate: priced at mma_flops
    # (fitted to the far slower attention kernels of docs/perf-log.md v10) every
    # tiling of a chain looked compute-bound alike, blind to the L2 re-reads of K and
    # V that made gqa's (16, 4, 2) grid at batch 8 slower than (16, 2, 4) (v22).
    # A chain run as wgmma with nothing else in its loop is faster again (on an H100,
    # gqa's chain kernels at batch 8 and 16 ran 0.80 and 0.76 of their mma.sync time,
    # docs/perf-log.md v28); with side work it is not (qknorm_gqa: 0.91 to 0.94, and
    # its designs ranked by the faster rate measured slower, v29).
    mma_rate = p.flop_rate
    if facts.chain:
        mma_rate = p.chain_mma_flops or p.flop_rate
        if facts.wgmma and p.chain_wgmma_flops:
            mma_rate = p.chain_wgmma_flops
    c_s = (k_flops + (slow - 1) * elem_flops) / mma_rate
    # A grid on part of the GPU still draws most of the memory bandwidth (on an
    # H200, 64 blocks streamed a weight 1.2x slower than 128, not 2x), while its
    # compute scales with the SMs it occupies.
    mem_util = util ** (util_exp if util_exp is not None else 1.0)
    forloop = op.block.forloop // ksplit if op.block is not None else 4
    copy_slow = slow if facts.scalar and forloop > 1 else 1.0
    # Boxes of 32-byte rows stream slower than wider ones of the same bytes: the Llama
    # layer's gate/up projection at batch 1 ran 72.5 us in them, at batch 8 60.5 in
    # 64-byte boxes, the same weight on as many blocks (docs/perf-log.md v39).
    if facts.narrow and p.narrow_box_slowdown:
        copy_slow *= p.narrow_box_slowdown
    # Unswizzled boxes of 112-byte rows likewise: the Qwen layer's down projection ran
    # 45.8 us in them (56 columns a block) against 38.0 in 128-byte boxes (64 columns),
    # its output projection 12.5 against 9.3 (docs/perf-log.md v42).
    if facts.plain and p.plain_box_slowdown:
        copy_slow *= p.plain_box_slowdown
    mem_s, comp_s = max(d_s, l_s) * copy_slow / mem_util, c_s / util
    # Blocks resident on one SM: bounded by threads and by shared memory per SM.
    per_sm = 1
    if threads:
        per_sm = max(1, min(p.max_threads_per_sm // threads,
                            p.smem_per_sm // max(plan_smem, 1), 32))
    block_s = 0.0
    if p.block_stream_bw:
        rate = (p.bulk_stream_bw or p.block_stream_bw) if facts.bulk else p.block_stream_bw
        block_s = _block_rounds_s(k_dram * copy_slow, blocks, per_sm, p, rate)
        if not co_blocks:
            mem_s = max(mem_s, block_s)
    bound_s = max(mem_s, comp_s)
    # Waves count rounds of one block per SM, whatever the occupancy: on an H200 a
    # second resident block did not double a streaming kernel's rate
    # (rmsnorm_linear and gated_mlp at batch 8: grid 256 at two blocks per SM ran
    # 36.8 and 53.0 µs, grid 128 at one 27.3 and 25.6; docs/perf-log.md v5), so
    # counting it as free picked the slower tuning. ``per_sm`` is reported only.
    waves = -(-(blocks + co_blocks) // p.num_sms)
    # Loads of iteration i+1 overlap compute of iteration i, so one iteration's
    # loads are exposed (the pipeline fill), and each iteration synchronises.
    # A loop with few copies in flight exposes part of each load's latency.
    depth = 1 + p.stage_penalty / stages ** 2 if forloop > 1 else 1.0
    stream = fit["stream"] * (bound_s + _fill_s(mem_s, comp_s, facts.chain) / forloop) * depth
    # A loop's invariant tiles are waited for before its first iteration (the ring's
    # first stages stream meanwhile). With one resident block per SM nothing else
    # runs on the SM meanwhile, in every round of blocks; with more, a later block's
    # wait overlaps the others' loops, and only the first round's is exposed.
    # mha_decode's split at batch 1, its whole 128 KB V tile per block at one block
    # per SM in two rounds, ran 44.5 µs on an H100 where its tilings with 64 KB and
    # two blocks per SM ran 33.7-34.0, which the model ranked after it
    # (docs/perf-log.md v30).
    if forloop > 1 and invariant and p.block_stream_bw:
        rate = (p.bulk_stream_bw or p.block_stream_bw) if facts.bulk else p.block_stream_bw
        resident = min(blocks, p.num_sms * per_sm)
        rounds = -(-blocks // resident) if per_sm == 1 else 1
        stream += fit["stream"] * rounds * max(resident * invariant / p.dram_bw,
                                               invariant / rate)
    # Element-wise math in a custom kernel runs on the CUDA cores of the blocks' few
    # warps, in series with the loop's copies and mma steps: it adds to the kernel's
    # time, at the FMA rate slowed by the profile's ``simt_slowdown``.
    simt_s = simt_flops * (p.simt_slowdown or 1.0) / p.fma_flops / util
    stream += fit["stream"] * simt_s
    sync = fit["sync"] * waves * forloop * p.iter_us * 1e-6
    launch = fit["launch"] * p.launch_us * 1e-6
    cluster = fit.get("cluster_us", 0.0) * 1e-6 if ksplit > 1 else 0.0
    return KernelCost(k_dram, k_l2, k_flops, k_smem, blocks, forloop, d_s * 1e6,
                      l_s * 1e6, c_s * 1e6, util, stream * 1e6, sync * 1e6,
                      launch * 1e6, (stream + sync + launch + cluster) * 1e6, plan_smem,
                      threads, per_sm, waves, facts.violation,
                      block_us=fit["stream"] * block_s * 1e6, cluster_us=cluster * 1e6)


def _fill_s(mem_s: float, comp_s: float, chain: bool) -> float:
    """What the first of a loop's iterations exposes (the pipeline fill, divided by
    the iterations where it is used): the whole bound for most kernels (one
    iteration's loads, before any compute overlaps them), the lesser of memory and
    compute for a matmul chain. A chain's pipeline holds several iterations' K and V
    tiles in flight at once, so only the first tile's compute (or, compute-bound, its
    copy) is exposed: as the whole bound, gqa's chain at batch 1 was predicted 9.1 µs
    at 2 iterations and 8.8 at 8 where an H100 ran 5.98 and 5.79 (docs/perf-log.md v23),
    and the search shipped a tiling that ran 9.5 µs in all against 7.5."""
    return min(mem_s, comp_s) if chain else max(mem_s, comp_s)


def _block_rounds_s(dram: float, blocks: int, per_sm: int, p: Profile, rate: float) -> float:
    """Seconds to stream ``dram`` bytes when each block reads its share at no more than
    ``rate``, the profile's ``block_stream_bw`` (``bulk_stream_bw`` for bulk tensor
    copies; one block keeps only so many bytes in flight, whatever the rest of the GPU
    does): blocks run in rounds of as many as are resident
    at once, each round as slow as its slower limit (the DRAM bandwidth, or one block's
    rate). So a grid of few blocks reads in proportion to its blocks, and a grid a
    little larger than the resident blocks pays a tail round of a few blocks at their
    own rate (148 blocks of a 271 MB weight at one per SM: 132, then 16; the Qwen layer's
    gate/up projection ran 86 µs on an H200 against 65 at the bandwidth)."""
    resident = p.num_sms * per_sm
    per_block = dram / blocks
    full, last = divmod(blocks, resident)
    t = full * max(resident * per_block / p.dram_bw, per_block / rate)
    if last:
        t += max(last * per_block / p.dram_bw, per_block / rate)
    return t


def estimate(g: Graph) -> Cost:
    dram = l2 = flops = smem = 0
    time_s = 0.0
    min_blocks = 0
    violations: list[str] = []
    p = profile()
    ks = kernel_costs(g)
    for i, (op, k) in enumerate(zip(g.ops, ks)):
        if op.block is not None:
            min_blocks = k.blocks if not min_blocks else min(min_blocks, k.blocks)
        if k.smem_bytes > p.smem_per_block:
            violations.append(f"kernel {i}: the model's shared memory {k.smem_bytes} B "
                              f"exceeds the {p.smem_per_block} B per block")
        if k.violation:
            violations.append(f"kernel {i}: {k.violation}")
        time_s += k.time_us * 1e-6
        dram, l2 = dram + k.dram_bytes, l2 + k.l2_bytes
        flops, smem = flops + k.flops, max(smem, k.smem_bytes)
    # The fit's constant is paid once per µGraph (what per-kernel terms do not explain:
    # the graph's own launch, timing overhead); per kernel it would duplicate ``launch``.
    time_us = time_s * 1e6 + p.fit["const_us"]
    return Cost(dram, l2, flops, sum(k.launched for k in ks), smem, min_blocks,
                not violations, time_us, tuple(violations))


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


def lowered(op: KernelOp, types: dict[str, TensorType]) -> KernelOp:
    """``op`` as the kernel it runs: a pre-defined matmul that tiles
    (:func:`mirage_cli.codegen.matmul_tiling.candidates`) as the candidate custom kernel
    this model predicts fastest, anything else as itself."""
    if op.op != "matmul" or op.block is not None:
        return op
    p = dataclasses.replace(profile(), fit=dict(UNIT_FIT))
    key = (types[op.inputs[0]], types[op.inputs[-1]], op.outputs[0].type, repr(p))
    if key not in _TILINGS:
        _TILINGS[key] = _tiling(*key[:3], p)
    choice = _TILINGS[key]
    if choice is None:
        return op
    built = matmul_tiling.build(op, types, *choice)
    assert built is not None
    return built


# The tiling of a pre-defined matmul is chosen with unit coefficients: the choice
# must not move with the fitted coefficients, or ``calibrate --fit`` would fit terms
# that change under it.
UNIT_FIT = (("stream", 1.0), ("sync", 1.0), ("launch", 1.0), ("const_us", 0.0),
            ("cluster_us", 0.0))
_TILINGS: dict[tuple[TensorType, TensorType, TensorType, str], tuple[int, int] | None] = {}


def _tiling(ta: TensorType, tb: TensorType, tc: TensorType, p: Profile
            ) -> tuple[int, int] | None:
    """The (column width, K tile) predicted fastest under ``p``; ties go to wider
    columns, then longer K tiles (fewer blocks and iterations)."""
    types = {"a": ta, "b": tb, "c": tc}
    probe = KernelOp("matmul", ("a", "b"), (Value("c", tc),))
    best: tuple[tuple[bool, float, int, int], tuple[int, int]] | None = None
    for (bn, bk), op in matmul_tiling.candidates(probe, types):
        c = _kernel_cost(op, types, p)
        key = (bool(c.violation), round(c.time_us, 3), -bn, -bk)
        if best is None or key < best[0]:
            best = (key, (bn, bk))
    return None if best is None or best[0][0] else best[1]


def _predefined(op: KernelOp, types: dict[str, TensorType], num_sms: int
                ) -> tuple[int, int, int, int, int]:
    ins = [types[i] for i in op.inputs]
    out = op.outputs[0].type
    nbytes = sum(t.nbytes for t in ins) + out.nbytes
    # A library kernel uses enough blocks to fill the GPU unless the output is tiny.
    blocks = max(1, min(num_sms, out.numel // 1024))
    return nbytes, nbytes, op_flops(op.op, ins, out), 0, blocks


# Tensor cores (mma.sync m16n8k16) take a block matmul's K in whole steps of 16.
MMA_K = 16


def _block_flops(op: str, ins: list[TensorType], out: TensorType) -> int:
    """A block operator's FLOPs as the kernel does them: a matmul's K rounded up to
    whole tensor-core steps (a design that loops over K one row at a time, as one found
    for the Llama layer's Q/K/V projection, does 16x the work: it ran 1530 µs on an H200
    where two-kernel forms take about 40, docs/perf-log.md v16)."""
    flops = op_flops(op, ins, out)
    k = ins[0].shape[-1] if ops.get(op).cuda.kind == "matmul" else 0
    return flops // k * (-(-k // MMA_K) * MMA_K) if k > 0 else flops


@dataclass(frozen=True)
class _Counts:
    """What the model counts in a custom kernel's block graph."""

    dram: int
    l2: int
    flops: int
    smem: int
    blocks: int
    gathered: int   # FLOPs of block matmuls whose mma fragments are gathered
    simt: int       # FLOPs of the other operators, as the blocks run them
    invariant: int = 0  # bytes of one block's loop-invariant loads


def _custom(bg: BlockGraph, types: dict[str, TensorType],
            direct: frozenset[str] = frozenset()) -> _Counts:
    """DRAM bytes, L2 bytes, FLOPs, the model's shared memory, blocks, the FLOPs of
    block matmuls whose mma fragments are gathered element by element (a K tile that is
    not a multiple of 16: the Llama layer's fused attention scores at batch 8, a K of 8
    per iteration, ran 101.7 µs on an H200 where the model said 29.1, docs/perf-log.md
    v17; or, named in ``direct``, one whose plan reads an operand from an f32 tile:
    mqa_decode's rescaled split at batch 8 multiplies its f32 probabilities by V after
    the loop, predicted 20.8 µs as if by ldmatrix, measured 39.8 on an H100, v23), and
    the FLOPs of the element-wise and reduction operators as every block runs them: once per iteration in the loop (a GELU before a loop's
    matmul is recomputed by every block along N), once after it."""
    tiles: dict[str, TensorType] = {}
    loop_l2 = smem = invariant = 0
    sources: set[str] = set()
    looped = {bi.value.name for bi in bg.inputs if bi.fmap is not None}
    for bi in bg.inputs:
        t = tile_type(types[bi.source], bg.grid, bg.forloop, bi.imap, bi.fmap)
        tiles[bi.value.name] = t
        sources.add(bi.source)
        reads = bg.forloop if bi.fmap is not None else 1
        loop_l2 += t.nbytes * reads
        invariant += t.nbytes if bi.fmap is None else 0
        smem += t.nbytes * (2 if bi.fmap is not None else 1)
    flops = elem = simt = gathered_direct = 0
    for bop in bg.ops:
        ins = [tiles[i] for i in bop.inputs]
        out = bop.outputs[0].type
        tiles[bop.outputs[0].name] = out
        smem += out.nbytes
        spec = ops.get(bop.op)
        if spec.is_accumulator:
            continue
        in_loop = any(i in looped for i in bop.inputs)
        if in_loop:
            looped.add(bop.outputs[0].name)
        f = _block_flops(bop.op, ins, out)
        flops += f
        if spec.cuda.kind == "matmul":
            if ins[0].shape[-1] % MMA_K:
                elem += f
            elif bop.outputs[0].name in direct:  # counted where it runs, as simt
                gathered_direct += f * (bg.forloop if in_loop else 1)
        else:
            simt += f * (bg.forloop if in_loop else 1)
    flops *= bg.forloop  # loop-body operators dominate; epilogue ops counted alike
    elem *= bg.forloop
    blocks = bg.num_blocks
    stored = sum(bo.value.type.nbytes for bo in bg.outputs)
    dram = sum(types[s].nbytes for s in sorted(sources)) + stored
    return _Counts(dram, loop_l2 * blocks + stored, flops * blocks, smem, blocks,
                   (elem + gathered_direct) * blocks, simt * blocks, invariant)
