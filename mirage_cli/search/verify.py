"""The one function through which the search verifies a candidate.

INTERIM METHOD (until the finite-field verifier, ``mirage_cli.verifier``, is merged):
both graphs run in the reference interpreter (:mod:`mirage_cli.interp`) in float64 on
random standard-normal inputs drawn from ``seed``, and the candidate passes when every
output's relative error ``||cand - ref|| / ||ref||`` is at most ``RTOL``. This is a
numerical test, not the finite-field certificate DESIGN.md §4 asks for; it is stated as
such in every candidate's metadata (``verification.method``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirage_cli import interp
from mirage_cli.ir import Graph

RTOL = 1e-9
METHOD = "float64-random (interim: interpreter on random inputs)"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    method: str
    seed: int
    max_rel_error: float

    def as_json(self) -> dict[str, object]:
        return {"equivalent": self.ok, "method": self.method, "seed": self.seed,
                "max_rel_error": float(f"{self.max_rel_error:.3e}")}


def verify(reference: Graph, candidate: Graph, seed: int) -> Verdict:
    """Does ``candidate`` compute ``reference``'s outputs (matched by position)?"""
    ins = interp.random_inputs(reference, seed)
    cand_ins = {c.value.name: ins[r.value.name]
                for r, c in zip(reference.inputs, candidate.inputs)}
    ref = interp.run(reference, ins, "float64")
    out = interp.run(candidate, cand_ins, "float64")
    worst = 0.0
    for rn, cn in zip(reference.outputs, candidate.outputs):
        a, b = ref[rn], out[cn]
        if a.shape != b.shape or not np.all(np.isfinite(b)):
            return Verdict(False, METHOD, seed, float("inf"))
        err = float(np.linalg.norm(b - a) / max(np.linalg.norm(a), 1e-300))
        worst = max(worst, err)
    return Verdict(worst <= RTOL, METHOD, seed, worst)
