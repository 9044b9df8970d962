"""Hand-built µGraphs that exercise the code generator's corners (shared by the CPU
compile tests and the GPU correctness tests)."""

from __future__ import annotations

from collections.abc import Callable

from mirage_cli.builder import BlockBuilder, GraphBuilder
from mirage_cli.ir import Graph


def rmsnorm_linear_small() -> Graph:
    b = GraphBuilder("rmsnorm_linear_small")
    x = b.input("X", (4, 64), "f16")
    w = b.input("W", (64, 32), "f16")
    k = b.custom((4, 1, 1), 128, 4)
    xt = k.load(x, (None, None, None), 1)
    wt = k.load(w, (1, None, None), 0)
    r = k.op("acc_rms_ld", xt)
    s = k.op("acc_sum", k.op("matmul", xt, wt))
    (z,) = k.finish([(k.op("div", s, r), "Z", (1, None, None))])
    b.output(z)
    return b.build()


def unswizzled_weight_boxes() -> Graph:
    """A streaming matmul (a 9 MB weight: bulk copies by default) whose weight tiles
    have rows of 56 columns, 112 bytes: seven 16-byte chunks, which no swizzle span
    divides, so each row is one unswizzled box (codegen/tmaplan.py)."""
    b = GraphBuilder("unswizzled_weight_boxes")
    x = b.input("X", (8, 4096), "f16")
    w = b.input("W", (4096, 1120), "f16")
    k = b.custom((20, 1, 1), 128, 64)
    xt = k.load(x, (None, None, None), 1)      # (8, 64)
    wt = k.load(w, (1, None, None), 0)         # (64, 56)
    s = k.op("acc_sum", k.op("matmul", xt, wt))
    (z,) = k.finish([(s, "Z", (1, None, None))])
    b.output(z)
    return b.build()


def _projections(name: str, x: tuple[int, int], dtype: str,
                 specs: tuple[tuple[str, int, int, int, int, bool], ...]) -> Graph:
    """Independent streaming projections of one input X, each spec (output, columns,
    blocks, threads, forloop, normed): with ``normed`` the RMSNorm of X scaled by G."""
    b = GraphBuilder(name)
    xv = b.input("X", x, dtype)
    g = b.input("G", (x[1],), dtype)
    for out, cols, grid, threads, loop, normed in specs:
        w = b.input(f"W{out}", (x[1], cols), dtype)
        k = b.custom((grid, 1, 1), threads, loop)
        xt = k.load(xv, (None, None, None), 1)
        wt = k.load(w, (1, None, None), 0)
        if normed:
            gt = k.load(g, (None, None, None), 0)
            r = k.op("acc_rms_ld", xt, eps=1e-6)
            s = k.op("div", k.op("acc_sum", k.op("matmul", k.op("mul", xt, gt), wt)), r)
        else:
            s = k.op("acc_sum", k.op("matmul", xt, wt))
        (z,) = k.finish([(s, out, (1, None, None))])
        b.output(z)
    return b.build()


def shallower_grouped_ring() -> Graph:
    """The Qwen layer's query, key and value projections at batch 8 as three
    independent streaming kernels: the query's (with the norm) plans six stages, one
    block per SM, the others two per SM, so the query's ring is lowered at five
    stages to share their launch (grouping.fit_residency)."""
    return _projections("shallower_grouped_ring", (8, 3584), "bf16", (
        ("Q", 3584, 56, 128, 28, True), ("K", 512, 32, 128, 16, False),
        ("V", 512, 32, 128, 16, False)))


def resized_grouped_member() -> Graph:
    """The Llama layer's query, key and value projections at batch 1 as three
    independent streaming kernels with the norm: the query's at 128 threads, 64
    columns a block, the key's and value's at 256 threads, 32 columns a block; these
    are lowered again at 128 threads to share the query's launch
    (grouping.fit_residency)."""
    return _projections("resized_grouped_member", (1, 4096), "f16", (
        ("Q", 4096, 64, 128, 32, True), ("K", 1024, 32, 256, 32, True),
        ("V", 1024, 32, 256, 32, True)))


