"""The verifier's API: compile a reference graph once, check many candidates.

Stable entry points (used by the search and by ``mirage verify``)::

    from mirage_cli.verifier.api import Verifier
    v = Verifier(reference_graph, seed=0, bound=2**-40)
    v.check(candidate)    -> Verdict      # fast: finite field, 1 trial by default
    v.certify(candidate)  -> Certificate  # finite field to the bound + float64 check

- Graphs are compared input-by-position and output-by-position; different input or
  output shapes, dtypes or counts raise :class:`MirageError` (bad input, exit 2).
- ``check(candidate, trials=1)`` runs ``trials`` finite-field trials. The reference's
  outputs of each trial (its "fingerprints") and the trial's inputs are computed once
  and cached, so checking a candidate costs one evaluation of the candidate per trial.
  A graph too large to evaluate at once is evaluated slab by slab along an independent
  leading axis (:mod:`.slabs`), drawing each slab's inputs when it is evaluated: same
  residues, same outputs, the memory of one slab (its inputs are then not cached).
  ``Verdict.equivalent`` is False on a mismatch (a proof of non-equivalence in the
  field model), True when every trial passed, None when the field model does not
  apply (e.g. nested exp) or every trial met a zero divisor.
- ``certify(candidate, crosscheck=True)`` runs as many trials as the requested bound
  needs (or ``trials`` when given), then the float64 cross-check, and returns a
  :class:`Certificate` whose ``to_json()`` is deterministic for a given seed.
- Everything depends only on (graphs, seed, bound/trials): same inputs, same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mirage_cli import ops
from mirage_cli.diagnostics import MirageError
from mirage_cli.ir import Graph
from mirage_cli.semantics.field import INPUT_BITS, P, Q, register_bits
from mirage_cli.semantics.fieldsem import FieldSem
from mirage_cli.semantics.values import FVal, TrialContext, Unsupported
from mirage_cli.verifier.analysis import Profile, profile
from mirage_cli.verifier.bound import TrialBound, trial_bound
from mirage_cli.verifier.crosscheck import CrossCheck, crosscheck
from mirage_cli.verifier.evaluate import evaluate
from mirage_cli.verifier.slabs import Slabs, gather, plan

DEFAULT_BOUND = 2.0 ** -40
# Trials that met a zero divisor are replaced; give up after this many replacements.
MAX_DISCARDED = 16
# In this trial the outputs are compared mod Q as well as mod P. A float constant c is
# mapped to an exact dyadic rational mod each prime, so a constant chosen to agree with
# another mod P (1 + P * 2^-52 is 1 mod P) still differs mod Q: a pair that only a
# multiple of P separates is caught here (docs/verification.md, "constants").
SECOND_FIELD_TRIAL = 0


@dataclass(frozen=True)
class Mismatch:
    """Where two graphs' outputs differ in one trial."""

    output: int
    name_a: str
    name_b: str
    index: tuple[int, ...]
    count: int
    total: int
    value_a: int
    value_b: int
    modulus: str = "P"

    def describe(self) -> str:
        idx = ", ".join(str(i) for i in self.index)
        return (f"output #{self.output} ('{self.name_a}' vs '{self.name_b}') differs at "
                f"[{idx}]: {self.value_a} vs {self.value_b} (mod {self.modulus}); "
                f"{self.count} of {self.total} elements differ")

    def to_json(self) -> dict[str, Any]:
        return {"output": self.output, "name_a": self.name_a, "name_b": self.name_b,
                "index": list(self.index), "differing": self.count, "elements": self.total,
                "modulus": self.modulus}


@dataclass(frozen=True)
class Verdict:
    """The finite-field verdict: True, False or None (undecided)."""

    equivalent: bool | None
    trials: int
    discarded: int
    mismatch: Mismatch | None = None
    failing_trial: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class Certificate:
    """A reproducible record of a verification (``to_json`` is deterministic)."""

    verdict: str
    seed: int
    requested: dict[str, Any]
    field_verdict: Verdict
    bound: TrialBound
    final_bound: float
    treatments: dict[str, str]
    assumptions: tuple[str, ...]
    crosscheck: CrossCheck | None
    disagreement: str | None
    counterexample_trial: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict == "equivalent" else 1

    def to_json(self) -> dict[str, Any]:
        fv = self.field_verdict
        return {
            "verdict": self.verdict,
            "method": "finite-field random testing (Schwartz-Zippel) with a float64 "
                      "cross-check",
            "fields": {"P": P, "Q": Q, "relation": "P = 2Q + 1, Q | P - 1",
                       "exp": "exp(a) = g^a for a in Z_Q, g of order Q in Z_P*, drawn "
                              "per trial",
                       "inputs": f"each residue uniform in [0, 2^{INPUT_BITS}), drawn per "
                                 "trial from (seed, trial)",
                       "compared": "every output element's residue mod P, exactly; in "
                                   f"trial {SECOND_FIELD_TRIAL} also mod Q (every output "
                                   "with a Z_Q meaning: not computed from exp)"},
            "seed": self.seed,
            "requested": self.requested,
            "finite_field": {
                "verdict": _word(fv.equivalent),
                "trials": fv.trials, "discarded_trials": fv.discarded,
                "reason": fv.reason,
                "mismatch": fv.mismatch.to_json() if fv.mismatch else None,
                "failing_trial": fv.failing_trial,
            },
            "bound": self.final_bound if fv.equivalent else None,
            "per_trial": {"bound": self.bound.per_trial, "degree": self.bound.degree,
                          "schwartz_zippel": self.bound.schwartz_zippel,
                          "random_function_collisions": self.bound.collisions,
                          "zero_divisor_risk": self.bound.zero_divisor_risk},
            "operators": self.treatments,
            "assumptions": list(self.assumptions),
            "float64": self.crosscheck.summary() if self.crosscheck else None,
            "disagreement": self.disagreement,
        }


