"""Lowering of pre-defined kernel operators to standalone kernels (one per operator).

This is the unfused lowering: what a compiler that picks one library-style kernel
per operator produces, and the baseline the fused µGraphs are measured against.

- ``matmul``: for f16/bf16 operands that tile, the custom kernel of
  :mod:`mirage_cli.codegen.matmul_tiling` (tensor cores, vector copies, tiling chosen
  by the cost model); otherwise a scalar tiled kernel (64×64 output tile per block of
  256 threads, 16-deep K slices in shared memory, f32 accumulation, bounds checks for
  any shape, batch dimensions broadcast);
- ``rms_norm`` and ``softmax``: one warp per row, warp-shuffle reductions;
- everything else (element-wise with broadcasting, reductions over a dimension,
  ``rms``, ``concat``): one thread per output element, grid-stride loop, the element
  computed by the expression engine from the registry's ``cuda`` slot.
"""

from __future__ import annotations

import dataclasses
from typing import assert_never

from mirage_cli import ops
from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.codegen import templates
from mirage_cli.codegen.expr import (
    CTYPE,
    Emitter,
    Inline,
    Node,
    Stored,
    indent,
    index_vars,
    keep_used,
    numel,
    offset_expr,
    reciprocal,
    row_major,
)
from mirage_cli.codegen.indexing import check_index_range, loop_index_type
from mirage_cli.codegen.plan import Kernel, Param
from mirage_cli.ir import (
    DType,
    KernelOp,
    TensorType,
)
from mirage_cli.semantics.accum import Combine, Finish
from mirage_cli.semantics.cuda import c_float, c_init, c_update, c_warp

ELEM_THREADS = 256
ROW_WARPS = 8
MAX_GRID = 65535


def _params(kop: KernelOp, types: dict[str, TensorType]) -> tuple[Param, ...]:
    ps = [Param("const " + CTYPE[types[n].dtype] + "* __restrict__", f"p{i}", n)
          for i, n in enumerate(dict.fromkeys(kop.inputs))]
    out = kop.outputs[0]
    ps.append(Param(CTYPE[out.type.dtype] + "* __restrict__", f"p{len(ps)}", out.name))
    return tuple(ps)


def _emitter(kop: KernelOp, types: dict[str, TensorType], params: tuple[Param, ...]) -> Emitter:
    em = Emitter()
    for p in params[:-1]:
        t = types[p.arg]
        em.nodes[p.arg] = Node(t.shape, Stored(p.name, "0", row_major(t.shape), CTYPE[t.dtype]))
    return em


def lower_kernel_op(kop: KernelOp, name: str, types: dict[str, TensorType],
                    arch: str = DEFAULT_ARCH, early: frozenset[str] = frozenset()) -> Kernel:
    """The kernel of a pre-defined operator; ``early``: the inputs a matmul may start
    copying before its grid-dependency wait (:func:`lower.early_inputs`)."""
    check_index_range(kop, types)
    spec = ops.get(kop.op).cuda
    match spec.kind:
        case "matmul":
            return _matmul(kop, name, types, arch, early)
        case "rms_norm" | "softmax":
            return _rows(kop, name, types)
        case "reduce" | "rms" if _warp_reduce_fits(kop, types):
            return _warp_reduce(kop, name, types)
        case "elementwise" | "gather" | "reduce" | "rms" | "concat" | "sum_to":
            return _per_element(kop, name, types)
        case "accum" | "custom":
            raise AssertionError(f"{kop.op} is not a standalone kernel")
        case _:
            assert_never(spec.kind)


