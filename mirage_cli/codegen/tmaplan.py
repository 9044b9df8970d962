"""Bulk tensor copies (TMA, sm_90): which loop inputs a plan brings into shared memory
with them, their boxes and swizzle (the shared-memory address of an element of such a
tile is ``expr.swizzled_address``, which every reader uses).

A 16-byte ``cp.async`` stream tops out at about 33 GB/s per SM on an H100 or H200
whatever its depth, while one ``cp.async.bulk.tensor`` per stage, issued by one thread,
reads at about 63 GB/s per SM (``tools/stream_probe.py``, docs/perf-log.md v19). On an
H200, 128 blocks at 33 GB/s are exactly its DRAM bandwidth, so any other traffic of a
streaming matmul (the shared operand, its mma work) came out of the weight stream.

A tile qualifies when it is a loop input staged in shared memory, read only as an mma
operand through ``ldmatrix`` or ``wgmma`` (or, for a wgmma chain's B1, by its column
statistics through the expression engine, layout._side_read), of a
16-bit dtype, whose device tensor has rank 2 to 5 with 16-byte row strides, and whose
rows (all dimensions but the last, flattened) are a multiple of 8 and whose dimensions
fit a box (at most 256 each). The tile is copied as boxes of ``swizzle`` bytes per row
(the largest of 128, 64, 32 that divides its row), side by side along the row: box
``b`` holds bytes ``b * swizzle ..`` of every row, rows ``swizzle`` bytes apart, with the
hardware's XOR swizzle of 16-byte chunks, so that the eight rows one ``ldmatrix`` reads
fall in distinct banks. A row of an odd number of 16-byte chunks (3 or more, at most
256 elements: 48, 80, 112, ... bytes) has no span that divides it; it is one box, the
whole row, unswizzled (``swizzle`` is then the row's bytes): rows an odd number of
chunks apart fall in distinct banks as they are, as a cp.async tile's unpadded rows
do. Each pipeline stage's slot is a multiple of 1024 bytes and starts 1024-aligned, as
the swizzle pattern needs.
"""

from __future__ import annotations

from mirage_cli.codegen.expr import row_major
from mirage_cli.codegen.plan import SWIZZLE_SPANS, TMAP_DTYPES, TensorMapSpec
from mirage_cli.ir import BlockInput, TensorType

# The narrowest unswizzled box row: three chunks. Boxes of 32-byte rows already stream
# slower than wider ones (the profile's narrow_box_slowdown); 16-byte ones stay cp.async.
MIN_PLAIN_ROW = 48
ALIGN = 1024              # slot alignment: the 128-byte swizzle repeats every 1024 bytes
MAX_BOX = 256             # elements per box dimension
MAX_RANK = 5


def swizzle_of(t: TensorType) -> int:
    """The widest swizzle span that divides the tile's row; else the row's bytes where
    it is one unswizzled box (an odd number of 16-byte chunks, at least MIN_PLAIN_ROW
    bytes and at most MAX_BOX elements); 0 if neither."""
    row = t.shape[-1] * t.dtype.nbytes
    span = next((w for w in SWIZZLE_SPANS if row % w == 0), 0)
    if not span and row % 16 == 0 and row >= MIN_PLAIN_ROW and t.shape[-1] <= MAX_BOX:
        return row
    return span


def rows(t: TensorType) -> int:
    """The tile's rows: every dimension but the last, flattened."""
    return t.numel // t.shape[-1]


def fits(t: TensorType, dev: TensorType) -> bool:
    """The box geometry rule of the module docstring (not the reader rule)."""
    if t.dtype not in TMAP_DTYPES or t.rank != dev.rank:
        return False
    if not 2 <= dev.rank <= MAX_RANK or swizzle_of(t) == 0 or rows(t) % 8:
        return False
    if any(d > MAX_BOX for d in t.shape[:-1]):
        return False
    es = dev.dtype.nbytes
    return all((s * es) % 16 == 0 and s * es < 1 << 40 for s in row_major(dev.shape)[:-1])


def slot_bytes(t: TensorType) -> int:
    """Bytes of one pipeline stage of the tile (boxes back to back), 1024-aligned."""
    n = t.numel * t.dtype.nbytes
    return (n + ALIGN - 1) // ALIGN * ALIGN


def spec(bi: BlockInput, dev: TensorType, swizzle: int) -> TensorMapSpec:
    t = bi.value.type
    es = dev.dtype.nbytes
    strides = tuple(s * es for s in reversed(row_major(dev.shape)[:-1]))
    box = (swizzle // es,) + tuple(reversed(t.shape[:-1]))
    return TensorMapSpec(dev.dtype, tuple(reversed(dev.shape)), strides, box, swizzle)


def boxes(t: TensorType, swizzle: int) -> int:
    return t.shape[-1] * t.dtype.nbytes // swizzle


def coords(bi: BlockInput, dev: TensorType, grid: tuple[int, int, int], it: str | None,
           box: int, swizzle: int) -> list[str]:
    """C expressions of box ``box``'s first element, innermost dimension first, for the
    block (``bx``, ``by``, ``bz``) at forloop iteration ``it`` (None: no forloop map)."""
    t = bi.value.type
    origin = []
    for d in range(dev.rank):
        terms = [f"{axis} * {dev.shape[d] // g}"
                 for axis, g, m in zip(("bx", "by", "bz"), grid, bi.imap) if m == d and g > 1]
        if it is not None and bi.fmap == d:
            terms.append(f"({it}) * {t.shape[d]}")
        if d == dev.rank - 1 and box:
            terms.append(str(box * swizzle // t.dtype.nbytes))
        origin.append(" + ".join(terms) if terms else "0")
    return list(reversed(origin))
