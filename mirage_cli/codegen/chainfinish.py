"""Emission of a register-resident matmul chain after its loop (:mod:`chain` emits the
loop): each row accumulator's partials combined over the 4 lanes of its row by
shuffles, a running maximum merged over the warps that split a row's columns (the
others rescaled to it), and every accumulator written from its fragments into its f32
tile, one level of column-split warps at a time (one writer per element and level, a
fixed order), where the epilogue and a cluster's combine read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mirage_cli.codegen.chain import tile_rows
from mirage_cli.codegen.chainfacts import Chain, clamped_row, real_rows, tile_rows_of
from mirage_cli.codegen.chainplan import ChainLayout
from mirage_cli.codegen.expr import Lines, indent, offset_expr, row_major, unrolled
from mirage_cli.codegen.mma import warp_ids
from mirage_cli.codegen.reduce import accum_spec
from mirage_cli.semantics.accum import Combine
from mirage_cli.semantics.cuda import c_init, c_update

if TYPE_CHECKING:
    from mirage_cli.codegen.kernel import FusedKernel


def finish(k: FusedKernel, ch: Chain, lay: ChainLayout, fins: dict[str, str]) -> Lines:
    """Row partials combined over each row's 4 lanes, then every accumulator into its
    f32 tile: one level of column-split warps at a time (the first writes, each further
    one folds its values in after a barrier: one writer per element and level, a fixed
    order). ``fins``: each accumulator's finish, a format of its combined state."""
    out: Lines = warp_ids(lay.groups)
    for op in ch.row_accs:
        name, comb = op.outputs[0].name, accum_spec(op).combine
        out += indent(unrolled("m", lay.tiles_per_warp, unrolled("h", 2, [
            c_update(f"acc_{name}[m][h]",
                     f"__shfl_xor_sync(0xffffffffu, acc_{name}[m][h], {x})", comb)
            for x in (1, 2)])))
    skip: frozenset[str] = frozenset()
    if ch.online is not None and lay.kwarps > 1:
        out += indent(_online_merge(k, ch, lay))
        skip = frozenset({ch.online.acc.outputs[0].name})
    for lvl in range(lay.kwarps):
        body = tile_rows(ch, lay) + _writes(k, ch, lay, first=lvl == 0, skip=skip)
        if lay.kwarps > 1:
            out += indent((["__syncthreads();"] if lvl else [])
                          + [f"if (mg_ks == {lvl}) {{"] + indent(body) + ["}"])
        else:
            out += indent(body)
    out.append("}")
    todo = [op for op in (ch.acc, *ch.row_accs) if fins[op.outputs[0].name] != "{0}"]
    if todo:
        out.append("__syncthreads();")
        for op in todo:
            name, n = op.outputs[0].name, op.outputs[0].type.numel
            out.append(f"for (int e = threadIdx.x; e < {n}; e += {k.T}) "
                       f"buf_{name}[e] = {fins[name].format(f'buf_{name}[e]')};")
    return out


def _slot(k: FusedKernel, name: str, r: str, col: str) -> str:
    """Element (row ``r``, column ``col``) of f32 tile ``name`` in this warp's matrix
    (``mg_b``, for a batched tile)."""
    shape = k.a.types[name].shape
    # The warp's matrix (mg_b) along the batch dimension that is not 1 (the first where
    # all are: mg_b is 0 then); the others are 1.
    dims = shape[:-2]
    at = next((i for i, d in enumerate(dims) if d > 1), 0)
    lead = ["mg_b" if i == at else "0" for i in range(len(dims))]
    return f"buf_{name}[{offset_expr('0', lead + [r, col], row_major(shape))}]"


