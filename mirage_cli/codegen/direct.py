"""Emission of direct kernels: each output element computed by one thread from global
memory.

A custom kernel qualifies (:func:`~.directfacts.direct_reason`) when its forloop has one
iteration, every tensor shares its outputs' leading dimensions, and its operators are
element-wise or reduce along the last dimension, with few input elements read per
output element: the combine of a split over the keys (a few split rows of partial
results and their row statistics folded into one row) is such a kernel. Staged, it
copies every input into shared memory, waits for all of them, and runs each reduction
as a pass of its own with a barrier after it: five barriers and a round trip to
shared memory between the wait for the kernel before it and its first store.

Here the threads of a block take the elements of its output tile in turn (consecutive
threads, consecutive elements: every load of a warp is coalesced). For its element a
thread computes the per-row values it needs once (the row's maximum, its sum; directfacts
``direct_locals``), as local variables, then the element's expression, reading every
input where it is used (a warp's reads of one row's statistics are one broadcast);
no shared memory, no barrier. The per-row values are recomputed by each thread of a
row, which is why the number of reads per element is bounded.
"""

from __future__ import annotations

import dataclasses

from mirage_cli import ops
from mirage_cli.codegen.directfacts import direct_locals, is_alias
from mirage_cli.codegen.expr import (
    CTYPE,
    Inline,
    Lines,
    Local,
    Node,
    Stored,
    offset_expr,
    row_major,
)
from mirage_cli.codegen.kernel import FusedKernel
from mirage_cli.codegen.plan import Kernel
from mirage_cli.ir import BlockOp


class DirectKernel(FusedKernel):
    """The emitter of one direct kernel."""

    def lower(self) -> Kernel:
        self._io_params()
        pre = self._prologue()
        for bi in self.bg.inputs:
            self.em.nodes[bi.value.name] = Node(bi.value.type.shape, Stored(
                self.pname[bi.source], f"base_{bi.value.name}",
                row_major(self.dev[bi.source].shape), CTYPE[bi.value.type.dtype]))
        # An accumulator of the one iteration that returns its input is that input.
        self._src: dict[str, str] = {}
        self._ops: dict[str, BlockOp] = {}  # each operator, aliases' readers reading their input
        for op in self.bg.ops:
            out = op.outputs[0]
            if is_alias(op):
                self._src[out.name] = self._source(op.inputs[0])
                continue
            self._ops[out.name] = dataclasses.replace(
                op, inputs=tuple(self._source(i) for i in op.inputs))
            self.em.nodes[out.name] = Node(out.type.shape, self._inline(out.name))
        self._locals = direct_locals(self.a)
        body: Lines = []
        for bo in self.bg.outputs:
            body += self._store(self._source(bo.source), bo.value.name, bo.omap)
        comment = (f"direct kernel: grid {list(self.bg.grid)}, {self.T} threads, each output "
                   f"element computed by one thread from global memory")
        gx, gy, gz = self.bg.grid
        return Kernel(self.name, tuple(self.params), tuple(pre + body), self.T, (gx, gy, gz),
                      0, 0, comment, self.plan.as_json(), min_blocks=1, wait_at=len(pre))

    def _source(self, name: str) -> str:
        return self._src.get(name, name)

    def _inline(self, name: str) -> Inline:
        p = self._ops[name]
        return Inline(p.op, p.inputs, ops.get(p.op).attr_values(p.attrs))

    def _needed(self, name: str, seen: set[str]) -> None:
        """Adds to ``seen`` the per-row values that computing ``name`` reads."""
        p = self._ops.get(name)
        if p is None or name in seen:
            return
        if name in self._locals:
            seen.add(name)
        for i in p.inputs:
            self._needed(i, seen)

    def _store(self, source: str, dev: str, omap: tuple[int | None, int | None, int | None]
               ) -> Lines:
        shape = self.a.types[source].shape
        strides = row_major(self.dev[dev].shape)
        terms = [f"{ax} * {shape[d] * strides[d]}"
                 for ax, d, g in zip(("bx", "by", "bz"), omap, self.bg.grid)
                 if d is not None and g > 1]
        base = " + ".join(terms) if terms else "0"
        p = self.pname[dev]
        needed: set[str] = set()
        self._needed(source, needed)
        order = [n for n in self._locals if n in needed]

        def body(idx: list[str]) -> Lines:
            lines: Lines = []
            row = idx[:-1] + ["0"]
            for name in order:  # block order: a per-row value reads only earlier ones
                st, e = self.em.apply(self._ops[name], row)
                v = self.em.fresh("r")
                lines += st + [f"const float {v} = {e};"]
                self.em.nodes[name] = Node(self.em.nodes[name].shape, Local(v))
            st, e = self.em.value(source, idx)
            for name in order:  # the locals exist only inside this element's code
                self.em.nodes[name] = Node(self.em.nodes[name].shape, self._inline(name))
            return lines + st + [f"mg_st({p} + ({offset_expr(base, idx, strides)}), {e});"]
        return self.elem_loop(shape, body, unroll=True)
