"""protocol.engine.rounding: SiteRecorder -> SiteReplayer on hand-made sites, the validity rule
and the bound adversary (SPEC §3.2, §3.3).

Each element of a site comes with its certified error bound e; two conforming machines' results
for it are within 2e of each other, even when both are the bound adversary. "Another machine" is
simulated by moving the recorded compute-dtype values by up to that: at random, or all of them
the same way, or each toward its nearest rounding boundary (the worst case). The replay must
reproduce the recording bit for bit — through direction entries where e is small against the
target ULP, through value entries where it is not (several ULPs of cancellation error).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from protocol.codec.roundinglog import RoundingLog, SiteLog, encode_log
from protocol.engine import fused
from protocol.engine.bandpass import CANONICAL_NAN, dense_bounds
from protocol.engine.bounds import SAFETY, Rule, _window_norms_read
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import (
    PrecisionPolicy,
    boundary_distance,
    target_ulp,
    toward_boundary,
)
from protocol.engine.rounding import (
    WIDE,
    BoundAdversary,
    SiteRecorder,
    SiteReplayer,
    site_values,
)
from protocol.errors import LogMismatchError, LogViolationError
from tests.protocol.engine import nan_replay
from tests.protocol.engine.worst_cases import root_inputs, worst_quotients

ROOT = Path(__file__).resolve().parents[3]  # the repository (`nan_replay` runs as a module)
F64_F32 = PrecisionPolicy(torch.float64, torch.float32)
F32_BF16 = PrecisionPolicy(torch.float32, torch.bfloat16)
POLICIES = [pytest.param(F64_F32, id="f64-f32"), pytest.param(F32_BF16, id="f32-bf16")]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
ULP1 = {F64_F32: 2.0**-23, F32_BF16: 2.0**-7}  # the target ULP of 1.0


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])


def value_bits(t: torch.Tensor) -> list[int]:
    """Target values as the unsigned bit patterns a value entry stores."""
    width = 8 * t.element_size()
    return (bits(t).to(torch.int64) & ((1 << width) - 1)).tolist()


def site_log(numel: int, indices=(), up=(), value_indices=(), values=()) -> SiteLog:
    return SiteLog(numel, np.asarray(indices, dtype=np.int64), np.asarray(up, dtype=bool),
                   np.asarray(value_indices, dtype=np.int64),
                   np.asarray(values, dtype=np.uint32))


def assert_bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(bits(x), bits(y))


# -- sites --------------------------------------------------------------------------------------


def near_boundaries(rng: np.random.Generator, base: torch.Tensor, e: torch.Tensor,
                    policy: PrecisionPolicy, spread: float = 3.0) -> torch.Tensor:
    """Values within `spread`·e of the rounding boundary just above each |RNE(base)|."""
    r = base.to(policy.target)
    sign = torch.where(base < 0, -1.0, 1.0).to(policy.compute)
    boundary = r.to(policy.compute) + sign * (target_ulp(r, policy) / 2).to(policy.compute)
    offset = torch.from_numpy(rng.uniform(-spread, spread, size=base.shape)).to(policy.compute)
    return boundary + offset * e.expand(base.shape)


def relative(rng, y: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Bounds |y|·2**-k, k uniform in [lo, hi] (as the relative rules give)."""
    k = torch.from_numpy(rng.uniform(lo, hi, size=y.shape)).to(y.dtype)
    return y.abs() * torch.exp2(-k)


def make_site(seed: int, policy: PrecisionPolicy) -> tuple[list[torch.Tensor], list]:
    """A site of five tensors with every kind of bound a rule gives:
    a: a (40, 50) matrix with a per-row bound (40, 1) (Cauchy–Schwarz style: narrow for the
       row's large elements, wide for its small ones), every 7th element placed near a boundary;
    b: near-boundary values with elementwise bounds from far below to a few times ulp/16
       (direction and value entries), some target-subnormal (float64 -> float32);
    c: cancellation: bounds of 8 to 64 target ULPs (value entries, perturbations of many ULPs);
    d: a correctly rounded op (bound None: e = 0), placed right at boundaries all the same;
    f: a scalar bound for a whole tensor."""
    rng = np.random.default_rng(seed)
    m = policy.fmt["target_mantissa"]
    dt = policy.compute
    a = torch.from_numpy(rng.normal(size=(40, 50))).to(dt)
    ea = a.abs().amax(dim=1, keepdim=True) * 2.0 ** -(m + 7)
    a.view(-1)[::7] = near_boundaries(rng, a, ea, policy).reshape(-1)[::7]
    b_base = torch.from_numpy(rng.normal(size=300) * 10.0 ** rng.integers(-3, 4, size=300)).to(dt)
    eb = relative(rng, b_base, m + 1, m + 14)
    if policy is F64_F32:
        sub = torch.from_numpy(rng.integers(-1000, 1000, size=75) * 2.0**-149)
        b_base[:75] = sub
        eb[:75] = torch.from_numpy(2.0**-149 * np.exp2(-rng.uniform(1, 8, size=75)))
    b = near_boundaries(rng, b_base, eb, policy)
    b[::5] = b_base[::5]  # and some plain values
    c_base = torch.from_numpy(rng.normal(size=60)).to(dt)
    ec = relative(rng, c_base, m - 6, m - 3)
    c = near_boundaries(rng, c_base, ec, policy, spread=1.0)
    d_base = torch.from_numpy(rng.normal(size=50)).to(dt)
    d = near_boundaries(rng, d_base, torch.zeros_like(d_base), policy)  # exact midpoints
    f = near_boundaries(rng, torch.ones(30, dtype=dt), torch.full((30,), 2.0 ** -(m + 8),
                                                                    dtype=dt), policy)
    return [a, b, c, d, f], [ea, eb, ec, None, 2.0 ** -(m + 8)]


def flat_bounds(ys, bounds) -> torch.Tensor:
    e = dense_bounds(ys, bounds)
    return torch.zeros_like(site_values(ys)) if e is None else e


def split_like(flat: torch.Tensor, ys: list[torch.Tensor]) -> list[torch.Tensor]:
    out, k = [], 0
    for y in ys:
        out.append(flat[k:k + y.numel()].reshape(y.shape).clone())
        k += y.numel()
    return out


def perturb(ys, bounds, policy: PrecisionPolicy, mode: str, factor: float, seed: int = 0
            ) -> list[torch.Tensor]:
    """Another machine's values: each element moved by at most factor·e, `mode` deciding how:
    "random" (uniform), "up" / "down" (all away from / toward zero), "toward" (each toward its
    nearest rounding boundary, crossing it where it is closer than factor·e)."""
    flat = site_values(ys)
    e = flat_bounds(ys, bounds)
    if mode == "random":
        rng = np.random.default_rng(seed)
        s = torch.from_numpy(rng.uniform(-1, 1, size=flat.shape)).to(flat.dtype)
    elif mode == "toward":
        s = toward_boundary(flat, flat.to(policy.target), policy)
    else:
        s = torch.where(flat < 0, -1.0, 1.0).to(flat.dtype) * (1.0 if mode == "up" else -1.0)
    moved = flat + s * factor * e
    # y + shift is rounded in the compute dtype; where that overshot, one compute ULP back
    over = (moved - flat).abs() > factor * e
    moved = torch.where(over, torch.nextafter(moved, flat), moved)
    return split_like(moved, ys)


