"""Emission of block matmuls on tensor cores (``mma.sync.m16n8k16``, f32 accumulation).

Follows the matmul's :class:`~mirage_cli.kplan.MmaPlan`: the output's m16n8 tiles are
dealt to ``warps / kwarps`` warp groups; the ``kwarps`` warps of a group each take
every ``kwarps``-th 16-wide step of K, so all warps work even when a block has fewer
output tiles than warps, and their fragments are summed (shared-memory atomics) once,
after the loop. Operands come from shared memory through ``ldmatrix`` (A, row-major)
and ``ldmatrix.trans`` (B, stored K-major) where the plan says so (rows past the end of
a short A tile read a zero row), otherwise as packed 32-bit loads or element by
element with bounds checks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mirage_cli import ops
from mirage_cli.codegen.blockfacts import scaled_operand
from mirage_cli.codegen.expr import (
    CTYPE,
    Lines,
    Stored,
    broadcast_index,
    indent,
    index_vars,
    offset_expr,
    row_major,
    swizzled_address,
)
from mirage_cli.ir import BlockOp, DType
from mirage_cli.kplan import MmaPlan

if TYPE_CHECKING:
    from mirage_cli.codegen.kernel import FusedKernel


def _grid(op: BlockOp) -> tuple[int, int, int]:
    """(batch tiles, 16-row tiles, 8-column tiles) covering the output tile."""
    t = op.outputs[0].type
    nb = 1
    for d in t.shape[:-2]:
        nb *= d
    return nb, -(-t.shape[-2] // 16), -(-t.shape[-1] // 8)


def acc_init(k: FusedKernel, acc: BlockOp, mp: MmaPlan) -> Lines:
    name = acc.outputs[0].name
    j = mp.tiles_per_warp
    lines = [f"float acc_{name}[{j}][4];", "#pragma unroll",
             (f"for (int j = 0; j < {j}; ++j) acc_{name}[j][0] = acc_{name}[j][1] = "
              f"acc_{name}[j][2] = acc_{name}[j][3] = 0.0f;")]
    return lines


def acc_update(k: FusedKernel, acc: BlockOp, mp: MmaPlan) -> Lines:
    """One forloop iteration of an accumulated matmul: this warp's K steps outside, its
    output tiles inside, so the tiles' mma chains are independent (and a single row of
    tiles shares one A fragment per step)."""
    op = k.a.producer[acc.inputs[0]]
    dreg = f"acc_{acc.outputs[0].name}[j]"
    nb, tm, tn = _grid(op)
    groups = k.W // mp.kwarps
    shared_a = nb == 1 and tm == 1
    a_lines, b_lines, mma = _operands(k, op, mp, [])
    inner = _tile_coords(op) + (b_lines if shared_a else a_lines + b_lines)
    inner.append(f"{mma}({dreg}, ra0, ra1, ra2, ra3, rb0, rb1);")
    tile_loop = ["#pragma unroll", f"for (int j = 0; j < {mp.tiles_per_warp}; ++j) {{",
                 f"  {_owned_tile(nb * tm * tn, groups, mp.tiles_per_warp)}"]
    tile_loop += indent(inner, 1) + ["}"]
    steps = -(-k.a.types[op.inputs[0]].shape[-1] // 16) // mp.kwarps
    step = [f"const int kk = (mg_ks + s * {mp.kwarps}) * 16;",
            "const int k0 = kk + 2 * mg_t, k1 = k0 + 8;", "(void)k0; (void)k1;",
            "unsigned ra0, ra1, ra2, ra3;"]
    if shared_a:
        step += ["const int mg_mi = 0, r0 = mg_g, r1 = r0 + 8;", "(void)r0; (void)r1;"] + a_lines
    elif _row_tiles(nb, tm, tn, groups, mp.tiles_per_warp):
        step, tile_loop = step[:3], _rows_of_tiles(tm, tn // groups, groups, a_lines,
                                                   b_lines, mma, dreg)
    return (warp_ids(groups) + [_unroll(steps), f"for (int s = 0; s < {steps}; ++s) {{"]
            + indent(step + tile_loop) + ["}", "}"])


def _row_tiles(nb: int, tm: int, tn: int, groups: int, per_warp: int) -> bool:
    """Whether a warp's tiles are whole columns of tiles: every 16-row tile of the
    8-column tiles ``mg_grp``, ``mg_grp + groups``, ... (q = mg_grp + groups * j)."""
    return nb == 1 and tm > 1 and tn % groups == 0 and per_warp == tm * (tn // groups)


def _rows_of_tiles(tm: int, per_n: int, groups: int, a_lines: Lines, b_lines: Lines,
                   mma: str, dreg: str) -> Lines:
    """One K step of a warp that owns every 16-row tile of its 8-column tiles: the
    ``tm`` A fragments once, then each B fragment once for all of them. Tile by tile,
    each of A's and B's fragments was loaded once per tile it is used in (12 ldmatrix
    for 6 mma where 5 do; rmsnorm_linear at batch 16, 32 rows). The accumulator
    index is the tile loop's: tile (mi, ni) is q = mi * tn + ni, j = mi * per_n + jn."""
    acc = dreg.removesuffix("[j]")
    lines: Lines = [f"unsigned mg_ra[{tm}][4];"]
    for mi in range(tm):
        lines += ["{", f"  const int mg_mi = {mi}, r0 = mg_mi * 16 + mg_g, r1 = r0 + 8;",
                  "  (void)r0; (void)r1;", "  unsigned ra0, ra1, ra2, ra3;"]
        lines += indent(a_lines, 1)
        lines += ["  " + " ".join(f"mg_ra[{mi}][{i}] = ra{i};" for i in range(4)), "}"]
    body = [f"const int mg_ni = mg_grp + {groups} * jn;",
            "const int c0 = mg_ni * 8 + 2 * mg_t, n0 = mg_ni * 8 + mg_g;",
            "(void)c0; (void)n0;"] + b_lines
    body += [f"{mma}({acc}[{mi * per_n} + jn], mg_ra[{mi}][0], mg_ra[{mi}][1], "
             f"mg_ra[{mi}][2], mg_ra[{mi}][3], rb0, rb1);" for mi in range(tm)]
    return lines + ["#pragma unroll", f"for (int jn = 0; jn < {per_n}; ++jn) {{"] \
        + indent(body) + ["}"]