def weighted_norm_uneven_tiles() -> Graph:
    """A weighted RMSNorm's ``x * w`` as the A operand of the loop's matmul (A's
    fragments scaled in registers), 72 columns a block (9 mma tiles over 4 warps: a
    warp's last tile clamped), bf16 with the weight second and f16 with it first over
    2 rows (the zero rows of a short A)."""
    b = GraphBuilder("weighted_norm_uneven_tiles")
    outs = []
    for dt, rows, first in (("bf16", 16, False), ("f16", 2, True)):
        x = b.input(f"X{dt}", (rows, 256), dt)
        g = b.input(f"G{dt}", (256,), dt)
        w = b.input(f"W{dt}", (256, 288), dt)
        k = b.custom((4, 1, 1), 128, 4)
        xt = k.load(x, (None, None, None), 1)
        gt = k.load(g, (None, None, None), 0)
        wt = k.load(w, (1, None, None), 0)
        r = k.op("acc_rms_ld", xt, eps=1e-6)
        xg = k.op("mul", gt, xt) if first else k.op("mul", xt, gt)
        s = k.op("acc_sum", k.op("matmul", xg, wt))
        (z,) = k.finish([(k.op("div", s, r), f"Z{dt}", (1, None, None))])
        outs.append(z)
    for z in outs:
        b.output(z)
    return b.build()


def two_row_tiles() -> Graph:
    """A loop matmul of two 16-row tiles per 8-column tile (a warp loads each B
    fragment once for both): 32 rows in f16, and 24 in bf16 (the second row tile half
    zero rows)."""
    b = GraphBuilder("two_row_tiles")
    outs = []
    for dt, rows in (("f16", 32), ("bf16", 24)):
        x = b.input(f"X{dt}", (rows, 128), dt)
        w = b.input(f"W{dt}", (128, 64), dt)
        k = b.custom((1, 1, 1), 128, 2)
        xt = k.load(x, (None, None, None), 1)
        wt = k.load(w, (None, None, None), 0)
        r = k.op("acc_rms_ld", xt)
        s = k.op("acc_sum", k.op("matmul", xt, wt))
        (z,) = k.finish([(k.op("div", s, r), f"Z{dt}", (None, None, None))])
        outs.append(z)
    for z in outs:
        b.output(z)
    return b.build()


def bf16_kernel_ops() -> Graph:
    """Every pre-defined kernel operator, bf16, odd shapes, broadcasting."""
    b = GraphBuilder("bf16_kernel_ops")
    a = b.input("A", (3, 5, 33), "bf16")
    v = b.input("V", (33,), "bf16")
    m = b.input("M", (2, 3, 33, 17), "bf16")
    t = b.op("add", a, v)
    t = b.op("mul_scalar", b.op("exp", b.op("neg", b.op("square", t))), scalar=0.5)
    s = b.op("sum", t, dim=1, keepdim=True)
    d = b.op("div", t, s)
    g = b.op("gelu", b.op("sub", d, a))
    r = b.op("relu", b.op("silu", g))
    q = b.op("rsqrt", b.op("add", b.op("sqrt", b.op("square", a)), b.op("exp", a)))
    mx = b.op("max", q, dim=2)
    mn = b.op("mean", r, dim=0, keepdim=True)
    sm = b.op("softmax", q, dim=1)
    rn = b.op("rms_norm", q, v, eps=1e-5)
    rr = b.op("rms", a, eps=1e-3)
    c = b.op("concat", sm, rn, dim=1)
    mm = b.op("matmul", c, m)  # (3,10,33) @ (2,3,33,17) -> (2,3,10,17)
    for o in (mx, mn, c, mm, rr):
        b.output(o)
    return b.build()


def f32_block_ops() -> Graph:
    """A fused kernel over two grid axes with every accumulator kind, block
    reductions, concat, sum_to, an invariant input and two outputs (f32)."""
    b = GraphBuilder("f32_block_ops")
    x = b.input("X", (4, 6, 40), "f32")
    y = b.input("Y", (4, 40, 12), "f32")
    z = b.input("Z", (6, 1), "f32")
    k = b.custom((2, 3, 1), 64, 5)
    xt = k.load(x, (0, 1, None), 2)      # (2, 2, 8)
    yt = k.load(y, (0, None, None), 1)   # (2, 8, 12)
    zt = k.load(z, (None, 0, None))      # (2, 1) invariant
    p = k.op("matmul", xt, yt)           # (2, 2, 12)
    e = k.op("add", p, zt)
    a1 = k.op("acc_max", e)
    a2 = k.op("acc_mean_ld", e)          # (2, 2, 1)
    a3 = k.op("acc_sum_to", e, width=4)  # (2, 2, 4)
    a4 = k.op("acc_max_ld", k.op("exp", k.op("mul_scalar", xt, scalar=0.1)))
    a5 = k.op("acc_rms", xt)
    a6 = k.op("acc_mean", k.op("sum", xt, dim=2, keepdim=True))
    st = k.op("sum_to", a1, width=3)     # (2, 2, 3)
    cc = k.op("concat", st, a3, dim=2)   # (2, 2, 7)
    o1 = k.op("sub", k.op("mul", cc, a2), a4)
    red = k.op("max", a5, dim=1, keepdim=True)  # (2, 1, 8)
    o2 = k.op("add", k.op("rms_norm", a5, eps=1e-6), k.op("add", red, a6))
    outs = k.finish([(o1, "O1", (0, 1, None)), (o2, "O2", (0, 1, None))])
    for o in outs:
        b.output(o)
    return b.build()


