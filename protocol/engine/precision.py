"""Precision policy and the certified rounding rule (SPEC §3.1, §3.2).

A value `y` computed in the compute dtype is rounded to the target dtype. Each element also has
an error bound `e` (from its op's rule, `protocol.engine.bounds`): every conforming execution of
the op on the same inputs lands within `e` of the exact result. Let `δ` be the absolute distance
of `y` from the nearest target rounding boundary (the midpoint between two neighbouring target
values). An element whose `δ ≤ 2e` could round the other way on another honest machine, so the
trainer logs it; any other element rounds to nearest-even everywhere.

The band test runs in two stages. A dense prefilter reads `y`'s bit pattern: for a target-normal
value, the low `s` bits (`s` = the compute dtype's extra mantissa bits) are its position inside
a target ULP, and `|low - 2**(s-1)|` compute ULPs is its distance from the midpoint of its
binade's target ULP. That distance is exact except just above a power of two, where the nearest
boundary lies below the binade, at half the spacing; there the true `δ` is at least half of it.
So "half the prefilter distance `≤ 2e`" keeps every element with `δ ≤ 2e` and few others. The
survivors (and every nonzero value below the target's smallest normal, rare, and every zero
whose bound reaches `PrecisionPolicy.zero_band`) get the exact `δ` of `boundary_distance`.

NaN and ±inf are not rounding choices; a finite result near the overflow threshold is: it
rounds to the largest finite value or to infinity (`_boundaries`).

Example:
    >>> policy = PrecisionPolicy()
    >>> y = torch.tensor([1.0 + 2.0**-24], dtype=torch.float64)  # exactly a float32 midpoint
    >>> float(boundary_distance(y, y.to(torch.float32), policy)[0])
    0.0
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import torch

from protocol.codec.dtypes import DTYPES, dtype_name
from protocol.errors import ConfigError

# The version of the bound rules (SPEC §3.2.1) this engine certifies with. A job names it, so a
# party with other rules refuses the job instead of disagreeing about its bands. Version 2:
# addcmul, addcdiv and lerp with a scalar weight are fixed formulas with e = 0
# (`protocol.engine.pointwise`) instead of bounded ATen kernels. Version 3: softmax,
# log-softmax, GELU (its exact form), their backwards and layer norm's backward carry own rules
# (`bounds`, "composite ops") instead of being decomposed: one site each where there were up to
# fifteen. Version 4: layer norm and batch norm (training) run as two sites, their statistics
# with an own rule and the normalize formula, a fixed formula (`normops`), instead of a dozen
# primitives. Version 5: square root and division of target values have e = 0
# (`bounds.SQRT_MARGIN_ULPS`, `bounds.QUOTIENT_MARGIN_ULPS`; quotients below 2^-125 keep a
# relative bound) instead of a 1-ULP relative bound, and are computed from target-dtype inputs
# in one fused pass.
RULES_VERSION = 5

# (compute, target) pairs the engine supports, with the bit-level facts it needs. The compute
# dtype's `.to(target)` must be a single correctly rounded nearest-even conversion, which holds
# for these pairs (float64->bfloat16 in torch goes through float32: double rounding, excluded).
_FORMATS = {
    (torch.float64, torch.float32): dict(
        int_dtype=torch.int64, shift=52 - 23, compute_mantissa=52, exp_mask=0x7FF0_0000_0000_0000,
        min_normal=2.0**-126, abs_mask=0x7FFF_FFFF_FFFF_FFFF, min_normal_bits=(1023 - 126) << 52,
        target_int=torch.int32, target_mantissa=23, target_bias=127),
    (torch.float32, torch.bfloat16): dict(
        int_dtype=torch.int32, shift=23 - 7, compute_mantissa=23, exp_mask=0x7F80_0000,
        min_normal=2.0**-126, abs_mask=0x7FFF_FFFF, min_normal_bits=1 << 23,
        target_int=torch.int16, target_mantissa=7, target_bias=127),
}

# The dtype names a policy may name: those of the supported pairs (DTYPES also names int/bool).
_POLICY_DTYPES = frozenset(dtype_name(d) for pair in _FORMATS for d in pair)


@lru_cache(maxsize=4096)
def _to_float32(x: float) -> float:
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # struct refuses finite values beyond float32: IEEE says inf
        return float("inf") if x > 0 else float("-inf")


@lru_cache(maxsize=4096)
def _to_bfloat16(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16))


_SCALAR_ROUNDERS = {torch.float32: _to_float32, torch.bfloat16: _to_bfloat16}


def holds_integer(dtype: torch.dtype, n: int) -> bool:
    """Whether the integer `n` is a value of the target `dtype` (float32 or bfloat16: an integer
    scalar argument is not rounded to the target dtype before use, as a float is: SPEC §3.3)."""
    return abs(n) < 2**128 and _SCALAR_ROUNDERS[dtype](float(n)) == n


@dataclass(frozen=True)
class PrecisionPolicy:
    """Compute dtype, target dtype and the version of the bound rules (SPEC §3.1)."""

    compute: torch.dtype = torch.float64
    target: torch.dtype = torch.float32
    rules: int = RULES_VERSION

    def __post_init__(self) -> None:
        pair = (self.compute, self.target)
        if pair not in _FORMATS:
            names = ", ".join(f"{dtype_name(c)}->{dtype_name(t)}" for c, t in _FORMATS)
            raise ConfigError(f"unsupported precision policy {dtype_name(self.compute)}->"
                              f"{dtype_name(self.target)}; supported: {names}")
        if isinstance(self.rules, bool) or not isinstance(self.rules, int):
            raise ConfigError(f"bound rules version must be an integer, got {self.rules!r}")
        if self.rules != RULES_VERSION:
            raise ConfigError(f"the job certifies rounding with bound rules version "
                              f"{self.rules}, this ovt implements version {RULES_VERSION}")

    @classmethod
    def parse(cls, text: str) -> PrecisionPolicy:
        """Parse 'float64->float32' (or 'float64:float32')."""
        parts = text.replace(":", "->").split("->")
        if len(parts) != 2 or any(p.strip() not in _POLICY_DTYPES for p in parts):
            raise ConfigError(f"bad precision policy {text!r}; expected e.g. 'float64->float32'")
        return cls(DTYPES[parts[0].strip()], DTYPES[parts[1].strip()])

    @classmethod
    def of_unit_roundoff(cls, unit_roundoff: float) -> PrecisionPolicy:
        """The supported policy whose compute dtype has this unit roundoff (each supported
        pair has a compute dtype of its own). Raises ConfigError for any other."""
        for compute, target in _FORMATS:
            if torch.finfo(compute).eps / 2 == unit_roundoff:
                return cls(compute, target)
        raise ConfigError(f"no supported precision policy computes with unit roundoff "
                          f"{unit_roundoff!r}")

    @property
    def scalar_rounder(self) -> Callable[[float], float]:
        """Python float -> the nearest target value (as a Python float): how a step's float
        arguments enter its ops (SPEC §3.3)."""
        return _SCALAR_ROUNDERS[self.target]

    @property
    def name(self) -> str:
        return f"{dtype_name(self.compute)}->{dtype_name(self.target)}"

    @property
    def fmt(self) -> dict:
        return _FORMATS[(self.compute, self.target)]

    @property
    def unit_roundoff(self) -> float:
        """u of the compute dtype: half its ULP at 1 (2**-53 for float64)."""
        return 2.0 ** -(self.fmt["compute_mantissa"] + 1)

    @property
    def overflow(self) -> float:
        """The overflow threshold of the target dtype, its largest value plus half its ULP:
        round-to-nearest gives infinity from there (2**128 - 2**103 for float32)."""
        mantissa = self.fmt["target_mantissa"]
        return float(torch.finfo(self.target).max) + 2.0 ** (126 - mantissa)

    @property
    def zero_band(self) -> float:
        """The bound `e` from which a zero result is in the band: its δ is half the target's
        smallest subnormal, so δ <= 2e where e is at least a quarter of that subnormal."""
        fmt = self.fmt
        return fmt["min_normal"] * 2.0 ** -fmt["target_mantissa"] / 4

    @property
    def tiny(self) -> float:
        """The compute dtype's smallest subnormal: the absolute error floor of every rule."""
        return float(torch.finfo(self.compute).smallest_normal) * \
            2.0 ** -self.fmt["compute_mantissa"]


