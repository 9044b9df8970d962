"""Laying a custom kernel out: its knobs resolved (pinned, or the planner's choice), where
each tile lives (:mod:`homes`), bulk tensor copies, how its tensor-core matmuls and
reductions are spread over warps and threads, and its shared-memory allocation
(:mod:`smemplan`). :mod:`planner` turns a layout into a :class:`~mirage_cli.kplan.KernelPlan`
and derives each knob's legal values from layouts tried here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from mirage_cli import arch as archs
from mirage_cli import ops
from mirage_cli.check import online_reads
from mirage_cli.codegen import chainplan, colstats, tmaplan
from mirage_cli.codegen.blockfacts import (
    Analysis,
    acc_row_reduction,
    direct_acc,
    fused_finish,
    is_mma,
    lanes_per_result,
    row_reduction,
    scaled_operand,
    threads_per_row,
)
from mirage_cli.codegen.chainfacts import Chain
from mirage_cli.codegen.homes import homes
from mirage_cli.codegen.knobranges import (
    VEC_BYTES,
    acc_in_registers,
    default_ksplit,
    default_stagger,
    ksteps,
    kwarps_range,
    mma_tiles_per_warp,
    streams,
    vec_range,
)
from mirage_cli.codegen.plan import swizzled
from mirage_cli.codegen.smemplan import TileDraft, allocate
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import BlockOp, DType, TensorType
from mirage_cli.kplan import Knobs, MmaPlan, ReducePlan, TilePlan

# The planner's choices where nothing is pinned (None: chosen from the kernel).
DEFAULTS = Knobs(stages=None, kwarps=None, pad=1, ldmatrix=1, stage_once=1, vec=None)


def lay_out(a: Analysis, dev_types: Mapping[str, TensorType], pins: Knobs, arch: archs.Arch,
            joined: frozenset[str] = frozenset(), shifted: frozenset[str] = frozenset()
            ) -> tuple[Knobs, dict[str, TileDraft], list[MmaPlan], list[ReducePlan], int, int]:
    """Knobs resolved, tile homes, mma and reduction mappings, and the shared-memory
    allocation: (knobs, tiles, mmas, reductions, shared memory bytes, scratch floats).
    ``joined``: input tiles of concatenations read in place (codegen/joins.py), staged
    by ``cp.async`` or scalar copies; ``shifted``: those of shifted joins, which only a
    matmul chain's key operand reads (:func:`_gathered`)."""
    k = resolve(a, dev_types, pins)
    if pins.ksplit is None and not online_reads(a.bg):  # a cluster's combine adds, unscaled
        k = dataclasses.replace(k, ksplit=default_ksplit(a, arch))
    if pins.wgmma is None and k.chain == 1 and k.kwarps == 1 and arch.name == "sm_90":
        # wgmma where the chain's layout admits it: on an H100 (docs/perf-log.md v28)
        # gqa's chain kernel at batch 8 ran 20.5 -> ~16 us, the whole µGraph 23.6 ->
        # 19.0 us at batch 8 and 38.9 -> 29.6 at batch 16, the same rounding error.
        try:
            return _lay_out_with(a, dev_types, dataclasses.replace(k, wgmma=1), pins, arch,
                                 joined, shifted)
        except MirageError:
            pass
    try:
        return _lay_out_with(a, dev_types, k, pins, arch, joined, shifted)
    except MirageError:
        if k.ksplit == 1 or pins.ksplit is not None:
            raise
        # The default split did not fit (a cluster needs every tile in shared memory).
        return _lay_out_with(a, dev_types, dataclasses.replace(k, ksplit=1), pins, arch,
                             joined, shifted)