def _word(eq: bool | None) -> str:
    return {True: "equivalent", False: "not equivalent", None: "undecided"}[eq]


def check_signatures(a: Graph, b: Graph) -> None:
    """Inputs and outputs must match by position in shape and dtype (else exit 2)."""
    for what, xs, ys in (("input", [i.value for i in a.inputs], [i.value for i in b.inputs]),
                         ("output", _outs(a), _outs(b))):
        if len(xs) != len(ys):
            raise MirageError(f"the graphs have different numbers of {what}s: "
                              f"{len(xs)} ('{a.name}') and {len(ys)} ('{b.name}')")
        for k, (x, y) in enumerate(zip(xs, ys)):
            if x.type != y.type:
                raise MirageError(f"{what} #{k} differs: '{x.name}' is {x.type} in "
                                  f"'{a.name}' but '{y.name}' is {y.type} in '{b.name}'")


def _outs(g: Graph) -> list[Any]:
    from mirage_cli.ir import Value

    types = g.tensor_types()
    return [Value(o, types[o]) for o in g.outputs]


class Verifier:
    """Finite-field verifier of candidates against one reference graph."""

    def __init__(self, reference: Graph, seed: int = 0, bound: float = DEFAULT_BOUND,
                 trials: int | None = None) -> None:
        if not 0.0 < bound < 1.0:
            raise MirageError(f"the bound must be in (0, 1), got {bound}")
        if seed < 0:
            raise MirageError(f"the seed must be a non-negative integer, got {seed}")
        if trials is not None and trials < 1:
            raise MirageError(f"the number of trials must be positive, got {trials}")
        self.reference = reference
        self.seed = seed
        self.bound = bound
        self.trials = trials
        self.profile: Profile = profile(reference)
        self._inputs: dict[int, list[FVal]] = {}
        self._ref: dict[int, tuple[list[np.ndarray] | None, bool, str]] = {}
        self._ref_q: list[np.ndarray | None] | None = None
        # The last candidate's trials (``check`` then ``certify`` of one candidate
        # replay the same trials; a trial's result depends only on (graph, trial)).
        self._cand: tuple[Graph | None, dict[int, Any]] = (None, {})

    # -- trials -----------------------------------------------------------------

    def trial_inputs(self, t: int) -> list[FVal]:
        """The field inputs of trial ``t`` by position (lazily drawn, cached)."""
        if t not in self._inputs:
            if len(self._inputs) >= 2:  # keep memory bounded on large programs
                self._inputs.pop(max(self._inputs))
            self._inputs[t] = [_random_input(self.seed, t, k, i.value.type.shape)
                               for k, i in enumerate(self.reference.inputs)]
        return self._inputs[t]

    def run_trial(self, g: Graph, t: int) -> tuple[list[np.ndarray] | None, bool, str]:
        outs, zero, why, _ = self._run(g, t)
        return outs, zero, why

    def _run(self, g: Graph, t: int) -> tuple[list[np.ndarray] | None, bool, str,
                                               list[np.ndarray | None]]:
        """Outputs mod P, zero division met, why unsupported, and (only in the second
        field's trial) outputs mod Q, None where an output has no Z_Q meaning."""
        ctx = TrialContext(self.seed, t)
        slabs = plan(g)
        try:
            if slabs is None:
                vals = evaluate(g, self.trial_inputs(t), ctx)
                outs = [o.p for o in vals]
                second = [o.q for o in vals] if t == SECOND_FIELD_TRIAL else []
            else:
                outs, second = self._run_slabs(g, slabs, t, ctx)
        except Unsupported as e:
            return None, False, str(e), []
        return outs, ctx.zero_division[0], "", second

    def _run_slabs(self, g: Graph, slabs: Slabs, t: int, ctx: TrialContext
                   ) -> tuple[list[np.ndarray], list[np.ndarray | None]]:
        """:meth:`_run`'s outputs mod P (and mod Q in the second field's trial), slab by
        slab: each slab's axis-carrying inputs are drawn as it is evaluated (the rows
        of the whole draw), the axis-free ones come whole from the trial's cache; one
        context for all slabs, so a zero divisor met in any slab is the trial's."""
        whole = self.trial_inputs(t)  # lazy: only the axis-free inputs get drawn
        shapes = [i.value.type.shape for i in g.inputs]
        n = len(g.outputs)
        both = t == SECOND_FIELD_TRIAL

        def one(s: int) -> list[np.ndarray | None]:
            rows = slabs.rows_of(s)
            ins = [_random_input(self.seed, t, k, shapes[k], rows) if c else whole[k]
                   for k, c in enumerate(slabs.inputs)]
            vals = evaluate(slabs.graph, ins, ctx)
            return [o.p for o in vals] + ([o.q for o in vals] if both else [])

        res = gather(slabs, slabs.outputs * (2 if both else 1), one)
        outs = res[:n]
        assert all(x is not None for x in outs)  # a residue mod P exists or raised
        return outs, res[n:]  # type: ignore[return-value]

    def _run_candidate(self, g: Graph, t: int) -> tuple[list[np.ndarray] | None, bool,
                                                        str, list[np.ndarray | None]]:
        """:meth:`_run` of a candidate, remembered for the last candidate checked."""
        last, runs = self._cand
        if last is not g:
            runs = {}
            self._cand = (g, runs)
        if t not in runs:
            runs[t] = self._run(g, t)
        return runs[t]  # type: ignore[no-any-return]

    def reference_outputs(self, t: int) -> tuple[list[np.ndarray] | None, bool, str]:
        if t not in self._ref:
            outs, zero, why, second = self._run(self.reference, t)
            self._ref[t] = (outs, zero, why)
            if t == SECOND_FIELD_TRIAL:
                self._ref_q = second
        return self._ref[t]

    # -- verdicts ---------------------------------------------------------------

    def check(self, candidate: Graph, trials: int = 1) -> Verdict:
        """``trials`` passing finite-field trials, or the first mismatch."""
        check_signatures(self.reference, candidate)
        passed = discarded = 0
        t = 0
        while passed < trials:
            if discarded > MAX_DISCARDED:
                return Verdict(None, passed, discarded, reason="a division met a zero "
                               "divisor in every trial")
            ref, ref_zero, why = self.reference_outputs(t)
            out, zero, why_c, second = (self._run_candidate(candidate, t)
                                        if ref is not None else (None, False, "", []))
            if ref is None or out is None:
                return Verdict(None, passed, discarded, reason=why or why_c)
            if ref_zero or zero:
                discarded += 1
            else:
                m = _mismatch(self.reference, candidate, ref, out)
                if m is None and t == SECOND_FIELD_TRIAL and self._ref_q is not None:
                    m = _mismatch_q(self.reference, candidate, self._ref_q, second)
                if m is not None:
                    return Verdict(False, passed + 1, discarded, m, t, "outputs differ")
                passed += 1
            t += 1
        return Verdict(True, passed, discarded, reason="every trial passed")

    def trial_bound(self, candidate: Graph) -> TrialBound:
        return trial_bound(self.profile, profile(candidate))

    def certify(self, candidate: Graph, crosscheck_float64: bool = True) -> Certificate:
        """Finite-field trials to the bound, then the float64 cross-check."""
        check_signatures(self.reference, candidate)
        tb = self.trial_bound(candidate)
        n = self.trials if self.trials is not None else tb.trials_for(self.bound)
        requested: dict[str, Any] = ({"trials": self.trials} if self.trials is not None
                                     else {"bound": self.bound})
        if n is None:
            fv = Verdict(None, 0, 0, reason="the per-trial bound is >= 1 for these graphs "
                         "(too many random-function keys or divisions for the fields)")
            # Still look for a counterexample with a few trials.
            probe = self.check(candidate, trials=2)
            if probe.equivalent is False:
                fv = probe
        else:
            fv = self.check(candidate, trials=n)
        cc = crosscheck(self.reference, candidate, self.seed) if crosscheck_float64 else None
        verdict, disagreement = _combine(fv, cc)
        return Certificate(verdict, self.seed, requested, fv, tb, tb.after(fv.trials),
                           self._treatments(candidate), self._assumptions(candidate),
                           cc, disagreement, fv.failing_trial)

    def _treatments(self, candidate: Graph) -> dict[str, str]:
        used = self.profile.operators | profile(candidate).operators
        out = {}
        for name in sorted(used):
            s = ops.get(name).field
            assert isinstance(s, FieldSem)
            out[name] = s.treatment
        return out

    def _assumptions(self, candidate: Graph) -> tuple[str, ...]:
        used = self.profile.operators | profile(candidate).operators
        out = [("the cleared difference of the two graphs, a polynomial with rational "
                "coefficients, has a coefficient that P does not divide, or, for an "
                "output not computed from exp, one that P * Q does not divide (trial "
                f"{SECOND_FIELD_TRIAL} compares such outputs mod Q too)"),
               "random functions are a keyed 64-bit hash, modelled as uniformly random"]
        if any(ops.get(n).field.uses_exp for n in used):
            out.append("exp (generic-exponent model): the values g^b of pairwise distinct "
                       "exponent terms are treated as independent uniform elements of "
                       "the order-Q subgroup, up to exp(a+b) = exp(a) exp(b); this step is "
                       "not proven (see docs/verification.md)")
        return tuple(out)


