"""Lowering of one custom kernel (a block graph) to one fused CUDA kernel.

Expects a checked block graph (DESIGN.md §3). Guarantees a kernel that computes
exactly what :func:`mirage_cli.interp.run_block_graph` computes, for any valid block
graph, with f32 arithmetic:

- every thread block runs the block graph on its tiles; block inputs that are read
  more than once per element (matmul operands, broadcast operands) are staged in
  shared memory by 16-byte ``cp.async`` copies where the layout allows, double
  buffered across forloop iterations; other inputs are read from global memory;
- element-wise chains, and reductions and matmuls read by a single element-wise
  consumer, are fused into registers (computed where they are read);
- other intermediates are f32 tiles in shared memory, or, when they do not fit, in a
  per-block scratch area of the workspace;
- forloop accumulators keep their state in registers (each thread owns fixed
  elements) and are finished after the loop;
- stores write each block's tile at its omap position.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from mirage_cli import ops
from mirage_cli.check import block_phases
from mirage_cli.codegen.cudaspec import c_float
from mirage_cli.codegen.expr import (
    CTYPE,
    Emitter,
    Inline,
    Lines,
    Node,
    Stored,
    indent,
    index_vars,
    keep_used,
    numel,
    offset_expr,
    row_major,
)
from mirage_cli.codegen.plan import Kernel, Param
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import (
    GRID_AXES,
    BlockGraph,
    BlockInput,
    BlockOp,
    DType,
    KernelOp,
    TensorType,
    Value,
    make_attrs,
)

SMEM_BUDGET = 96 * 1024   # fits sm_80 and sm_90 with two blocks per SM
MAX_STAGES = 4             # copies in flight per loop input (cp.async pipeline depth)
ACC_REGS_MAX = 32          # accumulator elements per thread kept in registers
VEC_BYTES = 16

Storage = Literal["global", "staged", "inline", "buf", "acc"]


@dataclass
class Tensor:
    name: str
    type: TensorType
    phase: str
    storage: Storage
    smem_offset: int | None = None   # bytes into dynamic shared memory
    scratch_offset: int | None = None  # f32 elements into the block's scratch
    nbuf: int = 1                     # staged loop inputs: pipeline stages


def decompose(bg: BlockGraph) -> BlockGraph:
    """Rewrite operators that read their input twice per element (``rms_norm``) into
    ones that read it once (``rms`` then ``div`` [then ``mul``]), so no element is
    recomputed per output."""
    new_ops: list[BlockOp] = []
    for op in bg.ops:
        spec = ops.get(op.op).cuda
        if spec.kind != "rms_norm":
            new_ops.append(op)
            continue
        out = op.outputs[0]
        x = op.inputs[0]
        t = out.type
        r = Value(f"{out.name}__rms", TensorType(t.shape[:-1] + (1,), t.dtype))
        eps = dict(op.attrs).get("eps")
        new_ops.append(BlockOp("rms", (x,), (r,), make_attrs(eps=eps)))
        if len(op.inputs) == 2:
            y = Value(f"{out.name}__n", t)
            new_ops.append(BlockOp("div", (x, r.name), (y,)))
            new_ops.append(BlockOp("mul", (y.name, op.inputs[1]), (out,)))
        else:
            new_ops.append(BlockOp("div", (x, r.name), (out,)))
    return dataclasses.replace(bg, ops=tuple(new_ops))


def _reads_once(consumer: BlockOp, operand_type: TensorType, types: dict[str, TensorType]
                ) -> bool:
    """Whether ``consumer`` reads each element of this operand exactly once."""
    spec = ops.get(consumer.op).cuda
    match spec.kind:
        case "elementwise":
            return types[consumer.outputs[0].name].shape == operand_type.shape
        case "reduce" | "rms" | "sum_to" | "concat" | "accum":
            return True
        case "matmul" | "rms_norm" | "softmax" | "custom":
            return False
    raise AssertionError(spec.kind)


class FusedLowering:
    """One fused kernel; see the module docstring."""

    def __init__(self, kop: KernelOp, name: str, dev_types: dict[str, TensorType],
                 cp_async: bool = True, use_mma: bool = True) -> None:
        assert kop.block is not None
        self.bg = decompose(kop.block)
        self.kop = kop
        self.name = name
        self.dev = dev_types
        self.cp_async = cp_async
        self.T = self.bg.threads
        self.F = self.bg.forloop
        self.em = Emitter()
        self.tensors: dict[str, Tensor] = {}
        self.params: list[Param] = []
        self.pname: dict[str, str] = {}
        self.smem = 0
        self.scratch = 0
        self.stages = 1
        self.use_mma = use_mma
        self.mma_acc: dict[str, BlockOp] = {}   # accumulator -> the matmul it sums (mma)
        self.mma_buf: dict[str, BlockOp] = {}   # matmul result materialized by mma

    # -- planning -------------------------------------------------------------------

    def plan(self) -> None:
        bg = self.bg
        phases = block_phases(bg)
        types = {bi.value.name: bi.value.type for bi in bg.inputs}
        types.update({op.outputs[0].name: op.outputs[0].type for op in bg.ops})
        uses: dict[str, list[BlockOp | None]] = {n: [] for n in types}
        for op in bg.ops:
            for i in op.inputs:
                uses[i].append(op)
        for bo in bg.outputs:
            uses[bo.source].append(None)  # None: a store
        for bi in bg.inputs:
            once = all(u is None or _reads_once(u, bi.value.type, types) for u in uses[bi.value.name])
            storage: Storage = "global" if once and len(uses[bi.value.name]) <= 1 else "staged"
            self.tensors[bi.value.name] = Tensor(bi.value.name, bi.value.type,
                                                 phases[bi.value.name], storage)
        for op in bg.ops:
            v = op.outputs[0]
            opdef = ops.get(op.op)
            if opdef.is_accumulator:
                st: Storage = "acc"
            else:
                st = "inline" if self._inlinable(v.name, v.type, phases, uses[v.name], types) \
                    else "buf"
            self.tensors[v.name] = Tensor(v.name, v.type, phases[v.name], st)
        for op in bg.ops:
            if self._mma_eligible(op):
                self._plan_mma(op, uses[op.outputs[0].name], phases)
        self._allocate()

    def _mma_eligible(self, op: BlockOp) -> bool:
        """Block matmuls on f16/bf16 tiles run on tensor cores (mma.sync m16n8k16,
        f32 accumulation); f32 matmuls keep f32 arithmetic."""
        return (self.use_mma and ops.get(op.op).cuda.kind == "matmul"
                and op.outputs[0].type.dtype in (DType.F16, DType.BF16) and self.T % 32 == 0)

    def _plan_mma(self, op: BlockOp, users: list[BlockOp | None], phases: Mapping[str, str]
                  ) -> None:
        out = op.outputs[0]
        user = users[0] if len(users) == 1 else None
        spec = ops.get(user.op).accum if user is not None else None
        if (user is not None and spec is not None and spec.pre == "id"
                and spec.reduce == "none" and spec.combine == "sum"
                and phases[out.name] == "loop" and 4 * self._mma_tiles_per_warp(out.type) <= 64):
            self.mma_acc[user.outputs[0].name] = op
            self.tensors[out.name].storage = "inline"
        else:
            self.mma_buf[out.name] = op
            self.tensors[out.name].storage = "buf"

    def _mma_grid(self, t: TensorType) -> tuple[int, int, int]:
        """(batch tiles, 16-row tiles, 8-column tiles) covering an output tile."""
        return numel(t.shape[:-2]), -(-t.shape[-2] // 16), -(-t.shape[-1] // 8)

    def _mma_tiles_per_warp(self, t: TensorType) -> int:
        nb, tm, tn = self._mma_grid(t)
        return -(-(nb * tm * tn) // (self.T // 32))

    def _inlinable(self, name: str, t: TensorType, phases: Mapping[str, str],
                   users: list[BlockOp | None], types: dict[str, TensorType]) -> bool:
        if len(users) != 1:
            return False
        user = users[0]
        if user is None:
            return True
        if ops.get(user.op).is_accumulator:
            return phases[name] == "loop"
        return phases[user.outputs[0].name] == phases[name] and _reads_once(user, t, types)

    def _allocate(self) -> None:
        """Shared memory for staged inputs and f32 tiles; what does not fit moves out
        (inputs are then read from global memory, tiles go to the scratch area)."""
        staged = [t for t in self.tensors.values() if t.storage == "staged"]
        bufs = [t for t in self.tensors.values() if t.storage in ("buf", "acc")]
        loop_staged = [t for t in staged if t.phase == "loop"]

        def set_stages(n: int) -> None:
            self.stages = n
            for t in loop_staged:
                t.nbuf = n

        def total() -> int:
            n = sum(_pad(t.type.nbytes) * t.nbuf for t in staged if t.storage == "staged")
            return n + sum(_pad(t.type.numel * 4) for t in bufs if t.scratch_offset is None)

        # Up to MAX_STAGES copies of each loop input in flight: the copies for
        # iteration i + S - 1 are issued while iteration i computes.
        set_stages(min(MAX_STAGES, self.F))
        while total() > SMEM_BUDGET and self.stages > 1:
            set_stages(self.stages - 1)
        for t in sorted(bufs, key=lambda t: -t.type.numel):
            if total() <= SMEM_BUDGET:
                break
            t.scratch_offset = self.scratch
            self.scratch += _pad(t.type.numel * 4) // 4
        for t in sorted(staged, key=lambda t: -t.type.nbytes):
            if total() <= SMEM_BUDGET:
                break
            t.storage = "global"
        staged = [t for t in staged if t.storage == "staged"]
        off = 0
        for t in staged:
            t.smem_offset = off
            off += _pad(t.type.nbytes) * t.nbuf
        for t in bufs:
            if t.scratch_offset is None:
                t.smem_offset = off
                off += _pad(t.type.numel * 4)
        self.smem = off

    # -- emission -------------------------------------------------------------------

    def lower(self) -> Kernel:
        self.plan()
        bg = self.bg
        body: Lines = []
        for bi in bg.inputs:
            self._param(bi.source, True)
        for bo in bg.outputs:
            self._param(bo.value.name, False)
        if self.scratch:
            self.params.append(Param("float* __restrict__", "mg_ws", "$scratch"))
        body += self._prologue()
        body += self._define_nodes()
        body += self._phase_code("invariant")
        accs = [op for op in bg.ops if ops.get(op.op).is_accumulator]
        body += self._acc_init(accs)
        loop = self._loop_body(accs)
        body += [f"for (int it = 0; it < {self.F}; ++it) {{"] + indent(loop) + ["}"]
        body += self._acc_finish(accs)
        body += self._phase_code("epilogue")
        for bo in bg.outputs:
            body += self._store(bo.source, bo.value.name, bo.omap)
        grid = self.bg.grid
        return Kernel(self.name, tuple(self.params), tuple(body), self.T, grid, self.smem,
                      self.scratch * 4, f"fused kernel: grid {list(grid)}, {self.T} threads, "
                      f"forloop {self.F}")

    def _param(self, dev: str, is_input: bool) -> None:
        if dev in self.pname:
            return
        t = self.dev[dev]
        p = f"p{len(self.params)}"
        ctype = ("const " if is_input else "") + CTYPE[t.dtype] + "* __restrict__"
        self.params.append(Param(ctype, p, dev))
        self.pname[dev] = p

    def _prologue(self) -> Lines:
        lines = ["const int bx = blockIdx.x, by = blockIdx.y, bz = blockIdx.z;",
                 "(void)bx; (void)by; (void)bz;"]
        if self.smem:
            lines.append("extern __shared__ __align__(16) unsigned char mg_smem[];")
        if self.scratch:
            g = self.bg.grid
            lines.append(f"float* mg_blk = mg_ws + (size_t)(bx + {g[0]} * (by + {g[1]} * bz))"
                         f" * {self.scratch};")
        for bi in self.bg.inputs:
            lines.append(f"const int base_{bi.value.name} = {self._block_base(bi)};")
        return lines

    def _block_base(self, bi: BlockInput) -> str:
        src = self.dev[bi.source]
        strides = row_major(src.shape)
        terms = []
        for axis, g, d in zip(("bx", "by", "bz"), self.bg.grid, bi.imap):
            if d is not None and g > 1:
                part = src.shape[d] // g
                terms.append(f"{axis} * {part * strides[d]}")
        return " + ".join(terms) if terms else "0"

    def _fmap_step(self, bi: BlockInput) -> int:
        assert bi.fmap is not None
        return bi.value.type.shape[bi.fmap] * row_major(self.dev[bi.source].shape)[bi.fmap]

    def _define_nodes(self) -> Lines:
        """Register every tensor with the expression engine; declare smem pointers."""
        lines: Lines = []
        for bi in self.bg.inputs:
            t = self.tensors[bi.value.name]
            ct = CTYPE[t.type.dtype]
            if t.storage == "global":
                base = f"off_{t.name}" if t.phase == "loop" else f"base_{t.name}"
                self.em.nodes[t.name] = Node(t.type.shape, Stored(
                    self.pname[bi.source], base, row_major(self.dev[bi.source].shape), ct))
            else:
                assert t.smem_offset is not None
                lines.append(f"{ct}* sm_{t.name}_0 = reinterpret_cast<{ct}*>(mg_smem + "
                             f"{t.smem_offset});")
                self.em.nodes[t.name] = Node(t.type.shape, Stored(
                    f"sm_{t.name}", "0", row_major(t.type.shape), ct))
        for op in self.bg.ops:
            t = self.tensors[op.outputs[0].name]
            if t.storage == "inline":
                attrs = ops.get(op.op).attr_values(op.attrs)
                self.em.nodes[t.name] = Node(t.type.shape, Inline(op.op, op.inputs, attrs))
                continue
            if t.scratch_offset is not None:
                lines.append(f"float* buf_{t.name} = mg_blk + {t.scratch_offset};")
            else:
                lines.append(f"float* buf_{t.name} = reinterpret_cast<float*>(mg_smem + "
                             f"{t.smem_offset});")
            self.em.nodes[t.name] = Node(t.type.shape, Stored(
                f"buf_{t.name}", "0", row_major(t.type.shape), "float"))
        return lines

    def _elem_loop(self, shape: tuple[int, ...], body_fn: BodyFn) -> Lines:
        n = numel(shape)
        e = self.em.fresh("e")
        decl, idx = index_vars(shape, e, self.em.fresh("i") + "_")
        inner = body_fn(idx)
        inner = keep_used(decl, inner) + inner
        return [f"for (int {e} = threadIdx.x; {e} < {n}; {e} += {self.T}) {{"] + indent(inner) + ["}"]

    def _materialize(self, op: BlockOp) -> Lines:
        if op.outputs[0].name in self.mma_buf:
            return self._mma_materialize(op) + ["__syncthreads();"]
        if self._warp_reduction(op):
            return self._warp_materialize(op) + ["__syncthreads();"]
        t = self.tensors[op.outputs[0].name]
        attrs = ops.get(op.op).attr_values(op.attrs)

        def body(idx: list[str]) -> Lines:
            lines, e = self.em._inline(op.op, op.inputs, attrs, t.type.shape, idx)
            return lines + [f"buf_{t.name}[{offset_expr('0', idx, row_major(t.type.shape))}] = {e};"]
        return self._elem_loop(t.type.shape, body) + ["__syncthreads();"]

    def _phase_code(self, phase: str) -> Lines:
        lines: Lines = []
        if phase == "invariant":
            staged = [bi for bi in self.bg.inputs
                      if self.tensors[bi.value.name].storage == "staged"
                      and self.tensors[bi.value.name].phase == "invariant"]
            for bi in staged:
                lines += self._stage(bi, f"base_{bi.value.name}", f"sm_{bi.value.name}_0")
            if staged:
                lines += ["mg_cp_async_wait_all();", "__syncthreads();"]
                for bi in staged:
                    lines.append(f"const auto* sm_{bi.value.name} = sm_{bi.value.name}_0;")
        for op in self.bg.ops:
            t = self.tensors[op.outputs[0].name]
            if t.phase == phase and t.storage == "buf":
                lines += self._materialize(op)
        return lines

    # -- staging of input tiles -------------------------------------------------------

    def _vec(self, bi: BlockInput) -> int:
        """Elements per 16-byte copy, or 1 where the tile's rows are not 16-byte aligned."""
        t = bi.value.type
        vec = VEC_BYTES // t.dtype.nbytes
        src = self.dev[bi.source]
        if not self.cp_async or t.shape[-1] % vec or src.shape[-1] % vec:
            return 1
        return vec

    def _stage(self, bi: BlockInput, base: str, dst: str) -> Lines:
        t = bi.value.type
        strides = row_major(self.dev[bi.source].shape)
        src = self.pname[bi.source]
        vec = self._vec(bi)
        n = t.numel // vec
        c = self.em.fresh("c")
        decl, idx = index_vars(t.shape, f"({c} * {vec})" if vec > 1 else c, self.em.fresh("s") + "_")
        g = offset_expr(base, idx, strides)
        if vec > 1:
            op = f"mg_cp_async16({dst} + {c} * {vec}, {src} + ({g}));"
        else:
            op = f"{dst}[{c}] = {src}[{g}];"
        return [f"for (int {c} = threadIdx.x; {c} < {n}; {c} += {self.T}) {{"] + indent(keep_used(decl, [op]) + [op]) + ["}"]

    # -- the forloop -------------------------------------------------------------------

    def _loop_body(self, accs: list[BlockOp]) -> Lines:
        lines: Lines = []
        loop_inputs = [bi for bi in self.bg.inputs if self.tensors[bi.value.name].phase == "loop"]
        for bi in loop_inputs:
            lines.append(f"const int off_{bi.value.name} = base_{bi.value.name} + it * "
                         f"{self._fmap_step(bi)};")
        staged = [bi for bi in loop_inputs if self.tensors[bi.value.name].storage == "staged"]
        S = self.stages
        if S == 1:
            for bi in staged:
                lines += self._stage(bi, f"off_{bi.value.name}", f"sm_{bi.value.name}_0")
            if staged:
                lines.append("mg_cp_async_wait_all();")
        elif staged:
            # Issue iteration it + S - 1's copies (one commit group per iteration, empty
            # at the end), then wait until only the S - 1 newest groups are pending:
            # iteration it's tiles have landed.
            pre: Lines = []
            for bi in staged:
                step = self._fmap_step(bi)
                pre += self._stage(bi, f"(off_{bi.value.name} + {(S - 1) * step})",
                                   self._slot(bi, f"(it + {S - 1})"))
            lines += [f"if (it + {S - 1} < {self.F}) {{"] + indent(pre) + ["}",
                      "mg_cp_async_commit();", f"mg_cp_async_wait<{S - 1}>();"]
        if staged:
            lines.append("__syncthreads();")
        for bi in staged:
            cur = self._slot(bi, "it") if S > 1 else f"sm_{bi.value.name}_0"
            lines.append(f"const auto* sm_{bi.value.name} = {cur};")
        for op in self.bg.ops:
            t = self.tensors[op.outputs[0].name]
            if t.phase == "loop" and t.storage == "buf":
                lines += self._materialize(op)
        for op in accs:
            lines += self._acc_update(op)
        lines.append("__syncthreads();")
        return lines

    def _slot(self, bi: BlockInput, iteration: str) -> str:
        """The shared-memory stage that holds ``iteration``'s tile of ``bi``."""
        t = self.tensors[bi.value.name]
        elems = _pad(t.type.nbytes) // t.type.dtype.nbytes
        return f"(sm_{t.name}_0 + (({iteration}) % {self.stages}) * {elems})"

    def prefetch_first(self) -> Lines:
        """Before the loop: issue the copies of iterations 0 .. S-2, one group each."""
        if self.stages == 1:
            return []
        staged = [bi for bi in self.bg.inputs if self.tensors[bi.value.name].phase == "loop"
                  and self.tensors[bi.value.name].storage == "staged"]
        if not staged:
            return []
        lines: Lines = []
        for i in range(self.stages - 1):
            for bi in staged:
                lines += self._stage(bi, f"(base_{bi.value.name} + {i * self._fmap_step(bi)})",
                                     self._slot(bi, str(i)))
            lines.append("mg_cp_async_commit();")
        return lines

    def _acc_shape(self, op: BlockOp) -> tuple[int, ...]:
        return op.outputs[0].type.shape

    def _acc_in_regs(self, op: BlockOp) -> bool:
        return -(-numel(self._acc_shape(op)) // self.T) <= ACC_REGS_MAX

    def _acc_init(self, accs: list[BlockOp]) -> Lines:
        lines = self.prefetch_first()
        for op in accs:
            spec = ops.get(op.op).accum
            assert spec is not None
            init = "0.0f" if spec.combine == "sum" else "__int_as_float(0xff800000)"
            name = op.outputs[0].name
            n = numel(self._acc_shape(op))
            if self._warp_acc(op):
                j = -(-n // (self.T // 32))
                lines += [f"float acc_{name}[{j}];", "#pragma unroll",
                          f"for (int j = 0; j < {j}; ++j) acc_{name}[j] = {init};"]
            elif name in self.mma_acc:
                j = self._mma_tiles_per_warp(op.outputs[0].type)
                lines += [f"float acc_{name}[{j}][4];", "#pragma unroll",
                          (f"for (int j = 0; j < {j}; ++j) acc_{name}[j][0] = acc_{name}[j][1] = "
                           f"acc_{name}[j][2] = acc_{name}[j][3] = 0.0f;")]
            elif self._acc_in_regs(op):
                npt = -(-n // self.T)
                lines += [f"float acc_{name}[{npt}];", "#pragma unroll",
                          f"for (int j = 0; j < {npt}; ++j) acc_{name}[j] = {init};"]
            else:
                lines += [f"for (int e = threadIdx.x; e < {n}; e += {self.T}) buf_{name}[e] = {init};"]
        return lines

    def _acc_elems(self, op: BlockOp, body_fn: BodyFn) -> Lines:
        """A loop over the accumulator's elements this thread owns (fixed across
        iterations, so updates need no barrier); ``slot`` is where its state lives."""
        name = op.outputs[0].name
        shape = self._acc_shape(op)
        n = numel(shape)
        e = self.em.fresh("e")
        decl, idx = index_vars(shape, e, self.em.fresh("a") + "_")
        if self._acc_in_regs(op):
            npt = -(-n // self.T)
            inner = body_fn(idx, f"acc_{name}[j]", e)
            inner = keep_used(decl, inner) + inner
            guard = n % self.T != 0
            core = ([f"if ({e} < {n}) {{"] + indent(inner) + ["}"]) if guard else inner
            return ["#pragma unroll", f"for (int j = 0; j < {npt}; ++j) {{",
                    f"  const int {e} = threadIdx.x + j * {self.T};"] + indent(core) + ["}"]
        inner = body_fn(idx, f"buf_{name}[{e}]", e)
        inner = keep_used(decl, inner) + inner
        return [f"for (int {e} = threadIdx.x; {e} < {n}; {e} += {self.T}) {{"] + indent(inner) + ["}"]

    def _acc_update(self, op: BlockOp) -> Lines:
        if op.outputs[0].name in self.mma_acc:
            mm = self.mma_acc[op.outputs[0].name]
            return self._mma_tiles(mm, f"acc_{op.outputs[0].name}[j]", None)
        if self._warp_acc(op):
            return self._warp_acc_update(op)
        spec = ops.get(op.op).accum
        assert spec is not None
        x = op.inputs[0]
        xshape = self.tensors[x].type.shape
        width = dict(op.attrs).get("width")

        def body(idx: list[str], slot: str, e: str) -> Lines:
            lines: Lines = []
            if spec.reduce == "none":
                terms = [(idx, "")]
                loop = None
            elif spec.reduce == "last":
                k = self.em.fresh("k")
                loop = (k, xshape[-1])
                terms = [(idx[:-1] + [k], "")]
            else:
                k = self.em.fresh("g")
                assert isinstance(width, int)
                loop = (k, xshape[-1] // width)
                terms = [(idx[:-1] + [f"({k} * {width} + {idx[-1]})"], "")]
            inner: Lines = []
            st, v = self.em.value(x, terms[0][0])
            inner += st
            if spec.pre == "square":
                w = self.em.fresh()
                inner += [f"const float {w} = {v};"]
                v = f"{w} * {w}"
            upd = f"{slot} += {v};" if spec.combine == "sum" else f"{slot} = fmaxf({slot}, {v});"
            inner.append(upd)
            if loop is None:
                return lines + inner
            k, n = loop
            return lines + [f"for (int {k} = 0; {k} < {n}; ++{k}) {{"] + indent(inner) + ["}"]
        return self._acc_elems(op, body)

    def _acc_finish(self, accs: list[BlockOp]) -> Lines:
        lines: Lines = []
        for op in accs:
            spec = ops.get(op.op).accum
            assert spec is not None
            name = op.outputs[0].name
            xshape = self.tensors[op.inputs[0]].type.shape
            count = self.F
            if spec.reduce == "last":
                count *= xshape[-1]
            elif spec.reduce == "to_width":
                count *= xshape[-1] // int(dict(op.attrs)["width"])
            fin = {"id": "{0}", "mean": f"{{0}} / {c_float(float(count))}",
                   "rms": f"sqrtf({{0}} / {c_float(float(count))})"}[spec.finish]

            def body(idx: list[str], slot: str, e: str, name: str = name, fin: str = fin) -> Lines:
                return [f"buf_{name}[{e}] = {fin.format(slot)};"]
            if self._warp_acc(op):
                lines += self._warp_rows(numel(self._acc_shape(op)), lambda row, j, name=name, fin=fin: [
                    f"if (mg_lane == 0) buf_{name}[{row}] = {fin.format(f'acc_{name}[{j}]')};"])
            elif name in self.mma_acc:
                lines += self._mma_tiles(self.mma_acc[name], f"acc_{name}[j]", (name, fin),
                                         compute=False)
            elif self._acc_in_regs(op) or spec.finish != "id":
                lines += self._acc_elems(op, body)
        if accs:
            lines.append("__syncthreads();")
        return lines

    # -- warp-cooperative reductions ---------------------------------------------------

    def _reduced(self, op: BlockOp) -> tuple[int, int] | None:
        """(reduced dimension, its length) of a reduction op computed by warps."""
        spec = ops.get(op.op).cuda
        xs = self.tensors[op.inputs[0]].type.shape
        if spec.kind == "rms":
            return len(xs) - 1, xs[-1]
        if spec.kind == "reduce":
            d = int(dict(op.attrs)["dim"])
            return d, xs[d]
        return None

    def _warp_reduction(self, op: BlockOp) -> bool:
        """Reductions along the contiguous last dimension, or with fewer results than
        threads, run one warp per result (lanes stride the row, shuffles combine)."""
        red = self._reduced(op)
        if red is None or red[1] < 32:
            return False
        rank = len(self.tensors[op.inputs[0]].type.shape)
        return red[0] == rank - 1 or op.outputs[0].type.numel < self.T

    def _warp_rows(self, n_rows: int, body_fn: BodyFn) -> Lines:
        W = self.T // 32
        J = -(-n_rows // W)
        body = body_fn("row", "j")
        return ["{", "  const int mg_warp = threadIdx.x / 32, mg_lane = threadIdx.x % 32;",
                f"  for (int j = 0; j < {J}; ++j) {{", f"    const int row = mg_warp + {W} * j;",
                f"    if (row < {n_rows}) {{"] + indent(body, 3) + ["    }", "  }", "}"]

    def _row_reduce(self, x: str, in_idx: list[str], kvar: str, length: int, combine: str,
                    square: bool, dst: str) -> Lines:
        """``dst`` (all lanes) = combine over k of x[in_idx] (k strides by lane)."""
        st, v = self.em.value(x, in_idx)
        body = st
        if square:
            w = self.em.fresh()
            body = body + [f"const float {w} = {v};"]
            v = f"{w} * {w}"
        init = "0.0f" if combine == "sum" else "__int_as_float(0xff800000)"
        upd = f"{dst} += {v};" if combine == "sum" else f"{dst} = fmaxf({dst}, {v});"
        red = "mg_warp_sum" if combine == "sum" else "mg_warp_max"
        head = f"for (int {kvar} = mg_lane; {kvar} < {length}; {kvar} += 32) {{"
        return ([f"float {dst} = {init};", head] + indent(body + [upd])
                + ["}", f"{dst} = {red}({dst});"])

    def _warp_materialize(self, op: BlockOp) -> Lines:
        red = self._reduced(op)
        assert red is not None
        dim, length = red
        spec = ops.get(op.op).cuda
        out = op.outputs[0]
        attrs = ops.get(op.op).attr_values(op.attrs)

        def body(row: str, j: str) -> Lines:
            decl, idx = index_vars(out.type.shape, row, self.em.fresh("w") + "_")
            k = self.em.fresh("k")
            if spec.kind == "rms":
                in_idx = idx[:-1] + [k]
            elif attrs.get("keepdim", False):
                in_idx = idx[:dim] + [k] + idx[dim + 1:]
            else:
                in_idx = idx[:dim] + [k] + idx[dim:]
            r = self.em.fresh("r")
            lines = self._row_reduce(op.inputs[0], in_idx, k, length,
                                     spec.combine or "sum", spec.kind == "rms", r)
            fin = r
            if spec.kind == "rms":
                fin = f"sqrtf({r} / {c_float(float(length))} + {c_float(float(attrs.get('eps', 0.0)))})"
            elif spec.finish == "mean":
                fin = f"{r} / {c_float(float(length))}"
            lines.append(f"if (mg_lane == 0) buf_{out.name}[{row}] = {fin};")
            return keep_used(decl, lines) + lines
        return self._warp_rows(out.type.numel, body)

    def _warp_acc(self, op: BlockOp) -> bool:
        spec = ops.get(op.op).accum
        assert spec is not None
        return (spec.reduce == "last" and self.tensors[op.inputs[0]].type.shape[-1] >= 32
                and op.outputs[0].name not in self.mma_acc)

    def _warp_acc_update(self, op: BlockOp) -> Lines:
        spec = ops.get(op.op).accum
        assert spec is not None
        name = op.outputs[0].name
        x = op.inputs[0]
        length = self.tensors[x].type.shape[-1]

        def body(row: str, j: str) -> Lines:
            decl, idx = index_vars(self._acc_shape(op), row, self.em.fresh("w") + "_")
            k, r = self.em.fresh("k"), self.em.fresh("r")
            lines = self._row_reduce(x, idx[:-1] + [k], k, length, spec.combine,
                                     spec.pre == "square", r)
            slot = f"acc_{name}[{j}]"
            lines.append(f"{slot} += {r};" if spec.combine == "sum"
                         else f"{slot} = fmaxf({slot}, {r});")
            return keep_used(decl, lines) + lines
        return self._warp_rows(numel(self._acc_shape(op)), body)

    # -- tensor cores -------------------------------------------------------------------

    def _mma_materialize(self, op: BlockOp) -> Lines:
        name = op.outputs[0].name
        return self._mma_tiles(op, "mg_d", (name, "{0}"), local=True)

    def _mma_tiles(self, op: BlockOp, dreg: str, sink: tuple[str, str] | None,
                   local: bool = False, compute: bool = True) -> Lines:
        """Loop over the m16n8 tiles of ``op``'s output owned by this warp: multiply
        over K into ``dreg`` (a float[4] fragment) and, with ``sink = (buffer,
        format)``, write the fragment to the buffer's f32 tile."""
        a, b = op.inputs
        ta, tb, tc = self.tensors[a].type, self.tensors[b].type, op.outputs[0].type
        M, K, N = tc.shape[-2], ta.shape[-1], tc.shape[-1]
        nb, tm, tn = self._mma_grid(tc)
        W = self.T // 32
        J = self._mma_tiles_per_warp(tc)
        mma, pack = (("mg_mma_f16", "mg_pack_f16") if tc.dtype is DType.F16
                     else ("mg_mma_bf16", "mg_pack_bf16"))
        batch = tc.shape[:-2]
        bdecl, bidx = index_vars(batch or (1,), "mg_nb", "mg_b")
        bidx = bidx if batch else []
        from mirage_cli.codegen.expr import broadcast_index
        ia = broadcast_index(bidx, ta.shape[:-2])
        ib = broadcast_index(bidx, tb.shape[:-2])

        def ld(name: str, pre: list[str], r: str, c: str, rows: int, cols: int) -> str:
            cond = [f"{r} < {rows}"] if rows % 16 else []
            cond += [f"{c} < {cols}"] if cols % 16 else []
            v = self.em.load(name, pre + [r, c])
            return f"(({' && '.join(cond)}) ? {v} : 0.0f)" if cond else v

        body: Lines = [f"const int mg_nb = q / {tm * tn};", f"const int mg_mi = (q / {tn}) % {tm};",
                       f"const int mg_ni = q % {tn};"] + bdecl
        body += ["const int r0 = mg_mi * 16 + mg_g, r1 = r0 + 8;",
                 "const int c0 = mg_ni * 8 + 2 * mg_t;",
                 "(void)mg_nb; (void)r1; (void)c0;"]
        if local:
            body.append(f"float {dreg}[4] = {{0.0f, 0.0f, 0.0f, 0.0f}};")
        if compute:
            kl = ["const int k0 = kk + 2 * mg_t, k1 = k0 + 8;",
                  "const int n0 = mg_ni * 8 + mg_g;"]
            regs = []
            for r, c in (("r0", "k0"), ("r1", "k0"), ("r0", "k1"), ("r1", "k1")):
                fast = self._pair(a, ia + [r, c], 1, tc.dtype, f"{r} < {M}" if M % 16 else None)
                regs.append(fast if fast is not None and K % 16 == 0 else
                            f"{pack}({ld(a, ia, r, c, M, K)}, {ld(a, ia, r, f'({c} + 1)', M, K)})")
            for k in ("k0", "k1"):
                fast = self._pair(b, ib + [k, "n0"], 0, tc.dtype, f"n0 < {N}" if N % 8 else None)
                regs.append(fast if fast is not None and K % 16 == 0 else
                            f"{pack}({ld(b, ib, k, 'n0', K, N)}, {ld(b, ib, f'({k} + 1)', 'n0', K, N)})")
            names = ["ra0", "ra1", "ra2", "ra3", "rb0", "rb1"]
            kl += [f"const unsigned {n} = {e};" for n, e in zip(names, regs)]
            kl.append(f"{mma}({dreg}, {', '.join(names)});")
            body += ["#pragma unroll 2", f"for (int kk = 0; kk < {K}; kk += 16) {{"] + indent(kl) + ["}"]
        if sink is not None:
            buf, fmt = sink
            ostr = row_major(tc.shape)
            for i, (r, c) in enumerate((("r0", "c0"), ("r0", "(c0 + 1)"), ("r1", "c0"),
                                        ("r1", "(c0 + 1)"))):
                cond = " && ".join(([f"{r} < {M}"] if M % 16 else []) + ([f"{c} < {N}"] if N % 8 else []))
                st = f"buf_{buf}[{offset_expr('0', bidx + [r, c], ostr)}] = {fmt.format(f'{dreg}[{i}]')};"
                body.append(f"if ({cond}) {st}" if cond else st)
        return ["{", "  const int mg_warp = threadIdx.x / 32, mg_lane = threadIdx.x % 32;",
                "  const int mg_g = mg_lane / 4, mg_t = mg_lane % 4;", "  (void)mg_g; (void)mg_t;",
                "  #pragma unroll", f"  for (int j = 0; j < {J}; ++j) {{",
                f"    const int q = mg_warp + {W} * j;",
                f"    if (q < {nb * tm * tn}) {{"] + indent(body, 3) + ["    }", "  }", "}"]

    def _pair(self, name: str, idx: list[str], axis: int, dtype: DType, guard: str | None
              ) -> str | None:
        """A packed 32-bit mma operand register holding elements ``idx`` and ``idx`` + 1
        along ``axis`` (0: rows, 1: columns of the last two dims) of a shared-memory or
        scratch tile, without f32 round trips; None where only the generic path fits."""
        how = self.em.nodes[name].how
        if not isinstance(how, Stored) or how.base != "0":
            return None
        shape = self.em.nodes[name].shape
        off = offset_expr("0", idx, how.strides)
        nxt = list(idx)
        nxt[-2 + axis] = f"({idx[-2 + axis]} + 1)"
        off2 = offset_expr("0", nxt, how.strides)
        mma_ct = CTYPE[dtype]
        pack = "mg_pack_f16" if dtype is DType.F16 else "mg_pack_bf16"
        if axis == 1 and how.strides[-1] == 1 and shape[-1] % 2 == 0:
            if how.ctype == mma_ct:
                e = f"*reinterpret_cast<const unsigned*>({how.ptr} + ({off}))"
            elif how.ctype == "float":
                e = f"{pack}2(*reinterpret_cast<const float2*>({how.ptr} + ({off})))"
            else:
                return None
        elif how.ctype == mma_ct:
            e = f"mg_bits2({how.ptr}[{off}], {how.ptr}[{off2}])"
        else:
            return None
        return f"(({guard}) ? {e} : 0u)" if guard else e

    def _store(self, source: str, dev: str, omap: tuple[int | None, int | None, int | None]
               ) -> Lines:
        t = self.tensors[source]
        out = self.dev[dev]
        strides = row_major(out.shape)
        terms = [f"{ax} * {t.type.shape[d] * strides[d]}"
                 for ax, d, g in zip(("bx", "by", "bz"), omap, self.bg.grid)
                 if d is not None and g > 1]
        base = " + ".join(terms) if terms else "0"
        p = self.pname[dev]

        def body(idx: list[str]) -> Lines:
            st, v = self.em.value(source, idx)
            return st + [f"mg_st({p} + ({offset_expr(base, idx, strides)}), {v});"]
        return self._elem_loop(t.type.shape, body)


BodyFn = Callable[..., Lines]  # builds a loop body from index expressions


def _pad(n: int) -> int:
    return (n + 15) // 16 * 16


def lower_custom(kop: KernelOp, name: str, dev_types: dict[str, TensorType]) -> Kernel:
    if any(t.numel >= 2 ** 31 for t in dev_types.values()):
        raise MirageError("tensors of 2^31 elements or more are not supported by the "
                          "code generator (32-bit indexing)")
    return FusedLowering(kop, name, dev_types).lower()


__all__ = ["GRID_AXES", "SMEM_BUDGET", "DType", "lower_custom"]