_FLOAT64_BIAS, _FLOAT64_MANTISSA = 1023, 52


def band_candidates(flat: torch.Tensor, bound: torch.Tensor, policy: PrecisionPolicy
                    ) -> torch.Tensor:
    """Sorted flat indices that may have δ ≤ 2e: a superset, checked exactly by the caller.

    `flat` is the site's values (1-D, compute dtype), `bound` their bounds `e` (same length).
    Elements with `e = 0` are never candidates: their op is correctly rounded, no machine can
    land elsewhere, and they log nothing (SPEC §3.2.1).
    """
    fmt = policy.fmt
    shift = fmt["shift"]
    bits = flat.view(fmt["int_dtype"])
    low = torch.bitwise_and(bits, (1 << shift) - 1)
    # distance from the binade's midpoint in compute ULPs, times the compute ULP of y's binade
    scale = torch.bitwise_and(bits, fmt["exp_mask"]).view(flat.dtype)  # 2**E; 0 for 0/subnormal
    far = (low - (1 << (shift - 1))).abs().to(flat.dtype) * scale
    # far * 2**-p / 2 <= 2e, for a finite y. The comparisons are negated (as in the fused
    # pass, csrc/fused.cpp, where that keeps them branch-free) so that a NaN bound is in the band.
    magnitude = torch.bitwise_and(bits, fmt["abs_mask"])
    mask = ~(far > bound * 2.0 ** (fmt["compute_mantissa"] + 2)) & (magnitude < fmt["exp_mask"])
    # Below the target's smallest normal the ULP differs: every such value is a candidate,
    # except a zero (the causal mask's exp(-inf), a ReLU's), whose δ is exactly half the
    # smallest subnormal, in the band only from e = `zero_band`.
    small = (magnitude != 0) | ~(bound < policy.zero_band)
    keep = torch.where(magnitude < fmt["min_normal_bits"], small, mask)
    return (keep & ~(bound <= 0)).nonzero().squeeze(1)