def _owned_tile(tiles: int, groups: int, per_warp: int) -> str:
    """The declaration of ``q``, this warp's ``j``-th output tile in a loop iteration's
    matmul. Where the tiles do not deal evenly over the warp groups, a warp's last
    ``q`` may be past the end; it is clamped to the last tile instead of skipped, so
    the step has no branch: a branch around each tile's ``ldmatrix`` and ``mma`` kept
    ptxas from overlapping one tile's loads with another's mma, and 9 tiles over 4
    warps ran the loop 2.2 times slower than 12 (qwen2_rmsnorm_qkv, 72 columns a
    block; docs/perf-log.md v31). The clamped tile's sums are never stored: the
    accumulator's finish (:func:`tiles`) skips ``q`` past the end."""
    if tiles >= groups * per_warp:
        return f"const int q = mg_grp + {groups} * j;"
    return f"const int q = min(mg_grp + {groups} * j, {tiles - 1});"


def _unroll(steps: int) -> str:
    """Short K loops unroll fully: every fragment address becomes a base register plus
    an immediate, and mmas of different steps interleave (−0.7 µs of 25.6 on
    rmsnorm_linear at batch 8 on an H200, docs/perf-log.md v4); long ones by two."""
    return "#pragma unroll" if steps <= 16 else "#pragma unroll 2"


def warp_ids(groups: int) -> Lines:
    """Opens a scope with this thread's warp, lane, fragment row/column (``mg_g``,
    ``mg_t``), warp group (``mg_grp``, of ``groups``) and K-split index (``mg_ks``)."""
    return ["{", "  const int mg_warp = threadIdx.x / 32, mg_lane = threadIdx.x % 32;",
            "  const int mg_g = mg_lane / 4, mg_t = mg_lane % 4;", "  (void)mg_g; (void)mg_t;",
            f"  const int mg_grp = mg_warp % {groups}, mg_ks = mg_warp / {groups};",
            "  (void)mg_ks;"]


def _tile_coords(op: BlockOp) -> Lines:
    """Output tile q's batch index, 16-row and 8-column tile indices, and this lane's
    rows and columns of the m16n8 fragment."""
    tc = op.outputs[0].type
    nb, tm, tn = _grid(op)
    bdecl, _ = index_vars(tc.shape[:-2] or (1,), "mg_nb", "mg_b")
    return ([f"const int mg_nb = q / {tm * tn};", f"const int mg_ni = q % {tn};"]
            + ([f"const int mg_mi = (q / {tn}) % {tm};",
                "const int r0 = mg_mi * 16 + mg_g, r1 = r0 + 8;"] if not (nb == 1 and tm == 1)
               else [])
            + bdecl + ["const int c0 = mg_ni * 8 + 2 * mg_t, n0 = mg_ni * 8 + mg_g;",
                       "(void)mg_nb; (void)c0; (void)n0;"])