def record(policy, ys, bounds, op="aten.mm.default"):
    rec = SiteRecorder(policy)
    out = rec.round_site(op, ys, bounds)
    return rec, out


# -- record -> replay ---------------------------------------------------------------------------


# 2e·(1 - 2**-10): the farthest two conforming machines can be apart, with a margin for the
# rounding of y + shift in the compute dtype; and e: an honest machine against an honest one.
FACTORS = [pytest.param(1.0, id="e"), pytest.param(2.0 * (1 - 2.0**-10), id="2e")]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("factor", FACTORS)
@pytest.mark.parametrize("mode", ["random", "up", "down", "toward"])
def test_replay_of_perturbed_values_reproduces_the_recording(policy, factor, mode):
    ys, bounds = make_site(1, policy)
    rec, recorded = record(policy, ys, bounds)
    log = rec.log()
    site = log.sites[0]
    assert site.numel == sum(y.numel() for y in ys)
    assert site.indices.size >= 100 and site.value_indices.size >= 60

    other = perturb(ys, bounds, policy, mode, factor, seed=2)
    moved = (site_values(other) - site_values(ys)).abs()
    assert bool((moved <= factor * flat_bounds(ys, bounds)).all())
    rne_other = site_values(other).to(policy.target)
    recorded_flat = site_values(recorded)
    flipped = (bits(rne_other) != bits(recorded_flat)).nonzero().squeeze(1)
    assert flipped.numel() >= (10 if mode == "random" else 40)  # the machines really disagree
    logged = set(site.indices.tolist()) | set(site.value_indices.tolist())
    assert set(flipped.tolist()) <= logged  # only logged elements could round differently
    far = (rne_other.to(torch.float64) - recorded_flat.to(torch.float64)).abs() > \
        1.5 * target_ulp(recorded_flat, policy)
    if factor > 1 or mode != "random":
        assert bool(far.any())  # some moved several target ULPs: only a value entry repairs it

    rep = SiteReplayer(policy, log, step=5)
    replayed = rep.round_site("aten.mm.default", other, bounds)
    rep.finish()
    assert_bits_equal(replayed, recorded)


@pytest.mark.parametrize("policy", POLICIES)
def test_log_composition(policy):
    """Entries only where e > 0; value entries exactly where WIDE·e >= the target ULP, holding
    the RNE bits; direction entries elsewhere; the counts add up."""
    ys, bounds = make_site(3, policy)
    rec, recorded = record(policy, ys, bounds)
    log = rec.log()
    (site,) = log.sites
    flat, e = site_values(ys), flat_bounds(ys, bounds)
    r = site_values(recorded)
    assert log.n_entries == site.indices.size + site.value_indices.size
    assert log.n_values == site.value_indices.size and log.n_directions == site.indices.size
    assert log.n_elements == flat.numel()
    idx = torch.from_numpy(np.concatenate([site.indices, site.value_indices]))
    assert bool((e[idx] > 0).all())
    d = boundary_distance(flat[idx], r[idx], policy)
    assert bool((d <= 2 * e[idx].to(torch.float64)).all())
    zero_part = slice(2000 + 300 + 60, 2000 + 300 + 60 + 50)  # tensor d: at boundaries, e = 0
    assert not (set(range(zero_part.start, zero_part.stop)) & set(idx.tolist()))
    assert bool((boundary_distance(flat[zero_part], r[zero_part], policy) == 0).all())
    wide = WIDE * e.to(torch.float64) >= target_ulp(r, policy)
    v_idx = torch.from_numpy(site.value_indices)
    d_idx = torch.from_numpy(site.indices)
    assert bool(wide[v_idx].all()) and not bool(wide[d_idx].any())
    assert site.values.tolist() == value_bits(r[v_idx])
    assert site.up.tolist() == (r[d_idx].to(flat.dtype).abs() > flat[d_idx].abs()).tolist()


@pytest.mark.parametrize("policy", POLICIES)
def test_record_mode_is_plain_rne_and_unperturbed_replay_is_identity(policy):
    ys, bounds = make_site(4, policy)
    rec, recorded = record(policy, ys, bounds)
    assert_bits_equal(recorded, [y.to(policy.target) for y in ys])
    rep = SiteReplayer(policy, rec.log())
    assert_bits_equal(rep.round_site("aten.mm.default", ys, bounds), recorded)
    rep.finish()


@pytest.mark.parametrize("policy", POLICIES)
def test_value_threshold_is_wide_times_e_at_least_one_ulp(policy):
    """An exact midpoint (δ = 0) with 16e = ulp is a value entry, with 16e just below it a
    direction entry."""
    ulp = ULP1[policy]
    y = torch.tensor([1.0 + ulp / 2, 1.0 + ulp / 2], dtype=policy.compute)
    e_at = ulp / WIDE
    e_below = float(torch.nextafter(torch.tensor(e_at, dtype=policy.compute),
                                    torch.tensor(0.0, dtype=policy.compute)))
    rec, _ = record(policy, [y], [torch.tensor([e_at, e_below], dtype=policy.compute)])
    (site,) = rec.log().sites
    assert site.value_indices.tolist() == [0] and site.indices.tolist() == [1]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fraction", [1 / 16 * (1 - 2.0**-10), 1 / 12, 1 / 8, 1 / 3],
                         ids=["just-narrow", "1/12", "1/8", "1/3"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["up", "down"])
def test_direction_entries_stay_unambiguous_below_a_power_of_two(policy, fraction, sign):
    """The hardest place for a direction entry: the boundary b = 2 - ulp/4 just below 2, whose
    gap (ulp/2) is half of 2's ULP. y sits just under 2e above b and rounds up to 2; another
    machine 1.99e farther lands within 4e of b. With 16e < ulp(2) that is still below 2, so
    "up" names 2 there too; a wider e must be (and is) logged as a value entry, else "up" would
    name 2 + ulp from above 2."""
    ulp2 = 2 * ULP1[policy]  # the ULP of 2.0
    e = fraction * ulp2
    b = 2.0 - ulp2 / 4
    y = torch.tensor([b + 2 * e * (1 - 2.0**-12)], dtype=policy.compute)
    rec, recorded = record(policy, [y], [e])
    (site,) = rec.log().sites
    assert float(recorded[0][0]) == 2.0
    assert (site.indices.tolist(), site.value_indices.tolist()) == (
        ([0], []) if WIDE * e < ulp2 else ([], [0]))
    other = [y + sign * 1.99 * e]
    replayed = SiteReplayer(policy, rec.log()).round_site("op", other, [e])
    assert_bits_equal(replayed, recorded)