def big_tiles_scratch() -> Graph:
    """Tiles too large for shared memory: intermediates go to the workspace."""
    b = GraphBuilder("big_tiles_scratch")
    x = b.input("X", (64, 256), "f16")
    w = b.input("W", (256, 1024), "f16")
    k = b.custom((2, 1, 1), 256, 2)
    xt = k.load(x, (None, None, None), 1)   # (64, 128)
    wt = k.load(w, (1, None, None), 0)      # (128, 512)
    m = k.op("matmul", xt, wt)              # (64, 512) f32 = 128 KiB
    e = k.op("silu", m)
    s1 = k.op("acc_sum", e)
    s2 = k.op("acc_sum", m)
    (o,) = k.finish([(k.op("mul", s1, s2), "O", (1, None, None))])
    b.output(o)
    return b.build()


def passthrough() -> Graph:
    """An output that is an input, and a kernel with one thread-level chain."""
    b = GraphBuilder("passthrough")
    x = b.input("X", (7, 9), "f16")
    b.output(x)
    b.output(b.op("exp", x))
    return b.build()


def reshape_aliases() -> Graph:
    """Reshapes in every storage case (codegen/aliasing.py): of an input (read in
    place; the program's first operator, so the first launched kernel is the second),
    of a temporary into a temporary and on into an output (the producer writes that
    output; a later kernel reads it there), and the two that copy: a second output of
    the same tensor, and an input reshaped into an output."""
    b = GraphBuilder("reshape_aliases")
    x = b.input("X", (4, 32), "f16")
    r0 = b.op("reshape", x, d0=8, d1=16)
    e = b.op("exp", r0)
    r1 = b.op("reshape", e, d0=128)
    r2 = b.op("reshape", r1, d0=4, d1=32, out="R2")
    f = b.op("exp", r1, out="F")
    r3 = b.op("reshape", e, d0=2, d1=64, out="R3")
    r4 = b.op("reshape", x, d0=128, out="R4")
    for o in (r2, f, r3, r4):
        b.output(o)
    return b.build()


def grouped_launches() -> Graph:
    """Independent kernels that share launches (codegen/grouping.py): two weight
    streams of one input (level 0, a K split over a cluster each), their two
    element-wise successors (level 1), and a kernel that reads both (level 2)."""
    b = GraphBuilder("grouped_launches")
    x = b.input("X", (2, 256), "f16")
    outs = []
    for n, cols in (("A", 64), ("B", 32)):
        w = b.input(f"W{n}", (256, cols), "f16", weight=True)
        k = b.custom((2, 1, 1), 128, 8)
        xt = k.load(x, (None, None, None), 1)
        wt = k.load(w, (1, None, None), 0)
        (z,) = k.finish([(k.op("acc_sum", k.op("matmul", xt, wt)), f"Z{n}",
                          (1, None, None))])
        outs.append(b.op("exp", z, out=f"E{n}"))
    ea, eb = outs
    b.output(b.op("matmul", ea, b.op("reshape", eb, d0=64, d1=1), out="O"))
    b.output(ea)
    return b.build()


def _online_softmax_times(b: GraphBuilder, k: BlockBuilder, x: str,
                          vt: str) -> Graph:
    """The rest of an online-softmax chain from its scores ``x``: O = softmax(x) @ V
    with the running maximum, as the output ``O``."""
    top = k.op("acc_max_ld", x)
    e = k.op("exp", k.op("sub", x, top))
    o = k.op("acc_sum", k.op("matmul", e, vt))
    (r,) = k.finish([(k.op("div", o, k.op("acc_sum_ld", e)), "O", (0, None, None))])
    b.output(r)
    return b.build()


