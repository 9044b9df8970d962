"""Emission of row kernels with their rows in registers.

A custom kernel qualifies (:func:`~.blockfacts.rows_in_registers`) when its forloop has one iteration, it has
no matmul, and every block tensor is a tile of R rows of L 16-bit or f32 elements
(``[R, L]``), a per-row result (``[R, 1]``) or a row every row shares (``[L]``, a
norm's weight, loaded as if each row held it): element-wise chains, row reductions
along the last dimension (``rms``, ``sum``, ``mean``, ``max``, ``min``, and row
accumulators of the one iteration such as ``acc_rms_ld``) and accumulators that an
iteration leaves unchanged (``acc_sum`` of one iteration) — norms, residual updates,
gates. Such a kernel never needs shared memory for its
tiles: each thread owns the same 8-element chunks of every tile (chunk ``c`` of a row
by thread ``c % T``, ``L / 8`` a multiple of ``T``), loads its chunks of each input
with one 16-byte access each, computes every element-wise tensor in registers, and
reduces a row with warp shuffles and one shared-memory slot per warp and row (one
barrier per reduction). Stores are 16 bytes per chunk. Measured on an H200
(``docs/perf-log.md`` v8) against the staged form of the same µGraph, ntrans at batch
1 / 8 / 16 ran in 2.1 / 2.6 / 2.9 µs instead of 3.9 / 4.6 / 5.1 µs.
"""

from __future__ import annotations

from collections.abc import Callable

from mirage_cli import ops
from mirage_cli.codegen.blockfacts import ROW_VEC as VEC
from mirage_cli.codegen.blockfacts import row_kind, row_tile
from mirage_cli.codegen.expr import Lines, Node, Regs, Stored, indent, reciprocal, row_major
from mirage_cli.codegen.kernel import FusedKernel
from mirage_cli.codegen.plan import Kernel
from mirage_cli.codegen.reduce import row_combine
from mirage_cli.ir import BlockOp
from mirage_cli.semantics.accum import Combine, Finish, Pre
from mirage_cli.semantics.cuda import c_float, c_init, c_update, c_warp


