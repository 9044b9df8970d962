"""Concatenations that launch nothing: their readers read the two parts in place.

A decode step's attention reads its key/value cache with the new token's row appended:
``concat(cache, new)`` copies the whole cache (134 MB at a Llama layer's batch 8, two
thirds of a DRAM read and write of it) only for one kernel to read the copy once. When
every reader of a concatenation is a custom kernel that stages the tensor in shared
memory by 16-byte chunks, each chunk can be read from the part it lies in instead: the
concatenation is *joined*, launches nothing and has no buffer, and its readers take
both parts' addresses (``mg_join`` in the prelude picks the part per chunk).

A concatenation is joined when
- it is not a program output (an output is a buffer the caller owns: it is written);
- every operator that reads it is a custom kernel, which plans it as a staged tile
  read through ``cp.async`` or scalar copies, never bulk tensor copies (a box lies in
  one tensor) nor direct global reads (:func:`planner.plan_kernel`'s ``joined``);
- either each part's elements per index of the dimensions before the concatenation's
  (its *period*) are a whole number of 16-byte chunks, so that no chunk straddles two
  parts and each is aligned in its part (a value cache's rows are);
- or it is *shifted*: it joins along the last dimension a first part whose rows need
  not be whole chunks and a second part narrower than one chunk (a transposed key
  cache of ``kv - 1`` columns and the new key's column). Its rows start anywhere in a
  chunk, so a reader copies the aligned chunks that cover each row of its tile (one
  more than the row's) and finds an element at its row's shift; the second part's
  columns it reads from global memory. Only a matmul chain's key operand reads such a
  tile (``mma.b_path`` "gather", :mod:`chain`); another reader keeps the copy;
- every reader still plans with it joined (the staged tile fits shared memory); a
  reader that plans with its other joins but not with its shifted ones keeps only
  the shifted ones copies.

The lowering (:mod:`.lower`), the launch levels (:mod:`.grouping`) and the cost model
(:mod:`mirage_cli.search.cost`) read :func:`joins`, so the model never prices a copy
that is not made.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mirage_cli import ops
from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.codegen.expr import numel
from mirage_cli.codegen.knobranges import VEC_BYTES
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import BlockGraph, Graph, KernelOp, TensorType
from mirage_cli.kplan import Knobs


@dataclass(frozen=True)
class Join:
    """A concatenation read in place: element ``o`` of the joined tensor (row-major)
    is element ``o % period`` of a period whose first ``head`` elements are
    ``parts[0]``'s (one period of it, ``head`` elements) and the rest ``parts[1]``'s."""

    parts: tuple[str, str]
    period: int
    head: int
    # Elements of a 16-byte chunk where the join is shifted (see the module's
    # docstring: rows of the first part start anywhere in a chunk); 0 where every
    # chunk lies whole in one part.
    chunk: int = 0

    @property
    def shifted(self) -> bool:
        return self.chunk > 0

    def pointer(self, p0: str, p1: str, offset: str) -> str:
        """The C expression of the element at ``offset``, the parts at ``p0``, ``p1``."""
        return f"mg_join<{self.period}, {self.head}>({p0}, {p1}, {offset})"


def candidate(op: KernelOp, types: dict[str, TensorType]) -> Join | None:
    """``op`` as a join, if it is a concatenation whose parts are whole chunks, or one
    that a shifted join reads (see the module's docstring)."""
    if ops.get(op.op).index is not ops.Index.CONCAT:
        return None
    dim = int(dict(op.attrs)["dim"])
    a, b = (types[n] for n in op.inputs)
    out = op.outputs[0].type
    head, tail = numel(a.shape[dim:]), numel(b.shape[dim:])
    parts = (op.inputs[0], op.inputs[1])
    if not any(n * out.dtype.nbytes % VEC_BYTES for n in (head, tail)):
        return Join(parts, head + tail, head)
    chunk = VEC_BYTES // out.dtype.nbytes
    # The chunks that cover a row of the first part lie in its buffer (whole chunks).
    if dim == len(out.shape) - 1 and tail < chunk and a.numel % chunk == 0:
        return Join(parts, head + tail, head, chunk)
    return None


def shifted_names(found: Mapping[str, Join], names: Iterable[str] | None = None
                  ) -> frozenset[str]:
    """Those of ``names`` (default: all of ``found``) that are shifted joins in ``found``."""
    return frozenset(n for n in (found if names is None else names)
                     if n in found and found[n].shifted)


def joins(g: Graph, arch: str = DEFAULT_ARCH) -> dict[str, Join]:
    """The joined concatenations of ``g``, by the tensor each one makes."""
    types = g.tensor_types()
    readers: dict[str, list[KernelOp]] = {}
    for op in g.ops:
        for n in set(op.inputs):
            readers.setdefault(n, []).append(op)
    found: dict[str, Join] = {}
    for op in g.ops:
        j = candidate(op, types)
        name = op.outputs[0].name
        if j is None or name in g.outputs or not readers.get(name):
            continue
        if all(r.block is not None for r in readers[name]):
            found[name] = j
    # A reader that does not plan with its joined inputs staged (shared memory) keeps
    # them copies; dropping one join never stops another reader from planning.
    changed = True
    while changed:
        changed = False
        for op in g.ops:
            mine = frozenset(n for n in op.inputs if n in found)
            if not mine or op.block is None:
                continue
            used = tuple(sorted((n, types[n]) for n in {*op.inputs, *(v.name for v in op.outputs)}))
            pins = op.plan.knobs if op.plan is not None else Knobs()
            shift = shifted_names(found, mine)
            if not _plans(op.block, used, arch, pins, mine, shift):
                # The shifted ones alone, where the reader plans with the others.
                alone = shift and _plans(op.block, used, arch, pins, mine - shift, frozenset())
                for n in shift if alone else mine:
                    del found[n]
                changed = True
    return found


@functools.lru_cache(maxsize=1024)
def _plans(bg: BlockGraph, types: tuple[tuple[str, TensorType], ...], arch: str, pins: Knobs,
           joined: frozenset[str], shift: frozenset[str]) -> bool:
    """Whether the custom kernel ``bg`` plans with ``joined`` staged (those in ``shift``
    shifted; cached: the search costs the same kernel in many µGraphs)."""
    from mirage_cli.codegen.planner import plan_kernel  # the planner reads Join too

    try:
        plan_kernel(bg, dict(types), arch, pins, joined=joined, shifted=shift)
    except MirageError:
        return False
    return True


def joined_ops(g: Graph, found: Mapping[str, Join]) -> frozenset[int]:
    """The indices of ``g``'s kernel operators that make the joined tensors ``found``
    (:func:`joins`): they launch nothing."""
    return frozenset(i for i, op in enumerate(g.ops) if op.outputs[0].name in found)

