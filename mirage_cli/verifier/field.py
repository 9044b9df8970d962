"""Arithmetic in the two prime fields of the verifier, on numpy int64 arrays.

The fields: ``P`` (2147483579) and ``Q`` (1073741789) with ``P = 2 Q + 1``: both prime,
``Q`` divides ``P - 1``, so the squares of ``Z_P*`` form a cyclic group of prime order
``Q`` and ``exp(a) = g**a`` (``g`` a square other than 1) maps ``(Z_Q, +)`` into
``(Z_P*, x)`` homomorphically: the two-field trick of Mirage, with fields ~2^31 and
~2^30 instead of 167 and 83. Both moduli are below 2^31, so a product of two residues
fits in an int64 and never overflows.

Matrix products cannot use int64 numpy matmul (slow, and sums of 4096 products of
two 31-bit numbers overflow). They are computed exactly with float64 BLAS instead:
operands are split into 16-bit limbs where needed and the reduction dimension is cut
into chunks so that every partial sum stays below 2^53 (exact in float64); the chunk
results are reduced mod the prime in int64 (see :func:`matmul_mod`).

Random functions (for operators with no field meaning) are a keyed 64-bit mixer
(splitmix64's finaliser) applied element-wise; both graphs of a comparison use the same
key, so equal arguments always give equal results.
"""

from __future__ import annotations

import weakref
from functools import lru_cache

import numpy as np

P = 2147483579
Q = 1073741789
assert P == 2 * Q + 1

# Inputs are drawn from [0, 2^INPUT_BITS) (a subset of both fields): Schwartz-Zippel
# only needs a large sampling set, and small inputs let a product of two inputs be
# summed exactly in float64 without splitting into limbs.
INPUT_BITS = 22
_EXACT_BITS = 53  # float64 represents every integer below 2^53 exactly


def _bits(x: np.ndarray) -> int:
    return int(x.max()).bit_length() if x.size else 0


def _chunk(bits_a: int, bits_b: int) -> int:
    """Largest number of products of such operands that sum exactly in float64."""
    return 1 << max(0, _EXACT_BITS - bits_a - bits_b)


# float64 copies of large int64 arrays (the trial inputs), by id of the owning array.
# int64 and float64 have the same item size, so any view of the int64 array (a tile
# made by reshape/transpose/broadcast) is the same view of its float64 mirror.
# A mirror lives exactly as long as its int64 array (a weak reference and a finalizer).
_MIRRORS: dict[int, tuple[weakref.ref[np.ndarray], np.ndarray]] = {}


def register_mirror(x: np.ndarray) -> None:
    """Keep a float64 copy of ``x`` (a C-contiguous int64 array) for matmuls."""
    _MIRRORS[id(x)] = (weakref.ref(x), x.astype(np.float64))
    weakref.finalize(x, _MIRRORS.pop, id(x), None)


def as_float(a: np.ndarray) -> np.ndarray:
    """``a`` as float64, through the mirror of the array it is a view of, if any."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    hit = _MIRRORS.get(id(root))
    if hit is None or hit[0]() is not root or a.dtype != np.int64:
        return a.astype(np.float64)
    mirror = hit[1]
    offset = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    flat = mirror.reshape(-1)[offset // 8:]
    return np.lib.stride_tricks.as_strided(flat, a.shape, a.strides, writeable=False)


def _gemm(a: np.ndarray, b: np.ndarray, m: int, chunk: int) -> np.ndarray:
    """``(a @ b) mod m`` by float64 GEMMs over chunks of the reduction dimension in
    which every partial sum is exact."""
    k = a.shape[-1]
    af, bf = as_float(a), as_float(b)
    out = None
    for s in range(0, k, chunk):
        part = np.matmul(af[..., s:s + chunk], bf[..., s:s + chunk, :]).astype(np.int64) % m
        out = part if out is None else (out + part) % m
    assert out is not None
    return out


def matmul_mod(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    """``(a @ b) mod m`` for residues in [0, m), m < 2^31, batched like np.matmul.

    The cheapest exact scheme for the operands' actual magnitudes: one GEMM when
    products of the two are small enough (e.g. two inputs); else one operand split
    into a 16-bit low and a high limb (two GEMMs; the smaller operand, when the
    chunks of the reduction dimension stay long enough); else both split (Karatsuba,
    three GEMMs)."""
    k = a.shape[-1]
    ba, bb = _bits(a), _bits(b)
    want = min(k, 64)
    if _chunk(ba, bb) >= min(k, 512):
        return _gemm(a, b, m, _chunk(ba, bb))
    options = []
    for split_a in (True, False):
        hi_bits = (ba if split_a else bb) - 16
        c = _chunk(max(hi_bits, 16), bb if split_a else ba)
        if c >= want:
            size = a.size if split_a else b.size
            out = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2],
                                                                      b.shape[-1])
            cost = 2 * size + 2 * -(-k // c) * int(np.prod(out))
            options.append((cost, split_a, c))
    if not options:
        return _karatsuba(a, b, m)
    _, split_a, c = min(options)
    if split_a:
        hi, lo = _gemm(a >> 16, b, m, c), _gemm(a & 0xFFFF, b, m, c)
    else:
        hi, lo = _gemm(a, b >> 16, m, c), _gemm(a, b & 0xFFFF, m, c)
    return ((hi << 16) % m + lo) % m


def _karatsuba(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    """Both operands split into 15+16-bit limbs: three GEMMs of 17-bit numbers."""
    c = _chunk(17, 17)
    hi = _gemm(a >> 16, b >> 16, m, c)
    lo = _gemm(a & 0xFFFF, b & 0xFFFF, m, c)
    mid = _gemm((a >> 16) + (a & 0xFFFF), (b >> 16) + (b & 0xFFFF), m, c)
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


def const(value: float | bool, m: int) -> int:
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
        out = self.hi[a >> 15]
        out *= self.lo[a & 0x7FFF]
        out %= P
        return out


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


def hash_key(salt: int, *parts: np.ndarray | None) -> np.ndarray:
    """A 64-bit pseudo-random function of (salt, residues...) per element; ``None``
    parts (residues a value does not have) are skipped."""
    with np.errstate(over="ignore"):
        h: np.ndarray | None = None
        for i, part in enumerate(parts):
            if part is None:
                continue
            x = part.astype(np.uint64) * _GOLD + np.uint64(i + 1)
            h = mix64(x ^ np.uint64(salt & (2**64 - 1))) if h is None else mix64(h + x)
        assert h is not None
        return mix64(h + _GOLD)


def hash_to_fields(h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three residues (mod P, mod Q, mod P) from 64-bit hashes, almost uniform
    (bias < 2^-32)."""
    hp = (h >> np.uint64(1)) % np.uint64(P)
    h2 = mix64(h ^ _GOLD)
    hq = (h2 >> np.uint64(1)) % np.uint64(Q)
    hr = (mix64(h2 ^ _GOLD) >> np.uint64(1)) % np.uint64(P)
    return hp.astype(np.int64), hq.astype(np.int64), hr.astype(np.int64)


@lru_cache(maxsize=64)
def subgroup_generator(seed: int, trial: int) -> int:
    """A pseudo-random generator of the order-Q subgroup of Z_P* (a square != 1)."""
    rng = np.random.default_rng([seed, trial, 0x6E])
    while True:
        h = int(rng.integers(2, P - 1))
        g = h * h % P
        if g != 1:
            return g