def _lay_out_with(a: Analysis, dev_types: Mapping[str, TensorType], k: Knobs, pins: Knobs,
                  arch: archs.Arch, joined: frozenset[str] = frozenset(),
                  shifted: frozenset[str] = frozenset()
                  ) -> tuple[Knobs, dict[str, TileDraft], list[MmaPlan], list[ReducePlan], int, int]:
    tiles = homes(a, dev_types, k, joined, shifted)
    ch = chainplan.chain_of(a) if k.chain == 1 else None
    if online_reads(a.bg) and (ch is None or k.ksplit != 1):
        raise MirageError(
            "this kernel's loop reads an accumulator's result (a running maximum), which "
            "only a matmul chain in registers carries (chain=1, ksplit=1); here: "
            + chainplan.why_not(a, k.kwarps or 1))
    if ch is not None:
        mmas, reds = _chain(a, ch, tiles, k)
    else:
        mmas, reds = mma_plans(a, tiles, k), _reductions(a, tiles)
    if shifted:
        mmas = _gathered(a, dev_types, ch, k, shifted, mmas)
    if k.wgmma == 1 and ch is None:
        raise MirageError("plan knob wgmma=1 needs a matmul chain in registers (chain=1)")
    # wgmma reads the swizzled boxes.
    bulk = (_tma_tiles(a, dev_types, tiles, mmas, _side_read(a, ch, k), joined)
            if arch.name == "sm_90" else {})
    if k.wgmma == 1:
        assert ch is not None
        bulk = _wgmma_operands(ch, bulk, pins)
        k = dataclasses.replace(k, tma=1)
    if k.tma is None:  # tmaplan: twice the per-SM rate of cp.async
        k = dataclasses.replace(k, tma=1 if _bulk_by_default(a, dev_types, ch, bulk, joined)
                                else 0)
    if k.tma == 1:
        for name, swizzle in bulk.items():
            t = tiles[name]
            t.swizzle, t.pitch = swizzle, t.type.shape[-1]
            how = f"{swizzle}-byte swizzle" if swizzled(swizzle) else "unswizzled"
            t.owner = (f"bulk tensor copies (TMA): {tmaplan.boxes(t.type, swizzle)} box(es) of "
                       f"{tmaplan.rows(t.type)} rows x {swizzle} B, {how}, "
                       f"issued by thread 0, one mbarrier per stage")
    smem, scratch = allocate(a, tiles, bool(mmas), reds, k, pins, arch)
    if ch is not None and any(tiles[n].home != "smem" for n in _chain_operands(ch)):
        raise MirageError("chain=1 needs the matmul operands in shared memory, which they "
                          "do not fit (pin fewer stages or chain=0)")
    return k, tiles, mmas, reds, smem, scratch


def _bulk_by_default(a: Analysis, dev_types: Mapping[str, TensorType], ch: Chain | None,
                     bulk: Mapping[str, int], joined: frozenset[str] = frozenset()) -> bool:
    """Whether a loop's inputs come by bulk copies unpinned: a loop that streams a weight
    from DRAM (a few small tiles wait on latency instead, which one issuing thread and
    an mbarrier add to: lora at batch 8 on an H100, 3.9 -> 5.1 us, perf-log v19); a
    matmul chain read by ldmatrix only where they bring every loop input, whatever its
    size: on an H200 the decode attentions' chain kernels ran faster with their K and V
    tiles by bulk copies (mqa_decode at batch 1 8.84 -> 7.89 us, mha_decode at batch 8
    144.1 -> 133.3, at batch 1 25.3 -> 24.5), while qknorm_gqa at batch 1, whose key
    tiles are also read element by element for their norms and so stay on cp.async,
    ran slower with its value tiles alone by bulk copies (9.70 -> 10.20; perf-log v37).
    A ``joined`` concatenation's tiles come by cp.async (a box lies in one tensor), and
    the chain's other loop inputs still by bulk copies: the Llama layer's attention at
    batch 8, its value cache joined, ran 49.5 us with both tiles by cp.async, against
    38.4 with both by bulk copies from the two copied caches (perf-log v40).
    """
    if not bulk:
        return False
    if ch is None:
        return streams(a, dev_types)
    return all(bi.value.name in bulk or bi.value.name in joined for bi in a.bg.inputs
               if a.phases[bi.value.name] == "loop")


def _tma_tiles(a: Analysis, dev: Mapping[str, TensorType], tiles: dict[str, TileDraft],
               mmas: list[MmaPlan], side_read: frozenset[str] = frozenset(),
               joined: frozenset[str] = frozenset()) -> dict[str, int]:
    """The loop inputs that bulk tensor copies can bring in (tmaplan), with their swizzle
    span: staged tiles read only as ldmatrix operands of tensor-core matmuls, or also,
    those in ``side_read``, element by element through the expression engine (which
    reads the swizzled layout too); never a joined concatenation's (a box is cut from
    one tensor)."""
    paths = {m.output: m for m in mmas}
    out: dict[str, int] = {}
    for bi in a.bg.inputs:
        name, t = bi.value.name, bi.value.type
        tile = tiles[name]
        if tile.home != "smem" or not tile.pitch or a.phases[name] != "loop" \
                or name in joined:
            continue
        readers = all(_ldmatrix_reader(u, name, paths) or name in side_read
                      for u in a.uses[name])
        if a.uses[name] and readers and tmaplan.fits(t, dev[bi.source]):
            out[name] = tmaplan.swizzle_of(t)
    return out


