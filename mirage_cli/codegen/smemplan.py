"""Shared memory of a kernel plan: tile sizes, the pipeline depth that fits, tiles moved
to the workspace, and every tile's offset.

:mod:`planner` decides where each tile lives (:class:`TileDraft`, a mutable
:class:`~mirage_cli.kplan.TilePlan`); :func:`allocate` then fits the tiles into the
target's shared memory: it lowers the pipeline depth (unless pinned), moves f32 tiles
to the block's workspace scratch, reads staged inputs from global memory instead, in
that order, and raises a :class:`MirageError` naming the limit when nothing fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_cli import arch as archs
from mirage_cli import ops
from mirage_cli.codegen import tmaplan
from mirage_cli.codegen.blockfacts import Analysis
from mirage_cli.codegen.knobranges import VEC_BYTES
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import DType, TensorType
from mirage_cli.kplan import Home, Knobs, ReducePlan

MAX_STAGES = 8        # copies in flight per loop input: the knob's largest value
DEFAULT_STAGES = 4    # the default depth, lowered until the tiles fit
# The default depth of a grid of at most one block per SM: such a kernel has no second
# block to share the SM's shared memory with, and a deeper ring keeps more of its
# stream in flight and copies more of its weights before the grid-dependency wait.
# Measured (docs/perf-log.md v19): rmsnorm_linear at batch 1, 4 -> 5..8 stages,
# 21.6 -> 19.9 us on an H100; 5 to 8 stages within noise of each other.
ONE_WAVE_STAGES = 6


def pitch_of(t: TensorType, pad: bool) -> int:
    """Elements per shared-memory row: an odd number of 16-byte chunks, so that 8 rows
    read by ``ldmatrix`` (or 8 lanes' 16-byte accesses) fall in distinct banks."""
    n = t.shape[-1]
    chunk = VEC_BYTES // t.dtype.nbytes
    if not pad or n % chunk or (n // chunk) % 2:
        return n
    return n + chunk


def _smem_bytes(t: TensorType, pitch: int) -> int:
    rows = t.numel // t.shape[-1]
    return pad16(rows * pitch * t.dtype.nbytes)


def pad16(n: int) -> int:
    return (n + 15) // 16 * 16


@dataclass
class TileDraft:
    """A tile while it is being planned (a mutable :class:`TilePlan`)."""

    name: str
    type: TensorType
    phase: str
    home: Home
    vec: int = 1
    stages: int = 1
    pitch: int = 0
    smem_offset: int = -1
    scratch_offset: int = -1
    owner: str = ""
    swizzle: int = 0  # copied by bulk tensor copies in swizzled boxes (tmaplan)
    # A joined concatenation's tile (codegen/joins.py): it has no buffer of its own to
    # be read from, so it stays in shared memory.
    joined: bool = False
    # A shifted join's tile: each row the aligned chunks that cover it, one more than
    # its own (joins.py); element (r, c) at the row's shift.
    shifted: bool = False

    def smem_need(self) -> int:
        """Bytes of shared memory: staged inputs (pitch > 0) in their own dtype, one copy
        per pipeline stage (1024-byte slots for bulk tensor copies); other tiles as f32."""
        if self.swizzle:
            return tmaplan.slot_bytes(self.type) * self.stages
        if self.pitch:
            return _smem_bytes(self.type, self.pitch) * self.stages
        return pad16(self.type.numel * 4)


RED = "$red"    # per-warp partial results of block-wide reductions
ZERO = "$zero"  # 16 zero bytes: ldmatrix rows past the end of a short A tile
MBAR = "$mbar"  # one mbarrier per pipeline stage: the bulk tensor copies' completion
RECV = "$recv"  # block 0's mbarrier for the partials its cluster pushes, then the partials


def pushed(a: Analysis) -> list[tuple[str, int]]:
    """(tile, bytes) of each accumulator a cluster's block pushes to block 0 (``push=1``,
    :mod:`cluster`): its f32 tile padded to 16 bytes, in the block graph's order."""
    return [(op.outputs[0].name, pad16(op.outputs[0].type.numel * 4)) for op in a.bg.ops
            if ops.get(op.op).is_accumulator]


def recv_bytes(a: Analysis, k: Knobs) -> int:
    """Bytes of block 0's receive area: the mbarrier the pushed stores complete (16
    bytes, so the slots stay aligned), then a slot of every pushed tile for each other
    block of the cluster (0 without the push form)."""
    if (k.ksplit or 1) == 1 or not k.push:
        return 0
    return ((k.ksplit or 1) - 1) * sum(n for _, n in pushed(a)) + 16


def allocate(a: Analysis, tiles: dict[str, TileDraft], has_mma: bool, reds: list[ReducePlan],
              k: Knobs, pins: Knobs, arch: archs.Arch) -> tuple[int, int]:
    """Shared-memory offsets (and the scratch area) for every tile that needs them;
    returns (dynamic shared memory bytes, scratch floats per block)."""
    W = a.bg.threads // 32
    staged = [t for t in tiles.values() if t.pitch]
    # A tile computed in the loop is written once per iteration: one copy, no pipeline.
    loop_staged = [t for t in staged if t.phase == "loop" and t.name not in a.producer]
    bufs = [t for t in tiles.values() if not t.pitch and t.home in
            ("smem", "acc_regs", "acc_mma", "acc_smem")]
    # The per-warp partials of block-wide reductions, padded to 16 bytes: the zero row
    # after them is read by ldmatrix (with one or two warps, W * 4 bytes left it 8-byte
    # aligned: a misaligned address fault at 64 threads).
    red = pad16(W * 4) if any(r.threads_per_row > 32 for r in reds) else 0
    recv = recv_bytes(a, k)
    extra = red + (16 if has_mma else 0) + recv
    tma = any(t.swizzle for t in staged)
    if tma:  # the mbarriers, and the slack that aligns the base to 1024 bytes at run time
        extra += 8 * MAX_STAGES + tmaplan.ALIGN

    def total() -> int:
        return extra + sum(t.smem_need() for t in staged + bufs if t.scratch_offset < 0)

    # A block's forloop runs forloop / ksplit iterations: no deeper pipeline than that.
    local = a.bg.forloop // (k.ksplit or 1)
    gx, gy, gz = a.bg.grid
    one_wave = gx * gy * gz * (k.ksplit or 1) <= arch.num_sms
    stages = min(k.stages or (ONE_WAVE_STAGES if one_wave else DEFAULT_STAGES), local)
    for t in loop_staged:
        t.stages = stages
    while total() > arch.smem_per_block and pins.stages is None and stages > 1:
        stages -= 1
        for t in loop_staged:
            t.stages = stages
    scratch = 0
    for t in sorted(bufs, key=lambda t: (-t.type.numel, t.name)):
        if total() <= arch.smem_per_block:
            break
        t.scratch_offset = scratch
        scratch += pad16(t.type.numel * 4) // 4
    for t in sorted(staged, key=lambda t: (-t.type.nbytes, t.name)):
        if total() <= arch.smem_per_block:
            break
        if t.name in a.producer or t.joined:  # no global copy to read
            continue
        # Its copy path (and the owner text that described it) goes with it.
        t.home, t.pitch, t.stages, t.swizzle, t.owner = "global", 0, 1, 0, ""
        staged.remove(t)
    if scratch and (k.ksplit or 1) > 1:
        raise MirageError(f"ksplit={k.ksplit} needs every tile in shared memory (the blocks of "
                          f"a cluster share one scratch area): pin fewer stages or no ksplit")
    if total() > arch.smem_per_block:
        raise MirageError(f"the kernel needs {total()} bytes of shared memory, more than the "
                          f"{arch.smem_per_block} a block may use on {arch.name} (pin fewer "
                          f"stages)")
    tma = any(t.swizzle for t in staged)  # again: a tile may have left shared memory
    off = 0
    # Bulk-copied tiles first: every slot is a multiple of 1024 bytes from the base.
    for t in sorted(staged, key=lambda t: not t.swizzle) + [t for t in bufs
                                                             if t.scratch_offset < 0]:
        t.smem_offset = off
        off += t.smem_need()
    if tma:
        tiles[MBAR] = TileDraft(MBAR, TensorType((2 * stages,), DType.F32), "invariant",
                                "smem", smem_offset=off, owner="one mbarrier (8 bytes) per stage")
        off += pad16(8 * stages)
    if extra:
        if red:
            tiles[RED] = TileDraft(RED, TensorType((W,), DType.F32), "epilogue", "smem",
                               smem_offset=off, owner="one partial per warp")
            off += red
        if has_mma:
            tiles[ZERO] = TileDraft(ZERO, TensorType((8,), DType.F16), "invariant", "smem",
                                smem_offset=off, owner="zeros")
            off += 16
        if recv:
            tiles[RECV] = TileDraft(RECV, TensorType((recv // 4,), DType.F32), "epilogue",
                                    "smem", smem_offset=off,
                                    owner="an mbarrier, then the partials pushed by the "
                                          "cluster's other blocks")
            off += recv
    return off + (tmaplan.ALIGN if tma else 0), scratch
