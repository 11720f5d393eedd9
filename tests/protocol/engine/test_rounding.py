"""protocol.engine.rounding: SiteRecorder -> SiteReplayer on hand-made sites (SPEC §3.2, §3.3).

"Another machine" is simulated by perturbing the recorded compute-dtype values by less than tau
target ULP: the replay must still reproduce the recorded rounding bit for bit, because every
element that could round the other way lies in the recorded band.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.codec.roundinglog import RoundingLog, SiteLog
from protocol.engine.precision import PrecisionPolicy, distance_to_boundary
from protocol.engine.rounding import SiteRecorder, SiteReplayer
from protocol.errors import LogMismatchError, LogViolationError

F64_F32 = PrecisionPolicy(torch.float64, torch.float32)
F32_BF16 = PrecisionPolicy(torch.float32, torch.bfloat16)
MANTISSA = {torch.float32: 23, torch.bfloat16: 7}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def target_ulp(y: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """Target ULP at each value (the ULP of the binade above at a power of two; subnormal ULP)."""
    _, e = torch.frexp(y)
    exp = (e - 1 - MANTISSA[policy.target]).clamp_min(policy.fmt["subnormal_ulp_exp"])
    exp = torch.where(y == 0, policy.fmt["subnormal_ulp_exp"], exp)
    return torch.ldexp(torch.ones_like(y), exp)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype])


def site_log(numel: int, indices=(), up=()) -> SiteLog:
    return SiteLog(numel, np.asarray(indices, dtype=np.int64), np.asarray(up, dtype=bool))


def in_band_values(rng: np.random.Generator, n: int, policy: PrecisionPolicy,
                   subnormal: bool) -> torch.Tensor:
    """Values within tau/2 target ULP of a rounding boundary (random side), some subnormal."""
    base = torch.from_numpy(rng.normal(size=n) * 10.0 ** rng.integers(-3, 4, size=n))
    base = base.to(policy.compute)
    if subnormal:
        base[: n // 4] = torch.from_numpy(rng.integers(-1000, 1000, size=n // 4) * 2.0**-149)
    r = base.to(policy.target).to(policy.compute)
    # the midpoint above |r| is r + sign * ulp/2; land within tau/2 of it (the compute dtype has
    # at least 16 bits more than the target, so the construction error is negligible)
    sign = torch.where(r < 0, -1.0, 1.0).to(policy.compute)
    offset = torch.from_numpy(rng.uniform(-0.5, 0.5, size=n) * policy.tau).to(policy.compute)
    return r + sign * target_ulp(r, policy) * (0.5 + offset)


def make_site(seed: int, policy: PrecisionPolicy, subnormal: bool) -> list[torch.Tensor]:
    """Two tensors of one site: mostly random values plus a block constructed inside the band."""
    rng = np.random.default_rng(seed)
    a = torch.from_numpy(rng.normal(size=(40, 50))).to(policy.compute)
    every7 = a.view(-1)[::7]
    every7.copy_(in_band_values(rng, every7.numel(), policy, subnormal))
    b = in_band_values(rng, 300, policy, subnormal)
    b[::3] = torch.from_numpy(rng.normal(size=100)).to(policy.compute)
    return [a, b]


def perturb(ys: list[torch.Tensor], policy: PrecisionPolicy, seed: int) -> list[torch.Tensor]:
    """Another machine's values: each moved by less than tau target ULP, and every in-band value
    pushed to the other side of its boundary (which the log must then repair)."""
    rng = np.random.default_rng(seed)
    out = []
    for y in ys:
        ulp = target_ulp(y, policy)
        delta = torch.from_numpy(rng.uniform(-0.9, 0.9, size=y.shape) * policy.tau)
        moved = y + delta.to(policy.compute) * ulp
        d = distance_to_boundary(y, policy).to(policy.compute)
        r = y.to(policy.target).to(policy.compute)
        # deep in the band (d < tau/2): mirror the value around its boundary, a move of 2d < tau
        # towards the midpoint, which sits nearer zero than |y| when RNE rounded up, else farther
        toward_mid = torch.where(r.abs() > y.abs(), -1.0, 1.0).to(policy.compute) * torch.sign(y)
        crossed = y + toward_mid * 2 * d * ulp
        moved = torch.where(d < policy.tau / 2, crossed, moved)
        out.append(moved)
    return out


def assert_bits_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(bits(x.contiguous()), bits(y.contiguous()))


POLICIES = [pytest.param(F64_F32, True, id="f64-f32"),
            pytest.param(F32_BF16, False, id="f32-bf16-normal")]


@pytest.mark.parametrize("policy, subnormal", POLICIES)
def test_replay_of_perturbed_values_reproduces_the_recording(policy, subnormal):
    ys = make_site(1, policy, subnormal)
    rec = SiteRecorder(policy)
    recorded = rec.round_site("aten.mm.default", ys)
    log = rec.log()
    assert log.sites[0].numel == sum(y.numel() for y in ys)
    assert rec.in_band == log.n_entries >= 100

    other = perturb(ys, policy, seed=2)
    rne_other = [y.to(policy.target) for y in other]
    flipped = torch.cat([(bits(r) != bits(o)).reshape(-1) for r, o in
                         zip(recorded, rne_other, strict=True)]).nonzero().squeeze(1)
    assert flipped.numel() >= 50  # the perturbation really crossed boundaries
    # By construction only in-band elements can round differently: the band covers them all.
    assert set(flipped.tolist()) <= set(log.sites[0].indices.tolist())
    shifts = torch.cat([((o - y) / target_ulp(y, policy)).abs().reshape(-1)
                        for o, y in zip(other, ys, strict=True)])
    assert float(shifts.max()) < policy.tau

    rep = SiteReplayer(policy, log, step=5)
    replayed = rep.round_site("aten.mm.default", other)
    rep.finish()
    assert_bits_equal(replayed, recorded)


@pytest.mark.parametrize("policy, subnormal", POLICIES)
def test_unperturbed_replay_is_identity(policy, subnormal):
    ys = make_site(3, policy, subnormal)
    rec = SiteRecorder(policy)
    recorded = rec.round_site("op", ys)
    rep = SiteReplayer(policy, rec.log())
    assert_bits_equal(rep.round_site("op", ys), recorded)
    assert_bits_equal(recorded, [y.to(policy.target) for y in ys])  # record mode is plain RNE


def test_every_site_is_logged_in_order():
    rec = SiteRecorder(F64_F32)
    ys1, ys2 = make_site(4, F64_F32, True), make_site(5, F64_F32, True)
    r1, r2 = rec.round_site("a", ys1), rec.round_site("b", [torch.ones(3, dtype=torch.float64)])
    r3 = rec.round_site("c", ys2)
    log = rec.log()
    assert [s.numel for s in log.sites] == [2300, 3, 2300]
    assert log.sites[1].indices.size == 0
    rep = SiteReplayer(F64_F32, log)
    assert_bits_equal(rep.round_site("a", perturb(ys1, F64_F32, 6)), r1)
    assert_bits_equal(rep.round_site("b", [torch.ones(3, dtype=torch.float64)]), r2)
    assert_bits_equal(rep.round_site("c", perturb(ys2, F64_F32, 7)), r3)
    rep.finish()


def test_empty_tensors_in_a_site():
    rec = SiteRecorder(F64_F32)
    y = torch.tensor([1.0 + 2.0**-24], dtype=torch.float64)  # an exact midpoint: logged
    rec.round_site("op", [torch.zeros(0, 3, dtype=torch.float64), y])
    assert rec.log().sites[0] == site_log(1, [0], [False])


# -- validity: log entries where no choice existed ---------------------------------------------


def _violation_site(distance_ulps: float) -> list[torch.Tensor]:
    """Site of two tensors; element 12 (b[2]) is `distance_ulps` target ULP from a boundary."""
    a = torch.ones(10, dtype=torch.float64)
    b = torch.full((6,), 1.0, dtype=torch.float64)
    b[2] = 1.0 + (0.5 - distance_ulps) * 2.0**-23
    return [a, b]


def test_entry_outside_twice_tau_is_a_violation():
    tau = F64_F32.tau
    log = RoundingLog((site_log(3), site_log(16, [12], [True])))
    rep = SiteReplayer(F64_F32, log, step=7)
    rep.round_site("aten.exp.default", [torch.ones(3, dtype=torch.float64)])
    with pytest.raises(LogViolationError) as info:
        rep.round_site("aten.mm.default", _violation_site(0.25))
    err = info.value
    assert (err.step, err.site, err.op, err.index) == (7, 1, "aten.mm.default", 12)
    assert err.distance == 0.25 and err.tau == tau
    assert err.exit_code == 3
    assert "step 7, site 1 (aten.mm.default), element 12" in str(err)


@pytest.mark.parametrize("factor, violation", [(2.0, True), (2.0 - 2.0**-20, False),
                                               (1.5, False), (4.0, True)])
def test_violation_threshold_is_exactly_twice_tau(factor, violation):
    tau = F64_F32.tau
    log = RoundingLog((site_log(16, [12], [True]),))
    ys = _violation_site(factor * tau)
    assert float(distance_to_boundary(ys[1][2:3], F64_F32)) == factor * tau
    rep = SiteReplayer(F64_F32, log, step=1)
    if violation:
        with pytest.raises(LogViolationError):
            rep.round_site("op", ys)
    else:
        (_, b) = rep.round_site("op", ys)
        assert float(b[2]) == 1.0 + 2.0**-23  # the logged direction, against RNE


def test_violation_names_the_first_bad_entry_of_a_later_tensor():
    good = 1.0 + 2.0**-24  # exact midpoint: d = 0
    a = torch.tensor([good, 2.0, good], dtype=torch.float64)
    b = torch.tensor([good, 3.0, good, 5.0], dtype=torch.float64)
    log = RoundingLog((site_log(7, [0, 2, 3, 4, 6], [True] * 5),))
    with pytest.raises(LogViolationError) as info:
        SiteReplayer(F64_F32, log).round_site("op", [a, b])
    assert info.value.index == 4 and info.value.step is None and info.value.distance == 0.5
    assert str(info.value).startswith("log violation at site 0 (op), element 4")


def test_bf16_forged_entry_at_zero_is_a_violation():
    y = torch.tensor([0.0, 1.0], dtype=torch.float32)
    log = RoundingLog((site_log(2, [0], [True]),))
    with pytest.raises(LogViolationError):
        SiteReplayer(F32_BF16, log).round_site("op", [y])


# -- structure: the log must match the replayed site sequence -----------------------------------


def test_numel_mismatch():
    log = RoundingLog((site_log(10),))
    rep = SiteReplayer(F64_F32, log, step=4)
    with pytest.raises(LogMismatchError, match=r"^step 4: site 0 \(aten.add.Tensor\) produced 12 "
                       r"elements but the rounding log records 10"):
        rep.round_site("aten.add.Tensor", [torch.ones(5, dtype=torch.float64),
                                           torch.ones(7, dtype=torch.float64)])


def test_log_with_extra_sites():
    log = RoundingLog((site_log(2), site_log(2), site_log(2)))
    rep = SiteReplayer(F64_F32, log, step=2)
    for _ in range(2):
        rep.round_site("op", [torch.ones(2, dtype=torch.float64)])
    with pytest.raises(LogMismatchError, match=r"^step 2: rounding log has 3 sites but the "
                       r"replayed step executed 2"):
        rep.finish()


def test_log_with_missing_sites():
    log = RoundingLog((site_log(2),))
    rep = SiteReplayer(F64_F32, log)
    rep.round_site("op", [torch.ones(2, dtype=torch.float64)])
    with pytest.raises(LogMismatchError, match=r"^replay reached site 1 \(aten.mul.Tensor, 5 "
                       r"elements\) but the rounding log has only 1 sites"):
        rep.round_site("aten.mul.Tensor", [torch.ones(5, dtype=torch.float64)])


def test_empty_log_finishes_cleanly():
    SiteReplayer(F64_F32, RoundingLog(())).finish()


# -- memory layout: indices are logical row-major -----------------------------------------------


def _layout_site(seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    y = torch.from_numpy(rng.normal(size=(2, 6, 5, 7)))
    y.view(-1)[::3] = in_band_values(rng, y.numel(), F64_F32, False)[::3]
    return y


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_replay_on_another_layout(layout):
    y = _layout_site(8)
    rec = SiteRecorder(F64_F32)
    (recorded,) = rec.round_site("aten.convolution.default", [y])
    log = rec.log()
    (other,) = perturb([y], F64_F32, seed=9)
    assert not torch.equal(bits(other.to(torch.float32)), bits(recorded))  # the log matters
    if layout == "channels_last":
        laid_out = other.contiguous(memory_format=torch.channels_last)
        assert not laid_out.is_contiguous()
    else:
        laid_out = other.transpose(1, 3).contiguous().transpose(1, 3)
        assert not laid_out.is_contiguous()
    assert torch.equal(laid_out, other)
    (replayed,) = SiteReplayer(F64_F32, log).round_site("aten.convolution.default", [laid_out])
    assert torch.equal(bits(replayed.contiguous()), bits(recorded))
    assert replayed.stride() == laid_out.to(torch.float32).stride()  # layout kept


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_record_on_another_layout_gives_the_same_log(layout):
    y = _layout_site(10)
    rec = SiteRecorder(F64_F32)
    (plain,) = rec.round_site("op", [y])
    if layout == "channels_last":
        laid_out = y.contiguous(memory_format=torch.channels_last)
    else:
        laid_out = y.transpose(0, 2).contiguous().transpose(0, 2)
    rec2 = SiteRecorder(F64_F32)
    (other,) = rec2.round_site("op", [laid_out])
    assert rec2.log() == rec.log() and rec.log().n_entries > 0
    assert torch.equal(bits(other.contiguous()), bits(plain))


# -- ieee sites ---------------------------------------------------------------------------------


def test_ieee_sites_log_nothing():
    ys = make_site(11, F64_F32, True)
    rec = SiteRecorder(F64_F32)
    rounded = rec.round_site("aten.add.Tensor", ys, ieee=True)
    site = rec.log().sites[0]
    assert site.numel == sum(y.numel() for y in ys) and site.indices.size == 0
    assert rec.in_band == 0
    assert_bits_equal(rounded, [y.to(torch.float32) for y in ys])
    # the same values at a general site are logged
    rec.round_site("aten.mm.default", ys)
    assert rec.log().sites[1].indices.size > 0


def test_any_entry_at_an_ieee_site_is_a_violation():
    y = torch.tensor([1.0, 1.0 + 2.0**-24], dtype=torch.float64)  # element 1: exact midpoint
    log = RoundingLog((site_log(2, [1], [True]),))
    with pytest.raises(LogViolationError) as info:
        SiteReplayer(F64_F32, log, step=3).round_site("aten.add.Tensor", [y], ieee=True)
    assert (info.value.index, info.value.distance, info.value.tau) == (1, 0.0, 0.0)
    # the same entry at a general site is legal
    (r,) = SiteReplayer(F64_F32, log).round_site("aten.mm.default", [y])
    assert float(r[1]) == 1.0 + 2.0**-23
