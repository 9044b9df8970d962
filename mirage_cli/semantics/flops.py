"""FLOP counts of operators: the rule library of the registry's ``cost`` slot.

A rule maps operand types and the result type to floating-point operations. Must not
import :mod:`mirage_cli.ops` (ops imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mirage_cli.ir import TensorType

# FLOPs of one application, from the operand and result types.
FlopFn = Callable[[Sequence[TensorType], TensorType], int]


def per_element(ins: Sequence[TensorType], out: TensorType) -> int:
    """One operation per element of the largest operand or result."""
    return max([out.numel] + [t.numel for t in ins])


def per_element_times(n: int) -> FlopFn:
    """``n`` operations per element: a transcendental function's instruction count as
    the CUDA math library evaluates it (``erff`` in GELU, ``expf`` in SiLU)."""
    def rule(ins: Sequence[TensorType], out: TensorType) -> int:
        return n * per_element(ins, out)
    rule.__doc__ = f"{n} operations per element of the largest operand or result."
    return rule


def contraction(ins: Sequence[TensorType], out: TensorType) -> int:
    """A multiply and an add per contracted element: ``2*m*n*k`` for a matmul."""
    return 2 * out.numel * ins[0].shape[-1]


def rms_like(ins: Sequence[TensorType], out: TensorType) -> int:
    """A square, an add and (for the normalisation) a divide per element."""
    return 3 * ins[0].numel
