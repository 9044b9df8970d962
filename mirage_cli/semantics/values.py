"""Field values of tensors during one verification trial.

A tensor is held as its residues in Z_P and in Z_Q (same shape), each computed on
first use: a value that only feeds ``exp`` is never computed mod P, and a value that
never feeds ``exp`` or a random function is never computed mod Q. ``q`` is ``None``
where the value has no meaning in Z_Q (the result of ``exp`` lives in Z_P only).

:class:`TrialContext` carries what one trial shares between the two graphs being
compared: the seed and trial number (from which every random function and the
generator of exp are derived) and the flag raised when a division met a zero.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mirage_cli.semantics.field import ExpTable, P, Q, mix64, subgroup_generator


class Unsupported(Exception):
    """The graph uses something the finite-field method cannot model (e.g. exp of a
    value that only exists in Z_P); the verdict falls back to the float64 check."""


Thunk = Callable[[], "np.ndarray | None"]
# The residues a value carries: mod P, mod Q, and mod P again at an independent second
# input point ("r"), used only to make random-function keys collide less often.
MODULI = (P, Q, P)


class FVal:
    """A tensor's residues (mod P, mod Q, second mod P), each computed once, on demand;
    ``None`` where the value has no meaning (Z_Q and second residue after exp)."""

    __slots__ = ("_thunks", "_vals")

    def __init__(self, fp: Thunk, fq: Thunk, fr: Thunk | None = None) -> None:
        self._thunks: list[Thunk | None] = [fp, fq, fr if fr is not None else _none]
        self._vals: list[np.ndarray | None] = [None, None, None]

    @staticmethod
    def of(p: np.ndarray, q: np.ndarray | None, r: np.ndarray | None = None) -> FVal:
        return FVal(lambda: p, lambda: q, lambda: r)

    def get(self, i: int) -> np.ndarray | None:
        """Residue ``i`` (0: mod P, 1: mod Q, 2: second mod P)."""
        thunk = self._thunks[i]
        if thunk is not None:
            self._vals[i], self._thunks[i] = thunk(), None
        return self._vals[i]

    @property
    def p(self) -> np.ndarray:
        p = self.get(0)
        if p is None:
            raise Unsupported("a value has no meaning in Z_P")
        return p

    @property
    def q(self) -> np.ndarray | None:
        return self.get(1)

    @property
    def r(self) -> np.ndarray | None:
        return self.get(2)

    @property
    def q_required(self) -> np.ndarray:
        q = self.q
        if q is None:
            raise Unsupported("exp is applied to a value with no meaning in Z_Q "
                              "(a result of exp): nested exponentials are not modelled")
        return q


def _none() -> None:
    return None


@dataclass
class TrialContext:
    """Randomness and bookkeeping shared by both graphs in one trial.

    ``lead`` is the number of leading axes that are not tensor dimensions: 0 at kernel
    level, 4 inside a vectorised block graph (grid x, y, z and forloop iteration)."""

    seed: int
    trial: int
    lead: int = 0
    zero_division: list[bool] = field(default_factory=lambda: [False])
    _exp: ExpTable | None = None

    def at_lead(self, lead: int) -> TrialContext:
        return TrialContext(self.seed, self.trial, lead, self.zero_division, self._exp)

    def exp(self, a: np.ndarray) -> np.ndarray:
        if self._exp is None:
            self._exp = _exp_table(self.seed, self.trial)
        return self._exp(a)

    def salt(self, name: str) -> int:
        """The key of random function ``name`` in this trial (same for both graphs)."""
        x = np.array([((self.seed * 1_000_003 + self.trial) * 2654435761
                       + zlib.crc32(name.encode())) % 2**64], dtype=np.uint64)
        return int(mix64(x)[0])

    def note_zero(self, hit: bool) -> None:
        if hit:
            self.zero_division[0] = True

    def axis(self, dim: int) -> int:
        return self.lead + dim


_EXP_CACHE: dict[tuple[int, int], ExpTable] = {}


def _exp_table(seed: int, trial: int) -> ExpTable:
    key = (seed, trial)
    if key not in _EXP_CACHE:
        if len(_EXP_CACHE) > 16:
            _EXP_CACHE.clear()
        _EXP_CACHE[key] = ExpTable(subgroup_generator(seed, trial))
    return _EXP_CACHE[key]


def moduli() -> tuple[int, int]:
    return P, Q