class RowKernel(FusedKernel):
    """The emitter of one row kernel with its rows in registers."""

    def lower(self) -> Kernel:
        self._io_params()
        shape = row_tile(self.a)
        assert shape is not None
        self.R, self.L = shape
        self.S = self.L // VEC // self.T   # chunks of one row per thread
        self.CH = self.R * self.S          # chunks of the tile per thread
        self._recip: set[str] = set()      # per-row results kept as their reciprocals
        body = ["const int bx = blockIdx.x, by = blockIdx.y, bz = blockIdx.z;",
                "(void)bx; (void)by; (void)bz;"]
        for bi in self.bg.inputs:
            body += self._load(bi.value.name, bi.source, self._block_base(bi))
        for op in self.bg.ops:
            body += self._op(op)
        for bo in self.bg.outputs:
            body += self._store(bo.source, bo.value.name, bo.omap)
        comment = (f"row kernel, rows in registers: grid {list(self.bg.grid)}, {self.T} "
                   f"threads, {self.CH} chunk(s) of {VEC} per thread and tile")
        gx, gy, gz = self.bg.grid
        return Kernel(self.name, tuple(self.params), tuple(body), self.T, (gx, gy, gz), 0, 0,
                      comment, self.plan.as_json(), min_blocks=1)

    # -- where a thread's chunk j lies ---------------------------------------------------

    def _row(self, j: int) -> int:
        return j // self.S

    def _col0(self, j: int) -> str:
        first = (j % self.S) * self.T * VEC
        return f"{first} + threadIdx.x * {VEC}" if first else f"threadIdx.x * {VEC}"

    def _chunks(self, body: Callable[[int, list[str]], Lines]) -> Lines:
        """``body(j, idx)`` for each of this thread's chunks, inside a loop over the 8
        elements ``q`` of the chunk; element slot ``j * 8 + q`` of every register tile."""
        lines: Lines = []
        for j in range(self.CH):
            self.em.reg_slot = f"{j * VEC} + q"
            idx = [str(self._row(j)), f"({self._col0(j)} + q)"]
            lines += ["#pragma unroll", f"for (int q = 0; q < {VEC}; ++q) {{"]
            lines += ["  " + ln for ln in body(j, idx)] + ["}"]
        self.em.reg_slot = None
        return lines

    # -- loads, operators, stores ------------------------------------------------------------

    def _load(self, name: str, dev: str, base: str) -> Lines:
        """This thread's chunks of an input; an [L] row (a norm's weight) is loaded
        for each of its chunks as if every row held it (the repeats hit L1)."""
        arr, p, Ld = f"r_{name}", self.pname[dev], self.dev[dev].shape[-1]
        shared_row = len(self.a.types[name].shape) == 1
        self.em.nodes[name] = Node((self.R, self.L), Regs(arr))
        lines = [f"float {arr}[{self.CH * VEC}];"]
        for j in range(self.CH):
            row = 0 if shared_row else self._row(j) * Ld
            off = f"{base} + {row} + {self._col0(j)}"
            lines.append(f"mg_ld8({p} + ({off}), {arr} + {j * VEC});")
        return lines

    def _op(self, op: BlockOp) -> Lines:
        out = op.outputs[0]
        kind = row_kind(op, self.a)
        if kind == "alias":
            self.em.nodes[out.name] = Node(out.type.shape, self.em.nodes[op.inputs[0]].how)
            return []
        if kind == "row":
            return self._reduce(op)
        arr = f"r_{out.name}"
        attrs = ops.get(op.op).attr_values(op.attrs)
        lines = [f"float {arr}[{self.CH * VEC}];"]
        by_inverse = ops.get(op.op).cuda.by_inverse
        per_row = by_inverse is not None and self.em.nodes[op.inputs[1]].shape[-1] == 1
        if per_row:
            # Division by a per-row value (a norm): one reciprocal per row, then a product
            # per element, instead of an IEEE division (a slow-path call) per element.
            inv = f"inv_{out.name}"
            d = self._row_value(op.inputs[1], "r")
            recip = d if op.inputs[1] in self._recip else reciprocal(d)
            lines += [f"float {inv}[{self.R}];", "#pragma unroll",
                      f"for (int r = 0; r < {self.R}; ++r) {inv}[r] = {recip};"]

        def body(j: int, idx: list[str]) -> Lines:
            if per_row:
                assert by_inverse is not None
                st, x = self.em.value(op.inputs[0], idx)
                e = by_inverse.format(x, f"{inv}[{self._row(j)}]")
                return st + [f"{arr}[{j * VEC} + q] = {e};"]
            st, e = self.em._inline(op.op, op.inputs, attrs, out.type.shape, idx)
            return st + [f"{arr}[{j * VEC} + q] = {e};"]
        lines += self._chunks(body)
        self.em.nodes[out.name] = Node(out.type.shape, Regs(arr))
        return lines

    def _row_value(self, name: str, row: str) -> str:
        """Row ``row``'s value of a per-row ``[R, 1]`` tensor (a reduction's result)."""
        how = self.em.nodes[name].how
        assert isinstance(how, Stored), f"{name} is not a per-row result"
        return f"{how.ptr}[{row}]"

    def _only_divides(self, name: str) -> bool:
        """Whether every use of ``name`` divides something else by it."""
        return all(u is not None and ops.get(u.op).cuda.by_inverse is not None
                   and u.inputs[1] == name and u.inputs[0] != name
                   for u in self.a.uses[name])

    def _reduce(self, op: BlockOp) -> Lines:
        """Per-row partials over this thread's chunks, then warp shuffles, one slot per
        warp and row in shared memory, one barrier, and every thread sums the slots."""
        out = op.outputs[0]
        rms, combine, fin = self._row_reduction(op)
        if rms and self._only_divides(out.name):
            # A norm used only as a divisor is kept as its reciprocal (rsqrtf, as
            # expr.reciprocal spells it: within a few ulp of f32) instead of sqrtf and
            # then 1 / x, two correctly rounded slow paths per row; its divisions
            # become products.
            eps = c_float(float(ops.get(op.op).attr_values(op.attrs).get("eps", 0.0)))
            fin = reciprocal(f"sqrtf({{0}} / {c_float(float(self.L))} + {eps})")
            self._recip.add(out.name)
        part, red, res = f"p_{out.name}", f"red_{out.name}", f"s_{out.name}"
        W = self.W
        lines = [f"float {part}[{self.R}];", "#pragma unroll",
                 f"for (int r = 0; r < {self.R}; ++r) {part}[r] = {c_init(combine)};"]

        def body(j: int, idx: list[str]) -> Lines:
            st, v = self.em.value(op.inputs[0], idx)
            term = f"{v} * {v}" if rms else v
            return st + [c_update(f"{part}[{self._row(j)}]", term, combine)]
        lines += self._chunks(body)
        tot = self.em.fresh("t")
        lines += [f"__shared__ __align__(16) float {red}[{self.R * W}];",
                  "#pragma unroll", f"for (int r = 0; r < {self.R}; ++r) {{",
                  f"  float v = {part}[r];", f"  v = {c_warp(combine, 'v')};",
                  f"  if ((threadIdx.x & 31) == 0) {red}[r * {W} + threadIdx.x / 32] = v;", "}",
                  "__syncthreads();", f"float {res}[{self.R}];",
                  "#pragma unroll", f"for (int r = 0; r < {self.R}; ++r) {{"]
        lines += indent(_combine_warps(red, W, tot, combine))
        lines += [f"  {res}[r] = {fin.format(tot)};", "}"]
        self.em.nodes[out.name] = Node(out.type.shape, Stored(res, "0", (1, 0), "float"))
        return lines

    def _row_reduction(self, op: BlockOp) -> tuple[bool, Combine, str]:
        """Whether a row reduction sums squares (a norm), how it combines, and its finish
        (``{0}``: the combined value); an accumulator of one iteration reduces its row
        as the operator it accumulates would (``acc_rms_ld`` as ``rms``)."""
        reg = ops.get(op.op)
        if reg.accum is None:
            combine, fin = row_combine(op, self.L)
            return reg.cuda.kind == "rms", combine, fin
        spec, n = reg.accum, c_float(float(self.L))
        if spec.finish is Finish.RMS:
            eps = c_float(float(reg.attr_values(op.attrs).get("eps", 0.0)))
            fin = f"sqrtf({{0}} / {n} + {eps})"
        else:
            fin = f"{{0}} / {n}" if spec.finish is Finish.MEAN else "{0}"
        return spec.pre is Pre.SQUARE, spec.combine, fin

    def _store(self, source: str, dev: str, omap: tuple[int | None, int | None, int | None]
               ) -> Lines:
        shape = (self.R, self.L)
        strides = row_major(self.dev[dev].shape)
        terms = [f"{ax} * {shape[d] * strides[d]}"
                 for ax, d, g in zip(("bx", "by", "bz"), omap, self.bg.grid)
                 if d is not None and g > 1]
        base = " + ".join(terms) if terms else "0"
        p, Ld = self.pname[dev], self.dev[dev].shape[-1]
        lines: Lines = []
        for j in range(self.CH):
            vals = []
            self.em.reg_slot = None
            for q in range(VEC):
                self.em.reg_slot = str(j * VEC + q)
                st, v = self.em.value(source, [str(self._row(j)), f"({self._col0(j)} + {q})"])
                lines += st
                vals.append(v)
            self.em.reg_slot = None
            off = f"{base} + {self._row(j) * Ld} + {self._col0(j)}"
            lines.append(f"mg_st8({p} + ({off}), {', '.join(vals)});")
        return lines