def test_every_site_is_logged_in_order():
    rec = SiteRecorder(F64_F32)
    ys1, b1 = make_site(4, F64_F32)
    ys2, b2 = make_site(5, F64_F32)
    ones = [torch.ones(3, dtype=torch.float64)]
    r1 = rec.round_site("a", ys1, b1)
    r2 = rec.round_site("b", ones, [None])
    r3 = rec.round_site("c", ys2, b2)
    log = rec.log()
    assert [s.numel for s in log.sites] == [2440, 3, 2440]
    assert log.sites[1] == site_log(3)
    assert log.n_entries > 0
    rep = SiteReplayer(F64_F32, log)
    assert_bits_equal(rep.round_site("a", perturb(ys1, b1, F64_F32, "toward", 1.9), b1), r1)
    assert_bits_equal(rep.round_site("b", ones, [None]), r2)
    assert_bits_equal(rep.round_site("c", perturb(ys2, b2, F64_F32, "random", 1.9, 7), b2), r3)
    rep.finish()


def test_only_a_replayer_reads_bounds_at_its_entries_alone():
    """`bound_positions`, where the rounder reads the next site's bounds (`RoundingMode` hands
    them to the rules as `read_at`): a replayer's are its log's entries, direction then value,
    and nothing past the log's end; a recorder, a subclass that sees every site's values (the
    divergence probe) and a wrapper that moves every element by its bound (the adversary,
    forwarding other attributes to a replayer) read them everywhere; and a rule that does not
    compute its bounds at positions alone (`Rule.at_positions`) is handed none."""
    log = RoundingLog((site_log(40, [3, 30], [True, False], [7, 30], [0, 0]), site_log(5)))
    rep = SiteReplayer(F64_F32, log)
    assert rep.bound_positions().tolist() == [3, 30, 7, 30]
    rep.position = 1
    assert rep.bound_positions().numel() == 0
    rep.position = 2
    assert rep.bound_positions() is None

    class Probe(SiteReplayer):
        def round_site(self, op, ys, bounds):
            return super().round_site(op, ys, bounds)

    assert Probe(F64_F32, log).bound_positions() is None
    assert SiteRecorder(F64_F32).bound_positions() is None
    convolution = Rule("convolution", lambda *_: [], at_positions=True)
    for rounder, read_at in ((SiteReplayer(F64_F32, log), [3, 30, 7, 30]),
                             (BoundAdversary(SiteReplayer(F64_F32, log), F64_F32), None),
                             (SiteRecorder(F64_F32), None)):
        mode = RoundingMode(F64_F32, rounder)
        got = mode._read_at(convolution)
        assert (got if got is None else got.tolist()) == read_at
        assert mode._read_at(Rule("sum", lambda *_: [])) is None  # (no `at_positions`)


@pytest.mark.parametrize("size", [8, 64])  # a site rounded apart, one rounded in place
def test_replay_hands_a_convolution_rule_the_entries_of_its_site(size, monkeypatch):
    """In replay `RoundingMode` hands the rules of a site with entries the replayer's positions
    (`read_at`): a convolution's rule gets the log's entries, and computes its windows there
    alone; in record it gets none. Both ways a site is rounded: a small result through
    `round_site`, a large one in place (`round_result_in_place`)."""
    g = torch.Generator().manual_seed(size)
    x, w = torch.randn(2, 3, size, size, generator=g), torch.randn(4, 3, 3, 3, generator=g)
    recorder = SiteRecorder(F64_F32)
    with RoundingMode(F64_F32, recorder):
        torch.nn.functional.conv2d(x, w, padding=1)
    (site,) = recorder.log().sites
    forged = RoundingLog((site_log(site.numel, [5, 70], [True, False]),))
    seen = []

    def spy(read_at, *args):
        seen.append(None if read_at is None else read_at.tolist())
        return _window_norms_read(read_at, *args)

    monkeypatch.setattr("protocol.engine.bounds._window_norms_read", spy)
    with contextlib.suppress(LogViolationError):  # (whether the forged entries are valid)
        with RoundingMode(F64_F32, SiteReplayer(F64_F32, forged)):
            torch.nn.functional.conv2d(x, w, padding=1)
    assert seen == [[5, 70]]
    with RoundingMode(F64_F32, SiteRecorder(F64_F32)):
        torch.nn.functional.conv2d(x, w, padding=1)
    assert seen == [[5, 70], None]


def test_empty_tensors_in_a_site():
    rec = SiteRecorder(F64_F32)
    y = torch.tensor([1.0 + 2.0**-24], dtype=torch.float64)  # an exact midpoint: logged
    empty = torch.zeros(0, 3, dtype=torch.float64)
    rec.round_site("op", [empty, y], [torch.zeros(0, 3, dtype=torch.float64), 2.0**-40])
    assert rec.log().sites[0] == site_log(1, [0], [False])


def test_bounds_broadcast_per_row_and_per_column():
    """A (rows, 1) and a (1, cols) bound reach the right elements: each puts exactly its own
    row (column) of exact midpoints into the band."""
    y = torch.full((3, 4), 1.0 + 2.0**-24, dtype=torch.float64)  # every element δ = 0
    per_row = torch.tensor([[0.0], [1e-12], [0.0]], dtype=torch.float64)
    per_col = torch.tensor([[0.0, 0.0, 0.0, 1e-12]], dtype=torch.float64)
    rec = SiteRecorder(F64_F32)
    rec.round_site("op", [y, y.clone()], [per_row, per_col])
    assert rec.log().sites[0].indices.tolist() == [4, 5, 6, 7, 12 + 3, 12 + 7, 12 + 11]


# -- validity: log entries where no choice existed ---------------------------------------------


def _violation_site(distance_ulps: float) -> list[torch.Tensor]:
    """Site of two tensors; element 12 (b[2]) is `distance_ulps` target ULP below a boundary."""
    a = torch.ones(10, dtype=torch.float64)
    b = torch.full((6,), 1.0, dtype=torch.float64)
    b[2] = 1.0 + (0.5 - distance_ulps) * 2.0**-23
    return [a, b]


def test_entry_far_from_a_boundary_is_a_violation_naming_step_site_op_element():
    log = RoundingLog((site_log(3), site_log(16, [12], [True])))
    rep = SiteReplayer(F64_F32, log, step=7)
    rep.round_site("aten.exp.default", [torch.ones(3, dtype=torch.float64)], [1e-9])
    e = 2.0**-40
    with pytest.raises(LogViolationError) as info:
        rep.round_site("aten.mm.default", _violation_site(0.25), [e, e])
    err = info.value
    assert (err.step, err.site, err.op, err.index) == (7, 1, "aten.mm.default", 12)
    assert err.distance == 0.25 * 2.0**-23 and err.bound == e
    assert err.exit_code == 3
    message = str(err)
    assert message.startswith("log violation at step 7, site 1 (aten.mm.default), element 12")
    assert "(the limit is 4)" in message


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("extra_ulps, violation", [(0, False), (1, True), (-1, False),
                                                   (2**10, True)])