def joined_concats() -> Graph:
    """Concatenations read in their parts (codegen/joins.py) by an online-softmax chain:
    the queries joined along the batch (a tile read once, all in one part), the keys
    along their last dimension (120 + 8 columns: the last iteration's tile straddles
    both) and the values along the keys (127 cached rows and a new one computed by the
    kernel before, a key-cache append). The bias's concatenation (127 + 1 columns, no
    whole 16-byte chunks) stays a copy."""
    b = GraphBuilder("joined_concats")
    qa, qb = b.input("QA", (1, 16, 32), "f16"), b.input("QB", (1, 16, 32), "f16")
    kc, kn = b.input("KC", (2, 32, 120), "f16"), b.input("KN", (2, 32, 8), "f16")
    vc, v0 = b.input("VC", (2, 127, 16), "f16"), b.input("V0", (2, 1, 16), "f16")
    ca, cb = b.input("CA", (2, 1, 127), "f16"), b.input("CB", (2, 1, 1), "f16")
    q = b.op("concat", qa, qb, dim=0)
    kk = b.op("concat", kc, kn, dim=2)
    v = b.op("concat", vc, b.op("exp", v0), dim=1)
    c = b.op("concat", ca, cb, dim=2)
    k = b.custom((2, 1, 1), 64, 4)
    qt = k.load(q, (0, None, None))          # (1, 16, 32)
    kt = k.load(kk, (0, None, None), 2)      # (1, 32, 32)
    vt = k.load(v, (0, None, None), 1)       # (1, 32, 16)
    ct = k.load(c, (0, None, None), 2)       # (1, 1, 32)
    x = k.op("add", k.op("mul_scalar", k.op("matmul", qt, kt), scalar=0.5), ct)
    return _online_softmax_times(b, k, x, vt)


def joined_beside_bulk() -> Graph:
    """A chain whose value tiles are a joined concatenation's (255 cached rows and a
    new one) and whose key tiles are a tensor of their own: the keys come by bulk
    copies, the values by cp.async (layout._bulk_by_default), as a decode layer's
    attention with its value cache read in place."""
    b = GraphBuilder("joined_beside_bulk")
    q = b.input("Q", (2, 16, 64), "f16")
    kk = b.input("K", (2, 64, 256), "f16")
    vc, v0 = b.input("VC", (2, 255, 64), "f16"), b.input("V0", (2, 1, 64), "f16")
    v = b.op("concat", vc, b.op("exp", v0), dim=1)
    k = b.custom((2, 1, 1), 64, 4)
    qt = k.load(q, (0, None, None))          # (1, 16, 64)
    kt = k.load(kk, (0, None, None), 2)      # (1, 64, 64)
    vt = k.load(v, (0, None, None), 1)       # (1, 64, 64)
    x = k.op("mul_scalar", k.op("matmul", qt, kt), scalar=0.125)
    return _online_softmax_times(b, k, x, vt)


def shifted_key_join(keys: int = 256) -> Graph:
    """A key cache of ``keys`` - 1 columns and the new key's column, joined along the
    keys (codegen/joins.py, shifted): the cache's rows start anywhere in a 16-byte chunk
    (row q at element (keys - 1) q), the last iteration's tile holds the new column,
    which the chain reads from its own tensor (computed by the kernel before)."""
    b = GraphBuilder("shifted_key_join")
    q = b.input("Q", (2, 16, 64), "f16")
    kc, kn = b.input("KC", (2, 64, keys - 1), "f16"), b.input("KN", (2, 64, 1), "f16")
    kk = b.op("concat", kc, b.op("exp", kn), dim=2)
    v = b.input("V", (2, keys, 64), "f16")
    k = b.custom((2, 1, 1), 64, 4)
    qt = k.load(q, (0, None, None))          # (1, 16, 64)
    kt = k.load(kk, (0, None, None), 2)      # (1, 64, 64)
    vt = k.load(v, (0, None, None), 1)       # (1, 64, 64)
    x = k.op("mul_scalar", k.op("matmul", qt, kt), scalar=0.125)
    return _online_softmax_times(b, k, x, vt)


def shifted_key_join_long() -> Graph:
    """:func:`shifted_key_join` over 1024 keys: tiles of 256 columns, whose gather eight
    warps share (the planner's GATHER_WARPS_FACTOR)."""
    return shifted_key_join(1024)


def single_buffer_unaligned() -> Graph:
    """Tile rows that are not 16-byte multiples (no cp.async) and forloop 1."""
    b = GraphBuilder("single_buffer_unaligned")
    x = b.input("X", (6, 30), "f16")
    w = b.input("W", (30, 10), "f16")
    k = b.custom((2, 1, 1), 32, 1)
    xt = k.load(x, (0, None, None))
    wt = k.load(w)
    s = k.op("acc_sum", k.op("matmul", xt, wt))
    (o,) = k.finish([(k.op("rms_norm", s), "O", (0, None, None))])
    b.output(o)
    return b.build()


