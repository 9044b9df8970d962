"""The probability bound of finite-field testing (derived in docs/verification.md).

For two graphs that are NOT equivalent in the field model, one trial (inputs drawn
uniformly from Z_P and Z_Q, fresh random functions and a fresh generator g) passes with
probability at most

    eps = (d / 2^22 + sum_f C(k_f, 2) * c_f) / (1 - z / 2^22)

- ``d``: degree of the cleared difference N_A D_B - N_B D_A of the first differing
  output (max over outputs of max(n_A + d_B, n_B + d_A)); Schwartz-Zippel over
  variables drawn from sets of size >= 2^22 (inputs are drawn from [0, 2^22));
- ``k_f``: keys fed to random function f in one trial by both graphs together;
  ``c_f``: probability that two different keys of degree <= e collide, (e/2^22)^3
  when keys carry all three residues (mod P, mod Q, mod P at a second, independent
  point), e/2^22 when they exist in Z_P only (downstream of exp); plus 2^-64 for
  multiset fingerprints (max), which can also collide as 64-bit hashes;
- ``z``: the zero-divisor risk (elements inverted x their degree, both graphs); trials
  that hit a zero divisor are discarded, which conditions on the event of probability
  >= 1 - z/2^22 that none does.

Trials are independent, so n passing trials bound the error by eps^n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mirage_cli.semantics.field import INPUT_BITS, Q
from mirage_cli.verifier.analysis import Profile


@dataclass(frozen=True)
class TrialBound:
    """The per-trial bound and its parts (all probabilities)."""

    degree: int
    schwartz_zippel: float
    collisions: float
    zero_divisor_risk: float
    per_trial: float

    def trials_for(self, bound: float) -> int | None:
        """Trials needed for ``per_trial ** n <= bound`` (None: unreachable)."""
        if self.per_trial >= 1.0:
            return None
        if self.per_trial <= 0.0:
            return 1
        return max(1, math.ceil(math.log(bound) / math.log(self.per_trial)))

    def after(self, trials: int) -> float:
        return min(1.0, self.per_trial) ** trials


def trial_bound(a: Profile, b: Profile) -> TrialBound:
    d = max([max(x.num + y.den, y.num + x.den) for x, y in zip(a.outputs, b.outputs)]
            + [1])
    # Inputs range over a set of 2^INPUT_BITS, random atoms over Z_P, exp atoms over
    # the order-Q subgroup: the smallest sampling set is the inputs'.
    sz = d / min(Q, 1 << INPUT_BITS)
    coll = 0.0
    for name in sorted(set(a.random) | set(b.random)):
        ua, ub = a.random.get(name), b.random.get(name)
        uses = [u for u in (ua, ub) if u is not None]
        k = sum(u.keys for u in uses)
        e = max(u.key_degree for u in uses)
        # Each residue of a key is a polynomial in inputs drawn from a set of size s;
        # keys carry three residues at independent points (one after exp).
        s = min(Q, 1 << INPUT_BITS)
        c = e / s if any(u.p_only for u in uses) else (e / s) ** 3
        if any(u.multiset for u in uses):
            c += 2.0 ** -64  # two multisets' 64-bit fingerprints (random oracle)
        coll += k * (k - 1) / 2 * c
    # A divisor is a polynomial in the inputs: zero with probability <= degree / 2^22.
    z = (a.inversions + b.inversions) / min(Q, 1 << INPUT_BITS)
    per = 1.0 if z >= 1 else (sz + coll) / (1 - z)
    return TrialBound(d, sz, coll, z, min(1.0, per))
