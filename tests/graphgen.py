"""Hypothesis strategies for random valid µGraphs, built only through GraphBuilder.

Each step draws an operator (kernel operator or custom kernel with random grid,
forloop, imaps, fmaps, block operators, accumulators and omaps) and keeps it only
if the builder accepts it, so every drawn graph is valid by construction.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from mirage_cli import ops
from mirage_cli.builder import BlockBuilder, GraphBuilder
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph

DIMS = (1, 2, 4, 8)
KERNEL_OPS = tuple(n for n in ops.names(ops.KERNEL) if n != "custom")
BLOCK_OPS = ops.names(ops.BLOCK)
ACCUMULATORS = tuple(n for n in BLOCK_OPS if ops.get(n).is_accumulator)
FLOATS = st.one_of(st.sampled_from([0.0, 1e-6, 1e-5, 0.125, -2.0, 3.0]),
                   st.floats(allow_nan=False, allow_infinity=False, width=64))


def _attrs(draw: Any, opdef: ops.OpDef, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for spec in opdef.attrs:
        if not spec.required and not draw(st.booleans()):
            continue
        if spec.name == "dim":
            out["dim"] = draw(st.integers(0, max(rank - 1, 0)))
        elif spec.name == "width":
            out["width"] = draw(st.sampled_from((1, 2, 4)))
        elif spec.kind is bool:
            out[spec.name] = draw(st.booleans())
        elif spec.kind is float:
            out[spec.name] = draw(FLOATS)
        else:
            out[spec.name] = draw(st.integers(0, 4))
    return out


def _try_op(draw: Any, b: GraphBuilder | BlockBuilder, names: tuple[str, ...]) -> None:
    if not b.types:
        return
    # matmul needs matching shapes and is rarely drawn valid: offer it more often.
    opdef = ops.get(draw(st.sampled_from(names + ("matmul",) * 4)))
    lo, hi = opdef.arity
    operands = draw(st.lists(st.sampled_from(sorted(b.types)), min_size=lo, max_size=hi))
    attrs = _attrs(draw, opdef, b.types[operands[0]].rank)
    try:
        b.op(opdef.name, *operands, **attrs)
    except MirageError:
        pass


def _axis_map(draw: Any, grid: tuple[int, int, int], rank: int, need: bool
              ) -> tuple[int | None, ...]:
    """Random distinct dims per axis; ``need``: axes of size > 1 must be mapped."""
    dims = draw(st.permutations(list(range(rank))))
    out: list[int | None] = []
    for g in grid:
        use = (need and g > 1) or draw(st.booleans())
        out.append(dims.pop() if use and dims else None)
    return tuple(out)


def _try_custom(draw: Any, b: GraphBuilder) -> None:
    grid = (draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 2))), 1)
    k = b.custom(grid, draw(st.sampled_from((32, 64, 128))), draw(st.sampled_from((1, 2, 4))))
    for _ in range(draw(st.integers(1, 3))):
        src = draw(st.sampled_from(sorted(b.types)))
        rank = b.types[src].rank
        imap = _axis_map(draw, grid, rank, need=False)
        fmap = draw(st.one_of(st.none(), st.integers(0, rank - 1)))
        try:
            k.load(src, imap, fmap)  # type: ignore[arg-type]
        except MirageError:
            pass
    if not k.types:
        return
    for _ in range(draw(st.integers(0, 4))):
        _try_op(draw, k, BLOCK_OPS)
    if not any(ops.get(op.op).is_accumulator for op in k.ops):
        _try_op(draw, k, ACCUMULATORS)
    stores = []
    for src in draw(st.lists(st.sampled_from(sorted(k.types)), min_size=1, max_size=2,
                             unique=True)):
        omap = _axis_map(draw, grid, k.types[src].rank, need=True)
        stores.append((src, None, omap))
    try:
        k.finish(stores)  # type: ignore[arg-type]
    except MirageError:
        pass


@st.composite
def graphs(draw: Any, max_steps: int = 6) -> Graph:
    """A random valid µGraph (kernel operators and custom kernels)."""
    n = draw(st.sampled_from(DIMS[1:]))
    b = GraphBuilder(draw(st.sampled_from(("g", "prog_1", "rmsnorm"))), (("n", n),))
    dtype = draw(st.sampled_from(("f16", "bf16", "f32")))
    for i in range(draw(st.integers(1, 3))):
        shape = draw(st.lists(st.sampled_from(DIMS), min_size=1, max_size=4))
        src = tuple("n" if d == n and draw(st.booleans()) else
                    "2 * n" if d == 2 * n and draw(st.booleans()) else str(d) for d in shape)
        b.input(f"X{i}", shape, dtype if draw(st.integers(0, 4)) else "f32", src)
    for _ in range(draw(st.integers(0, max_steps))):
        if draw(st.booleans()):
            _try_op(draw, b, KERNEL_OPS)
        else:
            _try_custom(draw, b)
    names = sorted(b.types)
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
        b.output(name)
    return b.build()
