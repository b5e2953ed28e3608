"""Independent references for the bf16 conversion.

F32 and F16 go through ml_dtypes (the contract: same bits, NaN included). F64 is rounded
once, exactly, with `fractions.Fraction`: torch, and ml_dtypes before 0.7, round F64 twice
via F32, so no package is the F64 oracle.
"""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import ml_dtypes
import numpy as np

BF16_MIN_NORMAL_EXP = -126
BF16_MANT_BITS = 7


def bf16_bits_ml_dtypes(values: np.ndarray) -> np.ndarray:
    """uint16 bit patterns of `values` (F32 or F16) cast by ml_dtypes."""
    with np.errstate(invalid="ignore", over="ignore"):
        return values.astype(ml_dtypes.bfloat16).view(np.uint16)


def bf16_from_float_exact(x: float) -> int:
    """The bf16 bits of the Python float `x` rounded once to nearest, ties to even.

    Subnormals are kept; values at or past the midpoint above the largest finite bf16
    become infinity; NaN becomes sign | 0x7FC0.
    """
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    if math.isnan(x):
        return sign | 0x7FC0
    if math.isinf(x):
        return sign | 0x7F80
    if x == 0:
        return sign
    v = Fraction(abs(x))
    e = math.frexp(abs(x))[1] - 1  # 2**e <= |x| < 2**(e+1), exact for every double
    if e < BF16_MIN_NORMAL_EXP:
        quantum_exp = BF16_MIN_NORMAL_EXP - BF16_MANT_BITS  # the subnormal spacing 2**-133
    else:
        quantum_exp = e - BF16_MANT_BITS
    n = round(v / Fraction(2) ** quantum_exp)  # Fraction rounds half to even
    if e < BF16_MIN_NORMAL_EXP:
        bits = n  # 0x0080 (the smallest normal) when a subnormal rounds up into it
    else:
        bits = ((e + 127) << BF16_MANT_BITS) + (n - (1 << BF16_MANT_BITS))
    return sign | min(bits, 0x7F80)


def f64_bits_to_bf16_exact(bits: int) -> int:
    return bf16_from_float_exact(struct.unpack("<d", struct.pack("<Q", bits))[0])


def f32_bits_to_bf16_exact(bits: int) -> int:
    return bf16_from_float_exact(struct.unpack("<f", struct.pack("<I", bits))[0])
