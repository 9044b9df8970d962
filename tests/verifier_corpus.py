"""The soundness corpus of the verifier: equivalent pairs and non-equivalent mutants,
built with the GraphBuilder (small shapes, so the whole corpus runs in seconds).

Each entry is ``(name, build_a, build_b)``; both builders return a Graph with the same
inputs and outputs by position.
"""

from __future__ import annotations

from collections.abc import Callable

from mirage_cli.builder import GraphBuilder
from mirage_cli.ir import Graph

Build = Callable[[], Graph]
R = (None, None, None)


def prog(name: str, shapes: dict[str, tuple[int, ...]], body: Callable[..., object]) -> Build:
    """A graph with f32 inputs ``shapes`` (in order) whose outputs ``body`` returns."""
    def build() -> Graph:
        b = GraphBuilder(name)
        ins = [b.input(n, s, "f32") for n, s in shapes.items()]
        outs = body(b, *ins)
        for o in outs if isinstance(outs, tuple) else (outs,):
            b.output(o)
        return b.build()
    return build


# -- building blocks ----------------------------------------------------------------

def rmsnorm_fused(grid: int = 4, forloop: int = 4, w_imap: int = 1, x_fmap: int = 1,
                  w_fmap: int = 0, acc: str = "acc_rms_ld", omap: int = 1,
                  acc_mm: str = "acc_sum", swap: bool = False) -> Callable[..., str]:
    """Z = rms_norm(X) @ W as one kernel (X: 8x64, W: 64x64)."""
    def body(b: GraphBuilder, x: str, w: str) -> str:
        k = b.custom((grid, 1, 1), 128, forloop)
        xt = k.load(x, R, x_fmap)
        wt = k.load(w, (w_imap, None, None), w_fmap)
        r = k.op(acc, xt)
        mm = k.op("matmul", wt, xt) if swap else k.op("matmul", xt, wt)
        s = k.op(acc_mm, mm)
        (z,) = k.finish([(k.op("div", s, r), None, (omap, None, None))])
        return z
    return body


def rmsnorm_program(b: GraphBuilder, x: str, w: str) -> str:
    return b.op("matmul", b.op("rms_norm", x), w)


def matmul_fused(grid: tuple[int, int, int], forloop: int, x_imap: tuple, w_imap: tuple,
                 omap: tuple, x_fmap: int | None = 1, w_fmap: int | None = 0
                 ) -> Callable[..., str]:
    """O = X @ W as one kernel, tiled by the given maps."""
    def body(b: GraphBuilder, x: str, w: str) -> str:
        k = b.custom(grid, 128, forloop)
        xt = k.load(x, x_imap, x_fmap)
        wt = k.load(w, w_imap, w_fmap)
        (o,) = k.finish([(k.op("acc_sum", k.op("matmul", xt, wt)), None, omap)])
        return o
    return body


def tiled_product(grid: tuple[int, int, int] = (2, 2, 1), forloop: int = 1,
                  x_imap: tuple = (0, 1, None), y_imap: tuple = (0, 1, None),
                  x_fmap: int | None = None, y_fmap: int | None = None,
                  omap: tuple = (0, 1, None)) -> Callable[..., str]:
    """acc_sum(X * Y) over the forloop, tiled by the given maps (X, Y: 8x8)."""
    def body(b: GraphBuilder, x: str, y: str) -> str:
        k = b.custom(grid, 128, forloop)
        xt = k.load(x, x_imap, x_fmap)
        yt = k.load(y, y_imap, y_fmap)
        (o,) = k.finish([(k.op("acc_sum", k.op("mul", xt, yt)), None, omap)])
        return o
    return body


def softmax_online(rescale: bool = True) -> Callable[..., str]:
    """softmax(x, dim=1) of X: 4x32 in two chunks (grid.x over columns): each block
    computes its chunk's max m_j and s_j = sum exp(x - m_j); the kernel level then
    rescales: M = max_j m_j, S = sum_j s_j exp(m_j - M), out = exp(x - M) / S."""
    def body(b: GraphBuilder, x: str) -> str:
        k = b.custom((2, 1, 1), 128, 1)
        xt = k.load(x, (1, None, None), None)
        m = k.op("acc_max_ld", xt)
        e = k.op("exp", k.op("sub", xt, m))
        s = k.op("sum", e, dim=1, keepdim=True)
        mp, sp = k.finish([(m, "MP", (1, None, None)), (s, "SP", (1, None, None))])
        big = b.op("max", mp, dim=1, keepdim=True)
        scale = b.op("exp", b.op("sub", mp, big)) if rescale else mp
        total = b.op("sum", b.op("mul", sp, scale), dim=1, keepdim=True)
        return b.op("div", b.op("exp", b.op("sub", x, big)), total)
    return body


