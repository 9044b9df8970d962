"""Stores of a fused kernel's outputs: each block writes its tile through the omap.

A tile's elements are computed where they are stored (the emitter's value chain) and
written one element per thread, or, where the plan's ``vec`` says so and the output's
rows allow it (``knobranges.store_vec``), ``vec`` consecutive elements per thread in one
16-byte store (``mg_st8``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mirage_cli.codegen.expr import Lines, offset_expr, row_major
from mirage_cli.codegen.knobranges import store_vec

if TYPE_CHECKING:
    from mirage_cli.codegen.kernel import FusedKernel


def store(k: FusedKernel, source: str, dev: str,
          omap: tuple[int | None, int | None, int | None], share: bool = False) -> Lines:
    """Store block tensor ``source`` into device tensor ``dev`` at this block's tile
    (``share``: this block's 1/KS share of it, see :mod:`cluster`)."""
    shape = k.em.nodes[source].shape
    out = k.dev[dev]
    strides = row_major(out.shape)
    terms = [f"{ax} * {shape[d] * strides[d]}"
             for ax, d, g in zip(("bx", "by", "bz"), omap, k.bg.grid)
             if d is not None and g > 1]
    base = " + ".join(terms) if terms else "0"
    p = k.pname[dev]
    vec = k.plan.knobs.vec or 1
    if vec > 1 and store_vec(k.a.types[source], out) == vec:
        return _store_vec(k, source, p, base, strides, shape, vec, share)

    def body(idx: list[str]) -> Lines:
        st, v = k.em.value(source, idx)
        return st + [f"mg_st({p} + ({offset_expr(base, idx, strides)}), {v});"]
    return k.elem_loop(shape, body, share)


def _store_vec(k: FusedKernel, source: str, p: str, base: str, strides: tuple[int, ...],
               shape: tuple[int, ...], vec: int, share: bool) -> Lines:
    """Each thread computes ``vec`` consecutive elements and stores them at once."""
    chunks = shape[:-1] + (shape[-1] // vec,)

    def body(idx: list[str]) -> Lines:
        first = f"({idx[-1]} * {vec})" if idx[-1] != "0" else "0"
        lines: Lines = []
        vals = []
        for j in range(vec):
            st, v = k.em.value(source, idx[:-1] + [f"({first} + {j})"])
            lines += st
            vals.append(v)
        off = offset_expr(base, idx[:-1] + [first], strides)
        return lines + [f"mg_st8({p} + ({off}), {', '.join(vals)});"]
    return k.elem_loop(chunks, body, share)