def test_direction_validity_threshold_is_exactly_four_e(policy, extra_ulps, violation):
    """δ' = 4e' is a legal entry (the logged direction is applied, against RNE); one compute
    ULP farther from the boundary is a violation."""
    ulp = ULP1[policy]
    e = ulp / 64
    y = torch.tensor([1.0 + ulp / 2 - 4 * e], dtype=policy.compute)  # δ = 4e, RNE: down
    int_dtype = policy.fmt["int_dtype"]
    y = (y.view(int_dtype) - extra_ulps).view(policy.compute)  # farther below the boundary
    d = float(boundary_distance(y, y.to(policy.target), policy)[0])
    assert (d > 4 * e) == violation
    log = RoundingLog((site_log(1, [0], [True]),))
    rep = SiteReplayer(policy, log, step=1)
    if violation:
        with pytest.raises(LogViolationError) as info:
            rep.round_site("op", [y], [e])
        assert info.value.distance == d and info.value.bound == e
    else:
        (r,) = rep.round_site("op", [y], [e])
        assert float(r[0]) == 1.0 + ulp  # the logged direction, against RNE


@pytest.mark.parametrize("policy", POLICIES)
def test_entry_where_the_bound_is_zero_is_a_violation(policy):
    """A correctly rounded op (e' = 0) has no choice even at an exact midpoint."""
    ulp = ULP1[policy]
    y = torch.tensor([1.0, 1.0 + ulp / 2], dtype=policy.compute)  # element 1: δ = 0
    for log in (RoundingLog((site_log(2, [1], [True]),)),
                RoundingLog((site_log(2, value_indices=[1], values=value_bits(
                    torch.tensor([1.0 + ulp], dtype=policy.target))),))):
        for bounds in ([None], [0.0], [torch.zeros(2, dtype=policy.compute)]):
            with pytest.raises(LogViolationError) as info:
                SiteReplayer(policy, log, step=3).round_site("aten.add.Tensor", [y], bounds)
            assert (info.value.step, info.value.index, info.value.bound) == (3, 1, 0.0)
            assert "site 0 (aten.add.Tensor), element 1" in str(info.value)
            if log.sites[0].indices.size:
                assert "correctly rounded" in str(info.value)
        # the same entry where the op has a bound is legal (a value entry needs a wide one)
        bound = ulp if log.sites[0].value_indices.size else 1e-30
        (r,) = SiteReplayer(policy, log).round_site("aten.exp.default", [y], [bound])
        assert float(r[1]) == 1.0 + ulp


def test_violation_names_the_first_bad_entry_of_a_later_tensor():
    good = 1.0 + 2.0**-24  # exact midpoint: δ = 0
    a = torch.tensor([good, 2.0, good], dtype=torch.float64)
    b = torch.tensor([good, 3.0, good, 5.0], dtype=torch.float64)
    log = RoundingLog((site_log(7, [0, 2, 3, 4, 6], [True] * 5),))
    with pytest.raises(LogViolationError) as info:
        SiteReplayer(F64_F32, log).round_site("op", [a, b], [1e-12, 1e-12])
    assert info.value.index == 4 and info.value.step is None
    assert info.value.distance == 2.0**-23  # 3.0 is a target value: half its ULP from both
    assert str(info.value).startswith("log violation at site 0 (op), element 4")


def test_entry_at_a_non_finite_value_is_a_violation():
    y = torch.tensor([1.0, float("nan"), float("inf")], dtype=torch.float64)
    for k in (1, 2):
        with pytest.raises(LogViolationError) as info:
            SiteReplayer(F64_F32, RoundingLog((site_log(3, [k], [True]),))).round_site(
                "op", [y], [1.0])
        assert info.value.index == k


# -- validity of value entries ------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("shrink, violation", [(0, False), (1, True)])
def test_value_validity_threshold_is_half_an_ulp_plus_four_e(policy, shrink, violation):
    """A value v is legal while |v - y'| <= ulp(v)/2 + 4e' (and the element is in band and wide,
    which this e' is): at e' = (|v - y'| - ulp(v)/2) / 4 it is applied; with e' a little smaller
    (by 2**-12 of it: the sum is evaluated in float64, so one notch can round back) it is a
    violation that says why."""
    ulp = ULP1[policy]
    y = torch.tensor([1.0 + ulp / 64], dtype=policy.compute)
    v = torch.tensor([1.0 + 3 * ulp], dtype=policy.target)  # three ULPs away
    gap = 3 * ulp - ulp / 64
    e = torch.tensor([(gap - ulp / 2) / 4], dtype=policy.compute)
    assert float(e[0]) * 4 == gap - ulp / 2  # exact
    if shrink:
        e = e * (1 - 2.0**-12)
    log = RoundingLog((site_log(1, value_indices=[0], values=value_bits(v)),))
    rep = SiteReplayer(policy, log, step=9)
    if violation:
        with pytest.raises(LogViolationError) as info:
            rep.round_site("aten.sum.dim_IntList", [y], [e])
        err = info.value
        assert (err.step, err.site, err.index) == (9, 0, 0)
        assert err.distance == gap and err.bound == float(e[0])
        assert "logged value" in str(err) and "not a choice an honest machine had" in str(err)
    else:
        (r,) = rep.round_site("aten.sum.dim_IntList", [y], [e])
        assert torch.equal(bits(r), bits(v))


@pytest.mark.parametrize("policy", POLICIES)
def test_value_entry_moved_many_ulps_is_a_violation(policy):
    ys, bounds = make_site(6, policy)
    rec, _ = record(policy, ys, bounds)
    site = rec.log().sites[0]
    assert site.value_indices.size > 0
    e = flat_bounds(ys, bounds)
    # the value entry with the smallest bound, its value moved by 8 ULPs + 8e' worth of ULPs
    k = int(torch.argmin(e[torch.from_numpy(site.value_indices)]))
    i = int(site.value_indices[k])
    ulps = 8 + int(8 * float(e[i]) / float(target_ulp(site_values(ys)[i:i + 1].to(
        policy.target), policy)[0]))
    values = site.values.copy()
    values[k] += ulps
    forged = SiteLog(site.numel, site.indices, site.up, site.value_indices, values)
    with pytest.raises(LogViolationError) as info:
        SiteReplayer(policy, RoundingLog((forged,)), step=2).round_site("op", ys, bounds)
    assert (info.value.step, info.value.site, info.value.index) == (2, 0, i)
    assert info.value.distance > 4 * info.value.bound


