"""Emission of a matmul chain with its score tile in registers (the attention family).

Expects a :class:`~mirage_cli.codegen.chainfacts.Chain` planned by
:mod:`chainplan` (``chain=1``): ``S = A @ B1``, element-wise links ``P = f(S, ...)``,
row accumulators of links, and ``acc += P @ B2``. Per forloop iteration each warp, for
each 16-row tile it owns: multiplies its rows of A (``ldmatrix`` from shared memory)
by its columns of B1 (``ldmatrix.trans``) into m16n8 fragments; applies the links to
every fragment element where it sits (each link computed once per element, into a
local), folding row accumulators into per-lane partials; packs the fragments to 16
bits as the A fragments of the second mma (the accumulator layout of two adjacent
m16n8 tiles is the A layout of one m16k16 step) and multiplies them by B2
(``ldmatrix.trans``) into the output fragments. No barrier and no shared memory for
anything but the staged operands. After the loop (:mod:`chainfinish`) the row
partials are combined over the 4 lanes of a row (shuffles) and, with the output
fragments, written into the accumulators' f32 tiles (warps that split a row's columns
add theirs in a fixed order), where the epilogue (and a cluster's combine) read them
as any accumulator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mirage_cli.codegen import colstats
from mirage_cli.codegen.chainfacts import Chain, clamped_row, real_rows, tile_rows_of
from mirage_cli.codegen.chainplan import WGMMA_N, ChainLayout
from mirage_cli.codegen.expr import (
    Lines,
    Local,
    Node,
    Stored,
    indent,
    unrolled,
)
from mirage_cli.codegen.mma import mma_fn, pack_fn, smem_ptr, warp_ids, wgmma_fn, zero_padded
from mirage_cli.codegen.reduce import accum_spec
from mirage_cli.semantics.accum import Combine, Pre
from mirage_cli.semantics.cuda import c_init, c_update

if TYPE_CHECKING:
    from mirage_cli.codegen.kernel import FusedKernel
    from mirage_cli.ir import BlockOp


def _lead(name: str, k: FusedKernel) -> list[str]:
    """A tile's index along its batch dimension (``mg_b``, the warp's matrix; 0 where it
    is 1, broadcast)."""
    return ["0" if d == 1 else "mg_b" for d in k.a.types[name].shape[:-2]]


def tile_rows(ch: Chain, lay: ChainLayout) -> Lines:
    """This warp's matrix of the batch (``mg_b``) and its 16-row tiles in it (``mg_mi{m}``)."""
    per = tile_rows_of(ch) // 16
    first = f"mg_grp * {lay.tiles_per_warp}"
    return ([f"const int mg_b = ({first}) / {per};", "(void)mg_b;"]
            + [f"const int mg_mi{m} = ({first} + {m}) % {per};"
               for m in range(lay.tiles_per_warp)])