def acc_finish(k: FusedKernel, acc: BlockOp, mp: MmaPlan, fin: str) -> Lines:
    """The fragments into the accumulator's f32 tile, then its finish (``fin``, a format
    of the summed value) in place."""
    mm = k.a.producer[acc.inputs[0]]
    name = acc.outputs[0].name
    lines = tiles(k, mm, mp, f"acc_{name}[j]", name, compute=False)
    if fin != "{0}":
        n = acc.outputs[0].type.numel
        lines += ["__syncthreads();", (f"for (int e = threadIdx.x; e < {n}; e += {k.T}) "
                                       f"buf_{name}[e] = {fin.format(f'buf_{name}[e]')};")]
    return lines


def materialize(k: FusedKernel, op: BlockOp, mp: MmaPlan) -> Lines:
    return tiles(k, op, mp, "mg_d", op.outputs[0].name, local=True)


def tiles(k: FusedKernel, op: BlockOp, mp: MmaPlan, dreg: str, sink: str | None,
          local: bool = False, compute: bool = True) -> Lines:
    """Loop over the m16n8 tiles of ``op``'s output owned by this warp: multiply over
    this warp's share of K into ``dreg`` (a float[4] fragment) and, with ``sink``,
    write (or, for K-split warps, add) the fragment into that f32 tile."""
    tc = op.outputs[0].type
    M, N = tc.shape[-2], tc.shape[-1]
    nb, tm, tn = _grid(op)
    groups = k.W // mp.kwarps
    bdecl, bidx = index_vars(tc.shape[:-2] or (1,), "mg_nb", "mg_b")
    bidx = bidx if tc.shape[:-2] else []
    body: Lines = [f"const int mg_nb = q / {tm * tn};", f"const int mg_mi = (q / {tn}) % {tm};",
                   f"const int mg_ni = q % {tn};"] + bdecl
    body += ["const int r0 = mg_mi * 16 + mg_g, r1 = r0 + 8;",
             "const int c0 = mg_ni * 8 + 2 * mg_t, n0 = mg_ni * 8 + mg_g;",
             "(void)mg_nb; (void)r1; (void)c0; (void)n0;"]
    if local:
        body.append(f"float {dreg}[4] = {{0.0f, 0.0f, 0.0f, 0.0f}};")
    if compute:
        body += _k_loop(k, op, mp, dreg, bidx)
    levels = mp.kwarps if sink is not None and not local and not compute else 1

    def sink_lines(assign: str) -> Lines:
        ostr = row_major(tc.shape)
        out: Lines = []
        for i, (r, c) in enumerate((("r0", "c0"), ("r0", "(c0 + 1)"), ("r1", "c0"),
                                    ("r1", "(c0 + 1)"))):
            cond = " && ".join(([f"{r} < {M}"] if M % 16 else []) + ([f"{c} < {N}"] if N % 8 else []))
            st = f"buf_{sink}[{offset_expr('0', bidx + [r, c], ostr)}] {assign} {dreg}[{i}];"
            out.append(f"if ({cond}) {st}" if cond else st)
        return out

    def tile_loop(inner: Lines) -> Lines:
        return ["  #pragma unroll", f"  for (int j = 0; j < {mp.tiles_per_warp}; ++j) {{",
                f"    const int q = mg_grp + {groups} * j;",
                f"    if (q < {nb * tm * tn}) {{"] + indent(inner, 3) + ["    }", "  }"]
    if levels == 1:
        return warp_ids(groups) + tile_loop(body + (sink_lines("=") if sink else [])) + ["}"]
    # K-split warps combine in a fixed order, one level of warps at a time: the warps
    # of split 0 write their fragments, each further split adds its own after a barrier.
    # Every element has exactly one writer per level, so no atomics (on an H200 the
    # shared-memory atomicAdd of this combine cost 1.6 µs of a 17 µs kernel, in the
    # kernel's tail where nothing hides it; docs/perf-log.md v6), and the sum is
    # deterministic.
    out: Lines = warp_ids(groups)
    for lvl in range(levels):
        if lvl:
            out.append("  __syncthreads();")
        out += [f"  if (mg_ks == {lvl}) {{"] + indent(tile_loop(body + sink_lines(
            "=" if lvl == 0 else "+=")), 1) + ["  }"]
    return out + ["}"]