def test_value_entry_whose_bits_do_not_fit_the_target_is_a_violation():
    y = torch.tensor([1.0, 1.0 + 2.0**-8], dtype=torch.float32)
    log = RoundingLog((site_log(2, value_indices=[1], values=[0x1_3F80]),))
    with pytest.raises(LogViolationError, match="do not fit torch.bfloat16") as info:
        SiteReplayer(F32_BF16, log, step=1).round_site("op", [y], [1.0])
    assert info.value.index == 1


@pytest.mark.parametrize("value, bound", [(float("nan"), 1e38), (-float("inf"), 1e38),
                                          (float("inf"), 1e36)])
def test_value_entry_holding_a_non_finite_value_is_a_violation(value, bound):
    """NaN is never a choice; infinity is one only of the result's sign and where the bound
    reaches the overflow threshold (3e38 + 4·1e36 does not)."""
    y = torch.tensor([3.0e38, 1.0], dtype=torch.float64)
    log = RoundingLog((site_log(2, value_indices=[0],
                                values=value_bits(torch.tensor([value]))),))
    with pytest.raises(LogViolationError):
        SiteReplayer(F64_F32, log).round_site("op", [y], [bound])


@pytest.mark.parametrize("policy", POLICIES)
def test_value_entry_far_from_a_boundary_is_a_violation(policy):
    """An element one compute ULP above a target value is half a target ULP from both
    boundaries; its bound is tiny (δ' = ulp/2 >> 4e'), so no honest machine can round it to
    anything but RNE. A value entry naming its upper neighbour is a rounding choice that did not
    exist (SPEC §3.2 validity, §6: the trainer's freedom is one ULP *inside the band* only)."""
    ulp = ULP1[policy]
    y = torch.tensor([1.0], dtype=policy.compute)
    y = torch.nextafter(y, torch.full_like(y, 2.0))
    e = ulp * 2.0**-20
    assert float(boundary_distance(y, y.to(policy.target), policy)[0]) > 4 * e
    upper = torch.tensor([1.0 + ulp], dtype=policy.target)
    log = RoundingLog((site_log(1, value_indices=[0], values=value_bits(upper)),))
    with pytest.raises(LogViolationError):
        SiteReplayer(policy, log, step=1).round_site("aten.exp.default", [y], [e])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("entry", ["value", "direction"])
def test_value_entry_at_a_narrow_element_is_a_violation(policy, entry):
    """An exact midpoint (δ' = 0, in band) with 32e' < ulp: a trainer logs a direction entry
    there, which names one of the two neighbours either way. A value entry could name any value
    within ulp/2 + 4e'; it is only legal where e' is wide (32e' >= ulp)."""
    ulp = ULP1[policy]
    y = torch.tensor([1.0 + ulp / 2], dtype=policy.compute)
    e = ulp / 64
    upper = torch.tensor([1.0 + ulp], dtype=policy.target)
    if entry == "value":
        log = RoundingLog((site_log(1, value_indices=[0], values=value_bits(upper)),))
        with pytest.raises(LogViolationError) as info:
            SiteReplayer(policy, log, step=4).round_site("aten.mm.default", [y], [e])
        assert (info.value.step, info.value.index, info.value.bound) == (4, 0, e)
    else:
        log = RoundingLog((site_log(1, [0], [True]),))
        (r,) = SiteReplayer(policy, log, step=4).round_site("aten.mm.default", [y], [e])
        assert torch.equal(bits(r), bits(upper))


@pytest.mark.parametrize("policy", POLICIES)
def test_replay_just_above_a_power_of_two(policy):
    """y = 1 + ulp/16 with e = 0.16 ulp: the nearest boundary is 1 - ulp/4 (below the power of
    two), δ = 5/16 ulp <= 2e. A machine 1.98e below (two conforming machines may be 2e apart)
    rounds to 1 - ulp/2 by itself, so the recorder must log the element (an earlier recorder,
    taking δ = 7/16 ulp from the boundary above, logged nothing and the replay differed)."""
    ulp = ULP1[policy]
    y = [torch.tensor([1.0 + ulp / 16], dtype=policy.compute)]
    e = 0.16 * ulp
    rec, recorded = record(policy, y, [e])
    other = [y[0] - 1.98 * e]
    replayed = SiteReplayer(policy, rec.log()).round_site("op", other, [e])
    assert_bits_equal(replayed, recorded)


# -- structure: the log must match the replayed site sequence -----------------------------------


def test_numel_mismatch():
    log = RoundingLog((site_log(10),))
    rep = SiteReplayer(F64_F32, log, step=4)
    with pytest.raises(LogMismatchError, match=r"^step 4: site 0 \(aten.add.Tensor\) produced 12 "
                       r"elements but the rounding log records 10"):
        rep.round_site("aten.add.Tensor", [torch.ones(5, dtype=torch.float64),
                                           torch.ones(7, dtype=torch.float64)], [None, None])


def test_log_with_extra_sites():
    log = RoundingLog((site_log(2), site_log(2), site_log(2)))
    rep = SiteReplayer(F64_F32, log, step=2)
    for _ in range(2):
        rep.round_site("op", [torch.ones(2, dtype=torch.float64)], [None])
    with pytest.raises(LogMismatchError, match=r"^step 2: rounding log has 3 sites but the "
                       r"replayed step executed 2"):
        rep.finish()


def test_log_with_missing_sites():
    log = RoundingLog((site_log(2),))
    rep = SiteReplayer(F64_F32, log)
    rep.round_site("op", [torch.ones(2, dtype=torch.float64)], [None])
    with pytest.raises(LogMismatchError, match=r"^replay reached site 1 \(aten.mul.Tensor, 5 "
                       r"elements\) but the rounding log has only 1 sites"):
        rep.round_site("aten.mul.Tensor", [torch.ones(5, dtype=torch.float64)], [None])


def test_empty_log_finishes_cleanly():
    SiteReplayer(F64_F32, RoundingLog(())).finish()


# -- memory layout: indices are logical row-major -----------------------------------------------


