"""protocol.engine.precision: the exact distance δ, the band prefilter, target ULPs, the direction
to the nearest boundary and step_toward (SPEC §3.1, §3.2).

Every bit-level routine is checked against a deliberately naive reference written with
`fractions.Fraction`: a target value is decoded from its bit pattern by hand, the target values
around `y` are found by walking the ordinals (signed bit patterns) next to a rough guess, the
rounding boundaries are their exact midpoints, and δ is the exact distance to the nearest one.
Beyond the largest finite value the reference continues the top binade's spacing, so the
overflow threshold (MAX + ulp/2, where round-to-nearest gives inf) is a boundary like any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import pytest
import torch

from protocol.engine.precision import (
    RULES_VERSION,
    PrecisionPolicy,
    band_candidates,
    boundary_distance,
    holds_integer,
    rounded_up,
    step_toward,
    target_ulp,
    toward_boundary,
)
from protocol.engine.rounding import WIDE, SiteRecorder
from protocol.errors import ConfigError

F64_F32 = PrecisionPolicy(torch.float64, torch.float32)
F32_BF16 = PrecisionPolicy(torch.float32, torch.bfloat16)
POLICIES = [pytest.param(F64_F32, id="f64-f32"), pytest.param(F32_BF16, id="f32-bf16")]
F32_MAX = float(np.finfo(np.float32).max)
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


# -- the naive reference ------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetFormat:
    """A binary target format with an 8-bit exponent (bias 127) and `mant` fraction bits."""

    mant: int

    @property
    def inf_bits(self) -> int:
        return 0xFF << self.mant

    def magnitude(self, m: int) -> Fraction:
        """The value of magnitude bits `m`; past the largest finite value the top binade's
        spacing continues (a virtual value: the overflow threshold is a boundary too)."""
        top = self.inf_bits - 1
        if m > top:
            return self.magnitude(top) + (m - top) * self.ulp_of_bits(top)
        exp, frac = m >> self.mant, m & ((1 << self.mant) - 1)
        if exp == 0:
            return Fraction(frac) * Fraction(2) ** (1 - 127 - self.mant)
        return Fraction((1 << self.mant) + frac) * Fraction(2) ** (exp - 127 - self.mant)

    def ulp_of_bits(self, m: int) -> Fraction:
        exp = max(m >> self.mant, 1)
        return Fraction(2) ** (exp - 127 - self.mant)

    def value(self, ordinal: int) -> Fraction:
        """Target values in order: ordinal k >= 0 is +bits k, ordinal -k is -bits k."""
        v = self.magnitude(abs(ordinal))
        return -v if ordinal < 0 else v


FORMATS = {F64_F32: TargetFormat(23), F32_BF16: TargetFormat(7)}


def rough_ordinal(y: float, policy: PrecisionPolicy) -> int:
    """Some ordinal within one of y's correct rounding (numpy's conversion or truncation)."""
    if policy is F64_F32:
        bits = int(np.array([abs(y)], dtype=np.float32).view(np.uint32)[0])
    else:
        bits = int(np.array([abs(y)], dtype=np.float32).view(np.uint32)[0]) >> 16
    return -bits if y < 0 else bits


@dataclass(frozen=True)
class Reference:
    delta: Fraction  # exact distance to the nearest boundary
    rne: Fraction  # y rounded to nearest, ties to even
    boundaries: tuple[Fraction, ...]  # the boundaries near y
    across: bool  # the nearest boundary lies across r = RNE(y) from y (see below)


def reference(y: float, policy: PrecisionPolicy) -> Reference:
    fmt, yf = FORMATS[policy], Fraction(y)
    k0 = rough_ordinal(y, policy)
    ordinals = list(range(k0 - 3, k0 + 4))
    values = [fmt.value(k) for k in ordinals]
    mids = tuple((a + b) / 2 for a, b in zip(values, values[1:], strict=False))
    assert values[1] <= yf <= values[-2], "the rough guess was off by more than one"
    delta = min(abs(yf - m) for m in mids)
    best = min(abs(yf - v) for v in values)
    nearest = [(k, v) for k, v in zip(ordinals, values, strict=True) if abs(yf - v) == best]
    if len(nearest) == 2:
        nearest = [kv for kv in nearest if abs(kv[0]) % 2 == 0]  # ties to even
    k, rne = nearest[0]
    across = False
    if yf != rne:  # the boundary between r and its neighbour on y's side
        side = (rne + fmt.value(k + (1 if yf > rne else -1))) / 2
        across = delta < abs(yf - side)
    return Reference(delta, rne, mids, across)


# Just above a power of two (r = 2**k, 0 < |y| - |r| < ulp(r) / 8) the nearest boundary is the
# midpoint *below* r, at r - ulp/4, not the one on y's side (an earlier boundary_distance got
# this wrong). The general tests cover those elements (`Reference.across`) like any other; the
# dedicated tests `test_distance_just_above_a_power_of_two` and the recorder's check that the
# values really contain them.


def ref_ulp(r: float, policy: PrecisionPolicy) -> Fraction:
    """The spacing of target values just above |r| (r a target value)."""
    fmt = FORMATS[policy]
    m = abs(rough_ordinal(r, policy))
    assert fmt.magnitude(m) == abs(Fraction(r))
    return fmt.magnitude(m + 1) - fmt.magnitude(m)


# -- test values --------------------------------------------------------------------------------


def _bits_to_f64(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint64).view(np.float64)


def random_f64(rng: np.random.Generator, n: int, lo_exp: int, hi_exp: int) -> np.ndarray:
    """Random signs and mantissas with (normal) float64 exponents uniform in [lo_exp, hi_exp]."""
    mant = rng.integers(0, 2**52, size=n, dtype=np.uint64)
    exp = rng.integers(lo_exp, hi_exp + 1, size=n).astype(np.uint64) + np.uint64(1023)
    sign = rng.integers(0, 2, size=n, dtype=np.uint64)
    return _bits_to_f64((sign << np.uint64(63)) | (exp << np.uint64(52)) | mant)


def offset_bits(values: np.ndarray, offsets) -> np.ndarray:
    """Each value moved by each offset, in units of its own last bit (same sign)."""
    int_dtype = np.int64 if values.dtype == np.float64 else np.int32
    bits = values.view(int_dtype)
    return np.concatenate([(bits + np.array(k, dtype=int_dtype)).view(values.dtype)
                           for k in offsets])


def _with_negatives(values: np.ndarray) -> np.ndarray:
    return np.concatenate([values, -values])


def f64_values(seed: int) -> np.ndarray:
    """float64 values for float64 -> float32: random over the whole target range (subnormal
    targets and values that round to zero included), exact target values, midpoints and their
    neighbours, both sides of every kind of binade edge, zero and the overflow threshold."""
    rng = np.random.default_rng(seed)
    rand32 = random_f64(rng, 300, -149, 127).astype(np.float32)
    rand32 = rand32[np.isfinite(rand32)]
    hi32 = np.nextafter(rand32, np.copysign(np.float32(np.inf), rand32))
    mids = (rand32.astype(np.float64) + hi32.astype(np.float64)) / 2  # exact in float64
    mids = mids[np.isfinite(mids)]
    pow2 = np.array([2.0**k for k in (-149, -148, -127, -126, -125, -60, -1, 0, 1, 60, 127)])
    edges = np.array([2.0**k * (1 + s * j * 2.0**-53) for k in (-125, -1, 0, 1, 60, 127)
                      for j in (1, 2, 3, 2**27, 2**28, 2**28 + 1, 2**29 - 1) for s in (-1, 1)])
    quarter_below = np.array([2.0**k - 2.0**(k - 25) for k in (-125, 0, 1, 100)])  # boundary
    specials = np.array([
        0.0, 2.0**-126 - 2.0**-149, 2.0**-126 - 2.0**-150, 2.0**-150, 2.0**-151, 2.0**-1074,
        2.0**-150 * (1 + 2.0**-52), 2.0**-150 * (1 - 2.0**-53), 3.5 * 2.0**-149, 7.25 * 2.0**-149,
        F32_MAX, F32_MAX + 2.0**102, F32_MAX + 2.0**103 - 2.0**75, 1e-30, 1e30,
    ])
    values = np.concatenate([
        random_f64(rng, 2000, -155, 127),
        rand32.astype(np.float64),
        offset_bits(mids, [0, 1, -1, 2**20, -(2**20), 2**28, -(2**28)]),
        pow2, offset_bits(pow2[2:], [1, -1]), edges,
        offset_bits(quarter_below, [0, 1, -1]), specials,
    ])
    values = _with_negatives(values)
    return values[np.abs(values) < F32_MAX + 2.0**103]  # beyond: rounds to inf, no site


def f32_values(seed: int) -> np.ndarray:
    """float32 values for float32 -> bfloat16, built the same way."""
    rng = np.random.default_rng(seed)
    rand = random_f64(rng, 2000, -149, 127).astype(np.float32)
    rand = rand[np.isfinite(rand) & (np.abs(rand) < BF16_MAX)]
    lo = (rand.view(np.uint32) & np.uint32(0xFFFF_0000)).view(np.float32)
    mids = (lo.view(np.uint32) | np.uint32(0x8000)).view(np.float32)  # exact bf16 midpoints
    pow2 = np.array([2.0**k for k in (-133, -132, -127, -126, -125, -1, 0, 1, 100, 127)],
                    dtype=np.float32)
    edges = np.array([2.0**k * (1 + s * j * 2.0**-24) for k in (-125, 0, 1, 100)
                      for j in (1, 2, 2**7 - 1, 2**7, 2**7 + 1, 2**8 - 1) for s in (-1, 1)],
                     dtype=np.float32)
    specials = np.array([
        0.0, 2.0**-149, 2.0**-134, 2.0**-135, 2.0**-133 * 1.5, 2.0**-126 - 2.0**-134,
        2.0**-126 - 2.0**-149, BF16_MAX, BF16_MAX + 2.0**118, BF16_MAX + 2.0**119 - 2.0**104,
    ], dtype=np.float32)
    values = np.concatenate([rand, lo[:200], offset_bits(mids[:300], [0, 1, -1, 2**8, -(2**8)]),
                             pow2, offset_bits(pow2, [1, -1]), edges, specials])
    values = _with_negatives(values)
    return values[np.abs(values) < BF16_MAX + 2.0**119]  # beyond: inf


VALUES = {F64_F32: f64_values, F32_BF16: f32_values}


@pytest.fixture(scope="module", params=POLICIES)
def case(request):
    """(policy, y, r, the reference of each y) for one policy."""
    policy = request.param
    values = VALUES[policy](11)
    y = torch.from_numpy(values)
    assert y.dtype == policy.compute
    refs = [reference(float(v), policy) for v in values]
    return policy, y, y.to(policy.target), refs


# -- the reference's own premises ---------------------------------------------------------------


def test_reference_decodes_like_the_hardware():
    """The hand decoder agrees with the machine on every float32 and bfloat16 magnitude class."""
    for bits in [0, 1, 2, 0x7F_FFFF, 0x80_0000, 0x3F80_0000, 0x3F80_0001, 0x7F7F_FFFF]:
        v = float(np.array([bits], dtype=np.uint32).view(np.float32)[0])
        assert TargetFormat(23).magnitude(bits) == Fraction(v)
    for bits in [0, 1, 0x7F, 0x80, 0x3F80, 0x3F81, 0x7F7F]:
        v = float(torch.tensor([bits], dtype=torch.int16).view(torch.bfloat16)[0])
        assert TargetFormat(7).magnitude(bits) == Fraction(v)
    assert TargetFormat(23).magnitude(0x7F80_0000) == Fraction(F32_MAX) + 2**104


def test_values_cover_the_edge_cases(case):
    policy, y, r, refs = case
    assert torch.isfinite(r).all()
    assert any(Fraction(float(v)) == ref.rne for v, ref in zip(y, refs, strict=True))  # y == r
    assert sum(ref.delta == 0 for ref in refs) >= 100  # exact midpoints
    assert bool((r == 0).any()) and bool(((r != 0) & (r.abs() < 2.0**-126)).any())
    assert bool((y < 0).any()) and bool((r.abs() == torch.finfo(policy.target).max).any())
    top = torch.finfo(policy.target).max
    assert bool(((y.abs() > top) & (r.abs() == top)).any())  # above MAX, below overflow


# -- boundary_distance --------------------------------------------------------------------------


def test_conversion_is_the_reference_round_to_nearest_even(case):
    """The premise of the policy: `.to(target)` is one correctly rounded RNE conversion."""
    policy, y, r, refs = case
    got = [Fraction(float(v)) for v in r.to(torch.float64)]
    assert got == [ref.rne for ref in refs]
    nonzero = y != 0
    assert torch.equal(torch.signbit(r)[nonzero], torch.signbit(y)[nonzero])


def test_boundary_distance_is_exact(case):
    """δ is the correctly rounded exact distance, and exactly it wherever δ <= ulp/4 (all that a
    band ever compares): the arithmetic is float64 on a difference that Sterbenz makes exact."""
    policy, y, r, refs = case
    d = boundary_distance(y, r, policy)
    assert d.dtype == torch.float64 and d.shape == y.shape
    ulps = target_ulp(r, policy)
    exact = 0
    for got, ulp, v, ref in zip(d.tolist(), ulps.tolist(), y.tolist(), refs, strict=True):
        assert got == float(ref.delta), v
        if ref.delta <= Fraction(ulp) / 4:
            assert Fraction(got) == ref.delta, v
            exact += 1
    assert exact >= len(refs) // 4


@pytest.mark.parametrize("policy", POLICIES)
def test_boundary_distance_at_hand_picked_points(policy):
    """Known answers, independent of the reference: a midpoint is 0 away; a target value away
    from a power of two is half a ULP from both neighbouring midpoints; a power of two is a
    quarter of its ULP from the midpoint below it; zero is half a subnormal ULP from ±ulp/2."""
    mant = policy.fmt["target_mantissa"]
    sub = 2.0 ** (-126 - mant)
    cases = [
        (1.0 + 2.0 ** -(mant + 1), 0.0),
        (1.5, 2.0 ** -(mant + 1)),
        (-1.5, 2.0 ** -(mant + 1)),
        (2.0, 2.0 ** -(mant + 1)),  # ulp(2) / 4
        (1.0, 2.0 ** -(mant + 2)),
        (2.0**-126, sub / 2),  # the smallest normal: the subnormal spacing below is the same
        (0.0, sub / 2),
        (-0.0, sub / 2),
        (3 * sub, sub / 2),
        (2.0 - 2.0 ** -(mant + 1), 0.0),  # the midpoint below 2
    ]
    y = torch.tensor([c[0] for c in cases], dtype=policy.compute)
    d = boundary_distance(y, y.to(policy.target), policy)
    assert d.tolist() == [c[1] for c in cases]


@pytest.mark.parametrize("policy", POLICIES)
def test_boundary_distance_is_symmetric_in_sign(policy):
    y = torch.from_numpy(VALUES[policy](12))
    d_pos = boundary_distance(y, y.to(policy.target), policy)
    d_neg = boundary_distance(-y, (-y).to(policy.target), policy)
    assert torch.equal(d_pos, d_neg)


# -- target_ulp ---------------------------------------------------------------------------------


def test_target_ulp_is_the_spacing_above(case):
    policy, _, r, _ = case
    ulps = target_ulp(r, policy)
    assert ulps.dtype == torch.float64
    for got, rv in zip(ulps.tolist(), r.to(torch.float64).tolist(), strict=True):
        assert Fraction(got) == ref_ulp(rv, policy), rv


@pytest.mark.parametrize("policy", POLICIES)
def test_target_ulp_at_hand_picked_values(policy):
    mant = policy.fmt["target_mantissa"]
    sub = 2.0 ** (-126 - mant)
    r = torch.tensor([0.0, -0.0, sub, 2.0**-127, 2.0**-126, 1.0, -1.0, 1.5, 2.0,
                      torch.finfo(policy.target).max], dtype=torch.float64).to(policy.target)
    expected = [sub, sub, sub, sub, sub, 2.0**-mant, 2.0**-mant, 2.0**-mant, 2.0 ** (1 - mant),
                2.0 ** (127 - mant)]
    assert target_ulp(r, policy).tolist() == expected


# -- toward_boundary ----------------------------------------------------------------------------


def test_toward_boundary_points_at_the_nearest_boundary(case):
    """Moving y by δ in the returned direction lands exactly on a boundary; at y == r with two
    equal gaps either boundary is nearest, below a power of two only the lower one is."""
    policy, y, r, refs = case
    direction = toward_boundary(y, r, policy)
    assert direction.dtype == y.dtype and set(direction.unique().tolist()) <= {-1.0, 1.0}
    checked = 0
    for s, v, ref in zip(direction.tolist(), y.tolist(), refs, strict=True):
        if ref.delta == 0:
            continue  # y is a boundary: both ways leave it
        assert Fraction(v) + int(s) * ref.delta in ref.boundaries, v
        checked += 1
    assert checked >= len(refs) // 2


@pytest.mark.parametrize("policy", POLICIES)
def test_toward_boundary_at_hand_picked_points(policy):
    mant = policy.fmt["target_mantissa"]
    ulp1 = 2.0**-mant
    y = torch.tensor([1.0 + ulp1 * 3 / 16, 1.0 + ulp1 * 3 / 8, 2.0, -2.0, 1.5, -1.5,
                      2.0 - ulp1 / 8, -(1.0 + ulp1 * 3 / 8)], dtype=policy.compute)
    # 1 + 3/16 ulp and 1 + 3/8 ulp: up, to 1 + ulp/2; ±2 exactly: toward zero, the smaller gap
    # is below a power of two; ±1.5 exactly: equal gaps, away from zero (the implementation's
    # choice; both are nearest); 2 - ulp/8 (r = 2): down, to the midpoint 2 - ulp/2 below 2;
    # -(1 + 3/8 ulp): away from zero, to -(1 + ulp/2)
    expected = [1.0, 1.0, -1.0, 1.0, 1.0, -1.0, -1.0, -1.0]
    assert toward_boundary(y, y.to(policy.target), policy).tolist() == expected


# -- band_candidates ----------------------------------------------------------------------------


def random_bounds(rng: np.random.Generator, y: np.ndarray, policy: PrecisionPolicy
                  ) -> np.ndarray:
    """Bounds of many magnitudes: relative to |y| (2**-60 .. 2**4 of it, i.e. far below to far
    above a target ULP), absolute (down to the compute dtype's subnormals), and zero."""
    n = y.size
    rel = np.abs(y) * np.exp2(-rng.uniform(-4, 60, size=n))
    absolute = np.exp2(-rng.uniform(0, 160, size=n))
    kind = rng.integers(0, 5, size=n)
    e = np.where(kind < 3, rel, absolute)
    e = np.where(kind == 4, 0.0, e)
    e = np.minimum(e, float(torch.finfo(policy.compute).max))  # finite, as every rule's bound
    if policy is F64_F32:
        e[::97] = 2.0**-1074  # the smallest subnormal bound: still a rounding error
    return e.astype(y.dtype)


def band_edge_values(refs: list[Reference], y: torch.Tensor) -> np.ndarray:
    """Bounds with δ = 2e exactly where δ/2 is representable: the band's inclusive edge."""
    halves = [float(ref.delta) / 2 for ref in refs]
    return np.array([h if Fraction(h) * 2 == ref.delta else 0.0
                     for h, ref in zip(halves, refs, strict=True)])


def _in_band(refs: list[Reference], e: np.ndarray) -> set[int]:
    return {i for i, (ref, b) in enumerate(zip(refs, e.tolist(), strict=True))
            if b > 0 and ref.delta <= 2 * Fraction(b)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_band_candidates_is_a_tight_superset(case, seed):
    """Every element with e > 0 and δ <= 2e is a candidate, none with e = 0 is, and a
    target-normal candidate has δ <= 4e (the prefilter loses at most a factor two, just above a
    power of two)."""
    policy, y, r, refs = case
    rng = np.random.default_rng(seed)
    e = random_bounds(rng, y.numpy(), policy)
    edge = band_edge_values(refs, y).astype(e.dtype)
    use_edge = (rng.integers(0, 4, size=e.size) == 0) & (edge > 0)
    e = np.where(use_edge, edge, e)
    cand = band_candidates(y, torch.from_numpy(e), policy)
    assert cand.dtype == torch.int64 and cand.dim() == 1
    assert torch.equal(cand, cand.sort().values) and cand.unique().numel() == cand.numel()
    got = set(cand.tolist())
    expected = _in_band(refs, e)
    assert expected <= got
    assert all(e[i] > 0 for i in got)
    tiny = float(torch.finfo(policy.target).smallest_normal)
    with np.errstate(over="ignore"):  # the prefilter scales e by 2**(p+2) in the compute dtype;
        scaled = np.isfinite(e * e.dtype.type(2.0 ** (policy.fmt["compute_mantissa"] + 2)))
    for i in got:  # where that overflows it keeps the element: harmless, just not tight
        if abs(float(y[i])) >= tiny and scaled[i]:
            assert refs[i].delta <= 4 * Fraction(float(e[i])), float(y[i])
    # both sides were exercised: in band, and with e > 0 out of it
    assert len(expected) >= 200 and int((e > 0).sum()) - len(got) >= 200
    assert any(e[i] > float(target_ulp(r[i:i + 1], policy)) for i in expected)  # e > a ULP


@pytest.mark.parametrize("policy", POLICIES)
def test_band_candidates_with_huge_and_zero_bounds(policy):
    """A bound beyond half a ULP puts every element in the band; e = 0 puts none there."""
    y = torch.from_numpy(VALUES[policy](13))
    everything = band_candidates(y, y.abs() + 1.0, policy)
    assert torch.equal(everything, torch.arange(y.numel()))
    assert band_candidates(y, torch.zeros_like(y), policy).numel() == 0
    # the exact midpoints (δ = 0) are not candidates at e = 0 either
    mid = torch.tensor([1.0 + 2.0 ** -(policy.fmt["target_mantissa"] + 1)], dtype=policy.compute)
    assert band_candidates(mid, torch.zeros_like(mid), policy).numel() == 0
    assert band_candidates(mid, torch.full_like(mid, 2.0**-140), policy).tolist() == [0]


@pytest.mark.parametrize("policy", POLICIES)
def test_non_finite_values_are_no_candidates(policy):
    int_dtype = policy.fmt["int_dtype"]
    shift = policy.fmt["shift"]
    # NaNs whose low bits sit exactly at the half point: the dense test must not let them in
    exp = policy.fmt["exp_mask"]
    nan_bits = torch.tensor([exp | (1 << (shift - 1)), exp | (1 << (shift - 1)) | (1 << shift)],
                            dtype=torch.int64).to(int_dtype)
    nans = nan_bits.view(policy.compute)
    assert torch.isnan(nans).all()
    y = torch.cat([nans, torch.tensor([math.inf, -math.inf, math.nan], dtype=policy.compute)])
    assert band_candidates(y, torch.full_like(y, 1e-3), policy).numel() == 0


# -- the recorder applies exactly the rule of SPEC §3.2 -----------------------------------------


def test_recorder_logs_exactly_the_reference_band(case):
    """End to end through SiteRecorder: the logged elements are {e > 0, δ <= 2e}, non-finite
    ones excluded and an overflowing one too where its bound does not reach back to the
    overflow threshold; a value entry exactly where WIDE·e >= the target ULP, holding the RNE
    bits; a direction entry elsewhere, up iff |RNE| > |y|."""
    policy, y, r, refs = case
    rng = np.random.default_rng(5)
    e = random_bounds(rng, y.numpy(), policy)
    edge = band_edge_values(refs, y).astype(e.dtype)
    e = np.where((rng.integers(0, 3, size=e.size) == 0) & (edge > 0), edge, e)
    extra_y = torch.tensor([math.nan, math.inf, -math.inf,
                            float(torch.finfo(policy.target).max) * 4], dtype=policy.compute)
    flat = torch.cat([y, extra_y])
    huge = 1e300 if policy is F64_F32 else 1e30
    bound = torch.cat([torch.from_numpy(e), torch.tensor(
        [huge, huge, huge, float(torch.finfo(policy.target).max)], dtype=policy.compute)])
    rec = SiteRecorder(policy)
    (rounded,) = rec.round_site("aten.exp.default", [flat], [bound])
    assert torch.equal(rounded[: y.numel()].view(policy.fmt["target_int"]),
                       r.view(policy.fmt["target_int"]))
    site = rec.log().sites[0]
    assert site.numel == flat.numel()
    expected = _in_band(refs, e)
    logged = set(site.indices.tolist()) | set(site.value_indices.tolist())
    assert logged <= expected  # non-finite and overflowing elements (the last 4) are not
    assert expected <= logged
    assert len(logged) == site.indices.size + site.value_indices.size  # no index twice
    ulps = target_ulp(r, policy).tolist()
    wide = {i for i in logged if WIDE * Fraction(float(e[i])) >= Fraction(ulps[i])}
    assert set(site.value_indices.tolist()) == wide and len(wide) >= 20
    assert len(logged - wide) >= 100
    width = 8 * r.element_size()
    bits = r.view(policy.fmt["target_int"]).to(torch.int64) & ((1 << width) - 1)
    assert site.values.dtype == np.uint32
    assert site.values.tolist() == [int(bits[i]) for i in site.value_indices]
    ups = [abs(float(r[i])) > abs(float(y[i])) for i in site.indices]
    assert site.up.tolist() == ups


@pytest.mark.parametrize("policy", POLICIES)
def test_recorder_band_edge_is_inclusive(policy):
    """δ = 2e exactly is logged; one compute ULP farther from the boundary is not."""
    mant = policy.fmt["target_mantissa"]
    ulp = 2.0**-mant
    e = ulp / 64  # narrow: direction entries
    at_edge = 1.0 + ulp / 2 - 2 * e  # δ = 2e
    y = torch.tensor([at_edge], dtype=policy.compute)
    beyond = torch.nextafter(y, torch.zeros_like(y))  # δ = 2e + one compute ULP
    assert float(boundary_distance(y, y.to(policy.target), policy)[0]) == 2 * e
    rec = SiteRecorder(policy)
    rec.round_site("op", [torch.cat([y, beyond])], [e])
    site = rec.log().sites[0]
    assert site.indices.tolist() == [0] and site.up.tolist() == [False]
    assert site.value_indices.size == 0


def test_nan_payload_in_band_bits_is_never_recorded():
    """A NaN whose low mantissa bits sit at the half point is neither a candidate nor logged."""
    nan_bits = torch.tensor([0x7FF0_0000_1000_0000, -0x000F_FFFF_F000_0000], dtype=torch.int64)
    y = nan_bits.view(torch.float64)
    assert torch.isnan(y).all()
    rec = SiteRecorder(F64_F32)
    (r,) = rec.round_site("op", [y], [1.0])
    assert torch.isnan(r).all()
    site = rec.sites[0]
    assert site.indices.size == 0 and site.value_indices.size == 0


# -- just above a power of two the nearest boundary is below it ---------------------------------


def test_distance_just_above_a_power_of_two(case):
    policy, y, r, refs = case
    across = [i for i, ref in enumerate(refs) if ref.across]
    assert len(across) >= 10  # the values include the case (edges of the form 2**k (1 + j u))
    idx = torch.tensor(across)
    d = boundary_distance(y[idx], r[idx], policy).tolist()
    direction = toward_boundary(y[idx], r[idx], policy).tolist()
    assert d == [float(refs[i].delta) for i in across]
    assert all(Fraction(float(y[i])) + int(s) * refs[i].delta in refs[i].boundaries
               for i, s in zip(across, direction, strict=True))


@pytest.mark.parametrize("policy", POLICIES)
def test_recorder_logs_an_element_just_above_a_power_of_two(policy):
    """y = 1 + ulp/16: the nearest boundary is 1 - ulp/4, δ = 5/16 ulp. With e = 0.16 ulp
    (δ <= 2e) another honest machine, within e of y, can land below 1 - ulp/4 and round to
    1 - ulp/2: the element must be logged (as a value entry: 16e >= ulp)."""
    ulp = 2.0 ** -policy.fmt["target_mantissa"]
    y = torch.tensor([1.0 + ulp / 16], dtype=policy.compute)
    assert reference(float(y[0]), policy).delta == Fraction(5, 16) * Fraction(ulp)
    rec = SiteRecorder(policy)
    rec.round_site("aten.exp.default", [y], [0.16 * ulp])
    assert rec.log().sites[0].value_indices.tolist() == [0]


# -- step_toward --------------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def ref_step(y: float, up: bool, policy: PrecisionPolicy) -> float:
    """The target neighbour of a non-representable y: larger magnitude if `up`, else smaller."""
    fmt = FORMATS[policy]
    k = rough_ordinal(y, policy)
    values = [(j, fmt.value(j)) for j in range(k - 2, k + 3)]
    yf = Fraction(y)
    lo = max((v for _, v in values if abs(v) < abs(yf) and (v >= 0) == (yf >= 0)),
             key=abs, default=Fraction(0))
    hi = min((v for _, v in values if abs(v) > abs(yf) and (v > 0) == (yf > 0)), key=abs)
    return float(hi if up else lo)


def _target_bits(values: list[float], y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bit patterns of exactly representable values; a zero takes the sign of its y."""
    t = torch.tensor(values, dtype=torch.float64)
    t = torch.where(t == 0, torch.copysign(t, y.to(torch.float64)), t)
    return _bits(t.to(dtype))


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
    expected = _target_bits([ref_step(v, up, policy) for v in cases], y, policy.target)
    assert torch.equal(_bits(got), expected)
    assert torch.equal(rounded_up(y, got), ups)


@pytest.mark.parametrize("policy", POLICIES)
def test_step_toward_on_random_values(policy):
    rng = np.random.default_rng(7)
    values = random_f64(rng, 2000, -140, 120)
    if policy is F32_BF16:
        values = values.astype(np.float32)
    y = torch.from_numpy(values)
    r = y.to(policy.target)
    keep = (r.to(policy.compute) != y).numpy()
    y, r = y[keep], r[keep]
    up = torch.from_numpy(rng.integers(0, 2, size=y.numel()).astype(bool))
    got = step_toward(r, y, up, policy)
    expected = _target_bits([ref_step(float(v), bool(u), policy) for v, u in
                             zip(y.tolist(), up.tolist(), strict=True)], y, policy.target)
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
    assert F64_F32.rules == RULES_VERSION == 5
    assert PrecisionPolicy.parse("float64->float32") == F64_F32
    assert PrecisionPolicy.parse("float32:bfloat16") == F32_BF16
    assert PrecisionPolicy.parse(" float64 -> float32 ") == F64_F32
    assert F32_BF16.name == "float32->bfloat16" and F64_F32.name == "float64->float32"
    assert not hasattr(F64_F32, "tau")  # superseded (SPEC §3.1)


def test_compute_dtype_constants():
    assert F64_F32.unit_roundoff == 2.0**-53 and F32_BF16.unit_roundoff == 2.0**-24
    zero, one = torch.zeros((), dtype=torch.float64), torch.ones((), dtype=torch.float64)
    assert F64_F32.tiny == 2.0**-1074 == float(torch.nextafter(zero, one))
    assert F32_BF16.tiny == 2.0**-149


@pytest.mark.parametrize("rules", [0, 1, 2, -1, RULES_VERSION + 1])
def test_other_rules_versions_are_refused(rules):
    """Version 1 (bounded addcmul/addcdiv/lerp) logs what version 2 computes exactly; version 2
    decomposes the softmax family, which version 3 rounds as one site each: other logs."""
    with pytest.raises(ConfigError, match=f"bound rules version {rules}"):
        PrecisionPolicy(rules=rules)


@pytest.mark.parametrize("rules", [True, False, 2.0, "2", None])
def test_rules_version_must_be_an_integer(rules):
    with pytest.raises(ConfigError, match="must be an integer"):
        PrecisionPolicy(rules=rules)


@pytest.mark.parametrize("text", ["float32->float64", "float64->bfloat16", "float16->float32",
                                  "float64", "float64->float32->bfloat16", "", "f64->f32",
                                  "bfloat16->float32", "int64->float32"])
def test_bad_policies(text):
    with pytest.raises(ConfigError):
        PrecisionPolicy.parse(text)


def test_unsupported_pair_names_the_supported_ones():
    with pytest.raises(ConfigError, match="float64->float32, float32->bfloat16"):
        PrecisionPolicy(torch.float64, torch.bfloat16)


def test_a_policy_is_found_by_its_unit_roundoff():
    assert PrecisionPolicy.of_unit_roundoff(2.0**-53) == F64_F32
    assert PrecisionPolicy.of_unit_roundoff(2.0**-24) == F32_BF16
    with pytest.raises(ConfigError, match="unit roundoff"):
        PrecisionPolicy.of_unit_roundoff(2.0**-11)
    assert F64_F32.scalar_rounder(0.1) == float(np.float32(0.1))
    assert F32_BF16.scalar_rounder(1 + 2.0**-9) == 1.0


def test_holds_integer_says_which_integers_a_target_dtype_holds_exactly():
    """An integer divisor is used as it is (SPEC §3.3), so whether the target holds it decides
    the division's rule: float32 holds 2^24 and 2^24 + 2 but not 2^24 + 1, its largest value
    2^128 − 2^104 but not 2^128; bfloat16 holds 256 and 258 but not 257; an integer beyond
    float64's range is held by neither (and raises nothing)."""
    f32, bf16 = torch.float32, torch.bfloat16
    assert all(holds_integer(f32, n) for n in (0, 3, -7, 2**24, 2**24 + 2, -(2**24 + 2),
                                               2**128 - 2**104, 2**127))
    assert not any(holds_integer(f32, n) for n in (2**24 + 1, -(2**24 + 1), 2**128,
                                                   2**128 - 2**103, 10**400, 2**53 + 1))
    assert all(holds_integer(bf16, n) for n in (256, 258, -258, 2**127))
    assert not any(holds_integer(bf16, n) for n in (257, 2**24 + 2, 10**400))
