"""The float64 cross-check: both graphs through the reference interpreter on random
real inputs, compared with a stated tolerance.

This is an independent second verdict: it uses the real meaning of every operator
(silu, max, sqrt, ... included) but is a numerical test, so it can only say "close"
or "far". Inputs are standard normal (``interp.random_inputs``), the same for both
graphs by position. Two graphs are *close* when, for every output and **every
element**, ``|a - b| <= RTOL * |b| + ATOL * rms(b)``: each element is held to its own
magnitude (a tolerance relative to the largest element let a change confined to the
small elements through), with a floor relative to the output's root mean square for
elements that cancel to nearly zero. A reassociated float64 computation differs by
about 1e-15 relative (a sum's rounding error is relative to its terms, hence to the
output's scale, not to a cancelled element), while the smallest real change the corpus
tests (dropping an eps of 1e-6 inside a square root) is about 1e-7 relative.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirage_cli import interp
from mirage_cli.ir import Graph
from mirage_cli.verifier import slabs

# The inputs of the last (input signature, seed) drawn: the safety check
# (:mod:`.numerics`) scales the same standard normal draw, and drawing it is most of a
# large program's check (tens of millions of normals).
_INPUTS: dict[tuple[object, ...], dict[str, np.ndarray]] = {}

RTOL = 1e-9
ATOL = 1e-14  # relative to the output's root mean square


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
    ins_b = float_inputs(b, seed)
    ins_a = {ia.value.name: ins_b[ib.value.name] for ia, ib in zip(a.inputs, b.inputs)}
    # Slab by slab where the graphs allow (:mod:`.slabs`): the same outputs.
    outs_a = slabs.run(a, slabs.source_of(ins_a), "float64")
    outs_b = slabs.run(b, slabs.source_of(ins_b), "float64")
    ya = [outs_a[o] for o in a.outputs]
    yb = [outs_b[o] for o in b.outputs]
    close, worst_abs, worst_rel, worst = True, 0.0, 0.0, 0
    for i, (x, y) in enumerate(zip(ya, yb)):
        err, rel = _distance(x, y)
        ok = rel <= RTOL
        if rel >= worst_rel:
            worst_rel, worst = rel, i
        worst_abs = max(worst_abs, err)
        close = close and ok
    return CrossCheck(close, seed, RTOL, ATOL, worst_abs, worst_rel, worst,
                      {ib.value.name: ins_b[ib.value.name] for ib in b.inputs}, ya, yb)


def float_inputs(g: Graph, seed: int) -> dict[str, np.ndarray]:
    """``interp.random_inputs(g, seed)``, remembered for the last input signature (names,
    shapes, dtypes by position) and seed; the arrays are read-only, as they are shared."""
    key = (seed, *((i.value.name, i.value.type) for i in g.inputs))
    if key not in _INPUTS:
        _INPUTS.clear()  # one signature at a time: these hold whole inputs
        ins = interp.random_inputs(g, seed)
        for x in ins.values():
            x.flags.writeable = False
        _INPUTS[key] = ins
    return dict(_INPUTS[key])


def _distance(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Largest absolute difference, and the largest element-wise relative difference
    ``|x - y| / (|y| + ATOL / RTOL * rms(y))`` (compared with RTOL, this is the test of
    the module docstring); NaN or inf at the same place in both counts as equal,
    anywhere else as an infinite difference."""
    fx, fy = np.isfinite(x), np.isfinite(y)
    same = (np.isnan(x) & np.isnan(y)) | ((x == y) & ~fx)
    if np.any((~fx | ~fy) & ~same):
        return float("inf"), float("inf")
    both = fx & fy
    if not both.any():
        return 0.0, 0.0
    d = np.abs(x[both] - y[both])
    ref = np.abs(y[both])
    floor = ATOL / RTOL * float(np.sqrt(np.mean(ref * ref)))
    if floor == 0.0:  # an all-zero output: only exact zeros agree
        return float(d.max()), (0.0 if not d.any() else float("inf"))
    return float(d.max()), float(np.max(d / (ref + floor)))