def _layout_site(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (2, 6, 5, 7) conv-like output with a per-(sample, channel) bound (2, 6, 1, 1)."""
    rng = np.random.default_rng(seed)
    y = torch.from_numpy(rng.normal(size=(2, 6, 5, 7)))
    e = y.abs().amax(dim=(2, 3), keepdim=True) * 2.0**-30
    y.view(-1)[::3] = near_boundaries(rng, y, e, F64_F32).reshape(-1)[::3]
    return y, e


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last":
        out = t.contiguous(memory_format=torch.channels_last)
    else:
        out = t.transpose(1, 3).contiguous().transpose(1, 3)
    assert not out.is_contiguous() and torch.equal(out, t)
    return out


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
@pytest.mark.parametrize("full_bound", [False, True], ids=["broadcast-bound", "laid-out-bound"])
def test_replay_on_another_layout(layout, full_bound):
    y, e = _layout_site(8)
    rec, (recorded,) = record(F64_F32, [y], [e], "aten.convolution.default")
    log = rec.log()
    assert log.n_entries > 50
    (other,) = perturb([y], [e], F64_F32, "toward", 1.9)
    assert not torch.equal(bits(other.to(torch.float32)), bits(recorded))  # the log matters
    laid = _laid_out(other, layout)
    # the replayer's bound as a rule would give it on that layout: broadcast, or a full tensor
    # in the same memory format (its flat order must still be logical row-major)
    bound = _laid_out(e.expand(y.shape).clone(), layout) if full_bound else e
    (replayed,) = SiteReplayer(F64_F32, log).round_site("aten.convolution.default", [laid],
                                                        [bound])
    assert torch.equal(bits(replayed), bits(recorded))
    assert replayed.stride() == laid.stride()  # the layout is kept


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_record_on_another_layout_gives_the_same_log(layout):
    y, e = _layout_site(10)
    rec, (plain,) = record(F64_F32, [y], [e])
    rec2, (other,) = record(F64_F32, [_laid_out(y, layout)],
                            [_laid_out(e.expand(y.shape).clone(), layout)])
    assert rec2.log() == rec.log() and rec.log().n_entries > 0
    assert torch.equal(bits(other), bits(plain))
    assert other.stride() == _laid_out(y, layout).stride()


# -- the bound adversary ------------------------------------------------------------------------


class Capture:
    """An inner rounder that keeps what it was given and rounds to nearest-even."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        self.policy, self.seen, self.sites = policy, [], 17

    def round_site(self, op, ys, bounds):
        self.seen.append(ys)
        return [y.to(self.policy.target) for y in ys]

    def log(self):
        return "the inner log"


@pytest.mark.parametrize("policy", POLICIES)
def test_adversary_moves_each_value_by_its_proven_bound_toward_the_boundary(policy):
    ys, bounds = make_site(11, policy)
    inner = Capture(policy)
    adversary = BoundAdversary(inner, policy)
    adversary.round_site("aten.mm.default", ys, bounds)
    (seen,) = inner.seen
    assert seen[3] is ys[3]  # e = 0: untouched (every machine computes the same value)
    flat, moved = site_values(ys), site_values(seen)
    e = flat_bounds(ys, bounds)
    step = moved - flat
    # |step| = e / SAFETY, up to the rounding of y + shift (half a compute ULP of the result)
    half_ulp = (torch.nextafter(moved.abs(), torch.full_like(moved, float("inf"))) -
                moved.abs()) / 2
    assert bool(((step.abs() - e / SAFETY).abs() <= half_ulp).all())
    assert bool((step.abs() > 0)[e > 0].any())
    direction = toward_boundary(flat, flat.to(policy.target), policy)
    assert bool((step * direction >= 0).all())  # always toward the nearest boundary
    # where the boundary is closer than e/SAFETY it is crossed: RNE then differs
    d = boundary_distance(flat, flat.to(policy.target), policy)
    crossing = (d > 0) & (d < 0.99 * e.to(torch.float64) / SAFETY)
    assert int(crossing.sum()) >= 30
    assert not torch.equal(bits(moved.to(policy.target)[crossing]),
                           bits(flat.to(policy.target)[crossing]))
    flips = bits(moved.to(policy.target)) != bits(flat.to(policy.target))
    assert bool(flips[crossing].all())
    # it forwards everything else to the rounder it wraps
    assert adversary.log() == "the inner log" and adversary.sites == 17


def test_adversary_leaves_non_finite_values_alone():
    y = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e300, 1.0],
                     dtype=torch.float64)
    inner = Capture(F64_F32)
    BoundAdversary(inner, F64_F32).round_site("op", [y], [torch.full_like(y, 1e-3)])
    moved = inner.seen[0][0]
    assert torch.equal(moved[:3].isnan(), y[:3].isnan()) and moved[1:3].tolist() == y[1:3].tolist()
    assert moved[3] == y[3]  # it overflows the target: no boundary to move toward
    assert moved[4] != y[4]


def test_adversary_keeps_the_memory_layout():
    y, e = _layout_site(12)
    laid = _laid_out(y, "channels_last")
    inner = Capture(F64_F32)
    BoundAdversary(inner, F64_F32).round_site("op", [laid], [e])
    moved = inner.seen[0][0]
    assert moved.stride() == laid.stride()
    plain = Capture(F64_F32)
    BoundAdversary(plain, F64_F32).round_site("op", [y], [e])
    assert torch.equal(moved, plain.seen[0][0])  # the same values, element for element
    assert not torch.equal(moved, y)