def _combine(fv: Verdict, cc: CrossCheck | None) -> tuple[str, str | None]:
    """The overall verdict; a disagreement between the methods is reported."""
    if cc is None:
        return _word(fv.equivalent), None
    if fv.equivalent is None:
        return "undecided", ("the finite-field method could not decide (" + fv.reason +
                             "); float64 says " + ("close" if cc.close else "different"))
    if fv.equivalent == cc.close:
        return _word(fv.equivalent), None
    if fv.equivalent:
        return "undecided", ("finite field: equivalent, but float64 outputs differ beyond "
                             "the tolerance")
    return "undecided", ("finite field: not equivalent (a rewrite relying on an identity "
                         "the field model does not have?), but float64 outputs agree")


def _random_input(seed: int, t: int, k: int, shape: tuple[int, ...],
                  rows: slice = slice(None)) -> FVal:
    """Input ``k`` of trial ``t`` (its residues drawn on first use), or its ``rows``
    (of dim 0, a step-1 slice): the same values as those rows of the whole input."""
    start, stop, _ = rows.indices(shape[0]) if shape else (0, 0, 1)
    part = shape if rows == slice(None) else (stop - start,) + shape[1:]
    skip = start * int(np.prod(shape[1:], dtype=np.int64))

    def draw(which: int) -> np.ndarray:
        return draw_uniform(np.random.default_rng([seed, t, k, which]), part, skip)
    return FVal(lambda: draw(0), lambda: draw(1), lambda: draw(2))


