"""Emission of reductions and forloop accumulators inside a fused kernel.

Row reductions (``rms``, ``sum``/``mean``/``max`` along a row, accumulators that reduce
the tile's last dimension) follow their :class:`~mirage_cli.kplan.ReducePlan`:
``threads_per_row`` threads stride each row (whole warps: every warp works even when a
block has fewer rows than warps; an aligned group of lanes for a reduction along a
strided dimension), combine with warp shuffles and, past one warp, through one
shared-memory slot per warp. Accumulators that reduce rows keep one
partial per thread across iterations and combine once, after the loop. Other
accumulators keep their state in registers (fixed elements per thread, so updates
need no barrier), in mma fragments (:mod:`mma`) or in shared memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, assert_never

from mirage_cli import ops
from mirage_cli.codegen import mma
from mirage_cli.codegen.expr import (
    Lines,
    Local,
    Node,
    Stored,
    indent,
    index_vars,
    keep_used,
    numel,
    offset_expr,
)
from mirage_cli.ir import BlockOp
from mirage_cli.kplan import ReducePlan
from mirage_cli.semantics.accum import Combine, Finish, Pre, Reduce
from mirage_cli.semantics.cuda import c_float, c_init, c_update, c_warp

if TYPE_CHECKING:
    from mirage_cli.codegen.kernel import FusedKernel

# How a combine is spelled (identity, update, warp shuffle) is the registry's floor's.
_init = c_init
_update = c_update


# Terms per lane up to which a lane's loop over its elements of a strided row is
# unrolled (measured there: docs/perf-log.md v26; rows along the last dimension keep
# their loop).
_UNROLL_TERMS = 16

Body = Callable[[str, str], tuple[Lines, Lines, Lines]]


def _rows(k: FusedKernel, rp: ReducePlan, n_rows: int, body: Body) -> Lines:
    """A loop over the rows this thread helps reduce (row ``threadIdx.x / tpr`` of each
    pass, lane ``threadIdx.x % tpr`` within it). ``body(row, lane)`` gives statements
    for every thread, for threads of a valid row, then again for every thread (those
    may hold barriers: every thread runs the same passes)."""
    per_pass, J = _passes(k, rp, n_rows)
    pre, valid, post = body("row", "mg_rl")
    if n_rows % per_pass:
        valid = [f"if (row < {n_rows}) {{"] + indent(valid) + ["}"]
    return (["#pragma unroll", f"for (int j = 0; j < {J}; ++j) {{"]
            + indent(_row_head(rp, per_pass) + pre + valid + post) + ["}"])


def _passes(k: FusedKernel, rp: ReducePlan, n_rows: int) -> tuple[int, int]:
    """Rows reduced at once by the block, and the passes over ``n_rows`` rows."""
    per_pass = k.T // rp.threads_per_row
    return per_pass, -(-n_rows // per_pass)


def _row_head(rp: ReducePlan, per_pass: int) -> Lines:
    """This thread's row in pass ``j`` and its lane in that row."""
    tpr = rp.threads_per_row
    return [f"const int row = threadIdx.x / {tpr} + {per_pass} * j;",
            f"const int mg_rl = threadIdx.x % {tpr};", "(void)row; (void)mg_rl;"]


def _row_leader(tpr: int, lines: Lines) -> Lines:
    """``lines`` for the first of each row's ``tpr`` lanes (at most a warp)."""
    return [f"if ((threadIdx.x & {tpr - 1}) == 0) {{"] + indent(lines) + ["}"]


def _combine(k: FusedKernel, rp: ReducePlan, v: str, combine: Combine,
             leader: Callable[[str], Lines]) -> Lines:
    """Combine ``v`` over the row's threads; ``leader(total)`` runs once per row. Run by
    every thread (past one warp per row it holds barriers)."""
    tpr = rp.threads_per_row
    lines = [f"{v} = {c_warp(combine, v, min(tpr, 32))};"]
    if tpr <= 32:
        return lines + _row_leader(tpr, leader(v))
    nw = rp.threads_per_row // 32
    tot = k.em.fresh("tot")
    acc = [f"float {tot} = mg_red[threadIdx.x / 32];",
           f"for (int w = 1; w < {nw}; ++w) "
           + _update(tot, "mg_red[threadIdx.x / 32 + w]", combine)]
    return (lines + [f"if ((threadIdx.x & 31) == 0) mg_red[threadIdx.x / 32] = {v};",
                     "__syncthreads();", f"if (threadIdx.x % {rp.threads_per_row} == 0) {{"]
            + indent(acc + leader(tot)) + ["}", "__syncthreads();"])