class Seeing(SiteRecorder):
    """A recorder that keeps a copy of each site's values."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        super().__init__(policy)
        self.seen: list[tuple[str, list[torch.Tensor]]] = []

    def round_site(self, op, ys, bounds):
        self.seen.append((op, [y.clone() for y in ys]))
        return super().round_site(op, ys, bounds)


def test_the_adversary_takes_roots_and_quotients_wide_and_moves_them_by_their_error():
    """Roots and quotients of float32 values have e = 0 (bound rules version 5), which
    certifies their rounding, not their float64 bits: the adversary declines to let the fused
    pass round them from the float32 values (it still lets exact products through), computes
    them wide and moves every element by the relative rule's e / SAFETY for its documented
    error — one to two float64 ULPs — toward its nearest rounding boundary. At the worst inputs,
    those nearest to float32 midpoints (`worst_cases`), each still rounds to the correctly
    rounded float32 result, and nothing is logged."""
    roots = root_inputs(61)[::16]
    a, b = worst_quotients(list(range(2**24 - 1, 2**24 - 20000, -2)))
    x, y, r = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(roots)
    claims = BoundAdversary(SiteRecorder(F64_F32), F64_F32)
    assert claims.claim_exact_site("aten.mul.Tensor", 4)
    assert not claims.claim_exact_site("aten.sqrt.default", 4)
    assert not claims.claim_exact_site("aten._foreach_div_.List", 4)
    inner = Seeing(F64_F32)
    with RoundingMode(F64_F32, BoundAdversary(inner, F64_F32)):
        got = [torch.sqrt(r), torch.div(x, y), torch.div(-x, y), torch.mul(x, y)]
        in_place = x.clone()
        in_place.div_(y)
        (listed,) = torch._foreach_div([x], [y])
    want = [torch.from_numpy(np.sqrt(roots)), torch.from_numpy(a / b), torch.from_numpy(-a / b),
            torch.from_numpy(a * b)]
    assert_bits_equal(got + [in_place, listed], want + [want[1], want[1]])
    assert inner.log().n_entries == 0
    assert len(inner.log().sites) == 6
    product = [ys for op, ys in inner.seen if op == "aten.mul.Tensor"]
    if fused.ENABLED:  # the fused pass took x·y, an exact product: the adversary let it
        assert not product
    else:  # it reached the adversary, which left it as it was
        assert torch.equal(product[0][0], x.double() * y)
    for op, (moved,) in ((op, ys) for op, ys in inner.seen if op != "aten.mul.Tensor"):
        # the honest float64 result (CPU division is correctly rounded, sqrt within 0.53 ULP)
        honest = r.double().sqrt() if op == "aten.sqrt.default" else \
            (x.double() / y).copysign(moved)
        ulp = torch.nextafter(honest.abs(), torch.tensor(float("inf"), dtype=torch.float64)) \
            - honest.abs()
        step = (moved - honest) * toward_boundary(honest, honest.float(), F64_F32)
        assert bool((step >= ulp / 2).all()) and bool((step <= 2.5 * ulp).all()), op
    assert [op for op, _ in inner.seen if op != "aten.mul.Tensor"] == [
        "aten.sqrt.default", "aten.div.Tensor", "aten.div.Tensor", "aten.div_.Tensor",
        "aten._foreach_div.List"]


def test_the_adversary_keeps_a_small_quotients_dtype_under_the_bfloat16_policy():
    """A quotient below 2^-125 has a relative bound over float64 magnitudes; under a float32
    compute dtype the adversary's moved values stay float32 (they were promoted, and the
    recorder failed on them), and an honest replay of its log is bit-exact."""
    x = torch.tensor([1e-30, 1.0, 2.0**-120], dtype=torch.bfloat16)
    y = torch.tensor([1e10, 3.0, 2.0**10], dtype=torch.bfloat16)
    inner = Seeing(F32_BF16)
    with RoundingMode(F32_BF16, BoundAdversary(inner, F32_BF16)):
        recorded = torch.div(x, y)
    ((op, (moved,)),) = inner.seen
    assert op == "aten.div.Tensor" and moved.dtype == torch.float32
    with RoundingMode(F32_BF16, SiteReplayer(F32_BF16, inner.log())):
        replayed = torch.div(x, y)
    assert torch.equal(bits(replayed), bits(recorded))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("trainer, auditor", [("adversary", "honest"), ("honest", "adversary"),
                                              ("adversary", "adversary")])
def test_honest_log_replays_bit_exactly_against_the_adversary(policy, trainer, auditor):
    """Each side computes within e/SAFETY of the exact value (here: `ys` moved at random by up
    to that); an adversary side then moves by e/SAFETY more toward its nearest boundary."""
    ys, bounds = make_site(13, policy)
    half = 1.0 / SAFETY
    mine = perturb(ys, bounds, policy, "random", half, seed=14)
    theirs = perturb(ys, bounds, policy, "random", half, seed=15)
    rec = SiteRecorder(policy)
    recorder = BoundAdversary(rec, policy) if trainer == "adversary" else rec
    recorded = recorder.round_site("aten.mm.default", mine, bounds)
    log = recorder.log()
    assert log is not None and log.n_entries > 0
    rep = SiteReplayer(policy, log, step=1)
    replayer = BoundAdversary(rep, policy) if auditor == "adversary" else rep
    replayed = replayer.round_site("aten.mm.default", theirs, bounds)
    replayer.finish()
    assert_bits_equal(replayed, recorded)
    # and the replayer's own RNE would have differed: the log did the work
    assert not all(torch.equal(bits(a), bits(b.to(policy.target)))
                   for a, b in zip(recorded, theirs, strict=True))


def test_a_site_that_fails_midway_leaves_no_entries_behind():
    """A site whose second tensor cannot be rounded raises; the candidates of its first tensor
    must not be credited to the next site (which has e = 0 and may hold no entry)."""
    from protocol.engine.bounds import Affine
    rec = SiteRecorder(F64_F32)
    near = torch.tensor([1.0 + 2.0**-24, 3.0], dtype=torch.float64)  # a float32 midpoint first
    bad = Affine(1e-12, 0.0, torch.ones(2, dtype=torch.float64), torch.ones(4, dtype=torch.float64))
    with pytest.raises(RuntimeError):
        rec.round_site("a", [near, torch.zeros(2, 3, dtype=torch.float64)], [1e-9, bad])
    rec.round_site("b", [near.clone()], [None])
    (site,) = rec.log().sites
    assert site.numel == 2 and site.indices.size == 0 and site.value_indices.size == 0



# -- the overflow threshold is a rounding boundary -----------------------------------------------

OVERFLOW = F64_F32.overflow  # 2**128 - 2**103: float32's largest value plus half its ULP


def _at_overflow(offsets: list[float]) -> torch.Tensor:
    return torch.tensor([OVERFLOW + o for o in offsets], dtype=torch.float64)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_result_at_the_overflow_threshold_replays_either_way(sign):
    """Just below the threshold RNE gives the largest float32, just above it infinity: two
    honest machines within e of each other may land either side. The trainer logs the choice,
    and a replay from the other side gets the trainer's value, with no violation."""
    e = 2.0**90
    below, above = sign * _at_overflow([-2.0**88]), sign * _at_overflow([2.0**88])
    for mine, theirs in ((below, above), (above, below)):
        rec = SiteRecorder(F64_F32)
        (r,) = rec.round_site("aten.mul.Tensor", [mine], [e])
        (site,) = rec.log().sites
        assert site.indices.tolist() == [0]
        (replayed,) = SiteReplayer(F64_F32, rec.log()).round_site("aten.mul.Tensor", [theirs], [e])
        assert torch.equal(bits(replayed), bits(r))
    assert torch.isinf(SiteRecorder(F64_F32).round_site("op", [above], [e])[0]).all()


def test_the_adversary_pushes_across_the_overflow_threshold_and_replay_holds():
    """The bound adversary moves results across the threshold from both sides (infinity to the
    largest value, and back); replays against it stay bit-exact."""
    e = 2.0**90
    y = _at_overflow([-2.0**86, 2.0**86, -2.0**92, 2.0**92])
    rec = SiteRecorder(F64_F32)
    (r,) = rec.round_site("op", [y.clone()], [e])
    adversary = BoundAdversary(SiteReplayer(F64_F32, rec.log()), F64_F32)
    (replayed,) = adversary.round_site("op", [y.clone()], [e])
    assert torch.equal(bits(replayed), bits(r))
    pushed = BoundAdversary(SiteRecorder(F64_F32), F64_F32)
    (moved,) = pushed.round_site("op", [y.clone()], [e])
    assert not torch.equal(bits(moved[:2]), bits(r[:2]))  # it did cross the threshold


def test_a_wide_element_at_the_overflow_threshold_logs_infinity_as_its_value():
    e = 2.0**102  # 16e >= the ULP of the largest float32 (2**104): a value entry
    rec = SiteRecorder(F64_F32)
    (r,) = rec.round_site("op", [_at_overflow([2.0**100])], [e])
    (site,) = rec.log().sites
    assert site.value_indices.tolist() == [0] and torch.isinf(r).all()
    (replayed,) = SiteReplayer(F64_F32, rec.log()).round_site("op", [_at_overflow([-2.0**100])],
                                                                [e])
    assert torch.isinf(replayed).all() and replayed[0] > 0