def softmax_plain(b: GraphBuilder, x: str) -> str:
    return b.op("softmax", x, dim=1)


def softmax_max_shift(b: GraphBuilder, x: str) -> str:
    e = b.op("exp", b.op("sub", x, b.op("max", x, dim=1, keepdim=True)))
    return b.op("div", e, b.op("sum", e, dim=1, keepdim=True))


def gqa_program(b: GraphBuilder, q: str, k: str, v: str) -> str:
    e = b.op("exp", b.op("matmul", q, k))
    return b.op("matmul", b.op("div", e, b.op("sum", e, dim=2, keepdim=True)), v)


def gqa_fused(divide: bool = True) -> Callable[..., str]:
    """Q (2,8,16), K (2,16,64), V (2,64,16): the flash-decoding pair of kernels."""
    def body(b: GraphBuilder, q: str, k: str, v: str) -> str:
        k1 = b.custom((2, 4, 2), 128, 2)
        qt = k1.load(q, (0, None, 1), None)
        kt = k1.load(k, (0, 2, None), 2)
        vt = k1.load(v, (0, 1, None), 1)
        e = k1.op("exp", k1.op("matmul", qt, kt))
        lp, op = k1.finish([(k1.op("acc_sum_ld", e), "LP", (0, 2, 1)),
                            (k1.op("acc_sum", k1.op("matmul", e, vt)), "OP", (0, 2, 1))])
        k2 = b.custom((2, 2, 1), 128, 1)
        lt = k2.load(lp, (0, 1, None), None)
        ot = k2.load(op, (0, 1, None), None)
        l_ = k2.op("acc_sum_ld", lt)
        o = k2.op("acc_sum_to", ot, width=16)
        r = k2.op("div", o, l_) if divide else o
        (out,) = k2.finish([(r, None, (0, 1, None))])
        return out
    return body


def gated_mlp_program(act: str = "silu") -> Callable[..., str]:
    def body(b: GraphBuilder, x: str, w1: str, w2: str) -> str:
        return b.op("mul", b.op(act, b.op("matmul", x, w1)), b.op("matmul", x, w2))
    return body


def gated_mlp_fused(act: str = "silu", swap: bool = False) -> Callable[..., str]:
    def body(b: GraphBuilder, x: str, w1: str, w2: str) -> str:
        k = b.custom((4, 1, 1), 128, 4)
        xt = k.load(x, R, 1)
        a = k.load(w1, (1, None, None), 0)
        c = k.load(w2, (1, None, None), 0)
        if swap:
            a, c = c, a
        s1 = k.op("acc_sum", k.op("matmul", xt, a))
        s2 = k.op("acc_sum", k.op("matmul", xt, c))
        (o,) = k.finish([(k.op("mul", k.op(act, s1), s2), None, (1, None, None))])
        return o
    return body


def lora_program(b: GraphBuilder, x: str, w: str, a: str, bb: str) -> str:
    return b.op("add", b.op("matmul", x, w), b.op("matmul", b.op("matmul", x, a), bb))


def lora_concat(drop_b: bool = False) -> Callable[..., str]:
    def body(b: GraphBuilder, x: str, w: str, a: str, bb: str) -> str:
        xa = b.op("matmul", x, a)
        left = b.op("concat", x, xa, dim=1)
        right = b.op("concat", w, b.op("mul_scalar", bb, scalar=0.0) if drop_b else bb,
                     dim=0)
        return b.op("matmul", left, right)
    return body


def ntrans_program(order: str = "ok") -> Callable[..., str]:
    def body(b: GraphBuilder, h: str, x: str, alpha: str) -> str:
        a = b.op("add", b.op("rms_norm", h), x)
        bb = b.op("mul", alpha, a) if order == "ok" else b.op("add", alpha, a)
        return b.op("rms_norm", b.op("add", x, bb))
    return body


