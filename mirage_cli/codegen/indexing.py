"""The range of the index arithmetic in generated kernels.

Kernels index with C ``int``: a tensor of 2^31 elements or more cannot be addressed,
and is refused here, located at the operator that touches it (exit 2), before any
code is written. Below that, an element offset always fits; what may not is a loop
index one step past its bound (a grid-stride loop over 2^31 - 1 elements steps
beyond ``INT_MAX``), so loops whose last step could overflow get a 64-bit index
(:func:`loop_index_type`). Small tensors, all of today's examples, keep ``int``.
"""

from __future__ import annotations

from collections.abc import Mapping

from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph, KernelOp, TensorType

INT_MAX = 2**31 - 1


def check_index_range(kop: KernelOp, types: Mapping[str, TensorType]) -> None:
    """Refuse an operator that reads or writes a tensor of 2^31 elements or more."""
    for name in (*kop.inputs, *(v.name for v in kop.outputs)):
        t = types[name]
        if t.numel > INT_MAX:
            raise MirageError(
                f"tensor '{name}' ({t}) has {t.numel} elements; generated kernels index "
                f"with 32-bit integers, so a tensor of 2^31 ({INT_MAX + 1}) elements or "
                f"more is not supported: split it", kop.span)


def check_program_range(g: Graph) -> None:
    """:func:`check_index_range` over every operator of ``g``: run by the commands that
    search before they generate code, so a program no kernel can index is refused at
    once, not after a search and a verification at its sizes (which, for tensors of
    10^22 elements, would not end)."""
    types = g.tensor_types()
    for kop in g.ops:
        check_index_range(kop, types)


def loop_index_type(bound: int, step: int) -> str:
    """The C type of an index running below ``bound`` in steps of ``step``: ``int``
    while its last value (at most ``bound - 1 + step``) fits, else ``long long``."""
    return "int" if bound - 1 + step <= INT_MAX else "long long"
