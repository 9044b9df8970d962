"""Rounding numpy arrays to the storage precision of a :class:`DType`.

numpy has no bfloat16, so bf16 is emulated on float32 bit patterns with
round-to-nearest-even (what the GPU's ``__float2bfloat16_rn`` does).
"""

from __future__ import annotations

import numpy as np

from mirage_cli.ir import DType


def round_to(dtype: DType, x: np.ndarray) -> np.ndarray:
    """``x`` rounded to ``dtype`` and returned as float32 (the compute type). A value
    beyond the type's range becomes an infinity, as the GPU's conversion makes it;
    that is the result, not an error, so numpy's overflow warning is silenced."""
    x32 = np.asarray(x, dtype=np.float32)
    if dtype is DType.F32:
        return x32
    if dtype is DType.F16:
        with np.errstate(over="ignore"):
            return x32.astype(np.float16).astype(np.float32)
    bits = x32.view(np.uint32)
    # Round to nearest even on the 16 bits that are dropped, in place on one uint32
    # array: a carry out of bit 31 happens only for NaN patterns, which are put back
    # below (four passes over 32-bit words: the verifier rounds weights of 58 M
    # elements, where a uint64 form with temporaries took most of a search's time).
    out = bits >> 16
    out &= np.uint32(1)
    out += bits
    out += np.uint32(0x7FFF)
    out &= np.uint32(0xFFFF0000)
    res = out.view(np.float32)
    nan = np.isnan(x32)
    if nan.any():
        res[nan] = x32[nan]
    return res


def largest(dtype: DType) -> float:
    """The largest finite value of ``dtype``."""
    if dtype is DType.F16:
        return float(np.finfo(np.float16).max)
    if dtype is DType.BF16:  # 0x7F7F: the largest exponent, all mantissa bits set
        return float(np.array([0x7F7F0000], dtype=np.uint32).view(np.float32)[0])
    return float(np.finfo(np.float32).max)


def storage_dtype(dtype: DType) -> np.dtype:
    """The numpy dtype used to store ``dtype`` in .npz files."""
    return np.dtype(np.float16) if dtype is DType.F16 else np.dtype(np.float32)