def _combine_warps(red: str, W: int, tot: str, combine: Combine) -> Lines:
    """``tot`` = the ``W`` warps' partials of row r in ``red`` combined, in a fixed
    order. Every thread reads all of them after the barrier: with W a multiple of 4,
    by 16-byte loads into four independent running states (a chain of W / 4 + 2
    updates instead of W - 1 dependent scalar loads and updates)."""
    if W % 4 or W < 8:
        return [f"float {tot} = {red}[r * {W}];",
                f"for (int w = 1; w < {W}; ++w) " + c_update(tot, f"{red}[r * {W} + w]", combine)]
    q = f"q_{tot}"
    return [f"const float4* {q} = reinterpret_cast<const float4*>({red} + r * {W});",
            f"float4 a_{tot} = {q}[0];", "#pragma unroll",
            f"for (int w = 1; w < {W // 4}; ++w) {{", f"  const float4 b = {q}[w];"] + [
            "  " + c_update(f"a_{tot}.{c}", f"b.{c}", combine) for c in "xyzw"] + [
            "}", c_update(f"a_{tot}.x", f"a_{tot}.y", combine),
            c_update(f"a_{tot}.z", f"a_{tot}.w", combine),
            c_update(f"a_{tot}.x", f"a_{tot}.z", combine), f"float {tot} = a_{tot}.x;"]