def warp_reductions() -> Graph:
    """Reductions long enough for warps: accumulators over the last dim and block
    reductions over the last and the first dimension."""
    b = GraphBuilder("warp_reductions")
    x = b.input("X", (8, 512), "f16")
    k = b.custom((2, 1, 1), 128, 4)
    xt = k.load(x, (0, None, None), 1)      # (4, 128)
    m = k.op("acc_max_ld", xt)
    r = k.op("acc_rms_ld", xt)
    s = k.op("acc_sum_ld", k.op("exp", k.op("mul_scalar", xt, scalar=0.25)))
    full = k.op("acc_sum", xt)              # (4, 128)
    c0 = k.op("sum", full, dim=0, keepdim=True)   # (1, 128)
    c1 = k.op("mean", full, dim=1, keepdim=True)  # (4, 1)
    q = k.op("rms", full, eps=1e-4)                # (4, 1)
    o = k.op("add", k.op("add", k.op("div", m, r), s), k.op("mul", c1, q))
    o2 = k.op("max", k.op("add", full, c0), dim=1, keepdim=True)
    outs = k.finish([(o, "O", (0, None, None)), (o2, "O2", (0, None, None))])
    for t in outs:
        b.output(t)
    return b.build()


def divide_by_mean() -> Graph:
    """A tile divided by its rows' mean, which the kernel stores as its reciprocal: the
    mean's ``sum / n`` must be inverted whole (it was once stored as ``1 / sum / n``)."""
    b = GraphBuilder("divide_by_mean")
    x = b.input("X", (8, 256), "f16")
    k = b.custom((2, 1, 1), 128, 2)
    xt = k.load(x, (0, None, None), 1)      # (4, 128)
    m = k.op("mean", k.op("exp", xt), dim=1, keepdim=True)
    s = k.op("acc_sum", k.op("div", xt, m))
    (o,) = k.finish([(s, "O", (0, None, None))])
    b.output(o)
    return b.build()


def mma_odd_shapes() -> Graph:
    """Tensor-core matmuls whose M, N, K are not multiples of the mma tile, batched
    with a broadcast operand, bf16; one into an accumulator, one materialized."""
    b = GraphBuilder("mma_odd_shapes")
    x = b.input("X", (3, 10, 80), "bf16")
    w = b.input("W", (80, 12), "bf16")
    k = b.custom((3, 1, 1), 64, 2)
    xt = k.load(x, (0, None, None), 2)      # (1, 10, 40)
    wt = k.load(w, (None, None, None), 0)   # (40, 12)
    p = k.op("matmul", xt, wt)              # (1, 10, 12)
    a = k.op("acc_sum", p)
    e = k.op("acc_max", k.op("exp", k.op("matmul", xt, wt)))
    (o,) = k.finish([(k.op("add", a, e), "O", (0, None, None))])
    b.output(o)
    return b.build()


def kernel_matmuls() -> Graph:
    """Kernel-level matmuls: lowered through generated block graphs (f16, bf16 with a
    broadcast batch) and through the f32 tiled kernel."""
    b = GraphBuilder("kernel_matmuls")
    a = b.input("A", (3, 32, 48), "f16")
    w = b.input("W", (48, 40), "f16")
    c = b.input("C", (1, 16, 64), "bf16")
    d = b.input("D", (4, 64, 24), "bf16")
    e = b.input("E", (5, 70), "f32")
    f = b.input("F", (70, 3), "f32")
    for o in (b.op("matmul", a, w), b.op("matmul", c, d), b.op("matmul", e, f)):
        b.output(o)
    return b.build()


