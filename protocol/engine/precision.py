"""Precision policy and the rounding rule (SPEC §3.1, §3.2).

A value `y` computed in the compute dtype is rounded to the target dtype. Its distance `d` from
the nearest rounding boundary (the midpoint between its two target-dtype neighbours) is measured
in target ULPs, 0 <= d <= 0.5. For a target-normal value that distance lives entirely in the
compute dtype's extra mantissa bits: with `s = mantissa_bits(compute) - mantissa_bits(target)`,
the low `s` bits of `y`'s bit pattern are the fraction of a target ULP, and the boundary sits at
`2**(s-1)`. So the band test is integer arithmetic on a bit view, with no transcendental math
(the reference implementation spent half its step time on `log10`/`pow` here).

Values whose target is subnormal use the subnormal ULP (the scaled remainder is exact in the
compute dtype); NaN, ±inf and values that overflow the target are not rounding sites.

Example:
    >>> policy = PrecisionPolicy()
    >>> y = torch.tensor([1.0 + 2.0**-24], dtype=torch.float64)  # exactly a float32 midpoint
    >>> float(distance_to_boundary(y, policy)[0])
    0.0
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.codec.dtypes import DTYPES, dtype_name
from protocol.errors import ConfigError

# (compute, target) pairs the engine supports, with the bit-level facts it needs. The compute
# dtype's `.to(target)` must be a single correctly rounded nearest-even conversion, which holds
# for these pairs (float64->bfloat16 in torch goes through float32: double rounding, excluded).
_FORMATS = {
    (torch.float64, torch.float32): dict(
        int_dtype=torch.int64, shift=52 - 23, min_normal=2.0**-126, subnormal_ulp_exp=-149,
        abs_mask=0x7FFF_FFFF_FFFF_FFFF, min_normal_bits=(1023 - 126) << 52),
    (torch.float32, torch.bfloat16): dict(
        int_dtype=torch.int32, shift=23 - 7, min_normal=2.0**-126, subnormal_ulp_exp=-133,
        abs_mask=0x7FFF_FFFF, min_normal_bits=1 << 23),
}

# The dtype names a policy may name: those of the supported pairs (DTYPES also names int/bool).
_POLICY_DTYPES = frozenset(dtype_name(d) for pair in _FORMATS for d in pair)

# Default band half-width in target ULPs for general ops. float64->float32: set from
# `ovt replay-check` (README "Precision policy"): the largest divergence between profiles
# measured here was 1.5e-3 target ULP (BatchNorm backward under channels_last), so 2**-8 leaves
# a 2.5x margin. float32->bfloat16: not measured yet; 2**-4 is a conservative guess.
DEFAULT_TAU = {
    (torch.float64, torch.float32): 2.0**-8,
    (torch.float32, torch.bfloat16): 2.0**-4,
}


@dataclass(frozen=True)
class PrecisionPolicy:
    """Compute dtype, target dtype and logging thresholds in target ULPs, SPEC §3.1.

    `tau` applies to "general" ops; `tau_ieee` to single correctly rounded IEEE operations,
    whose compute-dtype result no conforming machine can change (see `optable`): 0 by default,
    so they log nothing, and any log entry at such a site is a violation (d >= 2*0).
    """

    compute: torch.dtype = torch.float64
    target: torch.dtype = torch.float32
    tau: float | None = None
    tau_ieee: float = 0.0

    def __post_init__(self) -> None:
        pair = (self.compute, self.target)
        if pair not in _FORMATS:
            names = ", ".join(f"{dtype_name(c)}->{dtype_name(t)}" for c, t in _FORMATS)
            raise ConfigError(f"unsupported precision policy {dtype_name(self.compute)}->"
                              f"{dtype_name(self.target)}; supported: {names}")
        tau = DEFAULT_TAU[pair] if self.tau is None else self.tau
        object.__setattr__(self, "tau", tau)
        if not (0.0 < tau <= 0.25):
            raise ConfigError(f"tau must be in (0, 0.25] target ULPs, got {tau}")
        if not (0.0 <= self.tau_ieee <= 0.25):
            raise ConfigError(f"tau_ieee must be in [0, 0.25] target ULPs, got {self.tau_ieee}")

    @classmethod
    def parse(cls, text: str, tau: float | None = None) -> PrecisionPolicy:
        """Parse 'float64->float32' (or 'float64:float32')."""
        parts = text.replace(":", "->").split("->")
        if len(parts) != 2 or any(p.strip() not in _POLICY_DTYPES for p in parts):
            raise ConfigError(f"bad precision policy {text!r}; expected e.g. 'float64->float32'")
        return cls(DTYPES[parts[0].strip()], DTYPES[parts[1].strip()], tau)

    @property
    def name(self) -> str:
        return f"{dtype_name(self.compute)}->{dtype_name(self.target)}"

    @property
    def fmt(self) -> dict:
        return _FORMATS[(self.compute, self.target)]

    def tau_for(self, ieee: bool) -> float:
        assert self.tau is not None  # __post_init__ replaces None with the pair's default
        return self.tau_ieee if ieee else self.tau

    def band(self, tau: float) -> int:
        """Integer band: an element is logged iff |low bits - half| < band (SPEC §3.2)."""
        # k < x  <=>  k < ceil(x) for integer k, so the integer test is exact.
        return _ceil(tau * 2 ** self.fmt["shift"])



def _ceil(x: float) -> int:
    n = int(x)
    return n if n == x else n + 1


def near_boundary_mask(y: torch.Tensor, policy: PrecisionPolicy, tau: float) -> torch.Tensor:
    """Dense band test for target-normal values: |low bits - half| < band, as a bool tensor.

    Three passes over `y`: subtract, mask, compare. The subtraction is shifted so that one
    signed compare after masking tests the symmetric open interval (half - band, half + band).
    Subnormal-target, overflowing and non-finite values are fixed up by `band_candidates`
    and its caller.
    """
    fmt = policy.fmt
    shift, band = fmt["shift"], policy.band(tau)
    low_mask = (1 << shift) - 1
    half = 1 << (shift - 1)
    bits = y.view(fmt["int_dtype"])
    # (low - (half - band + 1)) mod 2**shift < 2*band - 1  <=>  |low - half| <= band - 1
    t = torch.bitwise_and(bits - (half - band + 1), low_mask)
    return t < (2 * band - 1)


def band_candidates(flat: torch.Tensor, policy: PrecisionPolicy, tau: float) -> torch.Tensor:
    """Sorted flat indices of the elements of 1-D `flat` (compute dtype) with d < tau.

    The dense integer test is exact for target-normal values. Target-subnormal values need the
    subnormal ULP (SPEC §3.2): two cheap counts tell whether any nonzero one exists (almost
    never), and only then are they found and measured exactly. Non-finite values and values
    that overflow the target may be returned; the caller drops them (no rounding choice there).
    """
    cand = near_boundary_mask(flat, policy, tau).nonzero().squeeze(1)
    fmt = policy.fmt
    absbits = torch.bitwise_and(flat.view(fmt["int_dtype"]), fmt["abs_mask"])
    small = absbits < fmt["min_normal_bits"]  # zero or target-subnormal
    zeros = flat.numel() - int(torch.count_nonzero(absbits))
    if int(torch.count_nonzero(small)) == zeros:
        return cand
    tiny = (small & (absbits != 0)).nonzero().squeeze(1)
    tiny = tiny[distance_to_boundary(flat[tiny], policy) < tau]
    cand = cand[~small[cand]]  # the integer test measured these against the wrong ULP
    return torch.cat([cand, tiny]).sort().values


def distance_to_boundary(y: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """Exact distance d in target ULPs (float64) of each value from its rounding boundary.

    Meant for sparse use (the candidates of the dense test, or logged elements in replay).
    The arithmetic is float64 whatever the compute dtype: the subnormal-target scaling
    (|y| * 2**133 for bfloat16) would overflow float32. Non-finite values get d = 0.5.
    """
    fmt = policy.fmt
    shift = fmt["shift"]
    bits = y.view(fmt["int_dtype"])
    frac = torch.bitwise_and(bits, (1 << shift) - 1).to(torch.float64) * 2.0**-shift
    y64 = y.to(torch.float64)
    tiny = y64.abs() < fmt["min_normal"]
    if bool(tiny.any()):
        scaled = y64.abs() * 2.0 ** -fmt["subnormal_ulp_exp"]  # exact: power-of-two scaling
        frac = torch.where(tiny, scaled - scaled.floor(), frac)
    d = (frac - 0.5).abs()
    return torch.where(torch.isfinite(y64), d, torch.full_like(d, 0.5))


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
    int_dtype = _TARGET_INT[policy.target]
    step = torch.where(up, 1, -1).to(int_dtype)
    moved = (r.view(int_dtype) + step).view(policy.target)
    return torch.where(wrong, moved, r)


_TARGET_INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