def ntrans_fused(b: GraphBuilder, h: str, x: str, alpha: str) -> str:
    """Two kernels: rms of H per row, then everything else (rows over grid.x)."""
    k = b.custom((4, 1, 1), 128, 1)
    ht = k.load(h, (0, None, None), None)
    xt = k.load(x, (0, None, None), None)
    at = k.load(alpha, (0, None, None), None)
    r = k.op("acc_rms_ld", ht)
    a = k.op("add", k.op("div", ht, r), xt)
    c = k.op("add", xt, k.op("mul", at, a))
    (cc,) = k.finish([(c, "C", (0, None, None))])
    return b.op("rms_norm", cc)


S88 = {"X": (8, 8), "W": (8, 8)}
XW = {"X": (8, 64), "W": (64, 64)}
X432 = {"X": (4, 32)}
ABC = {"A": (4, 8), "B": (4, 8), "C": (4, 8)}
GQA = {"Q": (2, 8, 16), "K": (2, 16, 64), "V": (2, 64, 16)}
MLP = {"X": (8, 32), "W1": (32, 32), "W2": (32, 32)}
LORA = {"X": (4, 16), "W": (16, 32), "A": (16, 4), "B": (4, 32)}
NT = {"H": (8, 32), "X": (8, 32), "alpha": (8, 32)}


