"""Designs and tunings: a found µGraph's decisions, kept apart from its sizes.

A :class:`Design` is what the generator decides (DESIGN.md §1 "design space"): which
kernels, which pre-defined operators, which block operators on which tiles, how each
input is split (imap/fmap, by index) and stored (omap). A :class:`Tuning` is what the
tuner decides: each custom kernel's grid sizes and forloop range. ``instantiate``
turns the pair into a checked :class:`~mirage_cli.ir.Graph` through the builder, so a
design found at one size is re-checked at every other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from mirage_cli.builder import GraphBuilder
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Attrs, AxisMap, BlockGraph, DType, Graph
from mirage_cli.serialize import Json


@dataclass(frozen=True)
class LoadD:
    source: str
    imap: AxisMap
    fmap: int | None


@dataclass(frozen=True)
class OpD:
    """A block operator; ``args`` index the kernel's tiles (loads first, then ops)."""

    op: str
    args: tuple[int, ...]
    attrs: Attrs


@dataclass(frozen=True)
class StoreD:
    """A store; ``dtype``: the device tensor's where it is not the tile's (a split's
    partial results kept in f32, :mod:`.online`)."""

    tile: int
    name: str
    omap: AxisMap
    dtype: DType | None = None


@dataclass(frozen=True)
class CustomD:
    """One custom kernel: ``axes`` grid axes are split (each by >= 2 blocks) and the
    forloop iterates (range >= 2) iff ``looped``."""

    loads: tuple[LoadD, ...]
    ops: tuple[OpD, ...]
    stores: tuple[StoreD, ...]
    axes: int
    looped: bool


@dataclass(frozen=True)
class PredefD:
    """A pre-defined kernel operator (a library kernel)."""

    op: str
    args: tuple[str, ...]
    attrs: Attrs
    name: str


Step = Union[CustomD, PredefD]  # noqa: UP007 - a runtime alias


@dataclass(frozen=True)
class Design:
    steps: tuple[Step, ...]
    outputs: tuple[str, ...]

    @property
    def num_kernels(self) -> int:
        return len(self.steps)

    def describe(self) -> list[Json]:
        """The design decisions, for a candidate's metadata."""
        out: list[Json] = []
        for s in self.steps:
            if isinstance(s, PredefD):
                out.append({"kernel": s.op, "inputs": list(s.args), "output": s.name})
            else:
                out.append({"kernel": "custom",
                            "block_ops": [o.op for o in s.ops],
                            "loads": [{"tensor": ld.source, "imap": list(ld.imap),
                                       "fmap": ld.fmap} for ld in s.loads],
                            "stores": [st.name for st in s.stores]})
        return out


# Per custom kernel: (grid, forloop). Pre-defined steps take no tuning.
Tuning = tuple[tuple[tuple[int, int, int], int], ...]


def instantiate(target: Graph, design: Design, tuning: Tuning, threads: int = 128
                ) -> Graph | None:
    """The µGraph of ``design`` at ``tuning``, or None where the sizes do not fit (or a
    loop-free kernel is given a forloop: not the design)."""
    b = GraphBuilder(target.name, target.params)
    for i in target.inputs:
        b.input(i.value.name, i.value.type.shape, i.value.type.dtype, i.dims_src,
                weight=i.weight)
    k = 0
    try:
        for step in design.steps:
            if isinstance(step, PredefD):
                b.op(step.op, *step.args, out=step.name,
                     **dict(step.attrs))  # type: ignore[arg-type]  # attrs, not out/span
                continue
            grid, forloop = tuning[k]
            k += 1
            if not step.looped and forloop != 1:
                return None  # iterated, a loop-free kernel would read its tiles again
            _custom(b, step, grid, forloop, threads)
        for name in design.outputs:
            b.output(name)
        return b.build()
    except MirageError:
        return None


def _custom(b: GraphBuilder, step: CustomD, grid: tuple[int, int, int], forloop: int,
            threads: int) -> None:
    kb = b.custom(grid, threads, forloop)
    tiles = [kb.load(ld.source, ld.imap, ld.fmap) for ld in step.loads]
    for o in step.ops:
        tiles.append(kb.op(o.op, *(tiles[i] for i in o.args),
                           **dict(o.attrs)))  # type: ignore[arg-type]  # attrs only
    kb.finish([(tiles[s.tile], s.name, s.omap, None, s.dtype) for s in step.stores])


def looped_kernel(target: Graph, design: Design, tuning: Tuning
                  ) -> tuple[CustomD, BlockGraph] | None:
    """The custom kernel of a one-kernel ``design`` whose forloop iterates, and its
    block graph at ``tuning``; None for any other design, or one that does not
    instantiate there (the moves of :mod:`.split`, :mod:`.runmax` start from it)."""
    if len(design.steps) != 1 or not isinstance(design.steps[0], CustomD):
        return None
    c = design.steps[0]
    if not c.looped:
        return None
    g = instantiate(target, design, tuning)
    if g is None:
        return None
    bg = g.ops[-1].block
    assert bg is not None
    return c, bg


def custom_steps(design: Design) -> list[CustomD]:
    return [s for s in design.steps if isinstance(s, CustomD)]


def design_of(g: Graph) -> tuple[Design, Tuning]:
    """The design and tuning of a µGraph (the inverse of :func:`instantiate`), so a
    candidate read from a file can be re-tuned, pinned or moved to other sizes."""
    steps: list[Step] = []
    tuning: list[tuple[tuple[int, int, int], int]] = []
    for op in g.ops:
        bg = op.block
        if bg is None:
            steps.append(PredefD(op.op, op.inputs, op.attrs, op.outputs[0].name))
            continue
        index = {bi.value.name: i for i, bi in enumerate(bg.inputs)}
        for bop in bg.ops:
            index[bop.outputs[0].name] = len(index)
        loads = tuple(LoadD(bi.source, bi.imap, bi.fmap) for bi in bg.inputs)
        ops = tuple(OpD(o.op, tuple(index[i] for i in o.inputs), o.attrs) for o in bg.ops)
        tiles = bg.tile_types()
        stores = tuple(StoreD(index[bo.source], bo.value.name, bo.omap,
                              None if bo.value.type.dtype == tiles[bo.source].dtype
                              else bo.value.type.dtype) for bo in bg.outputs)
        # The builder splits the leading grid axes; a size of 1 is an unsplit axis.
        axes = sum(1 for n in bg.grid if n > 1)
        steps.append(CustomD(loads, ops, stores, axes, bg.forloop > 1))
        tuning.append((bg.grid, bg.forloop))
    return Design(tuple(steps), g.outputs), tuple(tuning)