def _side_read(a: Analysis, ch: Chain | None, k: Knobs) -> frozenset[str]:
    """B1 of a wgmma chain whose column statistics (qknorm's key norms) all warps compute
    through shared memory: they read its elements by the expression engine."""
    if ch is None or k.wgmma != 1 or ch.cols is None:
        return frozenset()
    lay = chainplan.layout(ch, a.bg.threads // 32, k.kwarps or 1)
    if isinstance(lay, str) or colstats.in_fragments(ch, lay):
        return frozenset()
    return frozenset({ch.first.inputs[1]})


def _wgmma_operands(ch: Chain, bulk: dict[str, int], pins: Knobs) -> dict[str, int]:
    """The chain's B tiles, which wgmma reads by descriptor from bulk-copied boxes with
    the 128-byte swizzle; a diagnostic where they cannot be."""
    bs = (ch.first.inputs[1], ch.second.inputs[1])
    if pins.tma == 0:
        raise MirageError("plan knob wgmma=1 reads its B operands from bulk tensor copies: "
                          "it needs tma=1")
    if any(bulk.get(b) != chainplan.WGMMA_SWIZZLE for b in bs):
        raise MirageError("plan knob wgmma=1 needs both B operands of the chain loaded by "
                          f"bulk tensor copies in {chainplan.WGMMA_SWIZZLE}-byte swizzled "
                          f"boxes (rows of a multiple of {chainplan.WGMMA_N} 16-bit elements, "
                          "at most 256 rows)")
    return {b: bulk[b] for b in bs}


def _ldmatrix_reader(user: BlockOp | None, name: str, paths: Mapping[str, MmaPlan]) -> bool:
    """Whether ``user`` reads tile ``name`` only as an ldmatrix operand of an mma (not
    stored, not read by another operator)."""
    mp = paths.get(user.outputs[0].name) if user is not None else None
    if user is None or mp is None:
        return False
    return ((user.inputs[0] != name or mp.a_path in ("ldmatrix", "held"))
            and (user.inputs[1] != name or mp.b_path in ("ldmatrix.trans", "wgmma")))


def _gathered(a: Analysis, dev: Mapping[str, TensorType], ch: Chain | None, k: Knobs,
              shifted: frozenset[str], mmas: list[MmaPlan]) -> list[MmaPlan]:
    """The mma plans with the chain's key operand (B of its first matmul) gathered
    element by element from its shifted tile (``b_path`` "gather": its rows lie at
    shifts ldmatrix cannot read); a diagnostic where a shifted tile is read otherwise."""
    why = _why_not_gathered(a, dev, ch, k, shifted)
    if why is not None:
        raise MirageError(f"a concatenation whose first part's rows are not whole 16-byte "
                          f"chunks is read in place only as a matmul chain's key operand: "
                          f"{why}")
    assert ch is not None
    first = ch.first.outputs[0].name
    return [dataclasses.replace(m, b_path="gather") if m.output == first else m
            for m in mmas]


def _why_not_gathered(a: Analysis, dev: Mapping[str, TensorType], ch: Chain | None,
                      k: Knobs, shifted: frozenset[str]) -> str | None:
    if ch is None or k.wgmma == 1:
        return "this kernel has no matmul chain in registers on tensor cores (chain=1, wgmma=0)"
    if ch.cols is not None:
        return "the chain also reads the key operand's columns for their statistics"
    b1 = ch.first.inputs[1]
    if shifted != {b1} or a.uses[b1] != [ch.first]:
        return "the tile is read by another operator than the chain's first matmul"
    bi = next(bi for bi in a.bg.inputs if bi.value.name == b1)
    t, src = bi.value.type, dev[bi.source]
    chunk = VEC_BYTES // t.dtype.nbytes
    last = len(t.shape) - 1
    if any(n != 1 for n in t.shape[:-2]) or t.shape[-1] % chunk:
        return (f"its tile {list(t.shape)} is not one matrix of rows of whole 16-byte "
                f"chunks")
    splits = [g for g, d in zip(a.bg.grid, bi.imap) if d == last]
    if any(src.shape[-1] // g % chunk for g in splits):
        return "the blocks' tiles do not start at whole 16-byte chunks of a row"
    return None


def _chain_operands(ch: Chain) -> tuple[str, str, str]:
    return ch.first.inputs[0], ch.first.inputs[1], ch.second.inputs[1]


def _chain(a: Analysis, ch: Chain, tiles: dict[str, TileDraft], k: Knobs
           ) -> tuple[list[MmaPlan], list[ReducePlan]]:
    """Homes, mma and reduction entries of a matmul chain in registers (chainplan)."""
    lay = chainplan.layout(ch, a.bg.threads // 32, k.kwarps or 1)
    if isinstance(lay, str):
        raise MirageError(f"plan knob chain=1 is not legal here: {lay}")
    dt = ch.first.outputs[0].type.dtype
    if k.ldmatrix != 1 or not all(_ldmatrix_ok(tiles[n], dt) for n in _chain_operands(ch)):
        raise MirageError("plan knob chain=1 needs ldmatrix=1 and the matmul operands staged "
                          "in shared memory as 16-byte rows")
    if k.wgmma == 1:
        why = chainplan.wgmma_reason(ch, lay)
        if why is not None:
            raise MirageError(f"plan knob wgmma=1 is not legal here: {why}")
    a_path = "held" if chainplan.holds_a(a, ch, lay) else "ldmatrix"
    mmas, reds, owners = chainplan.plan_entries(ch, lay, a_path, wgmma=k.wgmma == 1)
    for name in ch.members | colstats.values(ch, lay):
        tiles[name].home = "frag"
    reds = reds + _tile_reductions(a, tiles)
    tiles[ch.acc.outputs[0].name].home = "acc_mma"
    for op in ch.row_accs:
        tiles[op.outputs[0].name].home = "acc_regs"
    for name, owner in owners.items():
        tiles[name].owner = owner
    return mmas, reds


def resolve(a: Analysis, dev: Mapping[str, TensorType], pins: Knobs) -> Knobs:
    """Pinned knobs, and the planner's choice for the others."""
    d = dataclasses.asdict(DEFAULTS)
    d.update({k: v for k, v in dataclasses.asdict(pins).items() if v is not None})
    d["threads"] = a.bg.threads
    if d["ksplit"] is None:
        d["ksplit"] = 1  # the caller (lay_out) chooses the default split
    if d["stagger"] is None:
        d["stagger"] = default_stagger(a, dev)
    ch = chainplan.chain_of(a) if d["chain"] != 0 and d["ldmatrix"] == 1 else None
    if ch is not None:
        # The chain's warps split the score's columns only where there are fewer 16-row
        # tiles than warps: every warp then owns rows.
        kw = d["kwarps"] or chainplan.default_kwarps(ch, a.bg.threads // 32)
        if d["wgmma"] == 1 and not d["kwarps"]:
            kw = 1  # a warpgroup's warps each own whole rows
        elif ch.online is not None and not d["kwarps"]:
            # No chain, no kernel: any split of the columns that gives a layout.
            kw = chainplan.online_kwarps(ch, a.bg.threads // 32, kwarps_range(a)) or kw
        ok = not isinstance(chainplan.layout(ch, a.bg.threads // 32, kw), str)
        if d["chain"] is None:
            d["chain"] = 1 if ok else 0
        if d["chain"] == 1:
            d["kwarps"] = kw
    if d["chain"] is None:
        d["chain"] = 0
    if d["wgmma"] is None:
        d["wgmma"] = 0
    if d["push"] is None:
        d["push"] = 0  # the shared epilogue (cluster.py); push is for measurement to pick
    if d["kwarps"] is None:
        # Measured on an H200 (docs/perf-log.md): splitting K pays while each warp keeps
        # at least 8 mma steps per iteration; past that the fragment sums cost more.
        steps = max([ksteps(op, a) for op in a.bg.ops if is_mma(op, a.bg.threads)] + [1])
        d["kwarps"] = max(kw for kw in kwarps_range(a) if kw == 1 or steps // kw >= 8)
    if d["vec"] is None:
        d["vec"] = max(vec_range(a, dev))
    return Knobs(**d)


def mma_plans(a: Analysis, tiles: dict[str, TileDraft], k: Knobs) -> list[MmaPlan]:
    W = a.bg.threads // 32
    out = []
    for op in a.bg.ops:
        if not is_mma(op, a.bg.threads):
            continue
        name = op.outputs[0].name
        acc = direct_acc(op, a)
        kw = (k.kwarps or 1) if acc is not None else 1
        per_warp = mma_tiles_per_warp(op, W // kw)
        if acc is not None and not acc_in_registers(op, W // kw):
            acc, kw = None, 1
            per_warp = mma_tiles_per_warp(op, W)
        if acc is not None:
            tiles[name].home = "inline"
            tiles[acc.outputs[0].name].home = "acc_mma"
            tiles[acc.outputs[0].name].owner = (
                f"mma m16n8 accumulator fragments: {W // kw} warp group(s) x {kw} "
                f"K-split warp(s), {per_warp} tile(s) per warp")
        else:
            tiles[name].home = "smem"
        ta, tb = tiles[op.inputs[0]], tiles[op.inputs[1]]
        dt = op.outputs[0].type.dtype
        K, N = ta.type.shape[-1], tb.type.shape[-1]
        use = k.ldmatrix == 1
        a_ok = use and _ldmatrix_ok(ta, dt) and K % 16 == 0
        b_ok = use and _ldmatrix_ok(tb, dt) and K % 16 == 0 and N % 8 == 0
        # An operand computed inline as a staged tile times a column vector (homes).
        scaled = ta.home == "inline" and scaled_operand(op.inputs[0], a) is not None
        out.append(MmaPlan(name, acc.outputs[0].name if acc else "",
                           "scaled" if scaled else "ldmatrix" if a_ok else "direct",
                           "ldmatrix.trans" if b_ok else "direct", kw, per_warp))
    return out


def _ldmatrix_ok(t: TileDraft, dtype: DType) -> bool:
    """ldmatrix reads 16-byte rows of 8 elements from shared memory."""
    return (t.home == "smem" and t.type.dtype == dtype and t.pitch > 0
            and (t.pitch * t.type.dtype.nbytes) % 16 == 0 and t.vec > 1)


def _reductions(a: Analysis, tiles: dict[str, TileDraft]) -> list[ReducePlan]:
    T = a.bg.threads
    out = []
    for op in a.bg.ops:
        name = op.outputs[0].name
        if (ops.get(op.op).is_accumulator and tiles[name].home != "acc_mma"
                and acc_row_reduction(op, a)):
            rows = op.outputs[0].type.numel
            tpr = threads_per_row(rows, T)
            tiles[name].owner = (f"registers: one partial per thread, {tpr} threads per "
                                 f"row, combined once after the loop")
            out.append(ReducePlan(name, "rows", tpr))
    return out + _tile_reductions(a, tiles)


def fused_finishes(a: Analysis, tiles: Mapping[str, TileDraft | TilePlan],
                   reds: list[ReducePlan]) -> dict[str, BlockOp]:
    """Row reductions into shared memory whose one element-wise reader is written by
    the reduction's leader lanes (blockfacts.fused_finish), by reduction."""
    out = {}
    for rp in reds:
        op = a.producer.get(rp.output)
        u = fused_finish(op, a) if op is not None and rp.strategy == "rows" else None
        if u is None or tiles[rp.output].home != "smem":
            continue
        t = tiles[u.outputs[0].name]
        if t.home == "smem" and not t.pitch and t.scratch_offset < 0:
            out[rp.output] = u
    return out


def _tile_reductions(a: Analysis, tiles: dict[str, TileDraft]) -> list[ReducePlan]:
    """Row reductions into shared-memory tiles: whole warps per row, or aligned groups of
    lanes along a strided dimension (``lanes_per_result``)."""
    T = a.bg.threads
    return [ReducePlan(op.outputs[0].name, "rows", lanes_per_result(op, a, T))
            for op in a.bg.ops if not ops.get(op.op).is_accumulator
            and tiles[op.outputs[0].name].home == "smem" and row_reduction(op, a, T)]