def _row_index(k: FusedKernel, shape: tuple[int, ...], row: str, dim: int | None,
               keepdim: bool, kv: str) -> tuple[Lines, list[str]]:
    """Index of element ``kv`` of reduced row ``row`` (a flat index into ``shape``, the
    result's shape) in the reduced operand; ``dim`` None: the last dimension."""
    decl, idx = index_vars(shape, row, k.em.fresh("w") + "_")
    if dim is None:
        return decl, idx[:-1] + [kv]
    if keepdim:
        return decl, idx[:dim] + [kv] + idx[dim + 1:]
    return decl, idx[:dim] + [kv] + idx[dim:]


def _lane_terms(k: FusedKernel, x: str, idx: list[str], kv: str, length: int, tpr: int,
                slot: str, pre: Pre, combine: Combine, decl: Lines) -> Lines:
    """``slot`` ⊕= pre(x[idx]) over this thread's elements ``kv`` of the row. 16-byte
    reads only where ``kv`` indexes the contiguous last dimension (a reduction along a
    strided dimension reads one element per step)."""
    vec = idx[-1] == kv and _vec_row(k, x, length, tpr)
    if vec:
        return _lane_terms_vec(k, x, idx, kv, length, tpr, slot, pre, combine, decl)
    st, v = _pre(k, pre, *k.em.value(x, idx))
    inner = st + [_update(slot, v, combine)]
    if idx[-1] == kv or length % tpr or length // tpr > _UNROLL_TERMS:
        loop = [f"for (int {kv} = mg_rl; {kv} < {length}; {kv} += {tpr}) {{"]
    else:  # a strided row's few terms per lane: unrolled, its loads issue together
        j = k.em.fresh("j")
        loop = ["#pragma unroll", f"for (int {j} = 0; {j} < {length // tpr}; ++{j}) {{",
                f"  const int {kv} = mg_rl + {j} * {tpr};"]
    loop += indent(inner) + ["}"]
    return keep_used(decl, loop) + loop


def _vec_row(k: FusedKernel, x: str, length: int, tpr: int) -> bool:
    """Whether the row can be read 16 bytes (8 elements) per lane: a 16-bit tile in
    shared memory with 16-byte-aligned rows, 8 elements per lane per pass."""
    how = k.em.nodes[x].how
    return (isinstance(how, Stored) and how.base == "0" and how.ctype in ("mg_f16", "mg_bf16")
            and how.ptr.startswith("sm_") and how.strides[-1] == 1
            and all(s % 8 == 0 for s in how.strides[:-1]) and length % (8 * tpr) == 0)


def _lane_terms_vec(k: FusedKernel, x: str, idx: list[str], kv: str, length: int, tpr: int,
                    slot: str, pre: Pre, combine: Combine, decl: Lines) -> Lines:
    how = k.em.nodes[x].how
    assert isinstance(how, Stored)
    f = k.em.fresh("f")
    off = offset_expr("0", idx[:-1] + [f"{kv} * 8"], how.strides)
    _, v = _pre(k, pre, [], f"{f}[q]", bind=False)
    loop = [f"for (int {kv} = mg_rl; {kv} < {length // 8}; {kv} += {tpr}) {{",
            f"  float {f}[8];", f"  mg_ld8({how.ptr} + ({off}), {f});",
            "  #pragma unroll", f"  for (int q = 0; q < 8; ++q) {_update(slot, v, combine)}", "}"]
    return keep_used(decl, loop) + loop