def boundary_distance(y: torch.Tensor, r: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """Exact absolute distance δ (float64) of each `y` from its nearest rounding boundary.

    `r` is `y` rounded to nearest-even in the target dtype. The two boundaries around `r` are
    the midpoints to its neighbours: half `r`'s ULP away from zero, and half the gap below it
    toward zero — half of that ULP again when |r| is a power of two (the binade changes). The
    nearest may lie on either side of `r`: just above a power of two the lower one is closer.
    The arithmetic is float64, exact wherever `y` is within a factor 2 of the boundary (every
    target-normal `y`: Sterbenz); only a `y` far below the smallest subnormal boundary is off
    by a float64 rounding. Meant for sparse use (candidates, logged elements in replay).
    """
    above, below = _boundary_gaps(y, r, policy)
    return torch.minimum(above, below)


def toward_boundary(y: torch.Tensor, r: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """+1 or -1 per element: the direction from `y` to its nearest rounding boundary.

    Used by the bound adversary (profiles: `adversary`).
    """
    a = y.to(torch.float64).abs()
    above, below = _boundaries(r, policy)
    nearest = torch.where((above - a).abs() <= (a - below).abs(), above, below)
    sign = torch.where(torch.signbit(r), -1.0, 1.0)  # the sign of y: RNE keeps it, even at 0
    return torch.where(nearest >= a, sign, -sign).to(y.dtype)


def _boundaries(r: torch.Tensor, policy: PrecisionPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """The magnitudes of the rounding boundaries above |r| and below it (float64, exact).

    Half `r`'s ULP above; half the gap below it beneath, a quarter ULP when |r| is a power of
    two (the binade changes). Below a zero `r` the "boundary" is the negative one's mirror,
    never the nearest. Above the largest finite target value the boundary is the overflow
    threshold, `max + ULP/2`: RNE gives infinity from there (IEEE-754 §4.3.1), so an infinite
    `r` has it below and none above; a result near it is a rounding choice like any other
    (finite largest value or infinity).
    """
    b = r.to(torch.float64).abs()
    ulp = target_ulp(r, policy)
    half = ulp * 0.5
    above, below = b + half, b - torch.where(_power_of_two(r, policy), ulp * 0.25, half)
    return above, torch.where(torch.isinf(r), policy.overflow, below)


def _boundary_gaps(y: torch.Tensor, r: torch.Tensor, policy: PrecisionPolicy
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """|y|'s distances to the boundary above |r| and to the one below it (float64, exact)."""
    a = y.to(torch.float64).abs()
    above, below = _boundaries(r, policy)
    return (above - a).abs(), (a - below).abs()


def _magnitude_bits(r: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """|r|'s bit pattern as int32 (exponent field and mantissa), for a target-dtype `r`."""
    fmt = policy.fmt
    return torch.bitwise_and(r.view(fmt["target_int"]).to(torch.int32),
                             (1 << (fmt["target_mantissa"] + 8)) - 1)


def _power_of_two(r: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """|r| is a normal power of two above the smallest normal: the gap below it is half."""
    mant_bits = policy.fmt["target_mantissa"]
    rb = _magnitude_bits(r, policy)
    return (torch.bitwise_and(rb, (1 << mant_bits) - 1) == 0) & ((rb >> mant_bits) > 1)


def target_ulp(r: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """The spacing of target values just above |r| (float64), for a target-dtype `r`: its ULP,
    the subnormal ULP for zero and subnormals."""
    fmt = policy.fmt
    mant_bits = fmt["target_mantissa"]
    exp_field = _magnitude_bits(r, policy) >> mant_bits
    # 2**E as float64 bits: the biased exponent (E + 1023) in bits 52..62, a zero significand
    exponent = exp_field.clamp_min(1) - (fmt["target_bias"] + mant_bits) + _FLOAT64_BIAS
    return (exponent.to(torch.int64) << _FLOAT64_MANTISSA).view(torch.float64)


def rounded_up(y: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Direction of a rounding (SPEC §3.2): True where |r| > |y|, i.e. away from zero."""
    return r.to(y.dtype).abs() > y.abs()


def step_toward(r: torch.Tensor, y: torch.Tensor, up: torch.Tensor,
                policy: PrecisionPolicy) -> torch.Tensor:
    """The target neighbour of `y` in direction `up` (True = away from zero), given r = RNE(y).

    Where RNE already went the requested way `r` is kept; elsewhere `r` moves one target ULP.
    Target floats are sign-magnitude, so on the bit pattern "one ULP away from zero" is +1 and
    "one ULP toward zero" is -1, for either sign, across binade edges and into subnormals
    (RNE keeps the sign of `y` even when it rounds to zero, so +1 from a signed zero is right).
    """
    wrong = rounded_up(y, r) != up
    if not bool(wrong.any()):
        return r
    int_dtype = policy.fmt["target_int"]
    step = torch.where(up, 1, -1).to(int_dtype)
    moved = (r.view(int_dtype) + step).view(policy.target)
    return torch.where(wrong, moved, r)