def attention_chain() -> Graph:
    """A matmul chain planned into registers (chain=1): bf16, a scaled score plus a
    per-key bias (a loaded [1, n] tile), a per-row weight (an invariant [R, 1] tile),
    row accumulators of two different links (a sum of the exponentials and a max of
    the scores), 32 rows (two 16-row tiles), 2 forloop iterations; an epilogue that
    reads all three accumulators."""
    b = GraphBuilder("attention_chain")
    q = b.input("Q", (2, 32, 32), "bf16")
    kk = b.input("K", (2, 32, 64), "bf16")
    v = b.input("V", (2, 64, 16), "bf16")
    c = b.input("C", (2, 1, 64), "bf16")
    w = b.input("W", (2, 32, 1), "bf16")
    k = b.custom((2, 1, 1), 128, 2)
    qt = k.load(q, (0, None, None))          # (1, 32, 32)
    kt = k.load(kk, (0, None, None), 2)      # (1, 32, 32)
    vt = k.load(v, (0, None, None), 1)       # (1, 32, 16)
    ct = k.load(c, (0, None, None), 2)       # (1, 1, 32)
    wt = k.load(w, (0, None, None))          # (1, 32, 1)
    t = k.op("add", k.op("mul_scalar", k.op("matmul", qt, kt), scalar=0.125), ct)
    e = k.op("mul", k.op("exp", t), wt)
    total = k.op("acc_sum_ld", e)
    top = k.op("acc_max_ld", t)
    o = k.op("acc_sum", k.op("matmul", e, vt))
    (r,) = k.finish([(k.op("add", k.op("div", o, total), top), "O", (0, None, None))])
    b.output(r)
    return b.build()


def attention_chain_batched() -> Graph:
    """A matmul chain over a batch of two matrices per block, the first matmul's B
    broadcast over it (f16), split over two forloop iterations of 32 keys."""
    b = GraphBuilder("attention_chain_batched")
    q = b.input("Q", (4, 32, 32), "f16")
    kk = b.input("K", (1, 32, 64), "f16")
    v = b.input("V", (4, 64, 16), "f16")
    k = b.custom((2, 1, 1), 64, 2)
    qt = k.load(q, (0, None, None))          # (2, 32, 32)
    kt = k.load(kk, (None, None, None), 2)   # (1, 32, 32)
    vt = k.load(v, (0, None, None), 1)       # (2, 32, 16)
    e = k.op("exp", k.op("mul_scalar", k.op("matmul", qt, kt), scalar=0.25))
    o = k.op("acc_sum", k.op("matmul", e, vt))
    (r,) = k.finish([(k.op("div", o, k.op("acc_sum_ld", e)), "O", (0, None, None))])
    b.output(r)
    return b.build()


def online_softmax_chain() -> Graph:
    """A chain whose loop subtracts the row maximum over all its iterations (the
    online softmax, ``chain.Online``): f16, 32 rows, 4 iterations of 32 keys, the
    maximum of a scaled score plus a per-key bias, a per-row weight after the exp (a
    value linear in it, summed), and an epilogue that reads the final maximum too."""
    return _online_chain("online_softmax_chain", 32, 128)


def _online_chain(name: str, rows: int, threads: int) -> Graph:
    b = GraphBuilder(name)
    q = b.input("Q", (2, rows, 32), "f16")
    kk = b.input("K", (2, 32, 128), "f16")
    v = b.input("V", (2, 128, 16), "f16")
    c = b.input("C", (2, 1, 128), "f16")
    w = b.input("W", (2, rows, 1), "f16")
    k = b.custom((2, 1, 1), threads, 4)
    qt = k.load(q, (0, None, None))          # (1, rows, 32)
    kt = k.load(kk, (0, None, None), 2)      # (1, 32, 32)
    vt = k.load(v, (0, None, None), 1)       # (1, 32, 16)
    ct = k.load(c, (0, None, None), 2)       # (1, 1, 32)
    wt = k.load(w, (0, None, None))          # (1, rows, 1)
    x = k.op("add", k.op("mul_scalar", k.op("matmul", qt, kt), scalar=2.0), ct)
    top = k.op("acc_max_ld", x)
    e = k.op("mul", k.op("exp", k.op("sub", x, top)), wt)
    total = k.op("acc_sum_ld", e)
    o = k.op("acc_sum", k.op("matmul", e, vt))
    (r,) = k.finish([(k.op("add", k.op("div", o, total), top), "O", (0, None, None))])
    b.output(r)
    return b.build()


def online_softmax_batched() -> Graph:
    """The online softmax over a batch of two matrices per block (bf16), K broadcast
    over it, the maximum of the raw score, 8 iterations of 16 keys."""
    b = GraphBuilder("online_softmax_batched")
    q = b.input("Q", (4, 32, 32), "bf16")
    kk = b.input("K", (1, 32, 128), "bf16")
    v = b.input("V", (4, 128, 16), "bf16")
    k = b.custom((2, 1, 1), 128, 8)
    qt = k.load(q, (0, None, None))          # (2, 32, 32)
    kt = k.load(kk, (None, None, None), 2)   # (1, 32, 16)
    vt = k.load(v, (0, None, None), 1)       # (2, 16, 16)
    s = k.op("matmul", qt, kt)
    e = k.op("exp", k.op("sub", s, k.op("acc_max_ld", s)))
    o = k.op("acc_sum", k.op("matmul", e, vt))
    (r,) = k.finish([(k.op("div", o, k.op("acc_sum_ld", e)), "O", (0, None, None))])
    b.output(r)
    return b.build()