EQUIVALENT: list[tuple[str, Build, Build]] = [
    ("distributivity", prog("a", ABC, lambda b, x, y, z: b.op("mul", b.op("add", x, y), z)),
     prog("b", ABC, lambda b, x, y, z: b.op("add", b.op("mul", x, z), b.op("mul", y, z)))),
    ("matmul distributes over add", prog("a", {"X": (4, 8), "U": (8, 6), "V": (8, 6)},
     lambda b, x, u, v: b.op("matmul", x, b.op("add", u, v))),
     prog("b", {"X": (4, 8), "U": (8, 6), "V": (8, 6)},
     lambda b, x, u, v: b.op("add", b.op("matmul", x, u), b.op("matmul", x, v)))),
    ("matmul associativity", prog("a", {"X": (4, 8), "U": (8, 6), "V": (6, 5)},
     lambda b, x, u, v: b.op("matmul", b.op("matmul", x, u), v)),
     prog("b", {"X": (4, 8), "U": (8, 6), "V": (6, 5)},
     lambda b, x, u, v: b.op("matmul", x, b.op("matmul", u, v)))),
    ("scale moved through matmul", prog("a", S88, lambda b, x, w: b.op(
        "mul_scalar", b.op("matmul", x, w), scalar=0.125)),
     prog("b", S88, lambda b, x, w: b.op("matmul", x, b.op("mul_scalar", w, scalar=0.125)))),
    ("rmsnorm: division after the matmul", prog("a", XW, rmsnorm_program),
     prog("b", XW, lambda b, x, w: b.op("div", b.op("matmul", x, w), b.op("rms", x)))),
    ("rmsnorm fused kernel", prog("a", XW, rmsnorm_program), prog("b", XW, rmsnorm_fused())),
    ("rmsnorm forloop 1 vs 4", prog("a", XW, rmsnorm_fused(forloop=1)),
     prog("b", XW, rmsnorm_fused(forloop=4))),
    ("rmsnorm forloop 2 vs 8", prog("a", XW, rmsnorm_fused(forloop=2)),
     prog("b", XW, rmsnorm_fused(forloop=8))),
    ("rmsnorm grid 1 vs 8", prog("a", XW, rmsnorm_fused(grid=1)),
     prog("b", XW, rmsnorm_fused(grid=8))),
    ("rms_norm with weight, division after the matmul",
     prog("a", {"X": (4, 16), "G": (16,), "W": (16, 8)},
          lambda b, x, g, w: b.op("matmul", b.op("rms_norm", x, g), w)),
     prog("b", {"X": (4, 16), "G": (16,), "W": (16, 8)},
          lambda b, x, g, w: b.op("div", b.op("matmul", b.op("mul", x, g), w),
                                  b.op("rms", x)))),
    ("rms_norm with eps as x / rms(x, eps)", prog("a", X432, lambda b, x: b.op(
        "rms_norm", x, eps=1e-5)),
     prog("b", X432, lambda b, x: b.op("div", x, b.op("rms", x, eps=1e-5)))),
    ("softmax decomposed", prog("a", X432, softmax_plain),
     prog("b", X432, lambda b, x: b.op("div", b.op("exp", x), b.op(
         "sum", b.op("exp", x), dim=1, keepdim=True)))),
    ("softmax with max subtraction", prog("a", X432, softmax_plain),
     prog("b", X432, softmax_max_shift)),
    ("online softmax with max rescaling", prog("a", X432, softmax_plain),
     prog("b", X432, softmax_online())),
    ("gqa flash decoding", prog("a", GQA, gqa_program), prog("b", GQA, gqa_fused())),
    ("matmul: grid over W columns vs X rows",
     prog("a", S88, matmul_fused((2, 1, 1), 2, R, (1, None, None), (1, None, None))),
     prog("b", S88, matmul_fused((2, 1, 1), 2, (0, None, None), R, (0, None, None)))),
    ("matmul: 2D grid vs one block", prog("a", S88, matmul_fused((1, 1, 1), 1, R, R, R)),
     prog("b", S88, matmul_fused((2, 4, 1), 2, (0, None, None), (None, 1, None),
                                 (0, 1, None)))),
    ("matmul: forloop over K vs no forloop",
     prog("a", S88, matmul_fused((2, 1, 1), 4, R, (1, None, None), (1, None, None))),
     prog("b", S88, matmul_fused((2, 1, 1), 1, R, (1, None, None), (1, None, None),
                                 None, None))),
    ("matmul kernel vs kernel operator", prog("a", S88, lambda b, x, w: b.op("matmul", x, w)),
     prog("b", S88, matmul_fused((4, 1, 1), 2, (0, None, None), R, (0, None, None)))),
    ("LoRA concatenated", prog("a", LORA, lora_program), prog("b", LORA, lora_concat())),
    ("gated MLP fused", prog("a", MLP, gated_mlp_program()), prog("b", MLP, gated_mlp_fused())),
    ("nTrans fused", prog("a", NT, ntrans_program()), prog("b", NT, ntrans_fused)),
    ("mean is sum times 1/n", prog("a", X432, lambda b, x: b.op("mean", x, dim=1)),
     prog("b", X432, lambda b, x: b.op("mul_scalar", b.op("sum", x, dim=1), scalar=1 / 32))),
    ("acc_mean_ld vs kernel mean", prog("a", X432, lambda b, x: b.op(
        "mean", x, dim=1, keepdim=True)),
     prog("b", X432, lambda b, x: _one_kernel(b, x, "acc_mean_ld", 4))),
    ("acc_max_ld vs kernel max", prog("a", X432, lambda b, x: b.op(
        "max", x, dim=1, keepdim=True)),
     prog("b", X432, lambda b, x: _one_kernel(b, x, "acc_max_ld", 4))),
    ("acc_sum_ld forloop 1 vs 8", prog("a", X432, lambda b, x: _one_kernel(b, x, "acc_sum_ld", 1)),
     prog("b", X432, lambda b, x: _one_kernel(b, x, "acc_sum_ld", 8))),
    ("subtracting a negation", prog("a", ABC, lambda b, x, y, z: b.op(
        "add", b.op("add", x, y), z)),
     prog("b", ABC, lambda b, x, y, z: b.op("sub", b.op("add", x, y), b.op("neg", z)))),
    ("square is x*x", prog("a", ABC, lambda b, x, y, z: b.op("add", b.op("square", x), y)),
     prog("b", ABC, lambda b, x, y, z: b.op("add", b.op("mul", x, x), y))),
    ("rsqrt is 1/sqrt", prog("a", ABC, lambda b, x, y, z: b.op("mul", y, b.op(
        "rsqrt", b.op("square", x)))),
     prog("b", ABC, lambda b, x, y, z: b.op("div", y, b.op("sqrt", b.op("square", x))))),
    ("division chains", prog("a", ABC, lambda b, x, y, z: b.op("div", b.op("div", x, y), z)),
     prog("b", ABC, lambda b, x, y, z: b.op("div", x, b.op("mul", y, z)))),
    ("exp of a sum", prog("a", ABC, lambda b, x, y, z: b.op("exp", b.op("add", x, y))),
     prog("b", ABC, lambda b, x, y, z: b.op("mul", b.op("exp", x), b.op("exp", y)))),
    ("relu under a fused matmul", prog("a", S88, lambda b, x, w: b.op(
        "relu", b.op("matmul", x, w))),
     prog("b", S88, lambda b, x, w: _relu_kernel(b, x, w))),
    ("silu commutes with a row split", prog("a", X432, lambda b, x: b.op("silu", x)),
     prog("b", X432, lambda b, x: _ew_kernel(b, x, "silu"))),
]


