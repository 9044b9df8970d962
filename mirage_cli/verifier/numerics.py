"""Numerical safety: a candidate may not be numerically less safe than its program.

The finite-field certificate and the float64 cross-check judge the *real function*;
two graphs equal over the reals can still differ in floating point: ``exp(x) /
sum(exp(x))`` overflows to inf/inf = NaN for logits near 100 where the max-subtracted
form the program means stays finite. So a candidate is also run in **native
precision** (device tensors in their dtype, arithmetic in f32: ``interp`` "native") next
to its program, on inputs of large magnitude (standard normal times each of ``SCALES``:
at 16, a 128-wide dot product of two such inputs scaled by 1/sqrt(128) gives logits of
a few hundred, and rows have norms 16 times larger; inputs of scale 1 are the float64
cross-check's), and both are compared with the program's float64 result on the same
inputs. The program's two runs are cached, so checking the next candidate after a
rejection costs one run. The candidate is *unsafe* at a scale when

- an output element is NaN or infinite where the program's native result is finite
  (overflow, or an underflow turned into 0/0), or
- its relative error ``||c - ref|| / ||ref||`` (over the elements where the float64
  reference is finite) exceeds both ``FLOOR`` (the project's accuracy criterion for
  f16 outputs) and ``FACTOR`` times the program's own error: it lost accuracy where
  the program did not.

Random inputs cancel: a partial sum that a split design stores between its kernels
(``sum exp(x - m_j) * v`` over a chunk of keys) stays small when ``v`` has random
signs, however large. So the candidate is also run with **one input held constant** at
``CONSTANT`` (2^14, a quarter of f16's largest value) and the others standard normal,
for each input in turn: a sum of such values does not cancel, and a partial result
stored in a dtype too narrow for it (an f16 workspace tensor holding the sum of a few
of them) overflows where the program, whose sums stay in f32, does not. On those
inputs only the first rule is judged, and the program is run only where the
candidate's result is not finite: a constant input is a test of range, and the
program's float64 run at the sizes of a large attention costs more than the search.

Elements where the program itself is not finite, or where the exact (float64) value
does not fit the output's dtype, are not judged: the candidate may do anything the
program does, and overflowing a value that is out of range is not a loss of safety.
Nor is overflowing one within rounding noise of the range's end: an exact value closer
to the dtype's largest than ``FLOOR`` times the root mean square of the output (the
error the accuracy criterion allows an element) overflows or not by the order of the
sums, in the program as in the candidate.
Likewise, on an input held constant that takes one of the program's own intermediate
tensors out of its dtype's range in exact arithmetic, finiteness is not judged: the
program's result is then finite only by its roundings (LayerNorm + linear at f16 with the weight held at
2^14: the program rounds ``rms_norm(c, g)`` to f16, saturating at 65504, and adds the
bias after; a kernel that computes ``g * c / rms + b`` and rounds once overflows where
the exact value, past 65504, is out of range in both). The rule is documented in
docs/verification.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mirage_cli.dtypes import largest, round_to
from mirage_cli.ir import DType, Graph, Value
from mirage_cli.verifier import slabs
from mirage_cli.verifier.crosscheck import float_inputs

SCALES = (16.0,)
CONSTANT = 2.0 ** 14
FLOOR = 1e-2
FACTOR = 4.0


@dataclass(frozen=True)
class Inputs:
    """One set of hostile inputs: the standard normal draw times ``scale``, or with
    input number ``constant`` (by position) set to ``CONSTANT`` everywhere."""

    scale: float = 1.0
    constant: int | None = None

    def describe(self, g: Graph) -> str:
        if self.constant is None:
            return f"standard normal x{self.scale:g}"
        return (f"{g.inputs[self.constant].value.name} = {CONSTANT:g}, the others standard "
                "normal")


def regimes(g: Graph) -> tuple[Inputs, ...]:
    """The input sets a candidate of ``g`` is judged on, in order."""
    return (tuple(Inputs(scale=s) for s in SCALES)
            + tuple(Inputs(constant=i) for i in range(len(g.inputs))))


@dataclass(frozen=True)
class Safety:
    """The verdict: ``safe``, and on which inputs and output it failed, and why."""

    safe: bool
    inputs: Inputs | None = None
    output: str | None = None
    reason: str = ""
    # (the inputs described, the program's relative error, the candidate's)
    errors: tuple[tuple[str, float, float], ...] = ()
    failed_on: str = ""  # the failing inputs, described

    @property
    def scale(self) -> float | None:
        """The scale of the failing random inputs (None: safe, or a constant input)."""
        return self.inputs.scale if self.inputs and self.inputs.constant is None else None

    def as_json(self) -> dict[str, object]:
        return {"verdict": "safe" if self.safe else "unsafe",
                "method": "native precision (f32 arithmetic, tensors in their dtype) "
                          "against float64, inputs standard normal times each scale, "
                          "and each input in turn held constant",
                "scales": list(SCALES), "constant": CONSTANT, "floor": FLOOR,
                "factor": FACTOR,
                "errors": [{"inputs": d, "program": p, "candidate": c}
                           for d, p, c in self.errors],
                **({} if self.safe else {"inputs": self.failed_on, "output": self.output,
                                         "reason": self.reason})}


def scaled_inputs(g: Graph, seed: int, scale: float) -> dict[str, np.ndarray]:
    """``interp.random_inputs`` times ``scale``, rounded to each input's dtype (the
    draw is the float64 cross-check's, :func:`.crosscheck.float_inputs`)."""
    return _whole(g, hostile_source(g, seed, Inputs(scale=scale)))


