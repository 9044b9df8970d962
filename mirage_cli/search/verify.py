"""The one function through which the search verifies a candidate.

With the finite-field verifier (:mod:`mirage_cli.verifier`, DESIGN.md §4) present, a
candidate is certified by ``Verifier.certify``: finite-field trials to the default
bound, plus the float64 cross-check for the best (first) candidate; it passes only on
the verdict ``equivalent``, and its certificate is kept in the candidate's metadata.

INTERIM METHOD, used only while that package is absent from the installation (it is
developed in parallel): the program runs in the reference interpreter
(:mod:`mirage_cli.interp`) and the candidate in its grid-vectorised equivalent
(:mod:`.batched`, tested against the interpreter), both in float64 on random
standard-normal inputs drawn from ``seed``; the candidate passes when every output's
relative error ``||cand - ref|| / ||ref||`` is at most ``RTOL``. This is a numerical
test, not a certificate, and every candidate's metadata says which method was used
(``verification.method``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mirage_cli import interp
from mirage_cli.ir import Graph
from mirage_cli.search import batched

RTOL = 1e-9
INTERIM = "float64-random (interim: reference interpreter vs. candidate on random inputs)"


@dataclass(frozen=True)
class Verdict:
    ok: bool
    method: str
    seed: int
    detail: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"equivalent": self.ok, "method": self.method, "seed": self.seed,
                **self.detail}


def have_verifier() -> bool:
    return importlib.util.find_spec("mirage_cli.verifier") is not None


def verify(reference: Graph, candidate: Graph, seed: int, chosen: bool = False) -> Verdict:
    """Does ``candidate`` compute ``reference``'s outputs (matched by position)?
    ``chosen``: the candidate that will be ranked first (gets the float64 check too)."""
    if have_verifier():
        v = _verifier(reference, seed)
        # A candidate whose per-trial bound is >= 1 can never be certified (certify
        # would answer "inconclusive" after probing); say so without running trials.
        if v.trial_bound(candidate).trials_for(v.bound) is None:
            return Verdict(False, "finite-field random testing (cannot be certified: "
                           "per-trial bound >= 1)", seed, {})
        quick = v.check(candidate, trials=1)  # one trial rejects most wrong ones cheaply
        if quick.equivalent is False:
            return Verdict(False, "finite-field random testing (1 trial, mismatch)", seed,
                           {"mismatch": quick.mismatch.to_json() if quick.mismatch else None})
        cert = v.certify(candidate, crosscheck_float64=chosen)
        doc = cert.to_json()
        return Verdict(cert.verdict == "equivalent", str(doc.get("method")), seed,
                       {"certificate": doc})
    return _interim(reference, candidate, seed)


_VERIFIERS: dict[tuple[Graph, int], Any] = {}


def _verifier(reference: Graph, seed: int) -> Any:
    """One verifier per reference (it caches the reference's outputs per trial)."""
    from mirage_cli.verifier.api import Verifier

    key = (reference, seed)
    if key not in _VERIFIERS:
        _VERIFIERS[key] = Verifier(reference, seed=seed)
    return _VERIFIERS[key]


def _interim(reference: Graph, candidate: Graph, seed: int) -> Verdict:
    ins = interp.random_inputs(reference, seed)
    cand_ins = {c.value.name: ins[r.value.name]
                for r, c in zip(reference.inputs, candidate.inputs)}
    ref = interp.run(reference, ins, "float64")
    out = batched.run(candidate, cand_ins)
    worst = 0.0
    for rn, cn in zip(reference.outputs, candidate.outputs):
        a, b = ref[rn], out[cn]
        if a.shape != b.shape or not np.all(np.isfinite(b)):
            return Verdict(False, INTERIM, seed, {"max_rel_error": None})
        worst = max(worst, float(np.linalg.norm(b - a) / max(np.linalg.norm(a), 1e-300)))
    return Verdict(worst <= RTOL, INTERIM, seed, {"max_rel_error": float(f"{worst:.3e}"),
                                                  "rtol": RTOL})
