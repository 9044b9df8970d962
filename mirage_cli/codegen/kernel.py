"""Emission: one custom kernel and its :class:`~mirage_cli.kplan.KernelPlan` → one CUDA
kernel.

Expects a checked block graph and a plan made for it by :mod:`planner` (the plan is
the only place where thread-level decisions are taken; this module prints them).
Guarantees a kernel that computes exactly what :func:`mirage_cli.interp.run_block_graph`
computes, with f32 arithmetic: tiles staged in shared memory by 16-byte ``cp.async``
copies (padded rows, a pipeline of the planned depth over forloop iterations),
element-wise chains computed in registers where they are read, accumulators in
registers (mma fragments or per-thread elements), reductions spread over whole warps
or the whole block (:mod:`reduce`), tensor-core matmuls (:mod:`mma`), and stores of
each block's tile at its omap position, 16 bytes at a time where the plan says so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from mirage_cli import ops
from mirage_cli.codegen import (
    chain,
    chainfinish,
    chainplan,
    cluster,
    colstats,
    layout,
    mma,
    reduce,
    staging,
    stores,
    tmaplan,
)
from mirage_cli.codegen.blockfacts import Analysis, analyse, decompose, stored_inverse
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
    offset_expr,
    row_major,
)
from mirage_cli.codegen.joins import Join
from mirage_cli.codegen.plan import Kernel, Param
from mirage_cli.codegen.smemplan import MBAR, RECV, RED, ZERO
from mirage_cli.codegen.staging import padded_strides
from mirage_cli.ir import BlockGraph, BlockInput, BlockOp, TensorType
from mirage_cli.kplan import KernelPlan, TilePlan

BodyFn = Callable[[list[str]], Lines]


def _bulk_only(k: FusedKernel) -> frozenset[str]:
    """Device tensors that every tile reading them copies in bulk."""
    bulk = {bi.source for bi in k.bulk}
    return frozenset(bulk - {bi.source for bi in k.bg.inputs if bi not in k.bulk})


def _defers(k: FusedKernel, early: frozenset[str]) -> bool:
    """Whether the invariant phase moves after the loop: it reads a tensor the kernel
    ahead may still be writing (the LoRA kernel's X @ A, written by the kernel before
    it), the loop reads nothing it computes, and every loop input may be read before
    the wait. The loop then streams its weights while that kernel finishes; only the
    epilogue waits."""
    inv = k.staged("invariant")
    if k.chain is not None or not inv or all(bi.source in early for bi in inv):
        return False
    loop = [bi for bi in k.bg.inputs if k.a.phases[bi.value.name] == "loop"]
    if not loop or any(bi.source not in early for bi in loop):
        return False
    # What the loop reads: its own values' operands and the accumulators' (updated in it).
    in_loop = [op for op in k.bg.ops if k.a.phases[op.outputs[0].name] == "loop"
               or ops.get(op.op).is_accumulator]
    return all(k.a.phases[i] != "invariant" for op in in_loop for i in op.inputs)


class FusedKernel:
    """The emitter of one fused kernel; state shared by :mod:`mma` and :mod:`reduce`."""

    def __init__(self, bg: BlockGraph, plan: KernelPlan, name: str,
                 dev_types: dict[str, TensorType], early: frozenset[str] = frozenset(),
                 joins: Mapping[str, Join] | None = None) -> None:
        # The plan may give the block another thread count: the block graph's result
        # does not depend on it.
        bg = dataclasses.replace(bg, threads=plan.threads)
        self.a: Analysis = analyse(decompose(bg))
        self.bg = self.a.bg
        self.plan = plan
        self.name = name
        self.dev = dev_types
        self.T, self.W, self.F = plan.threads, plan.warps, self.bg.forloop
        # With a K split over a cluster, each block runs FL of the F iterations.
        self.KS = plan.knobs.ksplit or 1
        self.FL = self.F // self.KS
        # Staggered: block b runs its iterations starting from its own (see the knob).
        self.STAG = plan.knobs.stagger == 1 and self.FL > 1
        self.em = Emitter()
        self.params: list[Param] = []
        self.pname: dict[str, str] = {}
        # Concatenations it reads in place (codegen/joins.py): each has no pointer of
        # its own (``pname``) but its parts' two, and is only ever staged.
        self.joins: dict[str, Join] = dict(joins or {})
        self.tiles = {t.name: t for t in plan.tiles}
        self.mmas = {m.output: m for m in plan.mmas}
        self.mma_acc = {m.accumulator: m for m in plan.mmas if m.accumulator}
        self.reds = {r.output: r for r in plan.reductions}
        # Element-wise tiles the leader lanes of a row reduction write (fused_finish).
        self.finishes = layout.fused_finishes(self.a, self.tiles, list(plan.reductions))
        self.finished = {u.outputs[0].name for u in self.finishes.values()}
        self.hoisted: Lines = []          # per-thread tables computed once, before use
        # Loop inputs brought in by bulk tensor copies, and their tensor-map parameters.
        self.bulk = [bi for bi in self.bg.inputs if self.tile(bi.value.name).swizzle]
        # Device tensors that no kernel still running ahead of this one can be writing
        # (lower.early_inputs): their first pipeline stages are copied before the wait.
        # With staged loop-invariant inputs, only those copied in bulk: the invariants'
        # wait for all cp.async copies would wait for the others too, while bulk copies
        # complete on their own mbarriers.
        self.early = early if not self.staged("invariant") else early & _bulk_only(self)
        self.early_copies: Lines = []     # issued before the grid-dependency wait
        self.tmap: dict[str, str] = {}
        self._tables: set[str] = set()
        # A matmul chain planned into registers (codegen/chain.py emits it).
        self.chain = chainplan.chain_of(self.a) if plan.knobs.chain == 1 else None
        self.chain_accs: set[str] = set()
        if self.chain is not None:
            lay = chainplan.layout(self.chain, self.W, plan.knobs.kwarps or 1)
            assert isinstance(lay, chainplan.ChainLayout), lay
            self.chain_lay = lay
            self.chain_accs = {op.outputs[0].name for op in (self.chain.acc,
                                                              *self.chain.row_accs)}
        # The chain's statistics of B1's columns, when it folds them from its fragments.
        self.frag_stats: frozenset[str] = frozenset()
        if self.chain is not None:
            self.frag_stats = colstats.values(self.chain, self.chain_lay)
        cols = self.frag_stats
        self.em.inverted = frozenset(
            op.outputs[0].name for op in self.bg.ops
            if (op.outputs[0].name in cols or self.tile(op.outputs[0].name).home == "smem"
                and not self.tile(op.outputs[0].name).pitch)
            and stored_inverse(op.outputs[0].name, self.a))
        # Invariants computed after the loop instead (_invariant(ring=False)): then the whole loop
        # runs before the wait, while the kernel ahead of it finishes.
        self.defer = _defers(self, early)
        if self.defer:
            self.early = early

    def tile(self, name: str) -> TilePlan:
        return self.tiles[name]

    def staged(self, phase: str) -> list[BlockInput]:
        return [bi for bi in self.bg.inputs if self.tile(bi.value.name).pitch
                and self.a.phases[bi.value.name] == phase]

    # -- the kernel ------------------------------------------------------------------

    def lower(self) -> Kernel:
        self._io_params()
        if self.plan.scratch_floats:
            self.params.append(Param("float* __restrict__", "mg_ws", "$scratch"))
        for bi in self.bulk:
            p = f"p{len(self.params)}"
            spec = tmaplan.spec(bi, self.dev[bi.source], self.tile(bi.value.name).swizzle)
            self.params.append(Param("const __grid_constant__ mg_tmap", p, bi.source, spec))
            self.tmap[bi.value.name] = p
        accs = [op for op in self.bg.ops if ops.get(op.op).is_accumulator]
        plain = [op for op in accs if op.outputs[0].name not in self.chain_accs]
        head = self._prologue() + self._define_nodes()
        # Deferred invariants are emitted where the others are (their per-thread tables
        # go before the wait with every other), and placed after the loop.
        deferred = self._invariant(ring=False) if self.defer else []
        # With deferred invariants only the ring's first stages precede the loop (their
        # copies are all early, so only commit groups are left after the wait's place).
        body = staging.prefetch(self)[0] if self.defer else self._invariant()
        body += reduce.acc_init(self, plain)
        if self.chain is not None:
            body += chain.init(self, self.chain, self.chain_lay)
        loop = self._loop_body(plain)
        # A chain's iteration is long and register-heavy: unrolling the forloop (which
        # the compiler does for a ring of two stages) would double its live registers.
        body += (["#pragma unroll 1"] if self.chain is not None else []) + [
            f"for (int it = 0; it < {self.FL}; ++it) {{"] + indent(loop) + ["}"]
        if staging.pipelined(self):  # the loop's last iteration ends without a barrier
            body.append("__syncthreads();")
        pre = head + self.hoisted + self.early_copies
        body = pre + body
        wait_at = len(pre)
        if self.defer:
            wait_at = len(body)
            body += deferred
        if self.chain is not None:
            fins = {op.outputs[0].name: "{0}" if self.KS > 1 else reduce.finish_format(self, op)
                    for op in accs if op.outputs[0].name in self.chain_accs}
            body += chainfinish.finish(self, self.chain, self.chain_lay, fins) + ["__syncthreads();"]
        body += reduce.acc_finish(self, plain, raw=self.KS > 1)
        shared = False
        if self.KS > 1:
            lines, shared = cluster.combine(self, accs)
            body += lines
        body += self._materialize_phase("epilogue")
        for bo in self.bg.outputs:
            body += stores.store(self, bo.source, bo.value.name, bo.omap, share=shared)
        if shared:
            body.append("mg_cluster_wait();")
        k = self.plan.knobs
        comment = (f"fused kernel: grid {list(self.bg.grid)}, {self.T} threads, forloop "
                   f"{self.F}; plan: {k.stages} stage(s), kwarps {k.kwarps}, "
                   f"{self.plan.smem_bytes} B shared memory"
                   + (f", forloop split over a cluster of {self.KS}" if self.KS > 1 else "")
                   + (", partials pushed to block 0" if RECV in self.tiles else ""))
        gx, gy, gz = self.bg.grid
        return Kernel(self.name, tuple(self.params), tuple(body), self.T,
                      (gx, gy, gz * self.KS), self.plan.smem_bytes,
                      self.plan.scratch_floats * 4, comment, self.plan.as_json(),
                      min_blocks=1, cluster=self.KS, wait_at=wait_at)

    def _io_params(self) -> None:
        """A pointer parameter for each device tensor the block graph loads or stores
        (a joined concatenation's: one for each of its parts)."""
        for bi in self.bg.inputs:
            for dev in self.joins[bi.source].parts if bi.source in self.joins else (bi.source,):
                self._param(dev, True)
        for bo in self.bg.outputs:
            self._param(bo.value.name, False)

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
        if self.KS > 1:  # grid.z holds the cluster's blocks: the µGraph's z is 0
            lines = ["const int bx = blockIdx.x, by = blockIdx.y, bz = 0;",
                     "(void)bx; (void)by; (void)bz;",
                     "const unsigned mg_rank = blockIdx.z;",
                     f"const int mg_it0 = (int)mg_rank * {self.FL};"]
        if self.STAG:
            gx, gy, _ = self.bg.grid
            rank = " + mg_rank" if self.KS > 1 else ""
            lines.append(f"const int mg_rot = (int)((bx + {gx} * (by + {gy} * bz)){rank}) "
                         f"% {self.FL};")
        if self.plan.smem_bytes and self.bulk:
            # Swizzled boxes need a 1024-byte-aligned base; the plan keeps 1 KB spare.
            lines += ["extern __shared__ __align__(16) unsigned char mg_smem_raw[];",
                      ("unsigned char* mg_smem = mg_smem_raw + "
                       "((1024u - (mg_smem_addr(mg_smem_raw) & 1023u)) & 1023u);")]
        elif self.plan.smem_bytes:
            lines.append("extern __shared__ __align__(16) unsigned char mg_smem[];")
        if self.plan.scratch_floats:
            g = self.bg.grid
            lines.append(f"float* mg_blk = mg_ws + (size_t)(bx + {g[0]} * (by + {g[1]} * bz))"
                         f" * {self.plan.scratch_floats};")
        for bi in self.bg.inputs:
            lines.append(f"const int base_{bi.value.name} = {self._block_base(bi)};")
        if ZERO in self.tiles:
            lines += [(f"unsigned* mg_zero = reinterpret_cast<unsigned*>(mg_smem + "
                       f"{self.tile(ZERO).smem_offset});"),
                      "if (threadIdx.x < 4) mg_zero[threadIdx.x] = 0u;"]
        if RED in self.tiles:
            lines.append(f"float* mg_red = reinterpret_cast<float*>(mg_smem + "
                         f"{self.tile(RED).smem_offset});")
        if MBAR in self.tiles:
            lines += [(f"unsigned long long* mg_mbar = reinterpret_cast<unsigned long long*>("
                       f"mg_smem + {self.tile(MBAR).smem_offset});"),
                      "if (threadIdx.x == 0) {",
                      f"  for (int s = 0; s < {staging.stages(self)}; ++s) mg_mbar_init(mg_mbar + s);",
                      "  mg_mbar_fence_init();", "}", "__syncthreads();"]
        if RECV in self.tiles:  # cluster.py's push form: block 0's mbarrier, then the arrive
            lines += [(f"unsigned long long* mg_recv_bar = reinterpret_cast<unsigned long long*>("
                       f"mg_smem + {self.tile(RECV).smem_offset});"),
                      "if (threadIdx.x == 0 && mg_rank == 0) {", "  mg_mbar_init(mg_recv_bar);",
                      "  mg_mbar_fence_init();", "}", "__syncthreads();",
                      "mg_cluster_arrive_relaxed();"]
        return lines

    def source_at(self, dev: str, base: str, offset: str) -> str:
        """The address of element ``base + offset`` of device tensor ``dev``, which the
        kernel reads (in a joined concatenation: in the part it lies in)."""
        j = self.joins.get(dev)
        if j is None:
            return f"{self.pname[dev]} + {base} + {offset}"
        return j.pointer(self.pname[j.parts[0]], self.pname[j.parts[1]], f"{base} + {offset}")

    def _block_base(self, bi: BlockInput) -> str:
        src = self.dev[bi.source]
        strides = row_major(src.shape)
        terms = [f"{axis} * {src.shape[d] // g * strides[d]}"
                 for axis, g, d in zip(("bx", "by", "bz"), self.bg.grid, bi.imap)
                 if d is not None and g > 1]
        return " + ".join(terms) if terms else "0"

    def _define_nodes(self) -> Lines:
        """Register every tensor with the expression engine; declare tile pointers."""
        lines: Lines = []
        for bi in self.bg.inputs:
            t, vt = self.tile(bi.value.name), bi.value.type
            ct = CTYPE[vt.dtype]
            if not t.pitch:
                base = f"off_{t.name}" if self.a.phases[t.name] == "loop" else f"base_{t.name}"
                self.em.nodes[t.name] = Node(vt.shape, Stored(
                    self.pname[bi.source], base, row_major(self.dev[bi.source].shape), ct))
                continue
            lines.append(f"{ct}* sm_{t.name}_0 = reinterpret_cast<{ct}*>(mg_smem + "
                         f"{t.smem_offset});")
            self.em.nodes[t.name] = Node(vt.shape, Stored(
                f"sm_{t.name}", "0", padded_strides(vt.shape, t.pitch), ct,
                (vt, t.swizzle) if t.swizzle else None))
        for op in self.bg.ops:
            v = op.outputs[0]
            t = self.tile(v.name)
            if t.home == "frag":  # the chain's emitter names each element as it goes
                continue
            if t.home == "inline":
                attrs = ops.get(op.op).attr_values(op.attrs)
                self.em.nodes[v.name] = Node(v.type.shape, Inline(op.op, op.inputs, attrs))
                continue
            if t.pitch:  # packed: in its own dtype, rows padded for ldmatrix
                ct = CTYPE[v.type.dtype]
                lines.append(f"{ct}* sm_{v.name}_0 = reinterpret_cast<{ct}*>(mg_smem + "
                             f"{t.smem_offset});")
                self.em.nodes[v.name] = Node(v.type.shape, Stored(
                    f"sm_{v.name}_0", "0", padded_strides(v.type.shape, t.pitch), ct))
                continue
            where = (f"mg_blk + {t.scratch_offset}" if t.scratch_offset >= 0 else
                     f"reinterpret_cast<float*>(mg_smem + {t.smem_offset})")
            lines.append(f"float* buf_{v.name} = {where};")
            self.em.nodes[v.name] = Node(v.type.shape, Stored(
                f"buf_{v.name}", "0", row_major(v.type.shape), "float"))
        return lines

    def elem_loop(self, shape: tuple[int, ...], body_fn: BodyFn, share: bool = False,
                  unroll: bool = False) -> Lines:
        """A loop of the block's threads over the elements of ``shape`` (``share``: only
        this block's 1/KS share of them, the cluster's blocks taking turns; ``unroll``:
        a whole number of at most 16 elements per thread becomes an unrolled loop, so
        a thread's loads and math overlap instead of waiting one element at a time)."""
        n = 1
        for d in shape:
            n *= d
        e = self.em.fresh("e")
        decl, idx = index_vars(shape, e, self.em.fresh("i") + "_")
        inner = body_fn(idx)
        inner = keep_used(decl, inner) + inner
        first, step = "threadIdx.x", self.T
        if share:
            first, step = f"(int)mg_rank * {self.T} + (int)threadIdx.x", self.KS * self.T
        if unroll and n % step == 0 and 2 <= n // step <= 16:
            j = self.em.fresh("j")
            return (["#pragma unroll", f"for (int {j} = 0; {j} < {n // step}; ++{j}) {{",
                     f"  const int {e} = {first} + {j} * {step};"] + indent(inner) + ["}"])
        return [f"for (int {e} = {first}; {e} < {n}; {e} += {step}) {{"] + indent(inner) + ["}"]

    def _materialize(self, op: BlockOp, unroll: bool = False) -> Lines:
        name = op.outputs[0].name
        if name in self.mmas:
            return mma.materialize(self, op, self.mmas[name]) + ["__syncthreads();"]
        if name in self.reds:
            return reduce.materialize(self, op, self.reds[name])
        t = op.outputs[0].type
        pitch = self.tile(name).pitch

        def body(idx: list[str]) -> Lines:
            lines, e = self.em.apply(op, idx)
            e = self.em.as_stored(name, e)
            if pitch:  # packed (blockfacts.packed): rounded to its dtype as it is stored
                off = offset_expr("0", idx, padded_strides(t.shape, pitch))
                return lines + [f"mg_st(sm_{name}_0 + ({off}), {e});"]
            return lines + [f"buf_{name}[{offset_expr('0', idx, row_major(t.shape))}] = {e};"]
        return self.elem_loop(t.shape, body, unroll=unroll) + ["__syncthreads();"]

    def _materialize_phase(self, phase: str) -> Lines:
        lines: Lines = []
        for op in self.bg.ops:
            name = op.outputs[0].name
            if (self.a.phases[name] == phase and self.tile(name).home == "smem"
                    and name not in self.finished):
                # Unrolled in the loop and before it (where no accumulator is live
                # yet: qknorm_gqa's normalised queries, 16 elements per thread, each
                # waiting on the last), not after it: in a long epilogue the extra
                # registers cost more than the overlap gains (the Llama layer's
                # attention kernel at batch 8 ran 75.5 -> 80.3 µs on an H200 with
                # every loop unrolled).
                lines += self._materialize(op, unroll=phase != "epilogue")
        return lines

    def _invariant(self, ring: bool = True) -> Lines:
        """The invariant tiles' copies, the loop ring's first stages (unless ``ring`` is
        False: deferred invariants come after the loop), the wait for the invariant
        tiles alone, then the invariant phase's values."""
        lines: Lines = []
        staged = self.staged("invariant")
        for bi in staged:
            lines += staging.stage(self, bi, f"base_{bi.value.name}", f"sm_{bi.value.name}_0")
        first, groups = staging.prefetch(self) if ring else ([], 0)
        if not staged:
            return first + self._materialize_phase("invariant")
        # The ring's first stages are issued before the wait for the invariant tiles, in
        # commit groups of their own: both are in flight at once, so the loop's first
        # tiles arrive one memory latency after the kernel starts instead of two.
        if groups:
            lines += ["mg_cp_async_commit();"] + first + [f"mg_cp_async_wait<{groups}>();"]
        else:
            lines += first + ["mg_cp_async_wait_all();"]
        lines.append("__syncthreads();")
        lines += [f"const auto* sm_{bi.value.name} = sm_{bi.value.name}_0;" for bi in staged]
        return lines + self._materialize_phase("invariant")

    def _loop_body(self, accs: list[BlockOp]) -> Lines:
        lines = staging.iteration_copies(self)
        side = self._materialize_phase("loop")
        if self.chain is not None:
            # Every pass ends with its barrier. Where the first matmul reads none of
            # the tiles the loop computes (its operands loaded, or computed before the
            # loop), the last one waits after it, so its mmas overlap the passes.
            loaded = {bi.value.name for bi in self.bg.inputs}
            late = bool(side) and all(i in loaded or self.a.phases[i] != "loop"
                                      for i in self.chain.first.inputs)
            if late:
                assert side[-1] == "__syncthreads();", side[-1]
                side = side[:-1]
            lines += side
            lines += chain.update(self, self.chain, self.chain_lay, barrier=late)
        else:
            lines += side
        for op in accs:
            lines += reduce.acc_update(self, op)
        if not staging.pipelined(self):
            # The next iteration writes shared memory before any barrier of its own.
            lines.append("__syncthreads();")
        return lines
