"""protocol.engine.precision: the band test, the exact distance and step_toward (SPEC §3.1, §3.2).

Every fast bit-level routine is cross-checked against a deliberately naive reference written with
`fractions.Fraction`: the two target neighbours of a value are found by `numpy.nextafter` (for
float32) or by clearing mantissa bits of the float32 pattern (for bfloat16), the boundary is their
exact midpoint, and the distance is measured exactly in units of their spacing.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from protocol.engine.precision import (
    DEFAULT_TAU,
    PrecisionPolicy,
    distance_to_boundary,
    near_boundary_mask,
    rounded_up,
    step_toward,
)
from protocol.engine.rounding import SiteRecorder
from protocol.errors import ConfigError

F64_F32 = PrecisionPolicy(torch.float64, torch.float32)
F32_BF16 = PrecisionPolicy(torch.float32, torch.bfloat16)
F32_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
TAUS = (2.0**-8, 2.0**-4, 0.003, 0.1, 0.25, 2.0**-20, 1e-9)

# -- the naive reference ------------------------------------------------------------------------


def ref_neighbours_f32(y: float) -> tuple[float, float] | None:
    """(lo, hi): the float32 values with |lo| < |y| < |hi| around y (signed), None if exact."""
    a = abs(y)
    r = np.float32(a)
    if float(r) == a:
        return None
    if float(r) > a:
        lo, hi = np.nextafter(r, np.float32(0)), r
    else:
        lo, hi = r, np.nextafter(r, np.float32(np.inf))
    sign = -1.0 if math.copysign(1.0, y) < 0 else 1.0
    return sign * float(lo), sign * float(hi)


def ref_neighbours_bf16(y: float) -> tuple[float, float] | None:
    """Same for float32 -> bfloat16: clear / bump the low 16 bits of the float32 pattern."""
    bits = int(np.float32(y).view(np.uint32))
    sign, mag = bits & 0x8000_0000, bits & 0x7FFF_FFFF
    lo_bits = mag & 0xFFFF_0000
    if lo_bits == mag:
        return None
    hi_bits = lo_bits + 0x1_0000

    def value(b: int) -> float:
        return float(np.uint32(sign | b).view(np.float32))

    return value(lo_bits), value(hi_bits)


REFERENCES = {F64_F32: ref_neighbours_f32, F32_BF16: ref_neighbours_bf16}


def ref_distance(y: float, policy: PrecisionPolicy) -> Fraction:
    """d of SPEC §3.2, exactly: |y - midpoint| / spacing of the two target neighbours."""
    if not math.isfinite(y):
        return Fraction(1, 2)
    pair = REFERENCES[policy](y)
    if pair is None:
        return Fraction(1, 2)
    lo, hi = (Fraction(v) for v in pair)
    return abs(Fraction(y) - (lo + hi) / 2) / abs(hi - lo)


def ref_step(y: float, up: bool, policy: PrecisionPolicy) -> float:
    """The target neighbour of a non-representable y: larger magnitude if `up`, else smaller."""
    lo, hi = REFERENCES[policy](y)
    return hi if up else lo


# -- test values --------------------------------------------------------------------------------


def _bits_to_f64(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint64).view(np.float64)


def random_f64(rng: np.random.Generator, n: int, lo_exp: int, hi_exp: int) -> np.ndarray:
    """Random signs and mantissas with exponents uniform in [lo_exp, hi_exp]."""
    mant = rng.integers(0, 2**52, size=n, dtype=np.uint64)
    exp = rng.integers(lo_exp, hi_exp + 1, size=n).astype(np.uint64) + np.uint64(1023)
    sign = rng.integers(0, 2, size=n, dtype=np.uint64)
    return _bits_to_f64((sign << np.uint64(63)) | (exp << np.uint64(52)) | mant)


def f32_midpoints(rng: np.random.Generator, n: int, lo_exp: int, hi_exp: int) -> np.ndarray:
    """Exact float64 midpoints of random adjacent float32 pairs (target-normal range)."""
    lo = random_f64(rng, n, lo_exp, hi_exp).astype(np.float32)
    hi = np.nextafter(lo, np.copysign(np.float32(np.inf), lo))
    return (lo.astype(np.float64) + hi.astype(np.float64)) / 2  # exact: 25 significant bits


def offset_bits(values: np.ndarray, offsets) -> np.ndarray:
    """Each value moved by each offset, in units of its own last bit (same sign, same binade)."""
    int_dtype = np.int64 if values.dtype == np.float64 else np.int32
    bits = values.view(int_dtype)
    out = [(bits + np.array(k, dtype=int_dtype)).view(values.dtype) for k in offsets]
    return np.concatenate(out)


def band_offsets(band: int) -> list[int]:
    """Offsets (in compute-dtype ULPs) exactly at / just inside / just outside a band."""
    return sorted({0, 1, -1, band - 1, 1 - band, band, -band, band + 1, -band - 1})


def f64_values(seed: int, tau: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    band = F64_F32.band(tau)
    mids = f32_midpoints(rng, 200, -120, 120)
    below_pow2 = np.array([2.0**k * (1 - j * 2.0**-53) for k in (-125, -1, 0, 1, 60, 127)
                           for j in (1, 2, 3, 2**28, 2**29, 2**29 + 1)])
    top_mid = np.array([2.0**k - 2.0**(k - 25) for k in (-120, 0, 1, 100)])  # midpoint below 2**k
    values = np.concatenate([
        random_f64(rng, 3000, -126, 127),
        offset_bits(mids, band_offsets(band)),
        offset_bits(top_mid, band_offsets(band)),
        below_pow2, -below_pow2,
        np.array([2.0**-126, -(2.0**-126), 1.0, -1.0, F32_MAX, -F32_MAX]),
    ])
    return values[(np.abs(values) >= 2.0**-126) & (np.abs(values) <= F32_MAX)]


def f32_values(seed: int, tau: float) -> np.ndarray:
    """float32 test values for the float32 -> bfloat16 policy, target-normal, below bf16 max."""
    rng = np.random.default_rng(seed)
    band = F32_BF16.band(tau)
    rand = random_f64(rng, 3000, -126, 126).astype(np.float32)
    mids = (rand.view(np.uint32) & np.uint32(0xFFFF_0000) | np.uint32(0x8000)).view(np.float32)
    below_pow2 = np.array([2.0**k * (1 - j * 2.0**-24) for k in (-125, 0, 1, 100)
                           for j in (1, 2, 2**7, 2**8, 2**8 + 1)], dtype=np.float32)
    values = np.concatenate([
        rand, offset_bits(mids[:200], band_offsets(band)), below_pow2, -below_pow2,
        np.array([2.0**-126, 1.0, -1.0, BF16_MAX, -BF16_MAX], dtype=np.float32),
    ])
    return values[(np.abs(values) >= 2.0**-126) & (np.abs(values) <= BF16_MAX)]


def subnormal_target_values(policy: PrecisionPolicy) -> np.ndarray:
    """Values whose target is subnormal, built around (k + 1/2) * subnormal ULP."""
    ulp_exp = policy.fmt["subnormal_ulp_exp"]
    top = 2 ** (-126 - ulp_exp)  # subnormal ULPs below the smallest normal
    tau = policy.tau
    ks = [0, 1, 2, 3, 7, top // 2, top - 2, top - 1]
    fracs = [0.5, 0.5 + tau, 0.5 - tau, 0.5 + tau / 2, 0.5 - tau / 2, 0.5 + 2 * tau,
             0.5 - 2 * tau + 2.0**-12, 0.25, 0.0625, 0.01, 0.999]
    mags = [(k + f) * 2.0**ulp_exp for k in ks for f in fracs] + [2.0**ulp_exp * 2.0**-j
                                                                   for j in range(1, 6)]
    dtype = np.float64 if policy.compute == torch.float64 else np.float32
    values = np.array(mags + [-m for m in mags], dtype=dtype)
    return values[np.abs(values) < 2.0**-126]


# -- band test and distance against the reference ------------------------------------------------


@pytest.mark.parametrize("tau", TAUS)
def test_near_boundary_mask_f64_matches_reference(tau):
    values = f64_values(1, tau)
    mask = near_boundary_mask(torch.from_numpy(values), F64_F32, tau).numpy()
    expected = np.array([ref_distance(float(v), F64_F32) < tau for v in values])
    assert np.array_equal(mask, expected)
    assert expected.sum() >= 100 and (~expected).sum() >= 100  # both sides were exercised


@pytest.mark.parametrize("tau", TAUS[:5])
def test_near_boundary_mask_bf16_matches_reference(tau):
    values = f32_values(2, tau)
    mask = near_boundary_mask(torch.from_numpy(values), F32_BF16, tau).numpy()
    expected = np.array([ref_distance(float(v), F32_BF16) < tau for v in values])
    assert np.array_equal(mask, expected)
    assert expected.sum() >= 100 and (~expected).sum() >= 100


def test_mask_exact_band_edges_f64():
    """At offset band-1 the value is in, at offset band it is out (the band is open)."""
    tau = 2.0**-8
    band = F64_F32.band(tau)
    mid = np.array([1.0 + 2.0**-24, -(3.0 + 2.0**-23)])
    inside = offset_bits(mid, [band - 1, 1 - band])
    outside = offset_bits(mid, [band, -band])
    assert near_boundary_mask(torch.from_numpy(inside), F64_F32, tau).all()
    assert not near_boundary_mask(torch.from_numpy(outside), F64_F32, tau).any()
    d_out = distance_to_boundary(torch.from_numpy(outside), F64_F32)
    assert torch.equal(d_out, torch.full((4,), tau, dtype=torch.float64))


def check_distance(got: float, ref: Fraction, value) -> None:
    """`got` is exact wherever d <= 1/4 (every band and every validity test with tau <= 1/8);
    above that, a subnormal-target remainder may carry more bits than the compute dtype holds,
    and `got` is then the correctly rounded d."""
    if ref <= Fraction(1, 4):
        assert Fraction(got) == ref, value
    else:
        assert got == float(ref), value


def test_distance_matches_reference_f64():
    values = np.concatenate([f64_values(3, 2.0**-8), subnormal_target_values(F64_F32)])
    d = distance_to_boundary(torch.from_numpy(values), F64_F32).numpy()
    for v, got in zip(values, d, strict=True):
        check_distance(float(got), ref_distance(float(v), F64_F32), v)


def test_distance_matches_reference_bf16():
    values = f32_values(4, 2.0**-4)
    d = distance_to_boundary(torch.from_numpy(values), F32_BF16)
    assert d.dtype == torch.float64  # always float64: 2**133 would overflow float32
    for v, got in zip(values, d.numpy(), strict=True):
        check_distance(float(got), ref_distance(float(v), F32_BF16), v)


def test_distance_bf16_subnormal_targets():
    values = subnormal_target_values(F32_BF16)
    d = distance_to_boundary(torch.from_numpy(values), F32_BF16)
    for v, got in zip(values, d.numpy(), strict=True):
        check_distance(float(got), ref_distance(float(v), F32_BF16), v)


@pytest.mark.parametrize("policy", [F64_F32, F32_BF16], ids=["f64-f32", "f32-bf16"])
def test_non_finite_values(policy):
    specials = torch.tensor([math.inf, -math.inf, math.nan], dtype=policy.compute)
    d = distance_to_boundary(specials, policy)
    assert torch.equal(d, torch.full((3,), 0.5, dtype=policy.compute))
    assert not near_boundary_mask(specials, policy, policy.tau).any()


@pytest.mark.parametrize("policy", [F64_F32, F32_BF16],
                         ids=["f64-f32", "f32-bf16"])
def test_zero(policy):
    zeros = torch.tensor([0.0, -0.0], dtype=policy.compute)
    assert torch.equal(distance_to_boundary(zeros, policy),
                       torch.full((2,), 0.5, dtype=torch.float64))
    assert not near_boundary_mask(zeros, policy, policy.tau).any()


def test_nan_payload_in_band_bits_is_never_recorded():
    """A NaN whose low mantissa bits sit at the half point passes the dense test, not the log."""
    nan_bits = torch.tensor([0x7FF0_0000_1000_0000, -0x000F_FFFF_F000_0000], dtype=torch.int64)
    y = nan_bits.view(torch.float64)
    assert torch.isnan(y).all()
    rec = SiteRecorder(F64_F32)
    (r,) = rec.round_site("op", [y])
    assert torch.isnan(r).all()
    assert rec.sites[0].indices.size == 0


@pytest.mark.parametrize("policy, subnormals", [
    (F64_F32, True), (F32_BF16, False), (F32_BF16, True)],
    ids=["f64-f32", "f32-bf16-normal", "f32-bf16-subnormal"])
def test_recorder_logs_exactly_the_reference_band(policy, subnormals):
    """End to end through SiteRecorder: dense test + subnormal fix-up + non-finite filtering."""
    tau = policy.tau
    values = f64_values(5, tau) if policy is F64_F32 else f32_values(6, tau)
    if subnormals:
        values = np.concatenate([values, subnormal_target_values(policy)])
    values = np.concatenate([values, np.array([0.0, -0.0, np.inf, -np.inf, np.nan],
                                              dtype=values.dtype)])
    rec = SiteRecorder(policy)
    (r,) = rec.round_site("op", [torch.from_numpy(values)])
    assert r.dtype == policy.target
    expected = [i for i, v in enumerate(values) if ref_distance(float(v), policy) < tau]
    assert rec.sites[0].indices.tolist() == expected
    if subnormals:
        assert any(0 < abs(v) < 2.0**-126 for v in values[expected])  # subnormals were logged
    # Directions: up iff RNE moved the magnitude away from zero.
    rv = r.to(torch.float64).numpy()
    ups = [abs(rv[i]) > abs(float(values[i])) for i in expected]
    assert rec.sites[0].up.tolist() == ups


# -- step_toward --------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def _target_bits(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    """Bit patterns of exactly representable values (sign of zero kept)."""
    return _bits(torch.tensor(values, dtype=torch.float64).to(dtype))


STEP_CASES_F64 = [
    1.0 + 2.0**-24 + 2.0**-40,  # just above a midpoint
    1.0 + 2.0**-24 - 2.0**-40,  # just below
    -(1.0 + 3 * 2.0**-24),  # negative exact midpoint: RNE goes to even
    2.0 - 2.0**-25,  # midpoint just below a power of two: RNE rounds up across the binade edge
    2.0 - 2.0**-25 - 2.0**-50,
    2.0 + 2.0**-23 + 2.0**-50,  # just above the edge
    -(2.0**-100 - 2.0**-126),
    2.0**-126 - 2.0**-150,  # midpoint below the smallest normal: RNE -> 2**-126 (even)
    2.0**-126 - 2.0**-150 - 2.0**-170,  # subnormal side of it
    2.0**-126 + 2.0**-150,  # normal side, between 2**-126 and its successor
    (3 + 0.5) * 2.0**-149,  # subnormal midpoints
    -(4 + 0.5) * 2.0**-149,
    2.0**-150,  # exactly half the smallest subnormal: RNE -> +0.0
    -(2.0**-150),  # -> -0.0
    2.0**-150 - 2.0**-170,  # RNE -> 0
    -(2.0**-160),  # RNE -> -0
    2.0**-150 + 2.0**-170,  # RNE -> smallest subnormal
    F32_MAX - 2.0**100,  # below the largest finite float32
]

STEP_CASES_BF16 = [
    1.0 + 2.0**-8,  # midpoint, RNE to even (1.0)
    1.0 + 3 * 2.0**-8,
    -(1.0 + 2.0**-8 + 2.0**-20),
    2.0 - 2.0**-9,  # midpoint below 2: RNE -> 2
    2.0 - 2.0**-9 - 2.0**-20,
    2.0**-126 - 2.0**-134,  # midpoint below the smallest normal
    (5 + 0.5) * 2.0**-133,
    -(0.5 * 2.0**-133),  # rounds to -0
    0.25 * 2.0**-133,
    2.0**-149,  # smallest float32 subnormal: RNE -> 0
    0.75 * 2.0**-133,
]


@pytest.mark.parametrize("policy, cases", [(F64_F32, STEP_CASES_F64), (F32_BF16, STEP_CASES_BF16)],
                         ids=["f64-f32", "f32-bf16"])
@pytest.mark.parametrize("up", [True, False])
def test_step_toward_gives_the_requested_neighbour(policy, cases, up):
    y = torch.tensor(cases, dtype=torch.float64).to(policy.compute)
    assert torch.equal(y.to(torch.float64), torch.tensor(cases, dtype=torch.float64))  # exact
    r = y.to(policy.target)
    ups = torch.full((len(cases),), up)
    got = step_toward(r, y, ups, policy)
    expected = _target_bits([ref_step(v, up, policy) for v in cases], policy.target)
    assert torch.equal(_bits(got), expected)
    assert torch.equal(rounded_up(y, got), ups)


@pytest.mark.parametrize("policy", [F64_F32, F32_BF16], ids=["f64-f32", "f32-bf16"])
def test_step_toward_on_random_values(policy):
    rng = np.random.default_rng(7)
    if policy is F64_F32:
        values = random_f64(rng, 2000, -140, 120)
    else:
        values = random_f64(rng, 2000, -140, 120).astype(np.float32)
    keep = [i for i, v in enumerate(values) if REFERENCES[policy](float(v)) is not None]
    values = values[keep]
    y = torch.from_numpy(values)
    r = y.to(policy.target)
    up = torch.from_numpy(rng.integers(0, 2, size=len(values)).astype(bool))
    got = step_toward(r, y, up, policy)
    expected = _target_bits([ref_step(float(v), bool(u), policy) for v, u in
                             zip(values, up.tolist(), strict=True)], policy.target)
    assert torch.equal(_bits(got), expected)


def test_step_toward_keeps_rne_when_it_already_went_that_way():
    y = torch.tensor([1.0 + 2.0**-23 - 2.0**-30, 1.0 + 2.0**-30], dtype=torch.float64)
    r = y.to(torch.float32)
    up = rounded_up(y, r)
    assert torch.equal(up, torch.tensor([True, False]))
    assert step_toward(r, y, up, F64_F32) is r  # nothing to change: no copy


# -- the policy ---------------------------------------------------------------------------------


def test_defaults_and_parse():
    assert PrecisionPolicy() == F64_F32
    assert F64_F32.tau == DEFAULT_TAU[(torch.float64, torch.float32)]
    assert F32_BF16.tau == DEFAULT_TAU[(torch.float32, torch.bfloat16)]
    assert PrecisionPolicy.parse("float64->float32") == F64_F32
    assert PrecisionPolicy.parse("float32:bfloat16") == F32_BF16
    assert PrecisionPolicy.parse(" float64 -> float32 ", tau=0.01).tau == 0.01
    assert F32_BF16.name == "float32->bfloat16"
    assert F64_F32.tau_for(True) == 0.0 and F64_F32.tau_for(False) == F64_F32.tau


def test_band_is_ceil_of_tau_in_compute_ulps():
    assert F64_F32.band(2.0**-8) == 2**21
    assert F64_F32.band(2.0**-8 + 2.0**-40) == 2**21 + 1
    assert F64_F32.band(1e-12) == 1
    assert F32_BF16.band(2.0**-4) == 2**12


@pytest.mark.parametrize("text", ["float32->float64", "float64->bfloat16", "float16->float32",
                                  "float64", "float64->float32->bfloat16", "", "f64->f32",
                                  "bfloat16->float32"])
def test_bad_policies(text):
    with pytest.raises(ConfigError):
        PrecisionPolicy.parse(text)


@pytest.mark.parametrize("tau", [0.0, -0.01, 0.26, 1.0, math.nan, math.inf])
def test_bad_tau(tau):
    with pytest.raises(ConfigError, match="tau"):
        PrecisionPolicy(tau=tau)
    with pytest.raises(ConfigError, match="tau"):
        PrecisionPolicy.parse("float32->bfloat16", tau=tau)


@pytest.mark.parametrize("tau_ieee", [-0.01, 0.3, math.nan])
def test_bad_tau_ieee(tau_ieee):
    with pytest.raises(ConfigError, match="tau_ieee"):
        PrecisionPolicy(tau_ieee=tau_ieee)


def test_unsupported_pair_names_the_supported_ones():
    with pytest.raises(ConfigError, match="float64->float32, float32->bfloat16"):
        PrecisionPolicy(torch.float64, torch.bfloat16)
