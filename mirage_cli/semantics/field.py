"""Arithmetic in the two prime fields of the verifier, on numpy int64 arrays.

The fields: ``P`` (2147483579) and ``Q`` (1073741789) with ``P = 2 Q + 1``: both prime,
``Q`` divides ``P - 1``, so the squares of ``Z_P*`` form a cyclic group of prime order
``Q`` and ``exp(a) = g**a`` (``g`` a square other than 1) maps ``(Z_Q, +)`` into
``(Z_P*, x)`` homomorphically: the two-field trick of Mirage, with fields ~2^31 and
~2^30 instead of 167 and 83. Both moduli are below 2^31, so a product of two residues
fits in an int64 and never overflows.

Matrix products cannot use int64 numpy matmul (slow, and sums of 4096 products of
two 31-bit numbers overflow). They are computed exactly with float64 BLAS instead:
one operand is split into limbs where needed and the reduction dimension is cut into
chunks so that every partial sum stays below 2^53 (exact in float64); the chunk
results are reduced mod the prime in int64 (see :func:`matmul_mod`).

Random functions (for operators with no field meaning) are a keyed 64-bit mixer
(splitmix64's finaliser) applied element-wise; both graphs of a comparison use the same
key, so equal arguments always give equal results.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
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


# Elementwise work on huge arrays (the matmuls' outputs and operands, exp) is done in
# slabs of about this many elements: the temporaries then stay in cache and are reused,
# instead of being freshly allocated arrays of 100+ MB whose first touch (page faults)
# cost more than the arithmetic on this kind of machine.
SLAB = 1 << 16
# Matmul outputs are computed in larger slabs: many small GEMMs cost BLAS thread
# start-ups and synchronisations, which dominate on a machine shared with other jobs.
MM_SLAB = 1 << 22


def _root(a: np.ndarray) -> np.ndarray:
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root


# Bounds on the bit length of the elements of large int64 arrays (the trial inputs, drawn
# below 2^INPUT_BITS), by id of the owning array, so that a matmul can pick its plan
# without a pass over the array; an entry lives exactly as long as its array (a weak
# reference and a finalizer). Views (tiles made by reshape/transpose/broadcast) find
# their root's entry.
_BOUNDS: dict[int, tuple[weakref.ref[np.ndarray], int]] = {}


def register_bits(x: np.ndarray, bits: int) -> None:
    """Record that every element of ``x`` (an int64 array owning its data) is below
    ``2^bits``."""
    _BOUNDS[id(x)] = (weakref.ref(x), bits)
    weakref.finalize(x, _BOUNDS.pop, id(x), None)


def bit_bound(a: np.ndarray) -> int:
    """A bound on the bit length of ``a``'s elements: its root's registered bound, or
    the bit length of its largest element."""
    root = _root(a)
    hit = _BOUNDS.get(id(root))
    if hit is not None and hit[0]() is root:
        return hit[1]
    return _bits(a)


@dataclass(frozen=True)
class _Plan:
    """How to compute one modular matmul exactly in float64: operand ``side`` (0: a,
    1: b) is split into ``limbs`` limbs of ``width`` bits (1 limb: no split), and the
    reduction dimension into chunks of ``chunk``, so that no partial sum reaches 2^53."""

    side: int
    limbs: int
    width: int
    chunk: int


# Rough costs (seconds per flop of a float64 GEMM on two cores, per element of an
# elementwise pass in cache) used only to pick the cheapest exact plan.
_GEMM_S, _PASS_S = 1 / 16e9, 1.5e-9


def _plan(a: np.ndarray, b: np.ndarray, ba: int, bb: int) -> _Plan:
    """The cheapest exact plan for these operand shapes and bit bounds."""
    k = a.shape[-1]
    batch = int(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2])))
    m_, n_ = a.shape[-2], b.shape[-1]
    out = batch * m_ * n_
    full = (batch * m_ * k, batch * k * n_)  # operand work once broadcast over the batch
    best: tuple[float, _Plan] | None = None
    for side in (0, 1):
        bits, other = (ba, bb) if side == 0 else (bb, ba)
        for limbs in range(1, 5):
            width = max(1, -(-bits // limbs))
            if limbs > 1 and width * (limbs - 1) >= bits:
                continue  # fewer limbs would do
            free = _EXACT_BITS - width - other
            if free < 0:
                continue
            chunk = 1 << free
            chunks = -(-k // chunk)
            cost = limbs * 2 * out * k * _GEMM_S
            cost += limbs * chunks * out * 4 * _PASS_S + (limbs - 1) * out * 4 * _PASS_S
            cost += (3 * limbs if limbs > 1 else 1) * full[side] * _PASS_S
            cost += full[1 - side] * _PASS_S
            if best is None or cost < best[0]:
                best = (cost, _Plan(side, limbs, width, chunk))
    assert best is not None
    return best[1]


def _slabs(batch: tuple[int, ...], rows: int, inner: int, cols: int
           ) -> list[tuple[tuple[int, ...], slice]]:
    """(leading batch index, row range) pieces whose operands and output hold about
    MM_SLAB elements together (at least one batch entry, and then row blocks)."""
    per_entry = rows * inner + inner * cols + rows * cols
    j = len(batch)
    while j > 0 and int(np.prod(batch[j - 1:])) * per_entry <= MM_SLAB:
        j -= 1
    # Within one batch entry, split the rows only (the reduction dimension is chunked
    # by _mm_slab, which bounds the converted part of the right operand).
    step = max(1, rows)
    if j == len(batch) and rows * (inner + cols) > MM_SLAB:
        step = max(1, MM_SLAB // max(1, inner + cols))
    return [(idx, slice(r, r + step)) for idx in np.ndindex(*batch[:j])
            for r in range(0, rows, step)]


def matmul_mod(a: np.ndarray, b: np.ndarray, m: int) -> np.ndarray:
    """``(a @ b) mod m`` for residues in [0, m), m < 2^31, batched like np.matmul.

    Exact float64 GEMMs: one operand (the cheaper one, by :func:`_plan`) is split into
    limbs and the reduction dimension into chunks so that every partial sum is an
    integer below 2^53; chunk results are reduced mod m in int64 and the limbs
    recombined. The output is computed in slabs (batch entries, row blocks) and the
    operands converted to float64 chunk by chunk, so every temporary is small and
    reused: no float64 copy of a large operand is ever made."""
    plan = _plan(a, b, bit_bound(a), bit_bound(b))
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    m_, n_ = a.shape[-2], b.shape[-1]
    ab = np.broadcast_to(a, batch + a.shape[-2:])
    bb = np.broadcast_to(b, batch + b.shape[-2:])
    out = np.empty(batch + (m_, n_), dtype=np.int64)
    if a.shape[-1] == 0:
        out.fill(0)  # an empty sum
        return out
    for idx, rows in _slabs(batch, m_, a.shape[-1], n_):
        _mm_slab(ab[idx][..., rows, :], bb[idx], m, plan, out[idx][..., rows, :])
    return out


def _mm_slab(a: np.ndarray, b: np.ndarray, m: int, plan: _Plan, out: np.ndarray) -> None:
    """One slab of :func:`matmul_mod`, written into ``out``: for each chunk of the
    reduction dimension, the unsplit operand is converted to float64 once and each limb
    of the other multiplied with it (every partial sum an exact integer below 2^53)."""
    acc: list[np.ndarray | None] = [None] * plan.limbs
    # Any chunk shorter than the plan's is exact too; keep the float64 copies of the
    # operands' chunks near 4 * MM_SLAB elements.
    rows_a = a.size // max(1, a.shape[-1])
    cols_b = b.size // max(1, b.shape[-2])
    per_k = max(1, rows_a * (plan.limbs if plan.side == 0 else 1)
                + cols_b * (plan.limbs if plan.side == 1 else 1))
    chunk = max(1, min(plan.chunk, max(256, 4 * MM_SLAB // per_k)))
    for s in range(0, a.shape[-1], chunk):
        ac, bc = a[..., s:s + chunk], b[..., s:s + chunk, :]
        split, other = (ac, bc) if plan.side == 0 else (bc, ac)
        of = other.astype(np.float64)
        for limb, part in enumerate(_limb_products(split, of, plan, m)):
            prev = acc[limb]
            if prev is None:
                acc[limb] = part
            else:
                prev += part
                np.remainder(prev, m, out=prev)
    # out = sum over limbs of acc[limb] * 2^(width * limb), by Horner's rule mod m.
    for limb in reversed(range(plan.limbs)):
        total = acc[limb]
        assert total is not None
        if limb == plan.limbs - 1:
            out[...] = total
        else:
            np.left_shift(out, plan.width, out=out)
            np.remainder(out, m, out=out)
            out += total
            np.remainder(out, m, out=out)


def _limb_products(split: np.ndarray, of: np.ndarray, plan: _Plan, m: int
                   ) -> list[np.ndarray]:
    """Each limb of ``split`` times ``of`` (float64), mod m, in the plan's order."""
    mask = (1 << plan.width) - 1
    limbs = [(((split >> (plan.width * limb)) & mask) if plan.limbs > 1 else split
              ).astype(np.float64) for limb in range(plan.limbs)]
    axis = -2 if plan.side == 0 else -1
    if plan.limbs > 1 and split.ndim == 2 and of.ndim == 2:
        # Plain matrices: the limbs stacked along the rows (a) or columns (b), so that
        # one GEMM reads the other operand once for all limbs.
        stacked = [np.concatenate(limbs, axis=axis)]
    else:
        stacked = limbs
    out = []
    for pf in stacked:
        prod = np.matmul(pf, of) if plan.side == 0 else np.matmul(of, pf)
        whole = prod.astype(np.int64)
        np.remainder(whole, m, out=whole)
        out.extend(np.split(whole, len(limbs) // len(stacked), axis=axis))
    return out


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
        # In slabs, into one output array: the index and gather temporaries are small
        # and reused (see SLAB).
        a = np.ascontiguousarray(a, dtype=np.int64)
        out = np.empty(a.shape, dtype=np.int64)
        flat_a, flat_o = a.reshape(-1), out.reshape(-1)
        n = flat_a.size
        idx = np.empty(min(n, SLAB), dtype=np.int64)
        tmp = np.empty(min(n, SLAB), dtype=np.int64)
        for s in range(0, n, SLAB):
            src, dst = flat_a[s:s + SLAB], flat_o[s:s + SLAB]
            i, t = idx[:src.size], tmp[:src.size]
            np.right_shift(src, 15, out=i)
            np.take(self.hi, i, out=dst)
            np.bitwise_and(src, 0x7FFF, out=i)
            np.take(self.lo, i, out=t)
            np.multiply(dst, t, out=dst)
            np.remainder(dst, P, out=dst)
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
