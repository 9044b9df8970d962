"""The one function through which the search verifies a candidate.

A candidate is certified by the finite-field verifier (:mod:`mirage_cli.verifier`,
DESIGN.md §4) through ``Verifier.certify``: finite-field trials to the default bound;
it passes only on the verdict ``equivalent``, and its certificate is kept in the
candidate's metadata. The chosen (first-ranked) candidate's float64 cross-check is
done by the driver on the final ranking.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from mirage_cli.ir import Graph


@dataclass(frozen=True)
class Verdict:
    ok: bool
    method: str
    seed: int
    detail: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"equivalent": self.ok, "method": self.method, "seed": self.seed,
                **self.detail}


def verify(reference: Graph, candidate: Graph, seed: int) -> Verdict:
    """Does ``candidate`` compute ``reference``'s outputs (matched by position)?"""
    v = _verifier(reference, seed)
    # A candidate whose per-trial bound is >= 1 can never be certified (certify would
    # answer "inconclusive" after probing); say so without running trials.
    if v.trial_bound(candidate).trials_for(v.bound) is None:
        return Verdict(False, "finite-field random testing (cannot be certified: "
                       "per-trial bound >= 1)", seed, {})
    quick = v.check(candidate, trials=1)  # one trial rejects most wrong ones cheaply
    if quick.equivalent is False:
        return Verdict(False, "finite-field random testing (1 trial, mismatch)", seed,
                       {"mismatch": quick.mismatch.to_json() if quick.mismatch else None})
    cert = v.certify(candidate, crosscheck_float64=False)
    doc = cert.to_json()
    return Verdict(cert.verdict == "equivalent", str(doc.get("method")), seed,
                   {"certificate": doc})


def verify_composed(reference: Graph, candidate: Graph, parts: list[dict[str, Any] | None],
                    seed: int) -> Verdict:
    """A candidate joined from parts of a cut program (:mod:`.partition`), each part
    already certified against its own sub-program (``None``: the program's own
    operator, identical). Replacing each part by an equivalent one composes to an
    equivalent whole, and a wrong "equivalent" for the whole needs a wrong one for some
    part: the whole's bound is the sum of the parts' bounds. One finite-field trial of
    the whole checks the join itself (renaming, wiring)."""
    bounds = []
    for p in parts:
        if p is not None:
            cert = p.get("certificate") or {}
            if not p.get("equivalent") or cert.get("bound") is None:
                return Verdict(False, "composition (a part is not certified)", seed, {})
            bounds.append(float(cert["bound"]))
    quick = _verifier(reference, seed).check(candidate, trials=1)
    if quick.equivalent is not True:
        return Verdict(False, "finite-field random testing of the joined parts (1 trial)",
                       seed, {"mismatch": quick.mismatch.to_json() if quick.mismatch
                              else None, "reason": quick.reason})
    return Verdict(True, "composition of certified parts (bound: the sum of the parts' "
                   "bounds) and 1 finite-field trial of the whole", seed,
                   {"bound": sum(bounds), "parts": parts})


# The verifiers of the last few references: each keeps its reference's random inputs
# for up to two trials, which at a layer's full size are gigabytes (the Llama layer's
# weights, as 64-bit field elements, are 1.7 GB a trial); a layer's parts are searched
# one after another, so older parts' verifiers are dropped rather than kept to the end.
_VERIFIERS: OrderedDict[tuple[Graph, int], Any] = OrderedDict()
MAX_VERIFIERS = 2


def _verifier(reference: Graph, seed: int) -> Any:
    """One verifier per recent reference (it caches the reference's outputs per
    trial)."""
    from mirage_cli.verifier.api import Verifier

    key = (reference, seed)
    if key in _VERIFIERS:
        _VERIFIERS.move_to_end(key)
    else:
        while len(_VERIFIERS) >= MAX_VERIFIERS:
            _VERIFIERS.popitem(last=False)
        _VERIFIERS[key] = Verifier(reference, seed=seed)
    return _VERIFIERS[key]
