"""Planning: one custom kernel's block graph → its :class:`~mirage_cli.kplan.KernelPlan`.

Expects a checked block graph. Decides, from the block graph, the target and the
knobs (pinned by the user or chosen here), every thread-level fact the emitter needs:
where each tile lives, how wide its accesses are, the pipeline depth, the shared
memory layout (row pitches padded against bank conflicts), how tensor-core matmuls are
spread over warps and how reductions are spread over threads: row kernels and direct
kernels here, loops through :mod:`layout`. Guarantees a plan that fits the target's
shared memory, or a :class:`MirageError` naming the knob or the tile that does not
fit. :func:`knob_space` gives each knob's legal values, :func:`check_pins` refuses the
others.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from mirage_cli import arch as archs
from mirage_cli import ops
from mirage_cli.check import online_reads
from mirage_cli.codegen import chainplan
from mirage_cli.codegen.blockfacts import (
    Analysis,
    analyse,
    analyse_at,
    decompose,
    row_kind,
    row_tile,
    rows_in_registers,
)
from mirage_cli.codegen.directfacts import direct_locals, direct_reason
from mirage_cli.codegen.knobranges import (
    default_threads,
    ksplit_range,
    kwarps_range,
    stagger_range,
    vec_range,
)
from mirage_cli.codegen.layout import fused_finishes, lay_out, mma_plans, resolve
from mirage_cli.codegen.smemplan import MAX_STAGES, TileDraft
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import BlockGraph, DType, TensorType
from mirage_cli.kplan import KernelPlan, Knobs, ReducePlan, TilePlan

# -- the plan ---------------------------------------------------------------------------

# Thread counts a pin may name: whole warps, up to the 1024 threads of a block.
THREAD_COUNTS = (32, 64, 128, 256, 512, 1024)
# The thread counts a kernel's tuning space offers besides its own and the default.
TUNED_THREADS = (64, 128, 256, 512)


# A kernel that reads a shifted join reads it only as its chain's gathered key operand
# (layout's "gather" path), and is bound by the gather, which its warps share: four
# times the warps of the default (two per 16-row tile become eight). On an H200 the
# Llama-3-8B layer's attention, one 16-row tile per block, ran 79.1 us with 2 warps,
# 49.3 with 4 and 50.4 with 8 at batch 8, and 152.0 with 2 against 78.2 with 8 at
# batch 16 (perf-log v41).
GATHER_WARPS_FACTOR = 4


def plan_kernel(bg: BlockGraph, dev_types: Mapping[str, TensorType], target: str,
                pins: Knobs | None = None, joined: frozenset[str] = frozenset(),
                shifted: frozenset[str] = frozenset()) -> KernelPlan:
    """The plan of one custom kernel for ``target`` with the given knob pins;
    ``joined``: device tensors it reads that are concatenations read in place
    (codegen/joins.py), which it stages in shared memory by ``cp.async`` or scalar
    copies (the loop kernel's staging picks each chunk's part); ``shifted``: those of
    them that are shifted joins, which take GATHER_WARPS_FACTOR times the default's
    threads (else twice, else the default) unless threads or warps are pinned."""
    pins = pins or Knobs()
    if pins.threads or pins.kwarps or not shifted & {bi.source for bi in bg.inputs}:
        return _plan_kernel(bg, dev_types, target, pins, joined, shifted)
    base = default_threads(bg, target)
    for threads in (base * GATHER_WARPS_FACTOR, base * 2):
        if threads in TUNED_THREADS:
            try:
                return _plan_kernel(bg, dev_types, target,
                                    dataclasses.replace(pins, threads=threads), joined,
                                    shifted)
            except MirageError:  # no warp layout or no room at these threads: fewer
                continue
    return _plan_kernel(bg, dev_types, target, pins, joined, shifted)


def _plan_kernel(bg: BlockGraph, dev_types: Mapping[str, TensorType], target: str,
                 pins: Knobs, joined: frozenset[str], shifted: frozenset[str]) -> KernelPlan:
    arch = archs.get(target)
    check_pins(bg, dev_types, target, pins)
    threads = pins.threads or default_threads(bg, target)
    if pins.kwarps and not pins.threads and online_reads(bg):
        # No chain, no kernel: threads that give the pinned split of the columns a layout.
        ch = chainplan.chain_of(analyse_at(bg, threads))
        threads = next((t for t in (threads, *TUNED_THREADS)
                        if ch is not None and chainplan.lays_out(ch, t, pins.kwarps)), threads)
    bg = dataclasses.replace(bg, threads=threads)
    a = analyse(decompose(bg))
    shifted = frozenset(bi.value.name for bi in bg.inputs if bi.source in shifted)
    joined = frozenset(bi.value.name for bi in bg.inputs if bi.source in joined)
    if not joined and rows_in_registers(a, dev_types, bg.threads) is None:
        return _row_plan(a, dev_types, target, pins)
    if not joined and direct_reason(a) is None:
        if not pins.threads:
            a = analyse(dataclasses.replace(a.bg, threads=direct_threads(a)))
        return _direct_plan(a, dev_types, target, pins)
    k, tiles, mmas, reds, smem, scratch = lay_out(a, dev_types, pins, arch, joined, shifted)
    k = dataclasses.replace(k, stages=max([t.stages for t in tiles.values()] + [1]))
    if k.chain != 1:
        mmas = mma_plans(a, tiles, k)  # operand paths again: a tile may have left shared memory
    T = bg.threads
    for name, u in fused_finishes(a, tiles, reds).items():
        tiles[u.outputs[0].name].owner = (f"f32 tile; written with {name} by the lanes that "
                                          f"combine each of its rows")
    out = []
    for t in tiles.values():
        if not t.owner:
            t.owner = _owner(t, T)
        out.append(TilePlan(t.name, t.home, t.owner, t.vec, t.stages, t.smem_offset, t.pitch,
                            t.scratch_offset, t.swizzle))
    return KernelPlan(target, T, k, smem, scratch, tuple(out), tuple(mmas), tuple(reds))


def _row_plan(a: Analysis, dev_types: Mapping[str, TensorType], target: str, pins: Knobs
              ) -> KernelPlan:
    """A row kernel with its rows in registers (``codegen/rowregs.py``): no tile in
    shared memory, 16-byte chunks, one block-wide reduction per row reduction."""
    T = a.bg.threads
    shape = row_tile(a)
    assert shape is not None
    # Every knob resolved, as in the other plans: the tuner ranks deviations from them.
    k = dataclasses.replace(resolve(a, dev_types, pins), stages=1, ksplit=1, tma=0, wgmma=0)
    owner = (f"registers: 8-element chunk c of each row held by thread c % {T} in every "
             f"tile ({shape[0] * shape[1] // 8 // T} chunk(s) per thread)")
    tiles = tuple(TilePlan(n, "regs", owner if t.shape[-1] > 1 else
                           "registers: one value per row, in every thread", 8 if t.shape[-1] > 1
                           else 1) for n, t in a.types.items())
    reds = tuple(ReducePlan(op.outputs[0].name, "block", T) for op in a.bg.ops
                 if op.outputs[0].type.shape[-1] == 1
                 and (not ops.get(op.op).is_accumulator or row_kind(op, a) == "row"))
    return KernelPlan(target, T, k, 0, 0, tiles, (), reds)


def direct_threads(a: Analysis) -> int:
    """Threads of a direct kernel: its planned count, but no more warps than its
    largest output tile has elements for (one element per thread)."""
    largest = max(a.types[bo.source].numel for bo in a.bg.outputs)
    return max(32, min(a.bg.threads, -(-largest // 32) * 32))


def _direct_plan(a: Analysis, dev_types: Mapping[str, TensorType], target: str, pins: Knobs
                 ) -> KernelPlan:
    """A kernel computed element by element from global memory (``codegen/direct.py``):
    no tile staged, no shared memory, no barrier."""
    T = a.bg.threads
    k = dataclasses.replace(resolve(a, dev_types, pins), stages=1, ksplit=1, chain=0,
                            tma=0, vec=1, wgmma=0)
    local = set(direct_locals(a))
    inputs = {bi.value.name for bi in a.bg.inputs}
    tiles = []
    for n in a.types:
        if n in inputs:
            tiles.append(TilePlan(n, "global", f"global memory: read where used by the "
                                  f"thread of each output element ({T} threads in turn)"))
        else:
            tiles.append(TilePlan(n, "inline", "registers: computed once per output element "
                                  "by its thread" if n in local else
                                  "registers: computed where read"))
    reds = tuple(ReducePlan(n, "thread", 1) for n in a.types if n in local
                 and ops.get(a.producer[n].op).cuda.kind != "elementwise")
    return KernelPlan(target, T, k, 0, 0, tuple(tiles), (), reds)


def _owner(t: TileDraft, threads: int) -> str:
    match t.home:
        case "smem" if t.type.dtype is not DType.F32 and t.pitch:
            if t.shifted:
                return (f"{t.vec}-element cp.async chunks covering each row of the "
                        f"concatenation's first part (rows at their own shifts; the second "
                        f"part's columns read from global memory), chunk c copied by thread "
                        f"c % {threads}; row pitch {t.pitch}")
            return (f"{t.vec}-element cp.async chunks, chunk c copied by thread c % {threads}"
                    + (" from the part of the concatenation it lies in" if t.joined else "")
                    + f"; row pitch {t.pitch}")
        case "global":
            return f"read from global memory where used; element e by thread e % {threads}"
        case "inline":
            return "registers: computed where read"
        case "acc_regs":
            return f"registers: element e by thread e % {threads}"
        case _:
            return f"f32 tile; element e written by thread e % {threads}"


def knob_space(bg: BlockGraph, dev_types: Mapping[str, TensorType], target: str,
               given: Knobs | None = None) -> dict[str, list[int]]:
    """Each knob's legal values for this kernel (the tuning space of the design); the
    pipeline depths are those that keep the tile placement of the plan with ``given``
    (the other knobs pinned, see :func:`_stage_range`)."""
    threads = sorted({bg.threads, default_threads(bg, target), *TUNED_THREADS})
    a = analyse_at(bg, default_threads(bg, target))
    kwarps = kwarps_range(a)
    online = bool(online_reads(bg))
    if online:  # only a chain carries the kernel: the thread counts it has
        at = {t: analyse_at(bg, t) for t in threads}
        threads = [t for t in threads if chainplan.online_kwarps(
            chainplan.chain_of(at[t]), t // 32, kwarps_range(at[t])) is not None] or threads
        # A pinned split of the columns takes the threads that lay it out (plan_kernel).
        kwarps = sorted({kw for t in threads for kw in kwarps_range(at[t])
                         if chainplan.online_kwarps(chainplan.chain_of(at[t]), t // 32, [kw])
                         is not None}) or kwarps
    # A direct kernel stores one element per thread (codegen/direct.py).
    vec = [1] if direct_reason(a) is None else vec_range(a, dev_types)
    wgmma = _wgmma_legal(bg, threads, dev_types, target)
    ksplit = (ksplit_range(a, target) if _no_scratch(a, dev_types, target) and not online
              else [1])
    return {"stages": _stage_range(a, dev_types, target, given),
            "kwarps": kwarps, "pad": [0, 1],
            "ldmatrix": [1] if online else [0, 1],  # a chain's operands need it
            "stage_once": [0, 1], "vec": vec, "threads": threads,
            "ksplit": ksplit,
            "stagger": stagger_range(a), "chain": chainplan.chain_range(a, kwarps),
            # A chain's B tiles are bulk-copied only for wgmma.
            "tma": [0, 1] if wgmma or _tma_legal(a, dev_types, target) else [0],
            "wgmma": [0, 1] if wgmma else [0],
            # The combine's form where the forloop splits over a cluster (without one,
            # push=1 changes nothing).
            "push": [0, 1] if len(ksplit) > 1 else [0]}


def _stage_range(a: Analysis, dev_types: Mapping[str, TensorType], target: str,
                 given: Knobs | None = None) -> list[int]:
    """Pipeline depths up to the forloop's length at which every tile stays where the
    plan with the ``given`` knobs (the default plan without them) keeps it. A deeper
    ring that pushes a loop tile out of shared memory (into global memory, or an
    accumulator into the scratch area) is another design, not a tuning of this one:
    rmsnorm_linear at batch 16 ran 18.4 us with 6 stages and 78.6 with 7, its weight
    read from global memory (docs/perf-log.md v32). The other knobs count: unpadded
    rows (pad=0) or bulk-copied tiles leave room for a deeper ring than the default
    plan's, and that plan's own depth must stay legal when its knobs are pinned again."""
    top = min(MAX_STAGES, a.bg.forloop)
    if top <= 1:
        return [1]
    given = dataclasses.replace(given or Knobs(), stages=None)
    default = _tiles_with(a, dev_types, given, target)
    if default is None:  # no layout with these pins: nothing to keep (lay_out reports it)
        return list(range(1, top + 1))
    legal = [s for s in range(1, top + 1)
             if (tiles := _tiles_with(a, dev_types, dataclasses.replace(given, stages=s),
                                      target)) is not None
             and _placement(tiles) == _placement(default)]
    return legal or [1]


def _placement(tiles: Mapping[str, TileDraft]) -> tuple[tuple[str, str, bool], ...]:
    """Each tile's home, and whether it was moved to the scratch area."""
    return tuple(sorted((n, t.home, t.scratch_offset >= 0) for n, t in tiles.items()))