def short_rows_online_chain() -> Graph:
    """The online softmax chain with 4 rows a block (a decode GQA's query heads per KV
    head): one 16-row mma tile, its 12 padding rows read as zeros and never stored; a
    per-row weight (read at the last real row for the padding rows) and a per-key bias;
    f16, 4 iterations of 32 keys."""
    return _online_chain("short_rows_online_chain", 4, 64)


def short_rows_chain_4d() -> Graph:
    """A decode layer's attention as it writes it: 4-D tensors (batch, KV head, query
    head of the group, ...), a block taking one KV head of one batch element (two batch
    dimensions of size 1 in the tile), 4 rows, the running maximum; f16."""
    b = GraphBuilder("short_rows_chain_4d")
    q = b.input("Q", (2, 2, 4, 32), "f16")
    kk = b.input("K", (2, 2, 32, 64), "f16")
    v = b.input("V", (2, 2, 64, 16), "f16")
    k = b.custom((2, 2, 1), 64, 2)
    qt = k.load(q, (0, 1, None))             # (1, 1, 4, 32)
    kt = k.load(kk, (0, 1, None), 3)         # (1, 1, 32, 32)
    vt = k.load(v, (0, 1, None), 2)          # (1, 1, 32, 16)
    s = k.op("mul_scalar", k.op("matmul", qt, kt), scalar=0.25)
    e = k.op("exp", k.op("sub", s, k.op("acc_max_ld", s)))
    o = k.op("acc_sum", k.op("matmul", e, vt))
    (r,) = k.finish([(k.op("div", o, k.op("acc_sum_ld", e)), "O", (0, 1, None))])
    b.output(r)
    return b.build()


def short_rows_chain_batched() -> Graph:
    """A chain over a batch of two matrices of 7 rows per block (Qwen2's 7 query heads
    per KV head; each matrix its own padded 16-row tile), bf16, K broadcast, 2
    iterations of 32 keys."""
    b = GraphBuilder("short_rows_chain_batched")
    q = b.input("Q", (4, 7, 32), "bf16")
    kk = b.input("K", (1, 32, 64), "bf16")
    v = b.input("V", (4, 64, 16), "bf16")
    k = b.custom((2, 1, 1), 64, 2)
    qt = k.load(q, (0, None, None))          # (2, 7, 32)
    kt = k.load(kk, (None, None, None), 2)   # (1, 32, 32)
    vt = k.load(v, (0, None, None), 1)       # (2, 32, 16)
    e = k.op("exp", k.op("mul_scalar", k.op("matmul", qt, kt), scalar=0.25))
    o = k.op("acc_sum", k.op("matmul", e, vt))
    (r,) = k.finish([(k.op("div", o, k.op("acc_sum_ld", e)), "O", (0, None, None))])
    b.output(r)
    return b.build()


def split_combine() -> Graph:
    """The combine of a split over the keys, computed element by element
    (``codegen/direct.py``): per (batch, row), 8 splits' maxima and sums and their
    partial rows of 16 columns, with each split's maximum spread over its columns (as
    the search's online split writes them); the maximum over the splits, each split
    rescaled, summed down to the 16 columns and divided by the rescaled total; bf16, a
    grid over two axes, two outputs."""
    b = GraphBuilder("split_combine")
    m = b.input("M", (2, 8, 8), "bf16")
    l_ = b.input("L", (2, 8, 8), "bf16")
    o = b.input("O", (2, 8, 128), "bf16")
    ms = b.input("MS", (2, 8, 128), "bf16")
    k = b.custom((2, 4, 1), 64, 1)
    mt = k.load(m, (0, 1, None))             # (1, 2, 8)
    lt = k.load(l_, (0, 1, None))
    ot = k.load(o, (0, 1, None))             # (1, 2, 128)
    st = k.load(ms, (0, 1, None))
    top = k.op("max", mt, dim=2, keepdim=True)
    total = k.op("acc_sum_ld", k.op("mul", lt, k.op("exp", k.op("sub", mt, top))))
    part = k.op("mul", ot, k.op("exp", k.op("sub", st, top)))
    r = k.op("div", k.op("acc_sum_to", part, width=16), total)
    (y, z) = k.finish([(r, "Y", (0, 1, None)),
                       (k.op("mul", r, k.op("acc_sum", top)), "Z", (0, 1, None))])
    b.output(y)
    b.output(z)
    return b.build()


