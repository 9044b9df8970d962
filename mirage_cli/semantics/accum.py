"""Forloop accumulators as data: the four kinds that say what one computes.

An accumulator over the tiles ``x_i`` of iterations ``i = 0..F-1`` computes
``finish( combine_i reduce(pre(x_i)) )``. Each kind is a closed ``str`` enum (the
JSON and the registry spell them as their values), every pass that interprets one
dispatches with ``match`` ending in ``assert_never``, and :class:`AccumSpec` rejects
at construction the combinations no pass gives a meaning to, so a new accumulator is
either fully meant everywhere or refused when it is registered.

This module is on the floor below the registry: it imports nothing from
``mirage_cli``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import assert_never

import numpy as np


class Pre(enum.StrEnum):
    """Element-wise, before reducing."""

    ID = "id"
    SQUARE = "square"


class Reduce(enum.StrEnum):
    """What of each tile is reduced: nothing, the last dim (kept as size 1), or the
    last dim summed in groups down to the ``width`` attribute."""

    NONE = "none"
    LAST = "last"
    TO_WIDTH = "to_width"


class Combine(enum.StrEnum):
    """How the reduced values (within a tile and over iterations) are combined."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"


class Finish(enum.StrEnum):
    """Applied once after the loop: nothing, divide by the count (``mean``), or the
    square root of that mean plus the ``eps`` attribute (``rms``, RMSNorm's denominator)."""

    ID = "id"
    MEAN = "mean"
    RMS = "rms"


class AccumSpecError(ValueError):
    """An accumulator combination that no pass gives a meaning to."""


@dataclass(frozen=True)
class AccumSpec:
    """What a forloop accumulator computes (see the module docstring)."""

    pre: Pre
    reduce: Reduce
    combine: Combine
    finish: Finish

    def __post_init__(self) -> None:
        # Coerce plain strings (the registry's spelling) and reject unknown ones early.
        for name, kind in (("pre", Pre), ("reduce", Reduce), ("combine", Combine),
                           ("finish", Finish)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                raise AccumSpecError(f"unknown accumulator {name} {value!r}; one of "
                                     + ", ".join(k.value for k in kind)) from None
        validate(self)

    @property
    def is_plain_sum(self) -> bool:
        """Sums its input as is (pre id, combine sum, finish id): the accumulators a
        matmul's partial products may flow into, split or fused."""
        return (self.pre is Pre.ID and self.combine is Combine.SUM
                and self.finish is Finish.ID)


def is_extreme(combine: Combine) -> bool:
    """True for the order-based combines (max, min): not field arithmetic."""
    match combine:
        case Combine.SUM:
            return False
        case Combine.MAX | Combine.MIN:
            return True
        case other:
            assert_never(other)


def validate(spec: AccumSpec) -> None:
    """Refuse what has no meaning: a mean or rms of a max/min, and a max/min down to a
    width (the width reduction is a sum of groups)."""
    if is_extreme(spec.combine) and spec.finish is not Finish.ID:
        raise AccumSpecError(f"finish {spec.finish.value} of combine {spec.combine.value} "
                             f"is not defined (only id)")
    if is_extreme(spec.combine) and spec.reduce is Reduce.TO_WIDTH:
        raise AccumSpecError(f"reduce to_width sums groups; combine {spec.combine.value} "
                             f"cannot use it")


def np_pre(pre: Pre, x: np.ndarray) -> np.ndarray:
    match pre:
        case Pre.ID:
            return x
        case Pre.SQUARE:
            return x * x
        case other:
            assert_never(other)


def np_combine(combine: Combine, x: np.ndarray, axis: int, keepdims: bool) -> np.ndarray:
    match combine:
        case Combine.SUM:
            return x.sum(axis=axis, keepdims=keepdims)
        case Combine.MAX:
            return x.max(axis=axis, keepdims=keepdims)
        case Combine.MIN:
            return x.min(axis=axis, keepdims=keepdims)
        case other:
            assert_never(other)


def np_sum_to(x: np.ndarray, width: int) -> np.ndarray:
    """Sum the last dimension in groups down to ``width``: out[..., j] is the sum of
    x[..., g*width + j] over g (block g's columns are concatenated in order)."""
    groups = x.shape[-1] // width
    return x.reshape(x.shape[:-1] + (groups, width)).sum(axis=-2)


def np_accumulate(spec: AccumSpec, tiles: np.ndarray, width: int | None,
                  eps: float = 0.0) -> np.ndarray:
    """Apply an accumulator to ``tiles``, the per-iteration tiles stacked on axis 0
    (``eps`` is added under the square root of an ``rms`` finish)."""
    v = np_pre(spec.pre, tiles)
    count = tiles.shape[0]
    match spec.reduce:
        case Reduce.NONE:
            pass
        case Reduce.LAST:
            count *= tiles.shape[-1]
            v = np_combine(spec.combine, v, -1, True)
        case Reduce.TO_WIDTH:
            assert width is not None
            count *= tiles.shape[-1] // width
            v = np_sum_to(v, width)
        case other:
            assert_never(other)
    v = np_combine(spec.combine, v, 0, False)
    match spec.finish:
        case Finish.ID:
            return v
        case Finish.MEAN:
            return v / count
        case Finish.RMS:
            return np.sqrt(v / count + eps)
        case finish:
            assert_never(finish)