def test_an_invented_infinity_far_from_the_threshold_is_a_violation():
    inf_bits = int(torch.tensor(float("inf")).view(torch.int32))
    log = RoundingLog((site_log(1, value_indices=[0], values=[inf_bits]),))
    with pytest.raises(LogViolationError):
        SiteReplayer(F64_F32, log).round_site("op", [torch.tensor([1.0e30], dtype=torch.float64)],
                                              [2.0**102])


@pytest.mark.parametrize("policy", [F64_F32, F32_BF16], ids=["f64-f32", "f32-bf16"])
def test_a_zero_dim_nan_replays_with_its_recorded_bits(policy):
    """A 0-d NaN result — a loss, a write into a 0-d tensor, a result kept in the compute dtype
    — rounds to the same bits in record and replay. torch's CPU cast into bfloat16 writes
    0x7FC0 for a 0-d NaN and 0xFFFF for the same NaN in one dimension (a replayer's site
    without entries once cast the 0-d tensor itself, the recorder its flat view: the auditor's
    state hash then differed from an honest trainer's); every rounding now writes one NaN
    (`bandpass.to_target`)."""
    target = policy.target
    x = torch.tensor([1.0, float("nan"), -2.0], dtype=target)
    scalar = torch.tensor(-1.0, dtype=target)

    def program():
        loss = x.sum()  # a 0-d result, rounded alone
        kept = x.to(policy.compute).mean()  # no target-dtype input: handed back widened
        written = scalar.clone()
        written.sub_(loss)  # a 0-d in-place write
        return loss, kept, written

    rec = SiteRecorder(policy)
    with RoundingMode(policy, rec):
        recorded = program()
    assert all(t.isnan() for t in recorded)
    rep = SiteReplayer(policy, rec.log())
    with RoundingMode(policy, rep):
        replayed = program()
    rep.finish()
    for a, b in zip(recorded, replayed, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape == ()
        assert torch.equal(a.view(BITS.get(a.dtype, torch.int64)),
                           b.view(BITS.get(b.dtype, torch.int64)))


@pytest.mark.parametrize("policy", [F64_F32, F32_BF16], ids=["f64-f32", "f32-bf16"])
def test_a_rounding_writes_one_nan_whatever_the_layout(policy):
    """`to_target`: a NaN's bits are the machine's (the compute dtype's kernels make NaNs of
    other signs and payloads by code path, a float32 cast keeps them; torch's casts into
    bfloat16 write 0xFFFF from the vectorised kernels and 0x7FC0 from the scalar one: a 0-d or
    strided tensor); every rounding writes the target's `CANONICAL_NAN`, into `out` too, and
    every other value as the cast rounds it."""
    from protocol.engine.bandpass import to_target
    if policy is F32_BF16:
        nan_bits = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, -0x7FFFFFF], dtype=torch.int32)
    else:
        nan_bits = torch.tensor([0x7FF8000000000000, -0x8000000000000, 0x7FF0000000000001,
                                 0x7FF8000020000000, -1], dtype=torch.int64)
    values = torch.cat([nan_bits.view(policy.compute),
                        torch.tensor([1.5, -0.0, 3e38, 1e-40, 1 + 2**-24], dtype=policy.compute)])
    wide = torch.stack([values, values], dim=1)  # each column strided
    int_of = BITS[policy.target]
    canonical = CANONICAL_NAN[policy.target]
    for x in (values, wide[:, 0], values[1], values[:1]):
        r = to_target(x, policy)
        assert r.dtype == policy.target and r.shape == x.shape
        bits, nan = r.view(int_of), x.isnan()
        assert torch.equal(bits[nan], torch.full_like(bits[nan], canonical))
        assert torch.equal(bits[~nan], x[~nan].to(policy.target).view(int_of))
    out = torch.empty(values.numel(), dtype=policy.target)
    assert to_target(wide[:, 1], policy, out) is out
    assert torch.equal(out.view(int_of), to_target(values, policy).view(int_of))


def test_a_nan_written_into_a_strided_view_replays_with_its_recorded_bits():
    """A NaN written in place into a strided compute-dtype view by an op whose rule reads its
    inputs (add_ with alpha): the recorder rounds the op's out-of-place result (contiguous),
    a replayer without entries at the site the strided original — two of torch's bfloat16
    casts, which wrote two NaNs before `to_target`."""
    def program():
        base = torch.linspace(0.5, 2.0, 24, dtype=torch.float32)
        base[5] = float("nan")
        base[1::2].add_(torch.linspace(1.0, 3.0, 12, dtype=torch.float32), alpha=0.3)
        return base

    rec = SiteRecorder(F32_BF16)
    with RoundingMode(F32_BF16, rec):
        recorded = program()
    rep = SiteReplayer(F32_BF16, rec.log())
    with RoundingMode(F32_BF16, rep):
        replayed = program()
    rep.finish()
    assert recorded[5].isnan()
    assert torch.equal(recorded.view(torch.int32), replayed.view(torch.int32))


@pytest.mark.parametrize("policy", [F64_F32, F32_BF16], ids=["f64-f32", "f32-bf16"])
def test_nans_replay_alike_on_the_default_instruction_set(policy, tmp_path):
    """A NaN's bits differ between torch's vectorised kernels (AVX2, AVX-512) and its scalar
    ones (`ATEN_CPU_CAPABILITY=default`, the isa-default profile): a float64 log1p or sum
    gives another sign or payload, a cast into bfloat16 0xFFFF against 0x7FC0. A log recorded
    here replays in a process on the default kernels with the same bits, NaNs included, each
    the target's one NaN (`bandpass.to_target`, csrc/band.h `narrow`)."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this process runs the default kernels already: no other kernels to compare")
    rec = SiteRecorder(policy)
    with RoundingMode(policy, rec):
        recorded = nan_replay.bits(nan_replay.nan_program(policy))
    log_file = tmp_path / "log.bin"
    log_file.write_bytes(encode_log(rec.log()))
    done = subprocess.run([sys.executable, "-m", "tests.protocol.engine.nan_replay", policy.name,
                           str(log_file)],
                          env={**os.environ, "ATEN_CPU_CAPABILITY": "default"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)
    elsewhere = json.loads(done.stdout)
    assert elsewhere["capability"] == "DEFAULT"
    assert elsewhere["bits"] == recorded
    mask, inf = (0x7FFFFFFF, 0x7F800000) if policy.target == torch.float32 else (0x7FFF, 0x7F80)
    nans = [b for result in recorded for b in result if b & mask > inf]
    assert len(nans) >= 3 and set(nans) == {CANONICAL_NAN[policy.target]}