def _wgmma_legal(bg: BlockGraph, threads: list[int], dev_types: Mapping[str, TensorType],
                 target: str) -> bool:
    """Whether the kernel's matmul chain can run as wgmma at one of ``threads`` (sm_90
    only): the warpgroups need one warp per 16-row tile, which the default thread count
    of a chain with a running maximum (two warps per tile) does not give."""
    if target != "sm_90":
        return False
    for t in threads:
        a = analyse_at(bg, t)
        if chainplan.chain_of(a) is None:
            return False
        if _tiles_with(a, dev_types, Knobs(ksplit=1, chain=1, wgmma=1), target) is not None:
            return True
    return False


def _tma_legal(a: Analysis, dev_types: Mapping[str, TensorType], target: str) -> bool:
    """Whether bulk tensor copies apply to some tile of the default plan (sm_90 only)."""
    if target != "sm_90":
        return False
    for chain in (0, 1):  # a kernel whose loop only a chain carries lays out with one
        tiles = _tiles_with(a, dev_types, Knobs(ksplit=1, tma=1, chain=chain, wgmma=0), target)
        if tiles is not None and any(t.swizzle for t in tiles.values()):
            return True
    return False


def _tiles_with(a: Analysis, dev_types: Mapping[str, TensorType], pins: Knobs, target: str
                ) -> dict[str, TileDraft] | None:
    """The tiles of the plan with ``pins``, or None where those pins have no plan."""
    try:
        return lay_out(a, dev_types, pins, archs.get(target))[1]
    except MirageError:
        return None


def _no_scratch(a: Analysis, dev_types: Mapping[str, TensorType], target: str) -> bool:
    """Whether the default plan keeps every tile out of the workspace scratch area (a
    cluster's blocks cannot split the forloop otherwise)."""
    return lay_out(a, dev_types, Knobs(ksplit=1), archs.get(target))[5] == 0


def check_pins(bg: BlockGraph, dev_types: Mapping[str, TensorType], target: str,
               pins: Knobs) -> None:
    """A diagnostic for a pinned knob outside its legal range."""
    if pins == Knobs():  # nothing pinned: the planner's own choices are legal
        return
    if pins.threads is not None:
        if pins.threads not in THREAD_COUNTS:  # before anything plans with it
            raise MirageError(f"plan knob threads={pins.threads} is not legal for this kernel "
                              f"(legal values: {', '.join(map(str, THREAD_COUNTS))})")
        bg = dataclasses.replace(bg, threads=pins.threads)
    space = knob_space(bg, dev_types, target, pins)
    for name, value in dataclasses.asdict(pins).items():
        if value is not None and value not in space[name]:
            raise MirageError(f"plan knob {name}={value} is not legal for this kernel "
                              f"(legal values: {', '.join(map(str, space[name]))})")
