"""Planning of matmul chains (the attention family) with the score tile in registers.

A block graph whose two tensor-core matmuls are joined by element-wise operators
(:func:`chainfacts.chain_form`) can keep the first matmul's result, the operators
after it and their row accumulators in the registers of mma fragments: each warp owns
whole 16-row tiles of the score (its rows times its share of the columns), so the
accumulator fragments of the first mma are, packed to 16 bits, the A fragments of the
second, and a row's partial sums sit in the 4 lanes that hold that row. Nothing of
the score tile goes through shared memory (``codegen/chain.py`` emits it).

Here: whether the ``chain`` knob may be 1, the warp layout that follows from the
threads and the ``kwarps`` knob (warps sharing 16-row tiles split the score's
columns), and the homes, mma and reduction entries of the plan.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mirage_cli.codegen import colstats
from mirage_cli.codegen.blockfacts import Analysis
from mirage_cli.codegen.chainfacts import Chain, chain_form, tile_rows_of
from mirage_cli.codegen.expr import numel
from mirage_cli.kplan import MmaPlan, ReducePlan

# f32 fragment registers per thread (score, output, row partials): past this the kernel
# spills (255 registers per thread at most; operands and addresses need the rest).
FRAG_REGS_MAX = 128


@dataclass(frozen=True)
class ChainLayout:
    """How the warps of a block share the chain: ``groups`` of ``kwarps`` warps; group g
    owns the ``tiles_per_warp`` 16-row tiles from g * tiles_per_warp on (of one matrix of
    a batched tile), and warp j of a group the j-th ``kwarps``-th of the score's
    columns."""

    groups: int
    kwarps: int
    tiles_per_warp: int
    score_tiles: int   # m16n8 tiles of the score per warp and 16-row tile
    out_tiles: int     # m16n8 tiles of the output per 16-row tile


def layout(ch: Chain, warps: int, kwarps: int) -> ChainLayout | str:
    """The warp layout for ``warps`` warps, ``kwarps`` of them per 16-row tile, or why
    there is none."""
    shape = ch.first.outputs[0].type.shape
    n = shape[-1]
    e = ch.second.outputs[0].type.shape[-1]
    slices = numel(shape[:-2])
    tm = row_tiles(ch)
    if warps % kwarps:
        return f"kwarps={kwarps} does not divide {warps} warps"
    groups = warps // kwarps
    if tm % groups:
        return f"{tm} tiles of 16 rows do not split over {groups} warp group(s)"
    if (n // 16) % kwarps:
        return f"the score's {n} columns do not split over {kwarps} warps in steps of 16"
    lay = ChainLayout(groups, kwarps, tm // groups, n // 8 // kwarps, e // 8)
    if slices > 1 and (tile_rows_of(ch) // 16) % lay.tiles_per_warp:
        return (f"a warp's {lay.tiles_per_warp} tiles of 16 rows would span two of the "
                f"{slices} matrices of the batch")
    regs = frag_regs(ch, lay)
    if regs > FRAG_REGS_MAX:
        return (f"{regs} f32 fragment registers per thread (at most {FRAG_REGS_MAX}): "
                f"more threads or kwarps")
    return lay


def frag_regs(ch: Chain, lay: ChainLayout) -> int:
    """f32 fragment registers per thread: the 16-row tiles of a warp are unrolled, so
    their score, output and row-partial registers are live together."""
    return lay.tiles_per_warp * (4 * lay.score_tiles + 4 * lay.out_tiles + 2 * len(ch.row_accs))


def held_a_regs(a: Analysis, ch: Chain, lay: ChainLayout) -> int:
    """Registers per thread of the first matmul's A fragments over its whole K (four
    per 16-wide step and 16-row tile, one ldmatrix.x4)."""
    return lay.tiles_per_warp * 4 * (a.types[ch.first.inputs[0]].shape[-1] // 16)


def holds_a(a: Analysis, ch: Chain, lay: ChainLayout) -> bool:
    """Whether the first matmul's A fragments are loaded once before the loop and kept
    in registers (the plan's ``a_path`` "held"): A is loop-invariant (staged or
    computed before the loop, as attention's queries) and its fragments fit beside the
    others. Each iteration otherwise reloads them with ldmatrix: on an H100
    (docs/perf-log.md v22) holding them took gqa's chain kernel 8.0 → 7.4 µs at
    batch 1 and 25.0 → 24.6 at batch 8, qknorm_gqa's 16.6 → 15.4 at batch 1 and
    83.0 → 80.3 at batch 16."""
    return (a.phases.get(ch.first.inputs[0]) == "invariant"
            and frag_regs(ch, lay) + held_a_regs(a, ch, lay) <= FRAG_REGS_MAX)


def default_kwarps(ch: Chain, warps: int) -> int:
    """Fewest warps per 16-row tile that give every warp rows to own."""
    return max(1, warps // row_tiles(ch))


def row_tiles(ch: Chain) -> int:
    """16-row tiles of the score (over the matrices of a batched tile)."""
    shape = ch.first.outputs[0].type.shape
    return numel(shape[:-2]) * (tile_rows_of(ch) // 16)


def chain_of(a: Analysis) -> Chain | None:
    """The block graph's matmul chain with the statistics of B1's columns it reads."""
    ch = chain_form(a)
    if not isinstance(ch, Chain):
        return None
    return dataclasses.replace(ch, cols=colstats.column_stats(a, ch))


def chain_range(a: Analysis, kwarps: list[int]) -> list[int]:
    """[0, 1] when some legal kwarps gives the chain a warp layout, else [0]; [1] for
    a chain with a running maximum, which has no other form."""
    ch = chain_of(a)
    W = a.bg.threads // 32
    if ch is None or not any(isinstance(layout(ch, W, kw), ChainLayout) for kw in kwarps):
        return [0]
    return [1] if ch.online is not None else [0, 1]


def lays_out(ch: Chain, threads: int, kwarps: int | None = None) -> bool:
    """Whether ``threads`` threads give the chain a warp layout with ``kwarps`` warps
    per 16-row tile (by default :func:`default_kwarps`)."""
    w = threads // 32
    return isinstance(layout(ch, w, kwarps or default_kwarps(ch, w)), ChainLayout)


def online_kwarps(ch: Chain | None, warps: int, kwarps: list[int]) -> int | None:
    """For a chain with a running maximum: the fewest warps per 16-row tile, from the
    default on, that give ``warps`` warps a layout (None: none does)."""
    if ch is None:
        return None
    start = default_kwarps(ch, warps)
    for kw in sorted(kwarps, key=lambda k: (k < start, k)):
        if isinstance(layout(ch, warps, kw), ChainLayout):
            return kw
    return None


def why_not(a: Analysis, kwarps: int) -> str:
    """Why a kernel has no register chain at ``kwarps`` (chain_form's reason, or the
    warp layout's)."""
    ch = chain_form(a)
    if isinstance(ch, str):
        return ch
    lay = layout(ch, a.bg.threads // 32, kwarps)
    return lay if isinstance(lay, str) else "pin chain=1 and ksplit=1"


# One wgmma's B operand: a box of rows of WGMMA_SWIZZLE bytes, swizzled as bulk tensor
# copies write them (tmaplan), of WGMMA_N 16-bit elements (the prelude's mg_wg_desc).
WGMMA_SWIZZLE = 128
WGMMA_N = WGMMA_SWIZZLE // 2


def wgmma_reason(ch: Chain, lay: ChainLayout) -> str | None:
    """Why the chain's two matmuls cannot run as warpgroup ``wgmma`` (sm_90a), or None.

    A warpgroup (4 consecutive warps) multiplies 64 rows; each of its warps holds 16 of
    them in exactly the registers of the m16n8 path (the A fragments, the score and
    output accumulators), so the links, row partials and the packing of the score into
    the second matmul's A operand are unchanged. Its B operands are read from shared
    memory by descriptor, as 64-column boxes with the 128-byte swizzle that bulk tensor
    copies write (tmaplan): so each warp must own one 16-row tile of all the columns
    (kwarps 1), the warpgroup's rows must lie in one matrix of a batched tile, and the
    B tiles' columns must be whole boxes. Statistics of B1's columns are computed by
    all warps from shared memory, not folded from ldmatrix fragments (colstats), which
    a descriptor never loads."""
    shape = ch.first.outputs[0].type.shape
    R, n = shape[-2:]
    e = ch.second.outputs[0].type.shape[-1]
    if lay.kwarps != 1 or lay.tiles_per_warp != 1:
        return (f"each warp must own one 16-row tile of all the score's columns "
                f"(here kwarps={lay.kwarps}, {lay.tiles_per_warp} tile(s) per warp)")
    if lay.groups % 4 or R % 64:
        return (f"the warps and the {R} rows of a matrix must form whole warpgroups of 64 "
                f"rows ({lay.groups} warps)")
    if n % WGMMA_N or e % WGMMA_N:
        return f"the score's {n} and the output's {e} columns must be multiples of {WGMMA_N}"
    if colstats.in_fragments(ch, lay):
        return "the loop folds statistics of B1's columns from its ldmatrix fragments"
    return None


def plan_entries(ch: Chain, lay: ChainLayout, a_path: str, wgmma: bool = False
                 ) -> tuple[list[MmaPlan], list[ReducePlan], dict[str, str]]:
    """The chain's mma and reduction entries, and each chain tensor's owner (in words)."""
    first, second = ch.first.outputs[0].name, ch.second.outputs[0].name
    acc = ch.acc.outputs[0].name
    b_path = "wgmma" if wgmma else "ldmatrix.trans"
    mmas = [MmaPlan(first, "", a_path, b_path, lay.kwarps,
                    lay.tiles_per_warp * lay.score_tiles),
            MmaPlan(second, acc, "frag", b_path, lay.kwarps,
                    lay.tiles_per_warp * lay.out_tiles)]
    reds = [ReducePlan(op.outputs[0].name, "quad", 4) for op in ch.row_accs]
    frag = (f"registers: mma m16n8 fragments; warp group g of {lay.groups} owns 16-row "
            f"tiles {lay.tiles_per_warp}g.. ({lay.tiles_per_warp} per warp), its {lay.kwarps} "
            f"warp(s) a share of the columns each")
    owners = {name: frag for name in ch.members - {second}}
    owners[second] = "registers: mma fragments, summed into the accumulator where computed"
    owners[acc] = (f"mma m16n8 accumulator fragments: {lay.groups} warp group(s) x "
                   f"{lay.kwarps} column-split warp(s), {lay.tiles_per_warp * lay.out_tiles} "
                   f"tile(s) per warp")
    for op in ch.row_accs:
        owners[op.outputs[0].name] = ("registers: partials of a row in the 4 lanes holding "
                                      "it, combined by shuffles once after the loop")
    if ch.cols is not None and colstats.in_fragments(ch, lay):
        reds += [ReducePlan(op.outputs[0].name, "quad", 4) for op in ch.cols.reduces]
        for name in colstats.values(ch, lay):
            owners[name] = ("registers: a value per column of the first matmul's B operand, "
                            "folded from its B fragments by the column's 4 lanes each "
                            "iteration, gathered by shuffles to the lanes that hold the "
                            "column's score elements")
    return mmas, reds, owners


def chain_threads(a: Analysis, wgmma: bool = False) -> int | None:
    """Threads (from the block graph's, doubling up to 512) for one warp per 16-row tile
    of the score, at least as many as hold the chain in registers; None without a
    chain. A warp with two 16-row tiles keeps both unrolled in its registers and
    hides less latency: on an H100 (docs/perf-log.md v20) qknorm_gqa at batch 8 (eight
    row tiles per block) ran 99.9 µs with 4 warps and 73.4 with 8, while gqa (four
    row tiles) was fastest with 4 (29.8 against 33.8). A chain whose loop also does
    :func:`side_work` gets 512 threads where a layout allows (more warps split the
    columns, ``kwarps``), unless ``wgmma`` (an sm_90 target) and one warp per 16-row
    tile runs it as warpgroups: on an H100 (docs/perf-log.md v28) qknorm_gqa at batch
    8 ran 34.5 us at 512 threads (mma.sync) and 31.5 at 256 (wgmma), at batch 16
    54.8 and 51.5."""
    ch = chain_of(a)
    if ch is None:
        return None
    if ch.online is not None:
        # Two warps per 16-row tile: each column-split warp keeps (and rescales every
        # iteration) a whole output accumulator, and four of them ran slower than two
        # at batch 1, 8 and 16 alike (mqa_decode on an H100, 13.05 -> 11.76, 20.46 ->
        # 19.19 and 29.53 -> 28.28 us; docs/perf-log.md v24).
        two = min(512, 64 * row_tiles(ch))
        if lays_out(ch, two, 2):
            return two
    t = a.bg.threads
    while t < 512 and (t // 32 < row_tiles(ch) or not lays_out(ch, t)):
        t *= 2
    if ch.online is not None and not lays_out(ch, t):
        # No other form: the most threads, from 512 down, that have a warp layout.
        t = next((u for u in (512, 256, 128, 64, 32) if lays_out(ch, u)), t)
    if side_work(a, ch) and lays_out(ch, 512) and not (wgmma and wgmma_shape(ch, t)):
        return max(t, 512)
    return t


def wgmma_shape(ch: Chain, threads: int) -> bool:
    """Whether ``threads`` threads, one warp per 16-row tile, give the chain a layout
    that runs as wgmma (:func:`wgmma_reason`)."""
    lay = layout(ch, threads // 32, 1)
    return isinstance(lay, ChainLayout) and wgmma_reason(ch, lay) is None


def side_work(a: Analysis, ch: Chain) -> bool:
    """Whether the loop computes, besides the chain, tensors the chain reads (a column
    statistic of a loaded tile: qknorm_gqa's key norms, mean of squares over the head
    dimension). All the block's threads compute them between two barriers, outside the
    mma fragments, so more warps shorten that phase as well as each warp's share of the
    score columns: on an H100 (docs/perf-log.md v21) qknorm_gqa's chain kernels ran
    82.5 → 50.5 µs (batch 8) and 105.2 → 85.1 µs (batch 16) from their one warp per row
    tile to 512 threads, while gqa, whose loop is the chain alone, ran 27.3 → 33.0."""
    inside = ch.members | {op.outputs[0].name for op in (ch.acc, *ch.row_accs)}
    return any(a.phases.get(op.outputs[0].name) == "loop" and op.outputs[0].name not in inside
               for op in a.bg.ops)
