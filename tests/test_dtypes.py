"""Rounding to a storage dtype (mirage_cli.dtypes): bf16 by round-to-nearest-even on the
dropped 16 bits, as the GPU's __float2bfloat16_rn, checked against a per-value reference."""

from __future__ import annotations

import struct

import numpy as np

from mirage_cli.dtypes import round_to
from mirage_cli.ir import DType


def _bf16_rn(v: float) -> int:
    """The bits of float32 ``v`` rounded to bf16 (kept in float32), one value at a time."""
    (b,) = struct.unpack("<I", struct.pack("<f", v))
    if (b & 0x7F800000) == 0x7F800000 and b & 0x007FFFFF:
        return b  # NaN unchanged
    return ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000) & 0xFFFFFFFF


def test_bf16_rounds_to_nearest_even_and_keeps_nan_and_infinity() -> None:
    one = 1.0
    tie_down = one + 2.0 ** -8          # halfway between 1 and 1 + 2^-7: to 1 (even)
    tie_up = one + 3 * 2.0 ** -8        # halfway between 1 + 2^-7 and 1 + 2^-6: up
    big = float(np.finfo(np.float32).max)  # past bf16's largest value: infinity
    vals = np.array([0.0, -0.0, one, tie_down, tie_up, -tie_up, big, -big, np.inf,
                     -np.inf, np.nan, 1e-40, -3.14159], dtype=np.float32)
    got = round_to(DType.BF16, vals)
    assert got.dtype == np.float32
    assert got[3] == 1.0 and got[4] == 1.0 + 2.0 ** -6 and got[5] == -(1.0 + 2.0 ** -6)
    assert np.isposinf(got[6]) and np.isneginf(got[7]) and np.isposinf(got[8])
    assert np.isnan(got[10]) and np.signbit(got[1])
    # NaN patterns whose rounding would carry out of bit 31 stay NaN, bits unchanged.
    nans = np.array([0x7FFFFFFF, 0xFFFFFFFF, 0xFFFF8000, 0x7FC00001], dtype=np.uint32)
    assert np.array_equal(round_to(DType.BF16, nans.view(np.float32)).view(np.uint32), nans)


def test_bf16_matches_the_per_value_reference_on_random_bit_patterns() -> None:
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 1 << 32, size=20000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    got = round_to(DType.BF16, x).view(np.uint32)
    want = np.array([_bf16_rn(float(v)) if not np.isnan(v) else b
                     for v, b in zip(x, bits)], dtype=np.uint32)
    assert np.array_equal(got, want)


def test_rounding_does_not_write_its_input_and_f16_f32_are_plain() -> None:
    x = np.array([1.0 + 2.0 ** -9, 65520.0, 3.0], dtype=np.float32)
    before = x.copy()
    round_to(DType.BF16, x)
    assert np.array_equal(x, before)
    assert round_to(DType.F16, x)[1] == np.inf and round_to(DType.F32, x) is not None
    assert np.array_equal(round_to(DType.F32, x), x)


def test_overflow_to_f16_is_an_infinity_without_a_warning() -> None:
    import warnings

    x = np.array([1e6, -1e6, 65504.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning here would reach bench output
        y = round_to(DType.F16, x)
    assert y.tolist() == [np.inf, -np.inf, 65504.0]


def test_largest_finite_values() -> None:
    from mirage_cli.dtypes import largest

    assert largest(DType.F16) == 65504.0
    assert largest(DType.BF16) == float.fromhex("0x1.fep127")
    assert largest(DType.F32) == float.fromhex("0x1.fffffep127")
    for dt in DType:  # each is finite in its own type, and the last such value
        x = np.array([largest(dt)], dtype=np.float32)
        assert round_to(dt, x)[0] == largest(dt)
