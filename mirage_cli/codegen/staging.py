"""Emission of a fused kernel's input staging: the copies that bring each block's tiles
into shared memory, and their pipeline over forloop iterations.

Three copy paths, as the plan says per tile (codegen/planner.py): 16-byte ``cp.async``
chunks into padded rows (each thread its own chunks, their offsets computed once),
element-by-element copies where rows are not whole 16-byte chunks, and bulk tensor
copies of swizzled boxes (``tmaplan``), issued by thread 0 and completing on one
mbarrier per stage. Loop inputs go through a ring of ``stages`` slots: the prologue
issues iterations 0 .. S-2, and each iteration waits for its own slot, passes one
barrier, and issues iteration ``it + S - 1`` into the slot ``it - 1`` freed. Copies of
inputs the kernel may read early (``FusedKernel.early``) are issued before the
grid-dependency wait.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mirage_cli.codegen import tmaplan
from mirage_cli.codegen.expr import Lines, indent, index_vars, keep_used, offset_expr, row_major
from mirage_cli.ir import BlockInput

if TYPE_CHECKING:
    from mirage_cli.codegen.kernel import FusedKernel


def padded_strides(shape: tuple[int, ...], pitch: int) -> tuple[int, ...]:
    """Row-major strides of a tile whose rows are ``pitch`` elements apart."""
    return row_major(shape[:-1] + (pitch,))


def stages(k: FusedKernel) -> int:
    """The pipeline depth of the loop inputs (1: no overlap)."""
    return max([k.tile(bi.value.name).stages for bi in k.staged("loop")] + [1])


def pipelined(k: FusedKernel) -> bool:
    """Loop inputs staged through a ring of two or more shared-memory stages."""
    return bool(k.staged("loop")) and stages(k) > 1


def global_it(k: FusedKernel, local: str) -> str:
    """The forloop iteration that this block's local iteration ``local`` is."""
    if k.STAG:
        fl = k.FL
        wrap = f"& {fl - 1}" if fl & (fl - 1) == 0 else f"% {fl}"
        local = f"((({local}) + mg_rot) {wrap})"
    return f"(mg_it0 + {local})" if k.KS > 1 else local


def fmap_step(k: FusedKernel, bi: BlockInput) -> int:
    """Elements between one iteration's tile of ``bi`` and the next one's."""
    assert bi.fmap is not None
    return bi.value.type.shape[bi.fmap] * row_major(k.dev[bi.source].shape)[bi.fmap]