def _operands(k: FusedKernel, op: BlockOp, mp: MmaPlan, bidx: list[str]
              ) -> tuple[Lines, Lines, str]:
    """Statements loading A's fragment (ra0..ra3) and B's (rb0, rb1) at step ``kk``,
    and the mma function."""
    a, b = op.inputs
    ta, tb, tc = k.a.types[a], k.a.types[b], op.outputs[0].type
    M, K, N = tc.shape[-2], ta.shape[-1], tc.shape[-1]
    if not bidx and tc.shape[:-2]:
        _, bidx = index_vars(tc.shape[:-2], "mg_nb", "mg_b")
    ia = broadcast_index(bidx, ta.shape[:-2])
    ib = broadcast_index(bidx, tb.shape[:-2])
    if mp.a_path == "ldmatrix":
        a_lines = _ldsm_a(k, a, ia, M)
    elif mp.a_path == "scaled":
        a_lines = _scaled_a(k, a, ia, M, tc.dtype)
    else:
        a_lines = [f"ra{i} = {e};" for i, e in enumerate(_direct_a(k, a, ia, M, K, tc.dtype))]
    b_lines = ["unsigned rb0, rb1;"]
    if mp.b_path == "ldmatrix.trans":
        b_lines += _ldsm_b(k, b, ib)
    else:
        b_lines += [f"rb{i} = {e};" for i, e in enumerate(_direct_b(k, b, ib, K, N, tc.dtype))]
    return a_lines, b_lines, mma_fn(tc.dtype)


def mma_fn(dtype: DType) -> str:
    """The prelude's m16n8k16 mma for 16-bit operands of ``dtype``."""
    return "mg_mma_f16" if dtype is DType.F16 else "mg_mma_bf16"


def wgmma_fn(dtype: DType) -> str:
    """The prelude's warpgroup m64n64k16 wgmma for 16-bit operands of ``dtype``."""
    return "mg_wgmma_f16" if dtype is DType.F16 else "mg_wgmma_bf16"


def pack_fn(dtype: DType) -> str:
    """The prelude's packing of two f32 values into one register of ``dtype``."""
    return "mg_pack_f16" if dtype is DType.F16 else "mg_pack_bf16"