def hostile_inputs(g: Graph, seed: int, which: Inputs) -> dict[str, np.ndarray]:
    """The inputs of ``which`` for ``g`` (see :class:`Inputs`)."""
    return _whole(g, hostile_source(g, seed, which))


def hostile_source(g: Graph, seed: int, which: Inputs) -> slabs.Source:
    """Rows of :func:`hostile_inputs`, built when asked for: every step is element-wise
    (scale, round, or the constant), so rows built alone equal those rows of the whole
    inputs, and a slab by slab run (:mod:`.slabs`) never holds a whole scaled input."""
    base = float_inputs(g, seed)
    types = {i.value.name: i.value.type for i in g.inputs}
    constant = None if which.constant is None else g.inputs[which.constant].value.name

    def rows_of(name: str, rows: slice) -> np.ndarray:
        x = round_to(types[name].dtype, base[name][rows] * np.float32(which.scale))
        return np.full_like(x, CONSTANT) if name == constant else x
    return rows_of


def _whole(g: Graph, source: slabs.Source) -> dict[str, np.ndarray]:
    return {i.value.name: source(i.value.name, slice(None)) for i in g.inputs}


def safety_check(program: Graph, candidate: Graph, seed: int = 0) -> Safety:
    """Is ``candidate`` at least as safe numerically as ``program`` (inputs and outputs
    matched by position)?"""
    with np.errstate(all="ignore"):  # overflow to inf is what is being judged
        return _check(program, candidate, seed)


def _check(program: Graph, candidate: Graph, seed: int) -> Safety:
    errors: list[tuple[str, float, float]] = []
    for which in regimes(program):
        # Each run builds its inputs a slab at a time (:mod:`.slabs`), and only the
        # outputs of one set of inputs are alive at once: at a large attention's sizes
        # whole inputs in float64 are gigabytes each.
        src_c = hostile_source(candidate, seed, which)
        nat_c = slabs.run(candidate, src_c, "native")
        if which.constant is not None and all(np.isfinite(nat_c[o]).all()
                                              for o in candidate.outputs):
            continue  # a test of range only (see the module docstring)
        ref, nat_p, in_range = _program_runs(program, seed, which,
                                             _renamed(src_c, program, candidate))
        types = program.tensor_types()
        for op, oc in zip(program.outputs, candidate.outputs):
            # Out of the dtype's range, or within rounding noise of its end: not
            # judged (see the module docstring).
            fits = _clear_of_range_end(ref[op], types[op].dtype)
            ref[op] = np.where(fits, ref[op], np.nan)
            # A constant input that takes the program's own intermediates out of range
            # tests nothing the program keeps (see the module docstring).
            judged = in_range or which.constant is None
            bad = _judge(ref[op], nat_p[op], nat_c[oc]) if judged else None
            e_p, e_c = _rel_err(nat_p[op], ref[op]), _rel_err(nat_c[oc], ref[op])
            errors.append((which.describe(program), e_p, e_c))
            if bad is None and which.constant is None and e_c > max(FLOOR, FACTOR * e_p):
                bad = (f"relative error {e_c:.3g} where the program's is {e_p:.3g} "
                       "(lost accuracy)")
            if bad is not None:
                return Safety(False, which, oc, bad, tuple(errors), which.describe(program))
    return Safety(True, errors=tuple(errors))


