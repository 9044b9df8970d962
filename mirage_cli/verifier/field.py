"""Arithmetic in the two prime fields of the verifier, on numpy int64 arrays.

The fields: ``P`` (2147483579) and ``Q`` (1073741789) with ``P = 2 Q + 1``: both prime,
``Q`` divides ``P - 1``, so the squares of ``Z_P*`` form a cyclic group of prime order
``Q`` and ``exp(a) = g**a`` (``g`` a square other than 1) maps ``(Z_Q, +)`` into
``(Z_P*, x)`` homomorphically: the two-field trick of Mirage, with fields ~2^31 and
~2^30 instead of 167 and 83. Both moduli are below 2^31, so a product of two residues
fits in an int64 and never overflows.

Matrix products cannot use int64 numpy matmul (slow, and sums of 4096 products of
two 31-bit numbers overflow). They are computed exactly with float64 BLAS instead:
each residue is split into a 15-bit high and 16-bit low limb, three limb products are
formed (Karatsuba), every partial sum stays below 2^53 (exact in float64) because the
reduction dimension is cut into chunks of at most 2^18, and the results are reduced
mod the prime in int64.

Random functions (for operators with no field meaning) are a keyed 64-bit mixer
(splitmix64's finaliser) applied element-wise; both graphs of a comparison use the same
key, so equal arguments always give equal results.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

P = 2147483579
Q = 1073741789
assert P == 2 * Q + 1

_CHUNK = 1 << 18  # reduction-dimension chunk of exact float64 limb products


def matmul_mod(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    """``(a @ b) mod m`` for residues in [0, m), m < 2^31, batched like np.matmul."""
    k = a.shape[-1]
    if k > _CHUNK:
        out = None
        for s in range(0, k, _CHUNK):
            part = matmul_mod(a[..., s:s + _CHUNK], b[..., s:s + _CHUNK, :], m)
            out = part if out is None else (out + part) % m
        assert out is not None
        return out
    a1, a0 = (a >> 16).astype(np.float64), (a & 0xFFFF).astype(np.float64)
    b1, b0 = (b >> 16).astype(np.float64), (b & 0xFFFF).astype(np.float64)
    hi = np.matmul(a1, b1).astype(np.int64) % m
    lo = np.matmul(a0, b0).astype(np.int64) % m
    mid = np.matmul(a1 + a0, b1 + b0).astype(np.int64) % m
    mid = (mid - hi - lo) % m
    # hi * 2^32 + mid * 2^16 + lo, reduced step by step to stay below 2^63.
    r = (hi << 16) % m
    r = ((r + mid) << 16) % m
    return (r + lo) % m


def pow_mod(base: np.ndarray, e: int, m: int) -> np.ndarray:
    """Element-wise ``base ** e mod m`` (square and multiply over the bits of e)."""
    result = np.ones_like(base)
    b = base % m
    while e:
        if e & 1:
            result = result * b % m
        b = b * b % m
        e >>= 1
    return result


def inverse(x: np.ndarray, m: int) -> tuple[np.ndarray, bool]:
    """Element-wise inverse mod prime m; zeros map to 0. Returns (inverse, any zero)."""
    return pow_mod(x, m - 2, m), bool((x == 0).any())


def const(value: float | int | bool, m: int) -> int:
    """The residue of an exact rational constant: a float is a dyadic rational
    ``n / 2^k``, mapped to ``n * (2^k)^-1 mod m`` (no rounding involved)."""
    from fractions import Fraction

    f = Fraction(value)
    return f.numerator % m * pow(f.denominator % m, m - 2, m) % m


class ExpTable:
    """``g ** a mod P`` for exponents ``a`` in Z_Q, by two table look-ups."""

    def __init__(self, g: int) -> None:
        self.g = g
        self.lo = _pow_table(g, 1, 1 << 15)
        self.hi = _pow_table(pow(g, 1 << 15, P), 1, 1 << 15)

    def __call__(self, a: np.ndarray) -> np.ndarray:
        return self.hi[a >> 15] * self.lo[a & 0x7FFF] % P


def _pow_table(g: int, start: int, n: int) -> np.ndarray:
    """[g^0, g^1, ..., g^(n-1)] mod P, by doubling (vectorised)."""
    t = np.ones(n, dtype=np.int64)
    t[1:2] = g % P
    filled = 2 if n > 1 else 1
    while filled < n:
        step = pow(g, filled, P)
        take = min(filled, n - filled)
        t[filled:filled + take] = t[:take] * step % P
        filled += take
    return t


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective avalanche mix of uint64 values."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64, copy=True)
        x ^= x >> np.uint64(30)
        x *= _M1
        x ^= x >> np.uint64(27)
        x *= _M2
        x ^= x >> np.uint64(31)
    return x


def hash_key(salt: int, kp: np.ndarray, kq: np.ndarray | None) -> np.ndarray:
    """A 64-bit pseudo-random function of (salt, kp[, kq]) per element."""
    with np.errstate(over="ignore"):
        h = mix64(kp.astype(np.uint64) ^ np.uint64(salt & (2**64 - 1)))
        if kq is not None:
            h = mix64(h + kq.astype(np.uint64) * _GOLD)
        return mix64(h + _GOLD)


def hash_to_fields(h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two residues (mod P, mod Q) from 64-bit hashes, almost uniform (bias < 2^-32)."""
    hp = (h >> np.uint64(1)) % np.uint64(P)
    hq = mix64(h ^ _GOLD) >> np.uint64(1)
    return hp.astype(np.int64), (hq % np.uint64(Q)).astype(np.int64)


@lru_cache(maxsize=64)
def subgroup_generator(seed: int, trial: int) -> int:
    """A pseudo-random generator of the order-Q subgroup of Z_P* (a square != 1)."""
    rng = np.random.default_rng([seed, trial, 0x6E])
    while True:
        h = int(rng.integers(2, P - 1))
        g = h * h % P
        if g != 1:
            return g