def row_total() -> Graph:
    """A direct kernel whose output is a per-row value (the rescaled total of a split's
    combine alone, ``[R, 1]``), from f32 partials."""
    b = GraphBuilder("row_total")
    m = b.input("M", (4, 16), "f32")
    l_ = b.input("L", (4, 16), "f32")
    k = b.custom((4, 1, 1), 128, 1)
    mt, lt = k.load(m, (0, None, None)), k.load(l_, (0, None, None))
    top = k.op("max", mt, dim=1, keepdim=True)
    total = k.op("acc_sum_ld", k.op("mul", lt, k.op("exp", k.op("sub", mt, top))))
    (y,) = k.finish([(total, "Y", (0, None, None))])
    b.output(y)
    return b.build()


def invariant_max_after_loop() -> Graph:
    """A reduction over a tile loaded once, with fewer results than threads, read only
    after the loop (the spread maximum ``0 * max(V)`` of mha_decode's batch-1 split):
    planned as a reduction over lanes into shared memory before the loop."""
    b = GraphBuilder("invariant_max_after_loop")
    q = b.input("Q", (2, 16, 32), "f16")
    kk = b.input("K", (2, 32, 128), "f16")
    v = b.input("V", (2, 64, 32), "f16")
    k = b.custom((2, 1, 1), 128, 4)
    qt = k.load(q, (0, None, None))          # (1, 16, 32)
    kt = k.load(kk, (0, None, None), 2)      # (1, 32, 32)
    vt = k.load(v, (0, None, None))          # (1, 64, 32), loaded once
    s = k.op("acc_sum", k.op("matmul", qt, kt))
    spread = k.op("add", k.op("mul_scalar", k.op("max", vt, dim=1, keepdim=True), scalar=0.5),
                  k.op("mul_scalar", vt, scalar=0.0))
    (r,) = k.finish([(k.op("add", s, k.op("sum", spread, dim=1, keepdim=True)), "O",
                      (0, None, None))])
    b.output(r)
    return b.build()


def invariant_after_loop() -> Graph:
    """LoRA as the search ships it: a pre-defined X @ A, then a kernel streaming W whose
    loop-invariant (X @ A) @ B only the epilogue reads. The invariant reads the first
    kernel's output and the loop reads only inputs, so the kernel runs its loop before
    its grid-dependency wait and the invariant after it (``FusedKernel.defer``)."""
    b = GraphBuilder("invariant_after_loop")
    x = b.input("X", (16, 64), "f16")
    w = b.input("W", (64, 128), "f16", weight=True)
    a = b.input("A", (64, 16), "f16", weight=True)
    bb = b.input("B", (16, 128), "f16", weight=True)
    t0 = b.op("matmul", x, a)
    k = b.custom((2, 1, 1), 128, 4)
    xt = k.load(x, (None, None, None), 1)     # (16, 16) a step
    wt = k.load(w, (1, None, None), 0)        # (16, 64) a step
    bt = k.load(bb, (1, None, None))          # (16, 64), loaded once
    tt = k.load(t0)                           # (16, 16), the first kernel's
    s = k.op("acc_sum", k.op("matmul", xt, wt))
    (y,) = k.finish([(k.op("add", k.op("matmul", tt, bt), s), "Y", (1, None, None))])
    b.output(y)
    return b.build()


CASES: dict[str, Callable[[], Graph]] = {f.__name__: f for f in (
    split_combine, row_total, invariant_max_after_loop, invariant_after_loop,
    attention_chain, attention_chain_batched, online_softmax_chain, online_softmax_batched,
    short_rows_online_chain, short_rows_chain_batched, short_rows_chain_4d,
    rmsnorm_linear_small, unswizzled_weight_boxes, shallower_grouped_ring,
    resized_grouped_member,
    weighted_norm_uneven_tiles, two_row_tiles, bf16_kernel_ops, f32_block_ops, big_tiles_scratch, passthrough,
    reshape_aliases, grouped_launches, joined_concats, joined_beside_bulk,
    shifted_key_join, shifted_key_join_long,
    single_buffer_unaligned, warp_reductions, divide_by_mean, mma_odd_shapes, kernel_matmuls)}