def row_combine(op: BlockOp, length: int) -> tuple[Combine, str]:
    """How a reduction operator over ``length`` elements combines, and the format of
    its finish (``{0}``: the combined value): rms is sqrt(sum / n + eps), mean sum / n."""
    spec = ops.get(op.op).cuda
    attrs = ops.get(op.op).attr_values(op.attrs)
    if spec.kind == "rms":
        eps = c_float(float(attrs.get("eps", 0.0)))
        return Combine.SUM, f"sqrtf({{0}} / {c_float(float(length))} + {eps})"
    fin = f"{{0}} / {c_float(float(length))}" if spec.finish is Finish.MEAN else "{0}"
    return spec.combine or Combine.SUM, fin


def materialize(k: FusedKernel, op: BlockOp, rp: ReducePlan) -> Lines:
    """A row-reduction operator into its f32 tile."""
    from mirage_cli.codegen.blockfacts import reduced_dim

    red = reduced_dim(op, k.a.types)
    assert red is not None
    dim, length = red
    spec = ops.get(op.op).cuda
    out = op.outputs[0]
    attrs = ops.get(op.op).attr_values(op.attrs)
    combine, fin = row_combine(op, length)
    n_rows = out.type.numel
    r, kv = k.em.fresh("r"), k.em.fresh("k")

    def terms(row: str, slot: str) -> Lines:
        decl, idx = _row_index(k, out.type.shape, row, None if spec.kind == "rms" else dim,
                               bool(attrs.get("keepdim", False)), kv)
        return _lane_terms(k, op.inputs[0], idx, kv, length, rp.threads_per_row, slot,
                           Pre.SQUARE if spec.kind == "rms" else Pre.ID, combine, decl)

    def leader(row: str, tot: str) -> Lines:
        return _guarded(f"{row} < {n_rows}", _leader(k, op, row, fin.format(tot)))

    if rp.threads_per_row <= 32 and 1 < _passes(k, rp, n_rows)[1] <= _SPLIT_PASSES:
        return _rows_then_stores(k, rp, n_rows, r, combine, terms, leader) + ["__syncthreads();"]

    def body(row: str, lane: str) -> tuple[Lines, Lines, Lines]:
        valid = terms(row, r)
        post = _combine(k, rp, r, combine, lambda tot: leader(row, tot))
        return [f"float {r} = {_init(combine)};"], valid, post
    return _rows(k, rp, n_rows, body) + ["__syncthreads();"]


# Passes (rows per thread) up to which a reduction's rows are all combined before any is
# stored. Each store may alias the next pass's loads, so a pass that stores as it goes
# waits for the previous one's whole chain of loads and shuffles (docs/perf-log.md v29).
_SPLIT_PASSES = 8


def _rows_then_stores(k: FusedKernel, rp: ReducePlan, n_rows: int, r: str, combine: Combine,
                      terms: Callable[[str, str], Lines],
                      leader: Callable[[str, str], Lines]) -> Lines:
    """:func:`_rows` for rows combined within a warp: every pass's value into ``r[j]``
    (loads and shuffles of all passes free to overlap), then the rows' leaders store
    them, one pass after another."""
    tpr = rp.threads_per_row
    per_pass, J = _passes(k, rp, n_rows)
    head = _row_head(rp, per_pass)
    valid = terms("row", f"{r}[j]")
    if n_rows % per_pass:
        valid = [f"if (row < {n_rows}) {{"] + indent(valid) + ["}"]
    fold = head + [f"{r}[j] = {_init(combine)};"] + valid
    fold += [f"{r}[j] = {c_warp(combine, f'{r}[j]', tpr)};"]
    store = head + _row_leader(tpr, leader("row", f"{r}[j]"))
    return ([f"float {r}[{J}];", "#pragma unroll", f"for (int j = 0; j < {J}; ++j) {{"]
            + indent(fold) + ["}", "#pragma unroll", f"for (int j = 0; j < {J}; ++j) {{"]
            + indent(store) + ["}"])


def _guarded(cond: str, lines: Lines) -> Lines:
    if len(lines) == 1:
        return [f"if ({cond}) {lines[0]}"]
    return [f"if ({cond}) {{"] + indent(lines) + ["}"]


