"""Kernel-level reshapes that launch nothing: the reshaped tensor shares its storage.

Every device tensor is stored contiguous and row-major, so ``reshape`` changes only how
its bytes are indexed. A kernel-level reshape therefore needs no kernel when its input
and output can live in one buffer: the output is read where the input was written.
Reshapes join tensors into groups (a tensor, its reshapes, their reshapes); a group is
stored in at most one entry-point argument, since a program input cannot also be an
output's buffer and two outputs are two buffers:

- a group without an argument lives in the workspace slot of its first tensor;
- a group with one argument lives there: a reshape of an input reads the input
  (nothing ever writes an input), and the producer of a tensor whose reshape is a
  program output writes that output directly;
- a reshape that would join two groups that both hold an argument (an input reshaped
  into an output, a program output reshaped into another) stays a copying kernel.

The lowering (:mod:`.lower`) and the cost model (:mod:`mirage_cli.search.cost`) both
read :func:`aliasing`, so the model never prices a kernel that is not launched.
"""

from __future__ import annotations

from dataclasses import dataclass

from mirage_cli import ops
from mirage_cli.arch import DEFAULT_ARCH
from mirage_cli.ir import Graph


@dataclass(frozen=True)
class Aliasing:
    """``storage``: each tensor stored in another tensor's buffer, mapped to that tensor
    (an input, an output or a workspace temporary); ``free``: the indices of the
    kernel operators that launch nothing."""

    storage: dict[str, str]
    free: frozenset[int]


def aliasing(g: Graph) -> Aliasing:
    """Which reshapes of ``g`` launch nothing, and where each tensor is stored."""
    arguments = {i.value.name for i in g.inputs} | set(g.outputs)
    parent: dict[str, str] = {}
    held: dict[str, str] = {}  # a group's root -> the argument the group is stored in

    def root(n: str) -> str:
        while n in parent:
            n = parent[n]
        return n

    free: set[int] = set()
    for k, op in enumerate(g.ops):
        if ops.get(op.op).index is not ops.Index.RESHAPE:  # not a row-major view
            continue
        src, dst = root(op.inputs[0]), op.outputs[0].name
        arg_src = held.get(src, src if src in arguments else None)
        arg_dst = dst if dst in arguments else None
        if arg_src is not None and arg_dst is not None:
            continue  # two buffers the caller owns: the reshape copies
        parent[dst] = src
        if arg_src or arg_dst:
            held[src] = arg_src or arg_dst  # type: ignore[assignment]
        free.add(k)
    storage: dict[str, str] = {}
    for n in parent:
        r = root(n)
        if held.get(r, r) != n:
            storage[n] = held.get(r, r)
    storage.update((r, arg) for r, arg in held.items() if arg != r)
    return Aliasing(storage, frozenset(free))


def launched(g: Graph, arch: str = DEFAULT_ARCH) -> int:
    """How many kernels the lowering of ``g`` runs: every kernel operator but the
    reshapes that share a buffer and the concatenations read in their parts
    (:mod:`.joins`); a grouped launch runs several (codegen/grouping.py)."""
    from mirage_cli.codegen.joins import joined_ops, joins

    return len(g.ops) - len(aliasing(g).free | joined_ops(g, joins(g, arch)))