def stage(k: FusedKernel, bi: BlockInput, base: str, dst: str) -> Lines:
    """Copy this block's tile of ``bi`` into shared memory (16-byte cp.async chunks
    where the plan allows, scalar copies otherwise), rows ``pitch`` apart."""
    t, shape = k.tile(bi.value.name), bi.value.type.shape
    if shifted(k, bi):
        return _shifted_stage(k, bi, base, dst)
    vec = t.vec
    chunks = shape[:-1] + (shape[-1] // vec,)
    n = 1
    for d in chunks:
        n *= d
    if vec > 1 and n % k.T == 0 and n // k.T <= 16:
        # Each thread copies the same chunks every iteration: their offsets are
        # computed once (registers), not divided out again per copy.
        tab = _offset_table(k, bi, chunks, n // k.T)
        src = k.source_at(bi.source, f"({base})", f"mg_so_{tab}[i]")
        copy = f"mg_cp_async16({dst} + mg_do_{tab}[i], {src});"
        return ["#pragma unroll", f"for (int i = 0; i < {n // k.T}; ++i) {copy}"]
    c = k.em.fresh("c")
    src_o, dst_o, decl = _chunk_offsets(k, bi, chunks, c, padded_strides(shape, t.pitch))
    src = k.source_at(bi.source, f"({base})", f"({src_o})")
    if vec == 1:
        src = (f"*{src}" if bi.source in k.joins
               else f"{k.pname[bi.source]}[{base} + ({src_o})]")
    op = (f"mg_cp_async16({dst} + ({dst_o}), {src});" if vec > 1 else f"{dst}[{dst_o}] = {src};")
    return ([f"for (int {c} = threadIdx.x; {c} < {n}; {c} += {k.T}) {{"]
            + indent(keep_used(decl, [op]) + [op]) + ["}"])


def shifted(k: FusedKernel, bi: BlockInput) -> bool:
    """Whether ``bi`` is a shifted join's tile (codegen/joins.py)."""
    j = k.joins.get(bi.source)
    return j is not None and j.shifted


def _shifted_stage(k: FusedKernel, bi: BlockInput, base: str, dst: str) -> Lines:
    """A shifted join's tile: for each of its rows (consecutive rows of the joined
    tensor, ``period`` elements apart) the aligned chunks that cover the row's part of
    the first part, one more than the row has (``mg_cp_shifted``)."""
    t, shape = k.tile(bi.value.name), bi.value.type.shape
    j = k.joins[bi.source]
    per_row = shape[-1] // t.vec + 1
    rows = bi.value.type.numel // shape[-1]
    c = k.em.fresh("c")
    src = k.pname[j.parts[0]]
    copy = (f"mg_cp_shifted<{j.period}, {j.head}, {j.chunk}>({dst} + {c}_r * {t.pitch} + "
            f"{c}_j * {t.vec}, {src}, ({base}) + {c}_r * {j.period}, {c}_j);")
    return [f"for (int {c} = threadIdx.x; {c} < {rows * per_row}; {c} += {k.T}) {{",
            f"  const int {c}_r = {c} / {per_row}, {c}_j = {c} - {c}_r * {per_row};",
            f"  {copy}", "}"]


def _chunk_offsets(k: FusedKernel, bi: BlockInput, chunks: tuple[int, ...], c: str,
                   smem_strides: tuple[int, ...]) -> tuple[str, str, Lines]:
    """Source (from the tile's base) and shared-memory offsets of chunk ``c``."""
    t = k.tile(bi.value.name)
    decl, idx = index_vars(chunks, c, k.em.fresh("s") + "_")
    if t.vec > 1:
        idx = idx[:-1] + [f"({idx[-1]} * {t.vec})" if idx[-1] != "0" else "0"]
    return (offset_expr("0", idx, row_major(k.dev[bi.source].shape)),
            offset_expr("0", idx, smem_strides), decl)


def _offset_table(k: FusedKernel, bi: BlockInput, chunks: tuple[int, ...], count: int) -> str:
    name = bi.value.name
    if name not in k._tables:
        k._tables.add(name)
        c = k.em.fresh("c")
        strides = padded_strides(bi.value.type.shape, k.tile(name).pitch)
        src_o, dst_o, decl = _chunk_offsets(k, bi, chunks, c, strides)
        body = [f"const int {c} = threadIdx.x + i * {k.T};"]
        ops_ = [f"mg_so_{name}[i] = {src_o};", f"mg_do_{name}[i] = {dst_o};"]
        body += keep_used(decl, ops_) + ops_
        k.hoisted += [f"int mg_so_{name}[{count}], mg_do_{name}[{count}];",
                      "#pragma unroll", f"for (int i = 0; i < {count}; ++i) {{"]
        k.hoisted += indent(body) + ["}"]
    return name


def slot(k: FusedKernel, bi: BlockInput, iteration: str) -> str:
    """The shared-memory stage that holds ``iteration``'s tile of ``bi``."""
    t = k.tile(bi.value.name)
    vt = bi.value.type
    elems = (vt.numel // vt.shape[-1]) * t.pitch
    elems = (elems * vt.dtype.nbytes + 15) // 16 * 16 // vt.dtype.nbytes
    if t.swizzle:
        elems = tmaplan.slot_bytes(vt) // vt.dtype.nbytes
    return f"(sm_{t.name}_0 + (({iteration}) % {t.stages}) * {elems})"


def read_once(grid: tuple[int, int, int], bi: BlockInput) -> bool:
    """Whether a ``grid`` of blocks reads each element of ``bi``'s tensor once: a loop
    input split over every grid axis of more than one block (a cluster's blocks take
    disjoint iterations). Its bulk copies are hinted to leave the L2 first
    (``mg_tma2<true>`` and the like)."""
    return bi.fmap is not None and all(n == 1 or bi.imap[a] is not None
                                       for a, n in enumerate(grid))


def bulk_copies(k: FusedKernel, bis: list[BlockInput], iteration: str, arrive: bool) -> Lines:
    """Thread 0 copies ``iteration``'s boxes of ``bis`` into their slots, their bytes
    expected on the stage's mbarrier (with its one arrival when ``arrive``)."""
    S = stages(k)
    bar = f"mg_mbar + (({iteration}) % {S})" if S > 1 else "mg_mbar"
    nbytes = sum(bi.value.type.numel * bi.value.type.dtype.nbytes for bi in bis)
    lines = [f"mg_mbar_arrive_expect({bar}, {nbytes}u);" if arrive else
             f"mg_mbar_expect({bar}, {nbytes}u);"]
    for bi in bis:
        vt, w = bi.value.type, k.tile(bi.value.name).swizzle
        dst = f"reinterpret_cast<unsigned char*>({slot(k, bi, iteration)})"
        it = global_it(k, iteration) if bi.fmap is not None else None
        for b in range(tmaplan.boxes(vt, w)):
            cs = tmaplan.coords(bi, k.dev[bi.source], k.bg.grid, it, b, w)
            at = f"{dst} + {b * tmaplan.rows(vt) * w}" if b else dst
            once = "<true>" if read_once(k.bg.grid, bi) else ""
            lines.append(f"mg_tma{len(cs)}{once}({at}, &{k.tmap[bi.value.name]}, "
                         f"{', '.join(cs)}, {bar});")
    return ["if (threadIdx.x == 0) {"] + indent(lines) + ["}"]


def prefetch(k: FusedKernel) -> tuple[Lines, int]:
    """Before the loop: issue the copies of iterations 0 .. S-2, one group each; the
    lines and the number of ``cp.async`` commit groups they make.

    Copies of ``k.early`` inputs go to ``k.early_copies`` instead, issued before the
    grid-dependency wait; they fall into the first group, which iteration 0 waits for
    anyway, so every later group still holds its iteration's copies."""
    staged = k.staged("loop")
    S = stages(k)
    cp = [bi for bi in staged if bi not in k.bulk]
    early = [bi for bi in k.bulk if bi.source in k.early]
    late = [bi for bi in k.bulk if bi.source not in k.early]
    lines: Lines = []
    for i in range(S - 1 if staged else 0):
        for bi in cp:
            step = fmap_step(k, bi)
            first = (f"{global_it(k, str(i))} * {step}" if k.KS > 1 or k.STAG
                     else str(i * step))
            copy = stage(k, bi, f"(base_{bi.value.name} + {first})", slot(k, bi, str(i)))
            if bi.source in k.early:
                k.early_copies += copy
            else:
                lines += copy
        # One arrival per stage: the last of the two halves makes it.
        if early:
            k.early_copies += bulk_copies(k, early, str(i), arrive=not late)
        if late:
            lines += bulk_copies(k, late, str(i), arrive=True)
        if cp:
            lines.append("mg_cp_async_commit();")
    return lines, (S - 1 if staged and cp else 0)


def iteration_copies(k: FusedKernel) -> Lines:
    """The start of each forloop iteration: this iteration's tiles waited for (and,
    pipelined, the next copies issued), and ``sm_<tile>`` pointing at its slots."""
    lines: Lines = []
    loop_inputs = [bi for bi in k.bg.inputs if k.a.phases[bi.value.name] == "loop"
                   and bi not in k.bulk]  # bulk copies address by coordinates
    for bi in loop_inputs:
        lines.append(f"const int off_{bi.value.name} = base_{bi.value.name} + "
                     f"{global_it(k, 'it')} * {fmap_step(k, bi)};")
    staged = k.staged("loop")
    S = stages(k)
    cp = [bi for bi in staged if bi not in k.bulk]
    if staged and S == 1:
        for bi in cp:
            lines += stage(k, bi, f"off_{bi.value.name}", f"sm_{bi.value.name}_0")
        if k.bulk:
            lines += bulk_copies(k, k.bulk, "it", arrive=True)
        lines += (["mg_cp_async_wait_all();"] if cp else []) + (
            ["mg_mbar_wait(mg_mbar, it & 1);"] if k.bulk else [])
        lines.append("__syncthreads();")
    elif staged:
        # Wait until iteration it's tiles have landed (only the S - 2 newest groups
        # pending; stage it's mbarrier phase complete), then, past the barrier (every
        # thread is done with iteration it - 1), issue iteration it + S - 1's copies
        # into the stage it - 1 used: one barrier per iteration. One commit group per
        # iteration, empty at the end.
        pre: Lines = []
        for bi in cp:
            step = fmap_step(k, bi)
            ahead = (f"(base_{bi.value.name} + {global_it(k, f'it + {S - 1}')} * {step})"
                     if k.STAG else f"(off_{bi.value.name} + {(S - 1) * step})")
            pre += stage(k, bi, ahead, slot(k, bi, f"(it + {S - 1})"))
        if k.bulk:
            pre += bulk_copies(k, k.bulk, f"it + {S - 1}", arrive=True)
        lines += ([f"mg_cp_async_wait<{S - 2}>();"] if cp else []) + (
            [f"mg_mbar_wait(mg_mbar + (it % {S}), (it / {S}) & 1);"] if k.bulk else [])
        lines += ["__syncthreads();", f"if (it + {S - 1} < {k.FL}) {{"] + indent(pre) + [
            "}"] + (["mg_cp_async_commit();"] if cp else [])
    for bi in staged:
        cur = slot(k, bi, "it") if S > 1 else f"sm_{bi.value.name}_0"
        lines.append(f"const auto* sm_{bi.value.name} = {cur};")
    return lines
