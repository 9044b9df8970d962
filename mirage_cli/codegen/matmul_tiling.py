"""How a pre-defined ``matmul`` is tiled: the block graph it lowers to, chosen by the
cost model.

A pre-defined matmul (in the unfused lowering, and beside custom kernels in a mixed
µGraph) runs as a generated custom kernel: the grid splits the output's columns (x),
its rows or a batch dimension (y) and a batch dimension (z); the forloop runs over K;
each block accumulates ``acc_sum(matmul(a, b))``. That is the form the search finds
for a matmul on its own, so a pre-defined matmul gets the fused path's tensor cores,
vector copies and pipelines. Which column width and K tile it uses is decided here
by the cost model over every legal pair, not by a
fixed rule: a decode projection (a few rows, a weight of tens of MB) wants about one
block per SM and long K tiles, a prefill matmul many 64-row tiles.

The choice among :func:`candidates` is the cost model's
(:func:`mirage_cli.search.cost.lowered`), and the model costs a pre-defined matmul as
the kernel it chose, so the search compares its designs with what the pre-defined
operator really runs (a library-style estimate once ranked a 2-block custom kernel,
465 µs on an H200, above a pre-defined matmul it predicted at 368 µs and that ran 28).
This module only enumerates and builds; it does not import the model.
"""

from __future__ import annotations

from mirage_cli.check import check_block, tile_type
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import (
    AxisMap,
    BlockGraph,
    BlockInput,
    BlockOp,
    BlockOutput,
    DType,
    KernelOp,
    TensorType,
    Value,
)
from mirage_cli.ops import infer_matmul

# Rows of one block's output tile (more rows are split over grid.y).
MAX_ROWS = 64
# Column widths are multiples of 8 elements (16-byte rows of an f16 tile, so tiles are
# copied with vector loads) up to this width.
MAX_COLS = 256
# K tiles (elements of K per iteration), multiples of the tensor-core K step.
K_TILES = (16, 32, 64, 128, 256, 512)
THREADS = 128


def candidates(kop: KernelOp, types: dict[str, TensorType]
               ) -> list[tuple[tuple[int, int], KernelOp]]:
    """Every custom kernel ``kop`` (a pre-defined matmul) may lower to, with its
    (column width, K tile); none when the matmul is not one this form takes (not
    f16/bf16, more than two batch dimensions, shapes that do not tile): such a matmul
    runs the scalar tiled kernel instead."""
    a, b = kop.inputs
    if kop.op != "matmul" or kop.block is not None or a == b:
        return []
    out = []
    for bn, bk in _sizes(types[a], types[b], kop.outputs[0].type):
        op = build(kop, types, bn, bk)
        if op is not None:
            out.append(((bn, bk), op))
    return out


def _maps(ta: TensorType, tb: TensorType, tc: TensorType, split_rows: bool
          ) -> tuple[AxisMap, AxisMap, AxisMap] | None:
    """imaps of A and B and the omap: x over N, y over M (``split_rows``) or the last
    batch dimension, z over the first batch dimension. A batch dimension of size 1 in
    an operand is broadcast (not mapped)."""
    nb = tc.rank - 2
    if nb > 2 or (nb == 2 and split_rows):
        return None
    batch_axes = {2: 0} if nb == 1 else ({1: 1, 2: 0} if nb == 2 else {})

    def operand(t: TensorType, x: int | None, y: int | None) -> AxisMap:
        m: list[int | None] = [x, y, None]
        off = t.rank - tc.rank  # operands may have fewer batch dimensions
        for axis, d in batch_axes.items():
            if d + off >= 0 and t.shape[d + off] > 1:
                m[axis] = d + off
        return (m[0], m[1], m[2])

    rows = tc.rank - 2 if split_rows else None
    im_a = operand(ta, None, ta.rank - 2 if split_rows else None)
    im_b = operand(tb, tb.rank - 1, None)
    om: list[int | None] = [tc.rank - 1, rows, None]
    for axis, d in batch_axes.items():
        if tc.shape[d] > 1:
            om[axis] = d
    return im_a, im_b, (om[0], om[1], om[2])


def _grid(tc: TensorType, omap: AxisMap, bm: int, bn: int) -> tuple[int, int, int]:
    sizes = []
    for axis, d in enumerate(omap):
        if d is None:
            sizes.append(1)
        elif axis == 0:
            sizes.append(tc.shape[d] // bn)
        elif d == tc.rank - 2:
            sizes.append(tc.shape[d] // bm)
        else:
            sizes.append(tc.shape[d])
    return sizes[0], sizes[1], sizes[2]


def build(kop: KernelOp, types: dict[str, TensorType], bn: int, bk: int
           ) -> KernelOp | None:
    a, b = kop.inputs
    ta, tb, tc = types[a], types[b], kop.outputs[0].type
    M, K = ta.shape[-2], ta.shape[-1]
    bm = min(M, MAX_ROWS)
    maps = _maps(ta, tb, tc, M > bm)
    if maps is None:
        return None
    im_a, im_b, omap = maps
    grid = _grid(tc, omap, bm, bn)
    forloop = K // bk
    try:
        at = tile_type(ta, grid, forloop, im_a, ta.rank - 1)
        bt = tile_type(tb, grid, forloop, im_b, tb.rank - 2)
        mt = infer_matmul([at, bt], {})
        bg = BlockGraph(grid, THREADS, forloop,
                        (BlockInput(Value("a", at), a, im_a, ta.rank - 1),
                         BlockInput(Value("b", bt), b, im_b, tb.rank - 2)),
                        (BlockOp("matmul", ("a", "b"), (Value("m", mt),)),
                         BlockOp("acc_sum", ("m",), (Value("s", mt),))),
                        (BlockOutput(kop.outputs[0], "s", omap),))
        check_block(bg, types)
    except MirageError:
        return None
    return KernelOp("custom", (a, b), kop.outputs, (), bg)


def _sizes(ta: TensorType, tb: TensorType, tc: TensorType) -> list[tuple[int, int]]:
    """Every legal (column width, K tile): widths are multiples of 8 dividing N (N
    itself when N is narrower than 8), K tiles divide K."""
    M, K, N = ta.shape[-2], ta.shape[-1], tb.shape[-1]
    if tc.dtype not in (DType.F16, DType.BF16) or M % min(M, MAX_ROWS):
        return []
    widths = [w for w in range(8, min(N, MAX_COLS) + 1, 8) if N % w == 0] or (
        [N] if N < 8 else [])
    ktiles = [k for k in K_TILES if K % k == 0 and k <= K]
    return [(w, k) for w in widths for k in ktiles]
