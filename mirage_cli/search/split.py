"""Split reduction (flash-decoding style): one fused kernel becomes two.

A single-kernel design whose forloop walks a reduction (attention's keys) runs only as
many blocks as its grid has; when that is far below the GPU's SM count, splitting the
walked index over one more grid axis too gives more blocks. Each block then
accumulates only its chunk, so the kernel stores its accumulators as *partial
results* (concatenated along their last dimension), and a second kernel adds the
chunks (``acc_sum_to`` / ``acc_sum_ld`` over the concatenated dimension) and runs the
original epilogue. This is the kernel-level generator move that produces Mirage's
two-kernel attention µGraphs from the one-kernel ones; it applies when every
accumulator is a plain sum (sums split over chunks; ``mean``/``rms``/``max`` do not
this way). The partial results are stored in the program's dtype, or, in a second
form (``wide``), in f32 as the accumulators that hold them, with the second kernel
converting its result to the output's dtype: a chunk's sum can exceed f16's range
where the program's result does not, which the numerics check finds
(docs/verification.md), and then the narrow form is rejected and the wide one, which
moves more bytes, ships. The wide form exists only where the second kernel reads
nothing but the partials (its operators need one dtype). Like every design, the
result is re-checked by the builder at each tuning and verified before it is
emitted.
"""

from __future__ import annotations

from mirage_cli import ops
from mirage_cli.ir import AxisMap, DType, Graph
from mirage_cli.search.design import CustomD, Design, LoadD, OpD, StoreD, Tuning, looped_kernel


def split_reduction(target: Graph, design: Design, tuning: Tuning, wide: bool = False
                    ) -> Design | None:
    """The two-kernel form of a one-kernel ``design`` (or None where it does not
    apply). ``tuning`` is any valid tuning of ``design``; it fixes the widths of the
    partial results. ``wide``: the partials in f32 (see the module docstring)."""
    found = looped_kernel(target, design, tuning)
    if found is None or found[0].axes >= 3:
        return None
    c, block = found
    nl = len(c.loads)
    phase = ["loop" if ld.fmap is not None else "invariant" for ld in c.loads]
    for o in c.ops:
        spec = ops.get(o.op).accum
        if spec is not None:
            if not spec.is_plain_sum:
                return None
            phase.append("acc")
        elif any(phase[a] in ("acc", "epilogue") for a in o.args):
            phase.append("epilogue")
        else:
            phase.append("loop" if any(phase[a] == "loop" for a in o.args)
                         else "invariant")
    # Epilogue operators may read accumulators, epilogue values and invariant loads.
    for k, o in enumerate(c.ops):
        if phase[nl + k] == "epilogue" and any(
                phase[a] == "invariant" and a >= nl for a in o.args):
            return None
    a = c.axes
    loads1 = tuple(LoadD(ld.source, _set(ld.imap, a, ld.fmap), ld.fmap) for ld in c.loads)
    acc_tiles = [nl + k for k, o in enumerate(c.ops) if phase[nl + k] == "acc"]
    out_omap = c.stores[0].omap
    stores1: list[StoreD] = []
    for j, t in enumerate(acc_tiles):
        rank = block.ops[t - nl].outputs[0].type.rank
        omap = _set(tuple(out_omap[i] if i < a else None for i in range(3)), a, rank - 1)
        if list(omap[:a]).count(rank - 1):
            return None
        stores1.append(StoreD(t, f"{c.stores[0].name}_part{j}", omap))
    remap1 = {x: x for x in range(nl)}
    k1_ops: list[OpD] = []
    for k, o in enumerate(c.ops):
        if phase[nl + k] != "epilogue":
            k1_ops.append(OpD(o.op, tuple(remap1[x] for x in o.args), o.attrs))
            remap1[nl + k] = nl + len(k1_ops) - 1
    # Kernel 2: load the partials (and invariant loads the epilogue reads), reduce the
    # chunks, run the epilogue.
    inv_used = sorted({x for k, o in enumerate(c.ops) if phase[nl + k] == "epilogue"
                       for x in o.args if x < nl})
    if wide and inv_used:
        return None
    stores1 = [StoreD(remap1[s.tile], s.name, s.omap, DType.F32 if wide else None)
               for s in stores1]
    kernel1 = CustomD(loads1, tuple(k1_ops), tuple(stores1), a + 1, True)
    loads2 = [LoadD(s.name, _first_axes(s.omap, a), None) for s in stores1]
    loads2 += [LoadD(c.loads[x].source, c.loads[x].imap, None) for x in inv_used]
    remap: dict[int, int] = {x: len(stores1) + i for i, x in enumerate(inv_used)}
    ops2: list[OpD] = []
    for j, t in enumerate(acc_tiles):
        acc = c.ops[t - nl]
        spec = ops.get(acc.op).accum
        assert spec is not None
        width = block.ops[t - nl].outputs[0].type.shape[-1]
        if spec.reduce is ops.Reduce.LAST:
            ops2.append(OpD("acc_sum_ld", (j,), ()))
        else:
            ops2.append(OpD("acc_sum_to", (j,), (("width", width),)))
        remap[t] = len(loads2) + len(ops2) - 1
    for k, o in enumerate(c.ops):
        if phase[nl + k] == "epilogue":
            ops2.append(OpD(o.op, tuple(remap[x] for x in o.args), o.attrs))
            remap[nl + k] = len(loads2) + len(ops2) - 1
    types = target.tensor_types()
    stores2 = tuple(StoreD(remap[s.tile], s.name, s.omap,
                           types[s.name].dtype if wide and s.name in types else None)
                    for s in c.stores)
    kernel2 = CustomD(tuple(loads2), tuple(ops2), stores2, a, False)  # type: ignore[arg-type]
    return Design((kernel1, kernel2), design.outputs)


def _set(amap: tuple[int | None, ...], axis: int, dim: int | None
         ) -> tuple[int | None, int | None, int | None]:
    m = list(amap) + [None] * (3 - len(amap))
    m[axis] = dim
    return (m[0], m[1], m[2])


def _first_axes(omap: AxisMap, n: int) -> AxisMap:
    """``omap`` with only its first ``n`` grid axes kept (the others replicate)."""
    x, y, z = (omap[i] if i < n else None for i in range(3))
    return (x, y, z)
