"""The float32 inputs whose square roots and quotients lie nearest float32 rounding midpoints
(test helper): the worst cases of bound rules version 5's roots and quotients, whose e = 0
rests on a margin (`bounds.SQRT_MARGIN_ULPS`, `bounds.QUOTIENT_MARGIN_ULPS`).
"""

from __future__ import annotations

import numpy as np


def midpoint_squares(k: np.ndarray) -> np.ndarray:
    """The float32 values nearest to the squares of the float32 rounding midpoints
    m = (2k + 1)·2^−24 in [1, 2), k in [2^23, 2^24) (m² is exact in float64): their roots lie
    nearest to those midpoints (4 − 2^−22 float64 ULPs the nearest of all)."""
    return (((2 * k + 1) * 2.0**-24) ** 2).astype(np.float32)


def root_inputs(seed: int) -> np.ndarray:
    """`midpoint_squares` and their neighbours, for the 2^16 smallest and largest k and 2^17
    more drawn with `seed`. Every other binade's are these scaled by a power of 4."""
    k = np.concatenate([np.arange(2**23, 2**23 + 2**16), np.arange(2**24 - 2**16, 2**24),
                        np.random.default_rng(seed).integers(2**23, 2**24, size=2**17)])
    nearest = midpoint_squares(k)
    return np.concatenate([nearest, np.nextafter(nearest, np.float32(0)),
                           np.nextafter(nearest, np.float32(8))])


def worst_quotients(divisors: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For odd integers B in (2^23, 2^24): dividends a = 2A, A in [B/2, B), with
    A·2^25 ≡ ±1 (mod B), so that a·2^24 − (2k + 1)·B = ±1 for an odd 2k + 1: the quotient a / B
    in [1, 2) lies exactly 2^−24 / B from the float32 rounding midpoint (2k + 1)·2^−24 — the
    least distance of `QUOTIENT_MARGIN_ULPS`'s proof, |a − m·b| = 2^(E−p+β), attained. In float64
    ULPs of [1, 2) that is 2^28 / B: just over 16 for B near 2^24. Returns (a, B) as float32
    arrays (both exact: 2A < 2^25 is even)."""
    dividends = []
    for b in divisors:
        if not (2**23 < b < 2**24 and b % 2):
            raise ValueError(f"{b} is not an odd integer in (2^23, 2^24)")
        inverse = pow(2**25, -1, b)  # A ≡ this gives A·2^25 ≡ 1; A ≡ b − this gives ≡ −1
        a = inverse if 2 * inverse >= b else b - inverse
        dividends.append(2 * a)
    return np.array(dividends, dtype=np.float32), np.array(divisors, dtype=np.float32)