def _renamed(source: slabs.Source, program: Graph, candidate: Graph) -> slabs.Source:
    """The candidate's inputs ``source`` under the program's names (by position)."""
    by_position = {ip.value.name: ic.value.name
                   for ip, ic in zip(program.inputs, candidate.inputs)}
    return lambda name, rows: source(by_position[name], rows)


_RUNS: dict[tuple[Graph, int, Inputs],
            tuple[dict[str, np.ndarray], dict[str, np.ndarray], bool]] = {}


def _program_runs(program: Graph, seed: int, which: Inputs, ins: slabs.Source
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], bool]:
    """The program's float64 and native outputs on the inputs ``ins`` gives (copies:
    the caller edits them), and whether every intermediate tensor of its float64 run
    fits its dtype (see the module docstring)."""
    key = (program, seed, which)
    if key not in _RUNS:
        if any(k[:2] != key[:2] for k in _RUNS):
            _RUNS.clear()  # one program at a time: these hold whole outputs
        outputs = set(program.outputs)
        fits = [True]

        def observe(v: Value, x: np.ndarray) -> None:
            if v.name not in outputs and fits[0]:
                with np.errstate(over="ignore"):
                    fits[0] = bool(np.isfinite(round_to(v.type.dtype, x)).all())
        ref = slabs.run(program, ins, "float64", observe=observe)
        _RUNS[key] = (ref, slabs.run(program, ins, "native"), fits[0])
    ref, nat, in_range = _RUNS[key]
    return dict(ref), dict(nat), in_range


def _clear_of_range_end(ref: np.ndarray, dtype: DType) -> np.ndarray:
    """Where the exact values ``ref`` fit ``dtype`` with a margin of ``FLOOR`` times
    their root mean square: the error the accuracy criterion allows an element of a
    result of that size. Within the margin, whether the native result overflows is
    decided by rounding noise, the program's as much as a candidate's (LayerNorm +
    linear at f16 with the weight held at 2^14: an exact output of -65427, 0.1% inside
    the range, came out -64608 in the program and -inf in a two-kernel design whose
    sums run in another order)."""
    finite = np.isfinite(ref)
    if not finite.any():
        return finite
    rms = float(np.sqrt(np.mean(np.square(ref[finite], dtype=np.float64))))
    return finite & (np.abs(ref) <= largest(dtype) - FLOOR * rms)


def _judge(ref: np.ndarray, prog: np.ndarray, cand: np.ndarray) -> str | None:
    """Why ``cand`` is unsafe element-wise (None if it is not)."""
    worse = np.isfinite(prog) & np.isfinite(ref) & ~np.isfinite(cand)
    if not worse.any():
        return None
    n = int(worse.sum())
    kind = "NaN" if np.isnan(cand[worse]).any() else "infinite"
    return f"{n} of {cand.size} elements {kind} where the program's are finite"


def _rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    """||x - ref|| / ||ref|| over the elements where ``ref`` and ``x`` are finite (an
    element where only ``x`` is not finite is judged by ``_judge``)."""
    ok = np.isfinite(ref) & np.isfinite(x)
    if not ok.any():
        return 0.0
    d = x[ok].astype(np.float64) - ref[ok]
    norm = float(np.linalg.norm(ref[ok]))
    return float(np.linalg.norm(d)) / norm if norm > 0 else float(np.linalg.norm(d))
