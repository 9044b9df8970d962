"""The float64 cross-check: both graphs through the reference interpreter on random
real inputs, compared with a stated tolerance.

This is an independent second verdict: it uses the real meaning of every operator
(silu, max, sqrt, ... included) but is a numerical test, so it can only say "close"
or "far". Inputs are standard normal (``interp.random_inputs``), the same for both
graphs by position. Two graphs are *close* when, for every output,
``max|a - b| <= ATOL + RTOL * max|b|``; a reassociated float64 computation differs by
about 1e-15 relative, while the smallest real change the corpus tests (dropping an
eps of 1e-6 inside a square root) is about 1e-7 relative.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirage_cli import interp
from mirage_cli.ir import Graph

RTOL = 1e-9
ATOL = 1e-12


@dataclass(frozen=True)
class CrossCheck:
    """The float64 verdict and where the outputs differ most."""

    close: bool
    seed: int
    rtol: float
    atol: float
    max_abs_err: float
    max_rel_err: float
    worst_output: int
    inputs: dict[str, np.ndarray]
    outputs_a: list[np.ndarray]
    outputs_b: list[np.ndarray]

    def summary(self) -> dict[str, object]:
        return {"method": "float64 reference interpreter on standard normal inputs",
                "seed": self.seed, "rtol": self.rtol, "atol": self.atol,
                "verdict": "close" if self.close else "different",
                "max_abs_err": self.max_abs_err, "max_rel_err": self.max_rel_err}


def crosscheck(a: Graph, b: Graph, seed: int = 0) -> CrossCheck:
    """Run ``a`` and ``b`` in float64 on the same random inputs (by position)."""
    ins_b = interp.random_inputs(b, seed)
    ins_a = {ia.value.name: ins_b[ib.value.name] for ia, ib in zip(a.inputs, b.inputs)}
    outs_a = interp.run(a, ins_a, "float64")
    outs_b = interp.run(b, ins_b, "float64")
    ya = [outs_a[o] for o in a.outputs]
    yb = [outs_b[o] for o in b.outputs]
    close, worst_abs, worst_rel, worst = True, 0.0, 0.0, 0
    for i, (x, y) in enumerate(zip(ya, yb)):
        err, scale = _distance(x, y)
        rel = err / scale if scale > 0 else err
        ok = err <= ATOL + RTOL * scale
        if rel >= worst_rel:
            worst_rel, worst = rel, i
        worst_abs = max(worst_abs, err)
        close = close and ok
    return CrossCheck(close, seed, RTOL, ATOL, worst_abs, worst_rel, worst,
                      {ib.value.name: ins_b[ib.value.name] for ib in b.inputs}, ya, yb)


def _distance(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Largest absolute difference and the scale of ``y``; NaN or inf at the same
    place in both counts as equal, anywhere else as an infinite difference."""
    fx, fy = np.isfinite(x), np.isfinite(y)
    same = (np.isnan(x) & np.isnan(y)) | ((x == y) & ~fx)
    if np.any((~fx | ~fy) & ~same):
        return float("inf"), 0.0
    both = fx & fy
    if not both.any():
        return 0.0, 0.0
    return float(np.max(np.abs(x[both] - y[both]))), float(np.max(np.abs(y[both])))