def _per_element(kop: KernelOp, name: str, types: dict[str, TensorType]) -> Kernel:
    params = _params(kop, types)
    em = _emitter(kop, types, params)
    out = kop.outputs[0]
    attrs = ops.get(kop.op).attr_values(kop.attrs)
    em.nodes[out.name] = Node(out.type.shape, Inline(kop.op, kop.inputs, attrs))
    n = out.type.numel
    decl, idx = index_vars(out.type.shape, "e", "i")
    vec = _store_vec(kop, out.type)
    grid = (min(-(-n // (vec * ELEM_THREADS)), MAX_GRID), 1, 1)
    ix = loop_index_type(n, grid[0] * ELEM_THREADS * vec)
    if vec == 1:
        head = (f"for ({ix} e = blockIdx.x * {ELEM_THREADS} + threadIdx.x; e < {n}; "
                f"e += gridDim.x * {ELEM_THREADS}) {{")
        st, v = em.value(out.name, idx)
        pre, inner = [], st + [f"mg_st({params[-1].name} + e, {v});"]
    else:
        head = (f"for ({ix} e{vec} = blockIdx.x * {ELEM_THREADS} + threadIdx.x; "
                f"e{vec} < {n // vec}; e{vec} += gridDim.x * {ELEM_THREADS}) {{")
        pre = [f"const {ix} e = e{vec} * {vec};"]
        inner, vs = [], []
        for j in range(vec):
            st, v = em.value(out.name, idx[:-1] + [f"({idx[-1]} + {j})"])
            inner += st
            vs.append(v)
        inner.append(f"mg_st8({params[-1].name} + e, {', '.join(vs)});")
    body = [head] + indent(pre + keep_used(decl, inner) + inner) + ["}"]
    how = ("8 consecutive output elements per thread, one 16-byte store" if vec > 1
           else "one thread per output element")
    return Kernel(name, params, tuple(body), ELEM_THREADS, grid, 0, 0, f"{kop.op}: {how}")


# Element-wise kernels and concatenations of 16-bit outputs store 8 elements per
# thread as one 16-byte access: the Llama layer's key/value cache concatenations
# moved 16.8 MB each in 12 µs on an H200 with one 2-byte store per thread.
VEC_KINDS = ("elementwise", "concat")


def _store_vec(kop: KernelOp, out: TensorType) -> int:
    """Output elements per thread: 8 for a 16-bit element-wise or concat output whose
    rows are whole 16-byte chunks, else 1."""
    ok = (ops.get(kop.op).cuda.kind in VEC_KINDS and out.dtype in (DType.F16, DType.BF16)
          and out.rank > 0 and out.shape[-1] % 8 == 0)
    return 8 if ok else 1


def _reduced_dim(kop: KernelOp, types: dict[str, TensorType]) -> int:
    x = types[kop.inputs[0]]
    if ops.get(kop.op).cuda.kind == "rms":
        return x.rank - 1
    return int(ops.get(kop.op).attr_values(kop.attrs)["dim"])


def _warp_reduce_fits(kop: KernelOp, types: dict[str, TensorType]) -> bool:
    """A warp per result where the reduction is long and either contiguous or too
    few results to fill the GPU with one thread each."""
    x = types[kop.inputs[0]]
    d = _reduced_dim(kop, types)
    return x.shape[d] >= 32 and (d == x.rank - 1 or kop.outputs[0].type.numel < 8192)


def _reduce_finish(finish: Finish, n: int) -> str:
    """The result of a reduction over ``n`` elements from its combined state ``s``."""
    match finish:
        case Finish.ID:
            return "s"
        case Finish.MEAN:
            return f"s / {c_float(float(n))}"
        case Finish.RMS:
            raise AssertionError("rms is its own CUDA kind, not a reduce finish")
        case other:
            assert_never(other)


def _warp_reduce(kop: KernelOp, name: str, types: dict[str, TensorType]) -> Kernel:
    """Reductions (sum/mean/max over a dimension, rms): one warp per result, lanes
    stride the reduced dimension, warp shuffles combine."""
    params = _params(kop, types)
    em = _emitter(kop, types, params)
    x = kop.inputs[0]
    spec = ops.get(kop.op).cuda
    attrs = ops.get(kop.op).attr_values(kop.attrs)
    out = kop.outputs[0].type
    d = _reduced_dim(kop, types)
    n = types[x].shape[d]
    decl, idx = index_vars(out.shape, "row", "r")
    keep = spec.kind == "rms" or bool(attrs.get("keepdim", False))
    in_idx = idx[:d] + ["k"] + (idx[d + 1:] if keep else idx[d:])
    xv = em.load(x, in_idx)
    combine = Combine.SUM if spec.kind == "rms" else spec.combine or Combine.SUM
    if spec.kind == "rms":
        body_acc = f"{{ const float t = {xv}; s = fmaf(t, t, s); }}"
        fin = f"sqrtf(s / {c_float(float(n))} + {c_float(float(attrs.get('eps', 0.0)))})"
    else:
        body_acc, fin = c_update("s", xv, combine), _reduce_finish(spec.finish, n)
    body = [(f"const {loop_index_type(out.numel, ROW_WARPS)} row = blockIdx.x * {ROW_WARPS} "
            "+ threadIdx.x / 32;"),
            "const int lane = threadIdx.x % 32;", f"if (row >= {out.numel}) return;"]
    loop = [f"float s = {c_init(combine)};",
            f"for ({loop_index_type(n, 32)} k = lane; k < {n}; k += 32) {body_acc}",
            f"s = {c_warp(combine, 's')};",
            f"if (lane == 0) mg_st({params[-1].name} + row, {fin});"]
    body += keep_used(decl, loop) + loop
    return Kernel(name, params, tuple(body), 32 * ROW_WARPS, (-(-out.numel // ROW_WARPS), 1, 1),
                  0, 0, f"{kop.op} over {n}: one warp per result")


# Rows kernels: a warp per row when there are enough rows to fill the GPU, else a
# block per row (an RMSNorm of one 4096-long row took 6.3 µs on an H200 on one warp).
BLOCK_ROWS_BELOW = 264


def _rows(kop: KernelOp, name: str, types: dict[str, TensorType]) -> Kernel:
    """One warp (or, for few rows, one block) per row along the reduced dimension."""
    params = _params(kop, types)
    em = _emitter(kop, types, params)
    x = kop.inputs[0]
    shape = types[x].shape
    attrs = ops.get(kop.op).attr_values(kop.attrs)
    kind = ops.get(kop.op).cuda.kind
    dim = int(attrs["dim"]) if kind == "softmax" else len(shape) - 1
    other = shape[:dim] + shape[dim + 1:]
    rows, n = numel(other), shape[dim]
    per_block = rows < BLOCK_ROWS_BELOW and n >= 32 * ROW_WARPS
    decl, oidx = index_vars(other or (1,), "row", "r")
    oidx = oidx if other else []
    idx = oidx[:dim] + ["k"] + oidx[dim:]
    out = params[-1].name
    if per_block:
        lanes, first, combine = 32 * ROW_WARPS, "threadIdx.x", "mg_block_{}(v, red)"
        body = [f"__shared__ float red[{ROW_WARPS}];"]
        body += ["const int row = blockIdx.x;"] if any("row" in d for d in decl) else []
    else:
        lanes, first, combine = 32, "lane", "mg_warp_{}(v)"
        body = [(f"const {loop_index_type(rows, ROW_WARPS)} row = blockIdx.x * {ROW_WARPS} "
                 "+ threadIdx.x / 32;"),
                "const int lane = threadIdx.x % 32;", f"if (row >= {rows}) return;"]
    body += decl
    ik = loop_index_type(n, lanes)
    loop = f"for ({ik} k = {first}; k < {n}; k += {lanes})"
    ostrides = row_major(kop.outputs[0].type.shape)
    xv = em.load(x, idx)
    o = offset_expr("0", idx, ostrides)
    if kind == "rms_norm":
        eps = c_float(float(attrs.get("eps", 0.0)))
        wv = ""
        if len(kop.inputs) == 2:
            from mirage_cli.codegen.expr import broadcast_index
            wv = " * " + em.load(kop.inputs[1], broadcast_index(idx, types[kop.inputs[1]].shape))
        body += ["float v = 0.0f;",
                 f"{loop} {{ const float t = {xv}; v = fmaf(t, t, v); }}",
                 f"const float ss = {combine.format('sum')};",
                 f"const float inv = {reciprocal(f'sqrtf(ss / {c_float(float(n))} + {eps})')};",
                 f"{loop} mg_st({out} + ({o}), {xv} * inv{wv});"]
    else:
        body += ["float v = __int_as_float(0xff800000);",
                 f"{loop} v = fmaxf(v, {xv});",
                 f"const float m = {combine.format('max')};", "v = 0.0f;",
                 f"{loop} v += mg_exp({xv} - m);",
                 f"const float inv = {reciprocal(combine.format('sum'))};",
                 f"{loop} mg_st({out} + ({o}), mg_exp({xv} - m) * inv);"]
    grid = (rows if per_block else -(-rows // ROW_WARPS), 1, 1)
    return Kernel(name, params, tuple(body), 32 * ROW_WARPS, grid, 0, 0,
                  f"{kop.op}: one {'block' if per_block else 'warp'} per row of {n}")


def _matmul(kop: KernelOp, name: str, types: dict[str, TensorType], arch: str,
            early: frozenset[str]) -> Kernel:
    # The tiling is the cost model's choice (see codegen/matmul_tiling.py).
    from mirage_cli.search.cost import lowered

    custom = lowered(kop, types)
    if custom.block is not None:
        from mirage_cli.codegen.custom import lower_custom

        k = lower_custom(custom, name, types, arch, early)
        g = custom.block
        assert g is not None
        return dataclasses.replace(k, comment=f"matmul as a generated block graph: grid "
                                   f"{list(g.grid)}, forloop {g.forloop}, tensor cores")
    params = _params(kop, types)
    a, b = kop.inputs
    ta, tb, tc = types[a], types[b], kop.outputs[0].type
    M, K, N = ta.shape[-2], ta.shape[-1], tb.shape[-1]
    batch = tc.shape[:-2]
    decl, bidx = index_vars(batch or (1,), "bz", "z")
    bidx = bidx if batch else []
    from mirage_cli.codegen.expr import broadcast_index
    a_off = offset_expr("0", broadcast_index(bidx, ta.shape[:-2]), row_major(ta.shape)[:-2])
    b_off = offset_expr("0", broadcast_index(bidx, tb.shape[:-2]), row_major(tb.shape)[:-2])
    pa = next(p.name for p in params if p.arg == a)
    pb = next(p.name for p in params if p.arg == b)
    body = templates.render("matmul_body.cu.j2", M=M, N=N, K=K, batch_decl=decl,
                            a_off=a_off, b_off=b_off, c_off=f"bz * {M * N}" if batch else "0",
                            A=pa, B=pb, C=params[-1].name).splitlines()
    grid = (-(-N // 64), -(-M // 64), max(1, numel(batch)))
    return Kernel(name, params, tuple(body), 256, grid, 0, 0,
                  f"matmul {M}x{K} @ {K}x{N}, batch {list(batch)}: 64x64 tiles")