def _leader(k: FusedKernel, op: BlockOp, row: str, value: str) -> Lines:
    """The reduction's result at ``row`` into its tile, and into the tile of the
    element-wise operator it finishes (``FusedKernel.finishes``)."""
    out = op.outputs[0]
    u = k.finishes.get(out.name)
    if u is None:
        return [f"buf_{out.name}[{row}] = {k.em.as_stored(out.name, value)};"]
    v = k.em.fresh("fin")
    lines = [f"const float {v} = {value};", f"buf_{out.name}[{row}] = {k.em.as_stored(out.name, v)};"]
    saved = k.em.nodes[out.name]
    k.em.nodes[out.name] = Node(out.type.shape, Local(v))
    st, e = k.em.apply(u, ["0"] * len(out.type.shape))
    k.em.nodes[out.name] = saved
    name = u.outputs[0].name
    return lines + st + [f"buf_{name}[{row}] = {k.em.as_stored(name, e)};"]


# -- forloop accumulators -------------------------------------------------------------


def accum_spec(op: BlockOp) -> ops.AccumSpec:
    spec = ops.get(op.op).accum
    assert spec is not None
    return spec


def acc_init(k: FusedKernel, accs: list[BlockOp]) -> Lines:
    lines: Lines = []
    for op in accs:
        spec, name = accum_spec(op), op.outputs[0].name
        n = op.outputs[0].type.numel
        init = _init(spec.combine)
        if name in k.mma_acc:
            lines += mma.acc_init(k, op, k.mma_acc[name])
        elif name in k.reds:
            J = -(-n // (k.T // k.reds[name].threads_per_row))
            lines += [f"float acc_{name}[{J}];", "#pragma unroll",
                      f"for (int j = 0; j < {J}; ++j) acc_{name}[j] = {init};"]
        elif k.tile(name).home == "acc_regs":
            npt = -(-n // k.T)
            lines += [f"float acc_{name}[{npt}];", "#pragma unroll",
                      f"for (int j = 0; j < {npt}; ++j) acc_{name}[j] = {init};"]
        else:
            lines.append(f"for (int e = threadIdx.x; e < {n}; e += {k.T}) buf_{name}[e] = {init};")
    return lines


def _acc_elems(k: FusedKernel, op: BlockOp, body_fn: Callable[[list[str], str, str], Lines]
               ) -> Lines:
    """A loop over the accumulator elements this thread owns (fixed across iterations,
    so updates need no barrier); ``slot`` is where an element's state lives."""
    name = op.outputs[0].name
    shape = op.outputs[0].type.shape
    n = numel(shape)
    e = k.em.fresh("e")
    decl, idx = index_vars(shape, e, k.em.fresh("a") + "_")
    if k.tile(name).home == "acc_regs":
        npt = -(-n // k.T)
        inner = body_fn(idx, f"acc_{name}[j]", e)
        inner = keep_used(decl, inner) + inner
        core = ([f"if ({e} < {n}) {{"] + indent(inner) + ["}"]) if n % k.T else inner
        return ["#pragma unroll", f"for (int j = 0; j < {npt}; ++j) {{",
                f"  const int {e} = threadIdx.x + j * {k.T};"] + indent(core) + ["}"]
    inner = body_fn(idx, f"buf_{name}[{e}]", e)
    inner = keep_used(decl, inner) + inner
    return [f"for (int {e} = threadIdx.x; {e} < {n}; {e} += {k.T}) {{"] + indent(inner) + ["}"]


def acc_update(k: FusedKernel, op: BlockOp) -> Lines:
    name, spec, x = op.outputs[0].name, accum_spec(op), op.inputs[0]
    if name in k.mma_acc:
        return mma.acc_update(k, op, k.mma_acc[name])
    xshape = k.a.types[x].shape
    if name in k.reds:
        rp = k.reds[name]
        kv = k.em.fresh("k")

        def rbody(row: str, lane: str) -> tuple[Lines, Lines, Lines]:
            decl, idx = _row_index(k, op.outputs[0].type.shape, row, None, True, kv)
            return [], _lane_terms(k, x, idx, kv, xshape[-1], rp.threads_per_row,
                                   f"acc_{name}[j]", spec.pre, spec.combine, decl), []
        return _rows(k, rp, op.outputs[0].type.numel, rbody)
    width = dict(op.attrs).get("width")

    def body(idx: list[str], slot: str, e: str) -> Lines:
        loop: tuple[str, int] | None
        match spec.reduce:
            case Reduce.NONE:
                terms, loop = idx, None
            case Reduce.LAST:
                g = k.em.fresh("k")
                terms, loop = idx[:-1] + [g], (g, xshape[-1])
            case Reduce.TO_WIDTH:
                g = k.em.fresh("g")
                assert isinstance(width, int)
                terms = idx[:-1] + [f"({g} * {width} + {idx[-1]})"]
                loop = (g, xshape[-1] // width)
            case other:
                assert_never(other)
        st, v = k.em.value(x, terms)
        st, v = _pre(k, spec.pre, st, v)
        inner = st + [_update(slot, v, spec.combine)]
        if loop is None:
            return inner
        return [f"for (int {loop[0]} = 0; {loop[0]} < {loop[1]}; ++{loop[0]}) {{"] + indent(inner) + ["}"]
    return _acc_elems(k, op, body)


def _pre(k: FusedKernel, pre: Pre, st: Lines, v: str, bind: bool = True
         ) -> tuple[Lines, str]:
    """Statements and expression of ``pre(v)`` (``bind``: name ``v`` first, so that an
    expression is evaluated once; a plain element read needs no name)."""
    match pre:
        case Pre.ID:
            return st, v
        case Pre.SQUARE:
            if not bind:
                return st, f"{v} * {v}"
            w = k.em.fresh()
            return st + [f"const float {w} = {v};"], f"{w} * {w}"
        case other:
            assert_never(other)


def finish_format(k: FusedKernel, op: BlockOp) -> str:
    """The finish of an accumulator as a format string of its combined state."""
    spec = accum_spec(op)
    xshape = k.a.types[op.inputs[0]].shape
    count = k.F
    match spec.reduce:
        case Reduce.NONE:
            pass
        case Reduce.LAST:
            count *= xshape[-1]
        case Reduce.TO_WIDTH:
            count *= xshape[-1] // int(dict(op.attrs)["width"])  # type: ignore[call-overload]
        case other:
            assert_never(other)
    eps = float(dict(op.attrs).get("eps") or 0.0)
    match spec.finish:
        case Finish.ID:
            return "{0}"
        case Finish.MEAN:
            return f"{{0}} / {c_float(float(count))}"
        case Finish.RMS:
            tail = f" + {c_float(eps)}" if eps else ""
            return f"sqrtf({{0}} / {c_float(float(count))}{tail})"
        case finish:
            assert_never(finish)


def acc_finish(k: FusedKernel, accs: list[BlockOp], raw: bool = False) -> Lines:
    """Each accumulator's combined state into its f32 tile, finished (``raw``: not yet:
    the blocks of a cluster still have partial states to combine)."""
    lines: Lines = []
    for op in accs:
        spec, name = accum_spec(op), op.outputs[0].name
        fin = "{0}" if raw else finish_format(k, op)
        if name in k.mma_acc:
            lines += mma.acc_finish(k, op, k.mma_acc[name], fin)
        elif name in k.reds:
            rp = k.reds[name]
            n_rows = op.outputs[0].type.numel

            def rbody(row: str, lane: str, name: str = name, fin: str = fin,
                      rp: ReducePlan = rp, n_rows: int = n_rows, combine: Combine = spec.combine
                      ) -> tuple[Lines, Lines, Lines]:
                v = k.em.fresh("v")
                return [f"float {v} = acc_{name}[j];"], [], _combine(k, rp, v, combine, lambda t: [
                    f"if ({row} < {n_rows}) buf_{name}[{row}] = {fin.format(t)};"])
            lines += _rows(k, rp, n_rows, rbody)
        elif k.tile(name).home == "acc_regs" or spec.finish is not Finish.ID:
            def store(idx: list[str], slot: str, e: str, name: str = name, fin: str = fin
                      ) -> Lines:
                return [f"buf_{name}[{e}] = {fin.format(slot)};"]
            lines += _acc_elems(k, op, store)
    if accs:
        lines.append("__syncthreads();")
    return lines