def _k_loop(k: FusedKernel, op: BlockOp, mp: MmaPlan, dreg: str, bidx: list[str]) -> Lines:
    """This warp's steps over K for one output tile: fragments, then one mma a step."""
    a_lines, b_lines, mma = _operands(k, op, mp, bidx)
    kl = [f"const int kk = (mg_ks + s * {mp.kwarps}) * 16;",
          "const int k0 = kk + 2 * mg_t, k1 = k0 + 8;", "(void)k0; (void)k1;",
          "unsigned ra0, ra1, ra2, ra3;"] + a_lines + b_lines
    kl.append(f"{mma}({dreg}, ra0, ra1, ra2, ra3, rb0, rb1);")
    steps = -(-k.a.types[op.inputs[0]].shape[-1] // 16) // mp.kwarps
    return [_unroll(steps), f"for (int s = 0; s < {steps}; ++s) {{"] + indent(kl) + ["}"]


def smem_ptr(k: FusedKernel, name: str, idx: list[str]) -> str:
    how = k.em.nodes[name].how
    assert isinstance(how, Stored)
    t = k.tiles.get(name)
    if t is not None and t.swizzle:  # swizzled boxes of a bulk tensor copy
        return swizzled_address(how.ptr, idx, k.a.types[name], t.swizzle)
    return f"({how.ptr} + ({offset_expr('0', idx, how.strides)}))"


def _ldsm_a(k: FusedKernel, a: str, ia: list[str], M: int) -> Lines:
    """A's 16x16 fragment: lanes 0-7, 8-15, 16-23, 24-31 address rows 0-7 / 8-15 of
    columns kk..kk+7, then of kk+8..kk+15 (a0..a3 of the mma)."""
    row = "(mg_mi * 16 + (mg_lane & 7) + ((mg_lane >> 3) & 1) * 8)"
    col = "(kk + (mg_lane >> 4) * 8)"
    return [f"mg_ldsm_x4(ra0, ra1, ra2, ra3, {zero_padded(smem_ptr(k, a, ia + [row, col]), row, M)});"]


def zero_padded(ptr: str, row: str, rows: int) -> str:
    """An ldmatrix row address of an A tile of ``rows`` rows: rows past its end (the
    padding of a short tile to whole 16-row mma tiles) read the zero row instead."""
    if rows % 16 == 0:
        return ptr
    return f"({row} < {rows} ? (const void*){ptr} : (const void*)mg_zero)"


def _scaled_a(k: FusedKernel, a: str, ia: list[str], M: int, dt: DType) -> Lines:
    """A's fragment where A is ``f(tile, vector)`` (:func:`blockfacts.scaled_operand`):
    ``tile``'s fragment by ``ldmatrix``, each register's two columns (k0, k0 + 1 in
    ra0 and ra1; k1, k1 + 1 in ra2 and ra3) combined with the vector's pair there by
    ``f``'s registry form on 16-bit pairs."""
    pair = scaled_operand(a, k.a)
    assert pair is not None
    tile, vec = pair
    lines = _ldsm_a(k, tile, ia, M)
    lead = ["0"] if len(k.a.types[vec].shape) == 2 else []
    op = k.a.producer[a]
    fn = f"{ops.get(op.op).cuda.pair16}_{dt.value}"
    for regs, col in ((("ra0", "ra1"), "k0"), (("ra2", "ra3"), "k1")):
        ptr = smem_ptr(k, vec, lead + [col])
        lines.append(f"{{ const unsigned mg_v = *reinterpret_cast<const unsigned*>({ptr});")
        # The operands in the operator's own order.
        lines += [f"  {r} = {fn}({r}, mg_v);" if op.inputs[0] == tile else
                  f"  {r} = {fn}(mg_v, {r});" for r in regs] + ["}"]
    return lines


def _ldsm_b(k: FusedKernel, b: str, ib: list[str]) -> Lines:
    """B's 16x8 fragment from a K-major tile: lanes 0-15 address rows kk..kk+15 of
    columns n0..n0+7; the transposed load gives each lane its pairs along K."""
    ptr = smem_ptr(k, b, ib + ["(kk + (mg_lane & 15))", "(mg_ni * 8)"])
    return [f"mg_ldsm_x2_t(rb0, rb1, {ptr});"]


def _ld(k: FusedKernel, name: str, pre: list[str], r: str, c: str, rows: int, cols: int) -> str:
    cond = ([f"{r} < {rows}"] if rows % 16 else []) + ([f"{c} < {cols}"] if cols % 16 else [])
    v = k.em.load(name, pre + [r, c])
    return f"(({' && '.join(cond)}) ? {v} : 0.0f)" if cond else v


def _direct_a(k: FusedKernel, a: str, ia: list[str], M: int, K: int, dt: DType) -> list[str]:
    pack = pack_fn(dt)
    regs = []
    for r, c in (("r0", "k0"), ("r1", "k0"), ("r0", "k1"), ("r1", "k1")):
        fast = _pair(k, a, ia + [r, c], 1, dt, f"{r} < {M}" if M % 16 else None)
        regs.append(fast if fast is not None and K % 16 == 0 else
                    f"{pack}({_ld(k, a, ia, r, c, M, K)}, {_ld(k, a, ia, r, f'({c} + 1)', M, K)})")
    return regs


def _direct_b(k: FusedKernel, b: str, ib: list[str], K: int, N: int, dt: DType) -> list[str]:
    pack = pack_fn(dt)
    regs = []
    for kv in ("k0", "k1"):
        fast = _pair(k, b, ib + [kv, "n0"], 0, dt, f"n0 < {N}" if N % 8 else None)
        regs.append(fast if fast is not None and K % 16 == 0 else
                    f"{pack}({_ld(k, b, ib, kv, 'n0', K, N)}, {_ld(k, b, ib, f'({kv} + 1)', 'n0', K, N)})")
    return regs


def _pair(k: FusedKernel, name: str, idx: list[str], axis: int, dtype: DType, guard: str | None
          ) -> str | None:
    """A packed 32-bit operand register holding elements ``idx`` and ``idx`` + 1 along
    ``axis`` (0: rows, 1: columns of the last two dims) of a shared-memory or scratch
    tile, without f32 round trips; None where only the element-wise path fits."""
    how = k.em.nodes[name].how
    if not isinstance(how, Stored) or how.base != "0":
        return None
    shape = k.em.nodes[name].shape
    off = offset_expr("0", idx, how.strides)
    nxt = list(idx)
    nxt[-2 + axis] = f"({idx[-2 + axis]} + 1)"
    off2 = offset_expr("0", nxt, how.strides)
    pack = pack_fn(dtype)
    if axis == 1 and how.strides[-1] == 1 and shape[-1] % 2 == 0:
        if how.ctype == CTYPE[dtype]:
            e = f"*reinterpret_cast<const unsigned*>({how.ptr} + ({off}))"
        elif how.ctype == "float":
            e = f"{pack}2(*reinterpret_cast<const float2*>({how.ptr} + ({off})))"
        else:
            return None
    elif how.ctype == CTYPE[dtype]:
        e = f"mg_bits2({how.ptr}[{off}], {how.ptr}[{off2}])"
    else:
        return None
    return f"(({guard}) ? {e} : 0u)" if guard else e