def _online_merge(k: FusedKernel, ch: Chain, lay: ChainLayout) -> Lines:
    """Warps that split a row's columns each ran their own maximum: the largest goes
    into the maximum's tile (one level of warps at a time), and each warp rescales its
    accumulators to it before they are added (:func:`_writes`)."""
    on = ch.online
    assert on is not None
    mname, acc = on.acc.outputs[0].name, ch.acc.outputs[0].name

    def slot(r: str) -> str:
        return _slot(k, mname, r, "0")

    out: Lines = []
    for lvl in range(lay.kwarps):
        rows: Lines = []
        for m in range(lay.tiles_per_warp):
            rows += ["{", f"  const int r0 = mg_mi{m} * 16 + mg_g, r1 = r0 + 8;",
                     "  if (mg_t == 0) {"]
            rows += [_if_real(ch, r, f"{slot(r)} = {f'acc_{mname}[{m}][{h}]'};" if lvl == 0
                              else c_update(slot(r), f"acc_{mname}[{m}][{h}]", Combine.MAX),
                              "    ")
                     for h, r in enumerate(("r0", "r1"))]
            rows += ["  }", "}"]
        out += (["__syncthreads();"] if lvl else []) + [f"if (mg_ks == {lvl}) {{"] + indent(
            tile_rows(ch, lay) + rows) + ["}"]
    out.append("__syncthreads();")
    scale: Lines = tile_rows(ch, lay)
    for m in range(lay.tiles_per_warp):
        scale += ["{", f"  const int r0 = mg_mi{m} * 16 + mg_g, r1 = r0 + 8;"]
        for h, r in enumerate(("r0", "r1")):
            run = f"acc_{mname}[{m}][{h}]"
            scale += [(f"  {{ const float mg_al = {run} == {c_init(Combine.MAX)} ? 0.0f : "
                       f"mg_exp({run} - {slot(clamped_row(ch, r))});")]
            scale += [f"    acc_{acc}[{m}][{j}][{2 * h + c}] *= mg_al;"
                      for j in range(lay.out_tiles) for c in range(2)]
            scale += [f"    acc_{op.outputs[0].name}[{m}][{h}] *= mg_al;" for op in ch.row_accs
                      if op.outputs[0].name in on.rescaled]
            scale += ["  }"]
        scale += ["}"]
    return out + ["{"] + indent(scale) + ["}"]


def _writes(k: FusedKernel, ch: Chain, lay: ChainLayout, first: bool,
            skip: frozenset[str] = frozenset()) -> Lines:
    """This warp's accumulator values into the f32 tiles (``=`` for the first level of
    column-split warps, the accumulator's combine after it); not those in ``skip``."""
    lines: Lines = []

    def put(name: str, r: str, v: str, comb: Combine) -> str:
        slot = _slot(k, name, r, "0")
        return f"{slot} = {v};" if first else c_update(slot, v, comb)

    acc = ch.acc.outputs[0].name
    for m in range(lay.tiles_per_warp):
        rows = [f"const int r0 = mg_mi{m} * 16 + mg_g, r1 = r0 + 8;"]
        for op in ch.row_accs:
            name, comb = op.outputs[0].name, accum_spec(op).combine
            if name in skip:
                continue
            rows += ["if (mg_t == 0) {"] + indent(
                [_if_real(ch, r, put(name, r, f"acc_{name}[{m}][{h}]", comb))
                 for h, r in enumerate(("r0", "r1"))]) + ["}"]
        for j in range(lay.out_tiles):
            rows += [_if_real(ch, r, _pair(k, acc, r, f"{j * 8} + 2 * mg_t",
                                           f"acc_{acc}[{m}][{j}][{2 * h}]",
                                           f"acc_{acc}[{m}][{j}][{2 * h + 1}]", first))
                     for h, r in enumerate(("r0", "r1"))]
        lines += ["{"] + indent(rows) + ["}"]
    return lines


def _pair(k: FusedKernel, name: str, r: str, col: str, a: str, b: str, first: bool) -> str:
    """A fragment's two neighbouring values (columns ``col``, ``col + 1`` of row ``r``,
    ``col`` even) written to, or added to, f32 tile ``name`` by one 8-byte access: half
    the shared-memory instructions and wavefronts of two scalar ones."""
    at = f"reinterpret_cast<float2*>(&{_slot(k, name, r, f'({col})')})"
    if first:
        return f"*{at} = make_float2({a}, {b});"
    return (f"{{ float2* mg_p = {at}; const float2 mg_o = *mg_p; "
            f"*mg_p = make_float2(mg_o.x + {a}, mg_o.y + {b}); }}")


def _if_real(ch: Chain, r: str, stmt: str, pad: str = "") -> str:
    """``stmt`` where row ``r`` exists: a short tile's padding rows are never stored."""
    if real_rows(ch) < tile_rows_of(ch):
        return f"{pad}if ({r} < {real_rows(ch)}) {{ {stmt} }}"
    return pad + stmt

