"""Abstract expressions as the search uses them: the term language of
:mod:`mirage_cli.semantics.terms`, evaluated through the operator registry.

The term library lives on the floor below the registry (it never imports
:mod:`mirage_cli.ops`); this module binds its registry-dependent entry points to
:func:`mirage_cli.ops.get`, so the search calls ``apply(op, xs, attrs)`` as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mirage_cli import ops
from mirage_cli.ir import AttrValue
from mirage_cli.semantics import terms
from mirage_cli.semantics.terms import (
    FORLOOP_KEY,
    UNIT,
    AVal,
    Labels,
    Term,
    Unions,
    children,
    inp,
    symbols,
)

__all__ = ["FORLOOP_KEY", "UNIT", "AVal", "Labels", "Term", "Unions", "apply", "children",
           "inp", "op_symbols", "symbols"]


def apply(op: str, xs: Sequence[AVal], attrs: Mapping[str, AttrValue]
          ) -> tuple[AVal, Unions]:
    """:func:`mirage_cli.semantics.terms.apply` over the registry."""
    return terms.apply(ops.get, op, xs, attrs)


def op_symbols(op: str) -> frozenset[str]:
    """Function symbols an operator of the registry introduces."""
    return terms.op_symbols(ops.get, op)