def draw_uniform(rng: np.random.Generator, shape: tuple[int, ...], skip: int = 0
                 ) -> np.ndarray:
    """int64 values uniform in [0, 2^INPUT_BITS): the low INPUT_BITS bits of the
    generator's 32-bit output words (uniform and independent, as every bit of PCG64's
    output is), masked straight into the result: no intermediate arrays. ``skip``: the
    elements from number ``skip`` on of a longer draw (PCG64 jumps over the 64-bit words
    before them, each of which holds two elements), so rows of an input can be drawn
    without drawing the whole input."""
    n = int(np.prod(shape))
    bits = rng.bit_generator
    assert isinstance(bits, np.random.PCG64)  # default_rng's, which can jump
    bits.advance(skip // 2)
    odd = skip % 2
    words = bits.random_raw((odd + n + 1) // 2).view(np.uint32)[odd:odd + n]
    x = np.empty(shape, dtype=np.int64)
    np.bitwise_and(words.reshape(shape), np.uint32((1 << INPUT_BITS) - 1), out=x,
                   casting="unsafe")
    if x.size >= 1 << 16:
        register_bits(x, INPUT_BITS)  # spares large matmuls a pass for the max
    return x


def _mismatch(a: Graph, b: Graph, ya: list[np.ndarray], yb: list[np.ndarray]
              ) -> Mismatch | None:
    for k, (x, y) in enumerate(zip(ya, yb)):
        if not np.array_equal(x, y):
            diff = np.argwhere(x != y)
            idx = tuple(int(i) for i in diff[0])
            return Mismatch(k, a.outputs[k], b.outputs[k], idx, len(diff), int(x.size),
                            int(x[idx]), int(y[idx]))
    return None


def _mismatch_q(a: Graph, b: Graph, ya: list[np.ndarray | None],
                yb: list[np.ndarray | None]) -> Mismatch | None:
    """The first difference mod Q, over the outputs both graphs give a Z_Q meaning."""
    pairs = [(x, y) if x is not None and y is not None else (None, None)
             for x, y in zip(ya, yb)]
    for k, (x, y) in enumerate(pairs):
        if x is None or y is None:
            continue
        m = _mismatch(a, b, [np.zeros(1)] * k + [x], [np.zeros(1)] * k + [y])
        if m is not None:
            return Mismatch(m.output, m.name_a, m.name_b, m.index, m.count, m.total,
                            m.value_a, m.value_b, "Q")
    return None