def _one_kernel(b: GraphBuilder, x: str, acc: str, forloop: int) -> str:
    k = b.custom((2, 1, 1), 128, forloop)
    xt = k.load(x, (0, None, None), 1)
    (o,) = k.finish([(k.op(acc, xt), None, (0, None, None))])
    return o


def _relu_kernel(b: GraphBuilder, x: str, w: str) -> str:
    k = b.custom((2, 1, 1), 128, 2)
    xt = k.load(x, R, 1)
    wt = k.load(w, (1, None, None), 0)
    s = k.op("acc_sum", k.op("matmul", xt, wt))
    (o,) = k.finish([(k.op("relu", s), None, (1, None, None))])
    return o


def _ew_kernel(b: GraphBuilder, x: str, op: str) -> str:
    k = b.custom((4, 1, 1), 128, 1)
    xt = k.load(x, (0, None, None), None)
    (o,) = k.finish([(k.op("acc_sum", k.op(op, xt)), None, (0, None, None))])
    return o


NOT_EQUIVALENT: list[tuple[str, Build, Build]] = [
    ("wrong imap", prog("a", S88, tiled_product()),
     prog("b", S88, tiled_product(y_imap=(1, 0, None)))),
    ("wrong fmap", prog("a", S88, tiled_product((2, 1, 1), 2, (0, None, None),
                                                (0, None, None), 1, 1, (0, None, None))),
     prog("b", S88, tiled_product((2, 1, 1), 2, (0, None, None), (1, None, None), 1, 0,
                                  (0, None, None)))),
    ("wrong omap", prog("a", S88, tiled_product()),
     prog("b", S88, tiled_product(omap=(1, 0, None)))),
    ("wrong accumulator: acc_mean for acc_sum", prog("a", XW, rmsnorm_fused()),
     prog("b", XW, rmsnorm_fused(acc_mm="acc_mean"))),
    ("wrong accumulator: acc_mean_ld for acc_rms_ld", prog("a", XW, rmsnorm_fused()),
     prog("b", XW, rmsnorm_fused(acc="acc_mean_ld"))),
    ("wrong accumulator: acc_max_ld for acc_sum_ld",
     prog("a", X432, lambda b, x: _one_kernel(b, x, "acc_sum_ld", 4)),
     prog("b", X432, lambda b, x: _one_kernel(b, x, "acc_max_ld", 4))),
    ("swapped matmul operands", prog("a", S88, lambda b, x, w: b.op("matmul", x, w)),
     prog("b", S88, lambda b, x, w: b.op("matmul", w, x))),
    ("swapped matmul operands in a kernel", prog("a", S88, rmsnorm_fused(grid=1, forloop=1)),
     prog("b", S88, rmsnorm_fused(grid=1, forloop=1, swap=True))),
    ("missing scale", prog("a", S88, lambda b, x, w: b.op(
        "mul_scalar", b.op("matmul", x, w), scalar=0.125)),
     prog("b", S88, lambda b, x, w: b.op("matmul", x, w))),
    ("wrong scale", prog("a", S88, lambda b, x, w: b.op("mul_scalar", x, scalar=0.125)),
     prog("b", S88, lambda b, x, w: b.op("mul_scalar", x, scalar=0.12))),
    ("off-by-one dimension", prog("a", S88, lambda b, x, w: b.op("sum", x, dim=0)),
     prog("b", S88, lambda b, x, w: b.op("sum", x, dim=1))),
    ("softmax over the wrong dimension", prog("a", S88, lambda b, x, w: b.op(
        "softmax", x, dim=0)), prog("b", S88, lambda b, x, w: b.op("softmax", x, dim=1))),
    ("silu <-> relu", prog("a", MLP, gated_mlp_program()),
     prog("b", MLP, gated_mlp_fused("relu"))),
    ("silu <-> gelu", prog("a", MLP, gated_mlp_program()),
     prog("b", MLP, gated_mlp_program("gelu"))),
    ("gated MLP: activation on the wrong branch", prog("a", MLP, gated_mlp_program()),
     prog("b", MLP, gated_mlp_fused(swap=True))),
    ("exp dropped", prog("a", X432, softmax_plain),
     prog("b", X432, lambda b, x: b.op("div", x, b.op("sum", x, dim=1, keepdim=True)))),
    ("eps dropped", prog("a", X432, lambda b, x: b.op("rms_norm", x, eps=1e-5)),
     prog("b", X432, lambda b, x: b.op("rms_norm", x))),
    ("rms_norm weight dropped", prog("a", {"X": (4, 16), "G": (16,)},
                                     lambda b, x, g: b.op("rms_norm", x, g)),
     prog("b", {"X": (4, 16), "G": (16,)}, lambda b, x, g: b.op("mul_scalar", b.op(
         "rms_norm", x), scalar=1.0))),
    ("online softmax without rescaling", prog("a", X432, softmax_plain),
     prog("b", X432, softmax_online(rescale=False))),
    ("max shift missing in the denominator", prog("a", X432, softmax_plain),
     prog("b", X432, lambda b, x: b.op("div", b.op("exp", b.op(
         "sub", x, b.op("max", x, dim=1, keepdim=True))), b.op(
         "sum", b.op("exp", x), dim=1, keepdim=True)))),
    ("gqa: division dropped", prog("a", GQA, gqa_program), prog("b", GQA, gqa_fused(False))),
    ("LoRA: B term dropped", prog("a", LORA, lora_program),
     prog("b", LORA, lora_concat(drop_b=True))),
    ("nTrans: add for mul", prog("a", NT, ntrans_program()), prog("b", NT, ntrans_program("x"))),
    ("sub operands swapped", prog("a", ABC, lambda b, x, y, z: b.op("sub", x, y)),
     prog("b", ABC, lambda b, x, y, z: b.op("sub", y, x))),
    ("div operands swapped", prog("a", ABC, lambda b, x, y, z: b.op("div", x, y)),
     prog("b", ABC, lambda b, x, y, z: b.op("div", y, x))),
    ("sqrt for rsqrt", prog("a", ABC, lambda b, x, y, z: b.op("rsqrt", b.op("square", x))),
     prog("b", ABC, lambda b, x, y, z: b.op("sqrt", b.op("square", x)))),
    ("exp of a sum is not a sum of exps", prog("a", ABC, lambda b, x, y, z: b.op(
        "exp", b.op("add", x, y))),
     prog("b", ABC, lambda b, x, y, z: b.op("add", b.op("exp", x), b.op("exp", y)))),
    ("mean for sum", prog("a", X432, lambda b, x: b.op("mean", x, dim=1)),
     prog("b", X432, lambda b, x: b.op("sum", x, dim=1))),
    ("max for sum", prog("a", X432, lambda b, x: b.op("max", x, dim=1)),
     prog("b", X432, lambda b, x: b.op("sum", x, dim=1))),
    ("concat order", prog("a", ABC, lambda b, x, y, z: b.op("concat", x, y, dim=1)),
     prog("b", ABC, lambda b, x, y, z: b.op("concat", y, x, dim=1))),
    ("distributivity half applied", prog("a", ABC, lambda b, x, y, z: b.op(
        "mul", b.op("add", x, y), z)),
     prog("b", ABC, lambda b, x, y, z: b.op("add", b.op("mul", x, z), y))),
    ("rmsnorm: rms of the squares", prog("a", XW, rmsnorm_fused()),
     prog("b", XW, lambda b, x, w: b.op("div", b.op("matmul", x, w),
                                        b.op("rms", b.op("square", x))))),
    ("relu dropped in a fused kernel", prog("a", S88, lambda b, x, w: b.op(
        "relu", b.op("matmul", x, w))),
     prog("b", S88, matmul_fused((2, 1, 1), 2, R, (1, None, None), (1, None, None)))),
]