def init(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """Zeroed output fragments and row partials (the accumulators' identities); the
    first matmul's A fragments when they stay in registers over the loop."""
    acc = ch.acc.outputs[0].name
    mt, no = lay.tiles_per_warp, lay.out_tiles
    lines = _held_a(k, ch, lay) + [f"float acc_{acc}[{mt}][{no}][4];"]
    lines += unrolled("m", mt, unrolled("j", no, [
        (f"acc_{acc}[m][j][0] = acc_{acc}[m][j][1] = acc_{acc}[m][j][2] = "
        f"acc_{acc}[m][j][3] = 0.0f;")]))
    for op in ch.row_accs:
        name = op.outputs[0].name
        lines += [f"float acc_{name}[{mt}][2];"]
        lines += unrolled("m", mt, [(f"acc_{name}[m][0] = acc_{name}[m][1] = "
                                     f"{c_init(accum_spec(op).combine)};")])
    return lines


def update(k: FusedKernel, ch: Chain, lay: ChainLayout, barrier: bool = False) -> Lines:
    """One forloop iteration of the chain over every 16-row tile this warp owns; the
    tiles go through each step together, so they share each B fragment loaded.
    ``barrier``: a block barrier between the first matmul and the links (which may read
    tiles the iteration computed before it)."""
    mt, ns = lay.tiles_per_warp, lay.score_tiles
    lines = [f"float mg_s[{mt}][{ns}][4];"]
    lines += [f"mg_s[{m}][{j}][0] = mg_s[{m}][{j}][1] = mg_s[{m}][{j}][2] = "
              f"mg_s[{m}][{j}][3] = 0.0f;" for m in range(mt) for j in range(ns)]
    lines += tile_rows(ch, lay)
    links = _links(k, ch, lay) if ch.online is None else _online_links(k, ch, lay)
    lines += _first(k, ch, lay) + (["__syncthreads();"] if barrier else []) + links
    lines += _second(k, ch, lay)
    return warp_ids(lay.groups) + indent(lines) + ["}"]


def _b_loads(k: FusedKernel, b: str, tiles: int, col0: str) -> Lines:
    """B fragments of ``tiles`` adjacent n8 tiles at K step ``kk`` from a K-major tile:
    two tiles per ``ldmatrix.x4.trans`` (lanes 16-31 address the second), into
    ``rb{t}_0``, ``rb{t}_1``. Issued together, ahead of the mmas that read them."""
    if any(m.b_path == "gather" and k.a.producer[m.output].inputs[1] == b
           for m in k.plan.mmas):
        return _b_gathered(k, b, tiles, col0)
    lines: Lines = []
    for t in range(0, tiles - 1, 2):
        p = smem_ptr(k, b, _lead(b, k) + ["(kk + (mg_lane & 15))",
                                            f"(({col0} + {t} + (mg_lane >> 4)) * 8)"])
        lines += [f"unsigned rb{t}_0, rb{t}_1, rb{t + 1}_0, rb{t + 1}_1;",
                  f"mg_ldsm_x4_t(rb{t}_0, rb{t}_1, rb{t + 1}_0, rb{t + 1}_1, {p});"]
    if tiles % 2:
        t = tiles - 1
        p = smem_ptr(k, b, _lead(b, k) + ["(kk + (mg_lane & 15))", f"(({col0} + {t}) * 8)"])
        lines += [f"unsigned rb{t}_0, rb{t}_1;", f"mg_ldsm_x2_t(rb{t}_0, rb{t}_1, {p});"]
    return lines


def _b_gathered(k: FusedKernel, b: str, tiles: int, col0: str) -> Lines:
    """The fragments of :func:`_b_loads` from a shifted join's tile (codegen/joins.py),
    element by element: lane l holds rows kk + 2 (l % 4) + {0, 1} and + {8, 9} of column
    l / 4 of each n8 tile, the lower row in the lower 16 bits (the m16n8k16 B layout)."""
    bi = next(bi for bi in k.bg.inputs if bi.value.name == b)
    j = k.joins[bi.source]
    how = k.em.nodes[b].how
    assert isinstance(how, Stored)
    at = (f"mg_shifted16<{j.period}, {j.head}, {j.chunk}>({how.ptr}, {k.tile(b).pitch}, "
          f"{k.pname[j.parts[1]]}, off_{b}, ")
    row = "kk + 2 * (mg_lane & 3)"
    lines: Lines = []
    for t in range(tiles):
        col = f"({col0} + {t}) * 8 + (mg_lane >> 2)"

        def e(dr: int, col: str = col) -> str:
            return f"{at}{row} + {dr}, {col})"
        lines += [f"const unsigned rb{t}_0 = {e(0)} | ({e(1)} << 16);",
                  f"const unsigned rb{t}_1 = {e(8)} | ({e(9)} << 16);"]
    return lines


def _held(k: FusedKernel, ch: Chain) -> bool:
    """Whether the plan loads the first matmul's A fragments once, before the loop, and
    keeps them in registers (``a_path`` "held", :func:`chainplan.holds_a`)."""
    first = ch.first.outputs[0].name
    return any(mp.output == first and mp.a_path == "held" for mp in k.plan.mmas)


def _a_frag(k: FusedKernel, ch: Chain, m: int) -> str:
    """This lane's ldmatrix.x4 address of A's 16x16 fragment of row tile ``m`` at K
    step ``kk``."""
    a = ch.first.inputs[0]
    row = f"(mg_mi{m} * 16 + (mg_lane & 7) + ((mg_lane >> 3) & 1) * 8)"
    return zero_padded(smem_ptr(k, a, _lead(a, k) + [row, "(kk + (mg_lane >> 4) * 8)"]),
                       row, real_rows(ch))


def _held_a(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """The A fragments of every K step, loaded once into ``mg_ha`` (see :func:`_held`)."""
    if not _held(k, ch):
        return []
    a = ch.first.inputs[0]
    steps, mt = k.a.types[a].shape[-1] // 16, lay.tiles_per_warp
    body = tile_rows(ch, lay)
    for s in range(steps):
        body += [f"{{ const int kk = {s * 16};"]
        for m in range(mt):
            r = ", ".join(f"mg_ha[{m}][{s}][{i}]" for i in range(4))
            body += [f"  mg_ldsm_x4({r}, {_a_frag(k, ch, m)});"]
        body += ["}"]
    return [f"unsigned mg_ha[{mt}][{steps}][4];"] + warp_ids(lay.groups) + indent(body) + ["}"]


def _wgmma(k: FusedKernel) -> bool:
    """Whether the plan runs the chain's matmuls as warpgroup wgmma (``chainplan.
    wgmma_reason``): emitted for the arch-specific target, beside the m16n8 path that
    other targets compile (the registers are the same)."""
    return any(mp.b_path == "wgmma" for mp in k.plan.mmas)


def _either(k: FusedKernel, wg: Lines, mma: Lines) -> Lines:
    if not _wgmma(k):
        return mma
    return ["#if defined(__CUDA_ARCH_FEAT_SM90_ALL)"] + wg + ["#else"] + mma + ["#endif"]


def _wg_mmas(k: FusedKernel, b: str, acc: str, regs: str, kk: int) -> Lines:
    """One wgmma per 64-column box of B tile ``b`` at its rows ``kk``.. (16 of them, a
    multiple of 8 from the box's first row, so no swizzle phase; of this warp's
    matrix), A in ``regs``, into the accumulator fragments ``acc``: box j's into
    fragments from 8 * j on."""
    fn = wgmma_fn(k.a.types[b].dtype)
    boxes = k.a.types[b].shape[-1] // WGMMA_N
    return [f"{fn}({acc} + {8 * j}, {regs}, mg_wg_desc("
            f"{smem_ptr(k, b, _lead(b, k) + [str(kk), str(j * WGMMA_N)])}));"
            for j in range(boxes)]


def _packed_a(ch: Chain, m: int, s: int, name: str) -> Lines:
    """The second matmul's A fragment for K step ``s`` of row tile ``m``: the score
    fragments of two adjacent n8 tiles packed to 16 bits (the accumulator layout of two
    m16n8 tiles is the A layout of one m16k16 step), as ``{name}_0`` .. ``{name}_3``."""
    pack = pack_fn(ch.second.outputs[0].type.dtype)
    lo, hi = 2 * s, 2 * s + 1
    return [f"const unsigned {name}_0 = {pack}(mg_s[{m}][{lo}][0], mg_s[{m}][{lo}][1]);",
            f"const unsigned {name}_1 = {pack}(mg_s[{m}][{lo}][2], mg_s[{m}][{lo}][3]);",
            f"const unsigned {name}_2 = {pack}(mg_s[{m}][{hi}][0], mg_s[{m}][{hi}][1]);",
            f"const unsigned {name}_3 = {pack}(mg_s[{m}][{hi}][2], mg_s[{m}][{hi}][3]);"]


def _wg_first(k: FusedKernel, ch: Chain) -> Lines:
    """S = A @ B1 for the warpgroup's 64 rows: per K step one wgmma per box of B1, A
    from this warp's fragments (held, or all K steps loaded by ldmatrix before the
    fence: a head dimension of 128 leaves no room to hold them)."""
    a, b = ch.first.inputs
    lines: Lines = []
    regs = []
    for s in range(k.a.types[a].shape[-1] // 16):
        if _held(k, ch):
            regs.append(", ".join(f"mg_ha[0][{s}][{i}]" for i in range(4)))
            continue
        r = ", ".join(f"ra{s}_{i}" for i in range(4))
        lines += [f"unsigned {r};",
                  f"{{ const int kk = {s * 16}; mg_ldsm_x4({r}, {_a_frag(k, ch, 0)}); }}"]
        regs.append(r)
    lines.append("mg_wg_fence();")
    for s, r in enumerate(regs):
        lines += _wg_mmas(k, b, "mg_s[0]", r, 16 * s)
    return lines + ["mg_wg_commit_wait();"]


def _wg_second(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """acc += P @ B2 for the warpgroup's 64 rows: P's fragments packed to 16 bits (as
    in the m16n8 path), then per K step one wgmma per box of B2."""
    b = ch.second.inputs[1]
    acc = ch.acc.outputs[0].name
    steps = lay.score_tiles // 2
    lines: Lines = []
    for s in range(steps):
        lines += _packed_a(ch, 0, s, f"pa{s}")
    lines.append("mg_wg_fence();")
    for s in range(steps):
        regs = ", ".join(f"pa{s}_{i}" for i in range(4))
        lines += _wg_mmas(k, b, f"acc_{acc}[0]", regs, 16 * s)
    return lines + ["mg_wg_commit_wait();"]


def _first(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """S = A @ B1 over this warp's rows and columns into ``mg_s``; with them, the
    statistics of B1's columns (:mod:`colstats`)."""
    wg = _wg_first(k, ch) if _wgmma(k) else []
    return _either(k, wg, _mma_first(k, ch, lay))


def _mma_first(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    a, b = ch.first.inputs
    d = k.a.types[a].shape[-1]
    mma = mma_fn(ch.first.outputs[0].type.dtype)
    held = _held(k, ch)
    lines: Lines = colstats.init(k, ch, lay)
    for s in range(d // 16):
        step = [f"const int kk = {s * 16};"]
        for m in range(lay.tiles_per_warp):
            if held:
                step += [f"const unsigned ra{m}_{i} = mg_ha[{m}][{s}][{i}];" for i in range(4)]
                continue
            step += [f"unsigned ra{m}_0, ra{m}_1, ra{m}_2, ra{m}_3;",
                     f"mg_ldsm_x4(ra{m}_0, ra{m}_1, ra{m}_2, ra{m}_3, {_a_frag(k, ch, m)});"]
        step += _b_loads(k, b, lay.score_tiles, f"mg_ks * {lay.score_tiles}")
        step += [f"{mma}(mg_s[{m}][{j}], ra{m}_0, ra{m}_1, ra{m}_2, ra{m}_3, rb{j}_0, rb{j}_1);"
                 for m in range(lay.tiles_per_warp) for j in range(lay.score_tiles)]
        step += colstats.fold(k, ch, lay)
        lines += ["{"] + indent(step) + ["}"]
    return lines + colstats.finish(k, ch, lay)


def _links(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """Every link at every element of the score fragments, once each; row partials;
    the second matmul's A operand left in ``mg_s``."""
    # Written out element by element (not as loops): every register array index is then
    # a constant, whatever the compiler's unrolling heuristics decide about a long body
    # (an un-unrolled loop put the fragments in local memory).
    first = ch.first.outputs[0].name
    idx = _lead(first, k) + ["mg_r", "mg_c"]
    lines: Lines = []
    for m in range(lay.tiles_per_warp):
        for j in range(lay.score_tiles):
            for i in range(4):
                lines += ["{"] + indent(_element(k, ch, lay, first, idx, m, j, i)) + ["}"]
    return lines


def _element(k: FusedKernel, ch: Chain, lay: ChainLayout, first: str, idx: list[str],
             m: int, j: int, i: int, links: tuple[BlockOp, ...] | None = None,
             row_accs: tuple[BlockOp, ...] | None = None, result: str | None = None) -> Lines:
    """The links at element ``i`` of score fragment ``j`` (``links``, default all),
    folded into the ``row_accs`` (default all); the value ``result`` (default the
    second matmul's operand) is left in the fragment register."""
    k.em.nodes[first] = Node(k.a.types[first].shape, Local(f"mg_s[{m}][{j}][{i}]"))
    colstats.bind(k, ch, j, i)
    body = [f"const int mg_r = {clamped_row(ch, f'mg_mi{m} * 16 + mg_g + {(i >> 1) * 8}')};",
            f"const int mg_c = (mg_ks * {lay.score_tiles} + {j}) * 8 + 2 * mg_t + {i & 1};",
            "(void)mg_r; (void)mg_c;"]
    for op in ch.links if links is None else links:
        name = op.outputs[0].name
        st, e = k.em.apply(op, idx)
        body += st + [f"const float mg_v_{name} = {e};"]
        k.em.nodes[name] = Node(op.outputs[0].type.shape, Local(f"mg_v_{name}"))
    for op in ch.row_accs if row_accs is None else row_accs:
        spec = accum_spec(op)
        st, v = k.em.value(op.inputs[0], idx)
        if spec.pre is Pre.SQUARE:
            v = f"({v} * {v})"
        body += st + [c_update(f"acc_{op.outputs[0].name}[{m}][{i >> 1}]", v, spec.combine)]
    st, p = k.em.value(ch.second.inputs[0] if result is None else result, idx)
    return body + st + [f"mg_s[{m}][{j}][{i}] = {p};"]


def _online_links(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """The links of a chain with a running maximum (:class:`chainfacts.Online`), in
    two sweeps over the fragment elements: the first computes ``x`` (left in the
    fragment registers) and the tile's row maxima; then each row's maximum grows and
    the accumulators linear in ``exp(x - max)`` are rescaled; the second sweep
    computes the rest of the links from ``x`` and the new maximum."""
    on = ch.online
    assert on is not None
    first = ch.first.outputs[0].name
    mname = on.acc.outputs[0].name
    idx = _lead(first, k) + ["mg_r", "mg_c"]
    mt, ns = lay.tiles_per_warp, lay.score_tiles
    elems = [(m, j, i) for m in range(mt) for j in range(ns) for i in range(4)]
    lines: Lines = [f"float mg_tm[{mt}][2];"]
    lines += [f"mg_tm[{m}][{h}] = {c_init(Combine.MAX)};" for m in range(mt) for h in range(2)]
    for m, j, i in elems:
        body = _element(k, ch, lay, first, idx, m, j, i, links=on.early, row_accs=(),
                        result=on.arg)
        body.append(c_update(f"mg_tm[{m}][{i >> 1}]", f"mg_s[{m}][{j}][{i}]", Combine.MAX))
        lines += ["{"] + indent(body) + ["}"]
    acc = ch.acc.outputs[0].name
    for m in range(mt):
        for h in range(2):
            tm, run = f"mg_tm[{m}][{h}]", f"acc_{mname}[{m}][{h}]"
            scale = [f"acc_{acc}[{m}][{j}][{2 * h + c}] *= mg_al;"
                     for j in range(lay.out_tiles) for c in range(2)]
            scale += [f"acc_{op.outputs[0].name}[{m}][{h}] *= mg_al;" for op in ch.row_accs
                      if op.outputs[0].name in on.rescaled]
            lines += ["{"] + indent(
                [c_update(tm, f"__shfl_xor_sync(0xffffffffu, {tm}, {x})", Combine.MAX)
                 for x in (1, 2)]
                + [f"const float mg_mn = fmaxf({run}, {tm});",
                   # A row that has seen only -inf has nothing to rescale (and
                   # exp(-inf - -inf) would be NaN); at its first finite tile the
                   # factor exp(-inf - m') is 0, its sums still empty.
                   (f"const float mg_al = mg_mn == {c_init(Combine.MAX)} ? 1.0f : "
                    f"mg_exp({run} - mg_mn);"),
                   f"{run} = mg_mn;"] + scale) + ["}"]
    saved = k.em.nodes[mname]
    late = tuple(op for op in ch.links if op not in on.early)
    folds = tuple(op for op in ch.row_accs if op is not on.acc)
    for m, j, i in elems:
        k.em.nodes[mname] = Node(k.a.types[mname].shape, Local(f"acc_{mname}[{m}][{i >> 1}]"))
        k.em.nodes[on.arg] = Node(k.a.types[on.arg].shape, Local(f"mg_s[{m}][{j}][{i}]"))
        body = _element(k, ch, lay, on.arg, idx, m, j, i, links=late, row_accs=folds)
        lines += ["{"] + indent(body) + ["}"]
    k.em.nodes[mname] = saved
    return lines


def _second(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """acc += P @ B2: P's fragments packed to 16 bits as A, B2 by ``ldmatrix.trans``
    (or by descriptor, :func:`_wg_second`)."""
    wg = _wg_second(k, ch, lay) if _wgmma(k) else []
    return _either(k, wg, _mma_second(k, ch, lay))


def _mma_second(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    b = ch.second.inputs[1]
    acc = ch.acc.outputs[0].name
    mma = mma_fn(ch.second.outputs[0].type.dtype)
    lines: Lines = []
    for s in range(lay.score_tiles // 2):
        step = [f"const int kk = (mg_ks * {lay.score_tiles // 2} + {s}) * 16;"]
        for m in range(lay.tiles_per_warp):
            step += _packed_a(ch, m, s, f"ra{m}")
        step += _b_loads(k, b, lay.out_tiles, "0")
        step += [f"{mma}(acc_{acc}[{m}][{j}], ra{m}_0, ra{m}_1, ra{m}_2, ra{m}_3, rb{j}_0, rb{j}_1);"
                 for m in range(lay.tiles_per_warp) for j in range(lay.out_tiles)]
        lines += ["{"] + indent(step) + ["}"]
    return lines
