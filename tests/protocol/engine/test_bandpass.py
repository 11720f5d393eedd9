"""The fused passes (csrc/fused.cpp) against the torch-ops path, bit for bit (issue 13).

Each site is built to be hard: values on and next to rounding boundaries, exact zeros,
target-subnormal and compute-subnormal values, NaN, ±inf, values that overflow the target,
and every form of bound a rule gives (`Affine` relative, relative plus an operand's
magnitudes, rows, outer with and without an added matrix, batched; a tensor, a number, NaN and
infinite bounds, zero). The two paths must give the same rounded bits, the same candidates and
the same bounds at them; whole steps of both built-ins must give the same logs and states.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protocol.codec.roundinglog import encode_log
from protocol.codec.state import state_digest
from protocol.engine import bandpass, fused
from protocol.engine.bandpass import bounds_at, dense_bounds, nearest, round_band
from protocol.engine.bounds import Affine, Bound
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy, band_candidates, target_ulp
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program

POLICY = PrecisionPolicy()
F64 = torch.float64

needs_fused = pytest.mark.skipif(fused.MISSING is not None,
                                 reason=f"the fused passes are not built: {fused.MISSING}")


def hard_values(rng: np.random.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """Normal values of many magnitudes, a third moved onto or next to a float32 rounding
    boundary, plus zeros, subnormals (target and compute), NaN, ±inf and overflows."""
    n = math.prod(shape)
    y = torch.from_numpy(rng.normal(size=n) * 10.0 ** rng.integers(-6, 7, size=n))
    r = y.to(torch.float32)
    boundary = r.to(F64) + torch.sign(y) * target_ulp(r, POLICY) / 2
    near = torch.from_numpy(rng.integers(-4, 5, size=n).astype(np.float64))
    y = torch.where(torch.from_numpy(rng.random(n) < 0.35), boundary + near * 2.0**-52 *
                    boundary.abs(), y)
    specials = [0.0, -0.0, 2.0**-149, -3 * 2.0**-149, 2.0**-150, 2.0**-1074, 2.0**-1030,
                2.0**-126, float("nan"), float("inf"), -float("inf"), 3.5e38, -1e300]
    where = rng.choice(n, size=min(n, 4 * len(specials)), replace=False)
    y[where] = torch.tensor(specials * 4, dtype=F64)[:where.size]
    return y.reshape(shape)


def hard_bounds(rng: np.random.Generator, like: torch.Tensor) -> torch.Tensor:
    """Bounds from 0 through tiny to many ULPs, with NaN and +inf among them."""
    e = like.abs().nan_to_num(nan=1.0, posinf=1.0) * torch.from_numpy(
        np.exp2(-rng.uniform(10, 60, size=like.shape)))
    e.view(-1)[::11] = 0.0
    e.view(-1)[3::97] = float("nan")
    e.view(-1)[5::89] = float("inf")
    e.view(-1)[7::13] = 2.0**-152  # around `zero_band`
    e.view(-1)[8::13] = 2.0**-151
    return e


def prefilter_ties(y: torch.Tensor) -> torch.Tensor:
    """Bounds exactly at the prefilter's limit for y's even elements (half its distance from
    the binade's midpoint equals 2e), one float64 step below it for the odd ones."""
    bits = y.view(torch.int64)
    low = torch.bitwise_and(bits, (1 << 29) - 1)
    power = torch.bitwise_and(bits, 0x7FF0_0000_0000_0000).view(F64)
    e = (low - (1 << 28)).abs().to(F64) * power * 2.0**-54
    below = torch.nextafter(e, torch.zeros_like(e))
    return torch.where(torch.arange(y.numel()).reshape(y.shape) % 2 == 0, e, below)


def sites(seed: int) -> list[tuple[str, torch.Tensor, Bound]]:
    rng = np.random.default_rng(seed)
    y2 = hard_values(rng, (37, 53))
    y3 = hard_values(rng, (3, 17, 29))
    y4 = hard_values(rng, (4, 5, 6, 7))
    norms = lambda *s: torch.from_numpy(rng.uniform(0, 4, size=s))  # noqa: E731
    ties = y2.abs() + 1.0
    return [
        ("relative", y2, Affine(2.0**-50, 1e-323)),
        ("relative, zero floor", y2, Affine(2.0**-44, 0.0)),
        ("relative, transposed", y2.t(), Affine(2.0**-50, 1e-323)),
        # GELU's and its backward's form; `other` holds NaN, ±inf and subnormals too
        ("plus", y2, Affine(2.0**-50, 1e-323, other=hard_values(rng, (37, 53)), weight=0.7)),
        ("plus, transposed", y2.t(),
         Affine(2.0**-49, 0.0, other=hard_values(rng, (37, 53)).t(), weight=12.25)),
        ("rows, full", y2, Affine(3.0e-16, 2e-322, hard_bounds(rng, y2))),
        ("rows, per row", y4, Affine(1e-15, 1e-320, norms(4, 5, 1, 1))),
        ("rows, per leading", y4, Affine(1e-15, 0.0, norms(4, 1, 1, 1))),
        ("rows, broadcast inside", y4, Affine(1e-15, 0.0, norms(1, 5, 1, 7))),
        # log-softmax's form: a row constant plus weight·|y| (y holds NaN, ±inf, subnormals)
        ("rows plus |y|, per row", y4, Affine(2.0**-50, 1e-322, norms(4, 5, 6, 1), weight=2.0)),
        ("rows plus |y|, full", y2, Affine(2.0**-49, 0.0, norms(37, 53), weight=0.3)),
        ("rows plus |y|, broadcast inside", y4,
         Affine(2.0**-50, 0.0, norms(1, 5, 1, 7), weight=2.0)),
        ("outer", y2, Affine(2.0**-48, 1e-322, norms(37), norms(53))),
        ("outer, bias", y2, Affine(2.0**-48, 1e-322, norms(37), norms(53), norms(53))),
        ("outer, matrix", y2, Affine(2.0**-48, 0.0, norms(37), norms(53), norms(37, 53))),
        ("outer, column", y2, Affine(2.0**-48, 0.0, norms(37), norms(53), norms(37, 1))),
        ("batched outer", y3, Affine(2.0**-47, 1e-323, norms(3, 17), norms(3, 29), norms(29))),
        ("tensor", y2, hard_bounds(rng, y2)),
        ("tensor per row", y2, norms(37, 1) * 1e-12),
        ("number", y2, 2.0**-40),
        ("prefilter ties", ties, Affine(1.0, 0.0, prefilter_ties(ties))),
        ("nan norms", y2, Affine(1e-16, 0.0, torch.full((37,), math.nan), norms(53))),
        ("zero", y2, None),
        ("empty", torch.zeros(0, 3, dtype=F64), Affine(1e-16, 0.0)),
    ]


def band(flat, y, bound, policy=POLICY):
    """`round_band`, with "no candidate" as an empty index tensor; the values it gives at the
    candidates are checked to be `flat`'s."""
    r, cand, e, values, _ = round_band(flat, y, bound, policy)
    assert (cand is None) == (e is None) == (values is None)
    if cand is not None:
        assert torch.equal(values.view(torch.uint8), flat[cand].view(torch.uint8))  # (bits)
    return r, torch.zeros(0, dtype=torch.int64) if cand is None else cand, e


def both_passes(y, bound, monkeypatch):
    out = {}
    for name in ("fused", "torch"):
        monkeypatch.setattr(fused, "ENABLED", name == "fused")
        out[name] = band(y.reshape(-1), y, bound)
    return out["fused"], out["torch"]


def fused_as_torch(y, bound, monkeypatch, name=""):
    """`both_passes`, asserting that the fused pass gave the torch ops' rounded bits,
    candidates and bounds at them; the fused pass's (r, candidates, bounds)."""
    (r, cand, e), (r2, cand2, e2) = both_passes(y, bound, monkeypatch)
    assert torch.equal(r.view(torch.int32), r2.view(torch.int32)), name
    assert torch.equal(cand, cand2), name
    assert (e is None) == (e2 is None), name
    if e is not None:
        assert torch.equal(e.view(torch.int64), e2.view(torch.int64)), name
    return r, cand, e


@needs_fused
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fused_pass_gives_the_bits_of_the_torch_ops(seed, monkeypatch):
    for name, y, bound in sites(seed):
        fused_as_torch(y, bound, monkeypatch, name)


def assert_same_pass(got, expected, name):
    """Two band passes' rounding, candidates, bounds and values, bit for bit."""
    (r, cand, e, values), (r2, cand2, e2, values2) = got[:4], expected[:4]
    assert torch.equal(r.view(torch.int32), r2.view(torch.int32)), name
    assert (cand is None) == (cand2 is None), name
    if cand is not None:
        assert torch.equal(cand, cand2), name
        assert torch.equal(e.view(torch.int64), e2.view(torch.int64)), name
        assert torch.equal(values.view(torch.int64), values2.view(torch.int64)), name


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("passes", ["fused", "torch"])
def test_a_given_destination_gets_the_bits_of_a_new_one(seed, passes, monkeypatch):
    """`round_band(..., out=)` (the parts path's destination) writes the rounding there, the
    bits `round_band` returns without one, with the same candidates, and hands `out` back; on
    either pass, into a contiguous destination and (the torch ops: any) a strided one."""
    monkeypatch.setattr(fused, "ENABLED", passes == "fused" and fused.ENABLED)
    for name, y, bound in sites(seed):
        flat = y.reshape(-1)
        r, cand, e, values, _ = round_band(flat, y, bound, POLICY)
        for out in (torch.full((flat.numel(),), math.nan, dtype=torch.float32),
                    torch.full((2 * flat.numel(),), math.nan, dtype=torch.float32)[::2]):
            given = round_band(flat, y, bound, POLICY, out)
            assert given[0] is out, name
            assert_same_pass(given, (r, cand, e, values), name)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("passes", ["fused", "torch"])
def test_widening_back_changes_nothing_but_the_values_given(seed, passes, monkeypatch):
    """`widen_back` (the interceptor's `round_result_in_place`): the same rounding, candidates,
    bounds and values as without it, read before the values are overwritten; where it says it
    widened (the fused pass, every contiguous site), the values hold exactly the rounding
    widened, and where it says not (the torch ops), they are untouched."""
    monkeypatch.setattr(fused, "ENABLED", passes == "fused" and fused.ENABLED)
    for name, y, bound in sites(seed):
        r, cand, e, values, widened = round_band(y.reshape(-1), y, bound, POLICY)
        assert not widened, name
        mine = y.contiguous().clone()
        widening = round_band(mine.view(-1), mine, bound, POLICY, widen_back=True)
        widened = widening[4]
        assert widened == fused.ENABLED, name
        assert_same_pass(widening, (r, cand, e, values), name)
        expected = r.to(F64).view(y.shape) if widened else y
        assert torch.equal(mine.view(torch.int64), expected.view(torch.int64)), name
        mine = y.contiguous().clone()
        r3, widened = nearest(mine.view(-1), POLICY, widen_back=True)
        assert widened == fused.ENABLED, name  # (an empty site too: nothing to write)
        assert torch.equal(r3.view(torch.int32), y.reshape(-1).to(torch.float32)
                           .view(torch.int32)), name
        expected = r3.to(F64).view(y.shape) if widened else y
        assert torch.equal(mine.view(torch.int64), expected.view(torch.int64)), name


@needs_fused
def test_values_are_not_widened_back_over_their_own_bound_factors():
    """A bound whose factors lie in the values' own memory would be read after it was
    overwritten: the pass then leaves the values as they are, says so, and gives what it gives
    without `widen_back`."""
    y = torch.tensor([1.0 + 2.0**-24 + 2.0**-45, 3.0 + 2.0**-23 + 2.0**-44, -2.5 + 2.0**-27,
                      7.0 + 2.0**-22 - 2.0**-43], dtype=F64)  # three within 2e of a midpoint

    def bounds_over(t):
        return [Affine(2.0**-40, 0.0, t, t[:1]),           # rows over t, columns over t[0]
                Affine(2.0**-40, 0.0, other=t, weight=1.0)]  # |y| + |t|

    for k in range(2):
        ref, mine = y.clone(), y.clone()
        expected = round_band(ref.view(-1), ref, bounds_over(ref)[k], POLICY)
        got = round_band(mine.view(-1), mine, bounds_over(mine)[k], POLICY, widen_back=True)
        assert not got[4], k
        assert torch.equal(mine.view(torch.int64), y.view(torch.int64)), k
        assert torch.equal(got[0].view(torch.int32), expected[0].view(torch.int32)), k
        assert expected[1] is not None and torch.equal(got[1], expected[1]), k


@needs_fused
def test_the_sites_reach_every_branch(monkeypatch):
    """The equality above means something: candidates exist in every bounded site, zeros are
    kept or dropped by their bound, NaN bounds are in the band, zero bounds never are."""
    found = {}
    for name, y, bound in sites(0):
        (_, cand, e), _ = both_passes(y, bound, monkeypatch)
        found[name] = cand.numel()
    assert all(found[name] > 0 for name in found if name not in ("zero", "empty")), found
    assert found["zero"] == 0 and found["empty"] == 0
    y = torch.tensor([0.0, 0.0, -0.0, 1.0 + 2.0**-24], dtype=F64)
    e = torch.tensor([2.0**-152, 2.0**-151, math.nan, 0.0], dtype=F64)
    (_, cand, _), _ = both_passes(y, e, monkeypatch)
    assert cand.tolist() == [1, 2]  # 0.0 with e = 2^-151 (δ = 2^-150 <= 2e); NaN bound
    y = torch.linspace(1.0, 2.0, 1001, dtype=F64)[1:-1]
    (_, cand, _), _ = both_passes(y, prefilter_ties(y), monkeypatch)
    assert cand.tolist() == list(range(0, 999, 2))  # the limit is in, one step below is out


def quiet_values(rng: np.random.Generator, n: int) -> torch.Tensor:
    """n float64 values a quarter of a float32 ULP or more from every rounding boundary (far
    out of a tight band), each special of `hard_values` alone among them every 131 elements
    (so most of the fused pass's blocks hold nothing in the band, and a block holding one
    holds nothing else), and NaNs of other bits than the default one: negative, with a
    payload, signalling."""
    base = torch.from_numpy(rng.uniform(1.0, 2.0, size=n) * 10.0 ** rng.integers(-3, 4, size=n))
    r = base.to(torch.float32).to(F64)
    offset = torch.from_numpy(rng.uniform(-0.25, 0.25, size=n)) * target_ulp(
        r.to(torch.float32), POLICY)
    y = r + offset
    nans = torch.tensor([-0x0008_0000_0000_0000, 0x7FF0_0000_0000_0001, 0x7FF8_0000_0000_BEEF,
                         -0x0000_0000_0000_0001], dtype=torch.int64).view(F64)
    specials = torch.cat([torch.tensor([0.0, -0.0, 2.0**-149, -3 * 2.0**-149, 2.0**-150,
                                        2.0**-1074, 2.0**-1030, 2.0**-127, float("inf"),
                                        -float("inf"), 3.5e38, -1e300], dtype=F64), nans])
    where = torch.arange(70, n, 131)[:specials.numel()]
    y[where] = specials[:where.numel()]
    return y


def at_zeros(y: torch.Tensor, e: float) -> torch.Tensor:
    """Per-element bounds for `y`: e at its zeros, 2^-300 elsewhere (float64)."""
    return torch.where(y == 0, torch.full_like(y, e), torch.full_like(y, 2.0**-300))


@needs_fused
@pytest.mark.parametrize("seed", [0, 1])
def test_lone_specials_in_quiet_blocks_are_found(seed, monkeypatch):
    """The fused pass tests each block cheaply first (csrc `may_be_in_band`) and reads only
    the blocks that may hold a candidate again: a zero, a value below float32's normals, an
    infinity or a NaN alone in an otherwise quiet block must still be decided as the torch ops
    decide it (a small value with e > 0 a candidate, a zero from e = 2^-151: the cheap test
    takes a zero's distance as 2^-152, tested at and just below 2^-151), and a NaN of any
    bits rounded to the one float32 NaN. Every bound form, tight enough that only specials
    are candidates."""
    rng = np.random.default_rng(seed)
    n = 128 * 19
    y = quiet_values(rng, n)
    m = y.reshape(38, 64)
    norms = lambda *s: torch.from_numpy(rng.uniform(0.5, 2.0, size=s))  # noqa: E731
    zeros_kept = {}
    for name, values, bound in [
            ("relative", y, Affine(2.0**-60, 2.0**-1073)),
            ("plus", y, Affine(2.0**-60, 0.0, other=quiet_values(rng, n), weight=0.5)),
            ("rows", m, Affine(2.0**-200, 2.0**-1070, norms(38, 1))),
            ("rows plus |y|", m, Affine(2.0**-60, 0.0, norms(38, 1), weight=2.0)),
            ("outer", m, Affine(2.0**-200, 2.0**-1070, norms(38), norms(64))),
            ("outer, bias", m, Affine(2.0**-200, 0.0, norms(38), norms(64), norms(64))),
            # a zero is in the band from e = 2^-151 (`zero_band`): at it, and one step below
            ("zeros at the zero band", y, Affine(1.0, 0.0, at_zeros(y, 2.0**-151))),
            ("zeros below the zero band", y,
             Affine(1.0, 0.0, at_zeros(y, math.nextafter(2.0**-151, 0.0))))]:
        r, cand, _ = fused_as_torch(values, bound, monkeypatch, name)
        flat, dense = values.reshape(-1), dense_bounds([values], [bound])
        small = (flat.abs() < 2.0**-126) & (flat != 0) & (dense > 0)
        assert small.sum() >= 4 and set(small.nonzero().squeeze(1).tolist()) <= \
            set(cand.tolist()), name
        zeros = flat == 0
        kept = zeros & ~(dense < 2.0**-151)  # (a NaN bound keeps one too)
        assert zeros.sum() == 2 and set((zeros & torch.isin(torch.arange(n), cand))
                                        .nonzero().squeeze(1).tolist()) == \
            set(kept.nonzero().squeeze(1).tolist()), name
        zeros_kept[name] = int(kept.sum())
        nan = torch.isnan(flat)
        assert nan.sum() == 4 and (r.view(torch.int32)[nan] == 0x7FC0_0000).all(), name
    assert zeros_kept["zeros at the zero band"] == 2
    assert zeros_kept["zeros below the zero band"] == 0


@needs_fused
def test_the_fused_pass_finds_every_element_in_the_band(monkeypatch):
    """Soundness, not just agreement: every element with exact δ <= 2e is a candidate."""
    from protocol.engine.precision import boundary_distance
    for name, y, bound in sites(3):
        flat = y.reshape(-1)
        e = dense_bounds([y], [bound])
        if e is None or not flat.numel():
            continue
        (r, cand, _), _ = both_passes(y, bound, monkeypatch)
        finite = torch.isfinite(flat) & torch.isfinite(r)
        inside = finite & (boundary_distance(flat, r, POLICY) <= 2 * e) & (e > 0)
        assert set(inside.nonzero().squeeze(1).tolist()) <= set(cand.tolist()), name


@pytest.mark.parametrize("seed", [0, 1])
def test_bounds_at_indices_are_the_dense_bounds(seed):
    rng = np.random.default_rng(seed)
    for name, y, bound in sites(seed):
        flat = y.reshape(-1)
        if not flat.numel():
            continue
        idx = torch.from_numpy(rng.choice(flat.numel(), size=min(200, flat.numel()),
                                          replace=False)).sort().values
        e = dense_bounds([y], [bound])
        want = torch.zeros(idx.shape, dtype=F64) if e is None else e[idx]
        assert torch.equal(bounds_at(flat, y, bound, idx), want), name


@pytest.mark.parametrize("seed", [0, 1])
def test_the_torch_pass_is_the_band_test(seed, monkeypatch):
    """The torch path is `band_candidates` on the dense bounds (what the fused pass copies)."""
    monkeypatch.setattr(fused, "ENABLED", False)
    for name, y, bound in sites(seed):
        flat = y.reshape(-1)
        e = dense_bounds([y], [bound])
        if e is None or not flat.numel():
            continue
        r, cand, ev = band(flat, y, bound)
        assert torch.equal(cand, band_candidates(flat, e, POLICY)), name
        assert torch.equal(r.view(torch.int32), flat.to(torch.float32).view(torch.int32))


def record_steps(program: str, profile: str) -> tuple[dict, list, list[bytes], str]:
    """Two steps of a built-in (test preset, seed 3) recorded under `profile`: the state they
    start from, their logs, the logs' encodings and the end state's digest."""
    ex = Executor(load_program(program, preset="test"), seed=3, policy=POLICY,
                  profile=Profile.parse(profile))
    ex.init_state(1)
    start = ex.state()
    records = [ex.step().log for _ in range(2)]
    return start, records, [encode_log(log) for log in records], state_digest(ex.state())


def replayed(program: str, profile: str, start: dict, records: list) -> str:
    """The digest of the state that `record_steps`'s logs replay to under `profile`."""
    auditor = Executor(load_program(program, preset="test"), seed=3, policy=POLICY,
                       profile=Profile.parse(profile))
    auditor.load_state(start)
    for log in records:
        auditor.step(log)
    return state_digest(auditor.state())


@needs_fused
@pytest.mark.parametrize("program", ["char-transformer", "image-cnn"])
def test_whole_steps_log_and_land_the_same_on_both_passes(program, monkeypatch):
    """Record on both passes: the same logs and states; replay those logs on both passes (the
    fused replay applies the entries in C++): the recorded state each time."""
    logs, states = {}, {}
    for name in ("fused", "torch"):
        monkeypatch.setattr(fused, "ENABLED", name == "fused")
        start, records, logs[name], states[name] = record_steps(program, "threads=2")
        assert replayed(program, "threads=1", start, records) == states[name], name
    assert logs["fused"] == logs["torch"] and states["fused"] == states["torch"]
    assert any(len(log) > 16 for log in logs["fused"])  # something was logged


def test_the_fused_pass_is_refused_gracefully_for_other_policies(monkeypatch):
    """float32 -> bfloat16 and non-CPU tensors take the torch ops even when fused is chosen."""
    monkeypatch.setattr(fused, "ENABLED", True)
    policy = PrecisionPolicy(torch.float32, torch.bfloat16)
    y = torch.randn(100, dtype=torch.float32)
    r, cand, e = band(y, y, Affine(2.0**-20, 0.0), policy)
    assert r.dtype == torch.bfloat16 and torch.equal(
        cand, band_candidates(y, dense_bounds([y], [Affine(2.0**-20, 0.0)]), policy))


@needs_fused
@pytest.mark.parametrize("seed", [0, 1])
def test_the_sum_rule_kernel_and_torch_ops_agree(seed, monkeypatch):
    """The exact-sum rule (`bounds._sum`) by its C++ pass (`torch.ops.ovt.sum_bound`, where
    `fused.own_arithmetic`) and by torch ops, over every run of dimensions, all but a run (a
    batch norm's sums), other sets (torch ops on both) and a 0-d sum, keepdim or not, with
    dimensions of one element among them, and long rows: terms of many magnitudes, with zeros,
    -0, subnormals; terms of few bits and like sizes, whose sums sit on either side of the
    exactness limit; then one non-float32 term, one NaN and one inf in turn, each of which
    must (or, for inf, need not) refuse the exact rule. Both decide exactness at the same
    elements (a decision no summation order may change: `bounds._exact_where`); elsewhere
    their Σ|x|, summed in two orders, each within γ_K of the exact one, so the bounds agree to
    2γ_K."""
    from protocol.engine.bounds import BoundContext, _sum, _sum_layout
    ctx = BoundContext(POLICY)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.normal(size=(5, 6, 7)) * 10.0 ** rng.integers(-8, 8, size=(5, 6, 7)))
    x = x.to(torch.float32).to(F64)
    x.view(-1)[::5] = 0.0
    x.view(-1)[1::11] = -0.0
    x.view(-1)[2::17] = 2.0**-149
    x[1, :, 3] = 0.0  # a column of zeros: +inf
    few_bits = torch.from_numpy(np.ldexp(rng.integers(-64, 65, size=(6, 5, 8)).astype(float),
                                         rng.integers(-30, -20, size=(6, 5, 8))))
    few_bits[0, :, :] = 2.0**24  # big terms: the small ones of the same sum make it inexact
    wide = x.to(torch.float32).to(F64).reshape(5, 6, 1, 7, 1)
    cases = [x, few_bits, x.clone().fill_(0.0), torch.tensor(3.0, dtype=F64)]
    for bad in (1.0 + 2.0**-40, math.nan, math.inf):
        y = x.clone()
        y[2, 3, 4] = bad
        cases.append(y)
    cases.append(wide)
    # rows longer than the kernel's block (2,048) and no multiple of its 8 lanes
    cases.append(torch.from_numpy(rng.normal(size=(3, 5003))).to(torch.float32).to(F64))
    runs = {3: [[0], [1], [2], [0, 1], [1, 2], [0, 1, 2], [-1], [2, 1], [0, 2], [2, 0]],
            2: [[1], [0], [0, 1]],
            0: [[]],
            5: [[0, 3], [0, 2, 3], [0, 3, 4], [1, 3], [1, 2], [2, 4], [0, 2, 4], [1],
                [0, 1, 2, 3, 4]]}
    assert _sum_layout(torch.Size([5, 6, 7]), (0, 2)) == (5, 6, 7, True)
    assert _sum_layout(torch.Size([5, 6, 1, 7, 1]), (0, 3, 4)) == (5, 6, 7, True)
    assert _sum_layout(torch.Size([5, 6, 1, 7, 1]), (1,)) == (5, 6, 7, False)
    assert _sum_layout(torch.Size([5, 6, 1, 7, 1]), (2, 4)) == (210, 1, 1, False)
    assert _sum_layout(torch.Size([2, 3, 4, 5]), (0, 2)) is None  # R K R K: torch ops

    def both(func, args, y) -> tuple[torch.Tensor, torch.Tensor, int]:
        got = []
        for kernel in (True, False):
            monkeypatch.setattr(fused, "own_arithmetic", lambda t, on=kernel: on)
            [bound] = _sum(ctx, func, args, {}, [y])
            got.append(bound.dense(y).expand(y.shape))
        return got[0], got[1], args[0].numel() // max(y.numel(), 1)

    def agree(kernel: torch.Tensor, torch_ops: torch.Tensor, k: int, where) -> None:
        assert torch.equal(kernel == 0, torch_ops == 0), where
        assert torch.equal(kernel.isnan(), torch_ops.isnan()), where
        assert torch.equal(kernel.isinf(), torch_ops.isinf()), where
        finite = torch.isfinite(kernel) & (kernel > 0)
        gap = (kernel[finite] - torch_ops[finite]).abs()
        assert bool((gap <= 2 * ctx.gamma(k) * torch_ops[finite]).all()), where

    seen = {"exact": 0, "bounded": 0}
    for index, t in enumerate(cases):
        for dims in runs[t.dim()]:
            for keepdim in (False, True):
                args = (t, dims, keepdim)
                e, e_torch, k = both(torch.ops.aten.sum.dim_IntList, args,
                                     torch.ops.aten.sum.dim_IntList(*args))
                agree(e, e_torch, k, (index, dims, keepdim))
                if index in (4, 5):  # not float32; NaN: the plain rule, never 0
                    assert not bool((e == 0).any()), (index, dims)
                if index == 1:  # nonzero terms: exact or not by the limit alone
                    seen["exact"] += int((e == 0).sum())
                    seen["bounded"] += int((e > 0).sum())
    assert seen["exact"] > 20 and seen["bounded"] > 20, seen
    # prims.sum, whose empty list of dimensions reduces them all, as aten.sum's does
    for dims in ((), (1,), (0, 2)):
        y = torch.ops.prims.sum.default(few_bits, dims)
        e, e_torch, k = both(torch.ops.prims.sum.default, (few_bits, dims), y)
        agree(e, e_torch, k, dims)


def replay_site(ys, bounds, site, monkeypatch, on: bool, applied: list[bool]):
    """One site replayed with the fused passes on or off: ("ok", the rounded bits of each
    result) or ("violation", the error's text). `applied` collects what the fused
    `apply_entries` returned for each result it was asked about."""
    from protocol.codec.roundinglog import RoundingLog
    from protocol.engine import rounding
    from protocol.errors import LogViolationError
    monkeypatch.setattr(fused, "ENABLED", on)
    real = bandpass.apply_entries

    def spy(*args):
        done = real(*args)
        applied.append(done)
        return done
    monkeypatch.setattr(rounding, "apply_entries", spy)
    replayer = rounding.SiteReplayer(POLICY, RoundingLog((site,), ()), step=7)
    try:
        out = replayer.round_site("aten.op", ys, bounds)
    except LogViolationError as err:
        return ("violation", str(err))
    finally:
        monkeypatch.setattr(rounding, "apply_entries", real)
    return ("ok", [r.view(torch.int32).clone() for r in out])


def same_replay(ys, bounds, site, monkeypatch) -> tuple[str, list[bool]]:
    """Replay one site both ways, assert the same outcome, and return it with what the fused
    pass reported (True: it applied the entries itself)."""
    applied: list[bool] = []
    fused_out = replay_site(ys, bounds, site, monkeypatch, True, applied)
    torch_out = replay_site(ys, bounds, site, monkeypatch, False, [])
    assert fused_out[0] == torch_out[0], (fused_out, torch_out)
    if fused_out[0] == "violation":
        assert fused_out[1] == torch_out[1]
    else:
        assert all(torch.equal(a, b) for a, b in zip(fused_out[1], torch_out[1], strict=True))
    return fused_out[0], applied


def value_choices(r: torch.Tensor) -> list[int]:
    """Bit patterns a value entry at an element rounded to `r` may carry: r, its neighbours, two
    ULPs off, the infinities, a NaN, and a pattern too wide for float32."""
    bits = int(r.view(torch.int32)) & 0xFFFFFFFF
    return [bits, (bits + 1) & 0xFFFFFFFF, (bits - 1) & 0xFFFFFFFF, (bits + 2) & 0xFFFFFFFF,
            0x7F800000, 0xFF800000, 0x7FC00000, 1 << 33]


def entry_verdicts(cases, rng, picks: int, monkeypatch) -> dict[str, int]:
    """`bandpass.apply_entries` against the replayer's torch ops, entry by entry on each site of
    `cases` (name, y, bound): a direction entry either way, and value entries of every kind
    (`value_choices`), at `picks` random elements, near and far from boundaries. Each is a
    one-entry log, so the pass's verdict on each check meets the torch ops' verdict alone: the
    same violation text, or the same bits (`same_replay`), the fused pass having applied every
    valid one itself. Then every valid entry of a site at once. Returns how many of each
    verdict."""
    from protocol.codec.roundinglog import SiteLog
    verdicts = {"ok": 0, "violation": 0}
    for name, y, bound in cases:
        flat = y.reshape(-1)
        if not flat.numel():
            continue
        r = flat.to(torch.float32).cpu()
        chosen = rng.choice(flat.numel(), size=min(picks, flat.numel()), replace=False)
        valid_dirs, valid_values = [], []
        for i in sorted(int(p) for p in chosen):
            index = np.array([i], dtype=np.int64)
            for up in (False, True):
                site = SiteLog(flat.numel(), index, np.array([up]))
                verdict, applied = same_replay([y], [bound], site, monkeypatch)
                verdicts[verdict] += 1
                if verdict == "ok":
                    assert applied == [True] or bound is None, name  # the fused pass did it
                    valid_dirs.append((i, up))
            for bits in value_choices(r[i]):
                site = SiteLog(flat.numel(), np.zeros(0, dtype=np.int64), np.zeros(0, bool),
                               index, np.array([bits], dtype=np.int64))
                verdict, applied = same_replay([y], [bound], site, monkeypatch)
                verdicts[verdict] += 1
                if verdict == "ok":
                    assert applied == [True], name
                    valid_values.append((i, bits))
        # all the valid ones together (one direction per element; values at other elements)
        dirs = dict(valid_dirs)
        values = {i: b for i, b in valid_values if i not in dirs}
        site = SiteLog(flat.numel(), np.array(sorted(dirs), dtype=np.int64),
                       np.array([dirs[i] for i in sorted(dirs)], dtype=bool),
                       np.array(sorted(values), dtype=np.int64),
                       np.array([values[i] for i in sorted(values)], dtype=np.int64))
        verdict, _ = same_replay([y], [bound], site, monkeypatch)
        assert verdict == "ok", name
    return verdicts


@needs_fused
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # (17 s each)
def test_replayed_entries_are_checked_and_applied_as_by_the_torch_ops(seed, monkeypatch):
    """`bandpass.apply_entries` (csrc/fused.cpp) against the replayer's torch ops on every hard
    site, entry by entry and all together (`entry_verdicts`)."""
    verdicts = entry_verdicts(sites(seed), np.random.default_rng(seed), 60, monkeypatch)
    assert verdicts["ok"] > 100 and verdicts["violation"] > 100, verdicts


def replay_in_place(y, bound, site, monkeypatch, on: bool):
    """`round_result_in_place` of a one-result site with the fused passes on or off: ("ok",
    the rounding's bits, whether `y` was written, `y`'s bits after) or ("violation", the
    error's text, `y`'s bits after). `y` is a copy: the replayer owns and overwrites it."""
    from protocol.codec.roundinglog import RoundingLog
    from protocol.engine import rounding
    from protocol.errors import LogViolationError
    monkeypatch.setattr(fused, "ENABLED", on)
    y = y.clone()
    replayer = rounding.SiteReplayer(POLICY, RoundingLog((site,), ()), step=7)
    try:
        r, widened = replayer.round_result_in_place("aten.op", y, bound)
    except LogViolationError as err:
        return ("violation", str(err), y.view(torch.int64))
    return ("ok", r.view(torch.int32), widened, y.view(torch.int64))


def written_back_verdicts(cases, rng, picks: int, valued: int, monkeypatch) -> dict[str, int]:
    """`round_result_in_place` of each contiguous bounded site of `cases` (name, y, bound) with
    one-entry logs — a direction either way at `picks` random elements, every kind of value
    entry (`value_choices`) at `valued` of them — the fused pass against the torch ops: the same
    verdict (the same violation text, and the result left as it was), or the same bits with the
    result then holding them widened, written by the fused pass in its one read. Returns how
    many of each verdict."""
    from protocol.codec.roundinglog import SiteLog
    from protocol.engine import rounding
    done: list[bool] = []  # what the fused pass returned, asked to write back
    real = bandpass.apply_entries

    def spy(*args, widen_back=False):
        applied = real(*args, widen_back=widen_back)
        if widen_back and fused.ENABLED:
            done.append(applied)
        return applied
    monkeypatch.setattr(rounding, "apply_entries", spy)
    verdicts = {"ok": 0, "violation": 0}
    for name, y, bound in cases:
        flat = y.reshape(-1)
        if not flat.numel() or not y.is_contiguous() or bound is None:
            continue
        r = flat.to(torch.float32).cpu()
        chosen = sorted(int(p) for p in rng.choice(flat.numel(), size=picks, replace=False))
        logs = [SiteLog(flat.numel(), np.array([i], dtype=np.int64), np.array([up]))
                for i in chosen for up in (False, True)]
        logs += [SiteLog(flat.numel(), np.zeros(0, dtype=np.int64), np.zeros(0, bool),
                         np.array([i], dtype=np.int64), np.array([bits], dtype=np.int64))
                 for i in chosen[:valued] for bits in value_choices(r[i])]
        for site in logs:
            done.clear()
            got = replay_in_place(y, bound, site, monkeypatch, True)
            want = replay_in_place(y, bound, site, monkeypatch, False)
            assert got[0] == want[0], (name, got[:2], want[:2])
            verdicts[got[0]] += 1
            if got[0] == "violation":
                assert got[1] == want[1], name
                assert torch.equal(got[2], y.view(torch.int64)), name  # (left as it was)
                assert torch.equal(want[2], y.view(torch.int64)), name
                continue
            assert done == [True], name  # the fused pass did it, in its one read
            assert torch.equal(got[1], want[1]) and got[2] and want[2], name
            widened = got[1].view(torch.float32).double().view(torch.int64).view(y.shape)
            assert torch.equal(got[3], widened) and torch.equal(want[3], widened), name
    return verdicts


@needs_fused
def test_replayed_entries_written_back_in_one_pass_as_by_the_torch_ops(monkeypatch):
    """A replayed result the replayer owns (`round_result_in_place`) with log entries: the
    fused pass rounds it, checks and applies the entries and writes the result back widened in
    one read (`apply_entries`'s `widen_back`); the torch ops do it in three. Direction and
    value entries, valid and not, on every contiguous hard site (`written_back_verdicts`)."""
    verdicts = written_back_verdicts(sites(3), np.random.default_rng(3), 12, 4, monkeypatch)
    assert verdicts["ok"] > 50 and verdicts["violation"] > 50, verdicts


@needs_fused
def test_replayed_entries_of_a_site_of_several_results(monkeypatch):
    """A foreach-like site of three results (one with e = 0): entries are found in the result
    they fall in (site positions from its offset), valid or not, as by the torch ops."""
    from protocol.codec.roundinglog import SiteLog
    from protocol.engine.precision import boundary_distance
    rng = np.random.default_rng(5)
    ys = [hard_values(rng, (13, 7)), hard_values(rng, (40,)), hard_values(rng, (5, 9))]
    bounds: list[Bound] = [Affine(2.0**-40, 0.0), None, Affine(1e-14, 0.0, hard_bounds(rng, ys[2]))]
    offsets = [0, 91, 131]
    entries, ups = [], []
    for y, b, offset in zip(ys, bounds, offsets, strict=True):
        if b is None:
            continue
        flat = y.reshape(-1)
        e = dense_bounds([y], [b])
        near = (torch.isfinite(flat) & (boundary_distance(flat, flat.to(torch.float32), POLICY)
                                        <= 4 * e) & (e > 0)).nonzero().squeeze(1)
        entries += [offset + int(i) for i in near]
        ups += [bool(u) for u in rng.integers(0, 2, size=near.numel())]
    assert len(entries) > 5
    site = SiteLog(sum(y.numel() for y in ys), np.array(entries, dtype=np.int64),
                   np.array(ups, dtype=bool))
    verdict, applied = same_replay(ys, bounds, site, monkeypatch)
    assert verdict == "ok" and applied == [True, True]  # (no entry in the e = 0 result: no call)
    # one entry in the e = 0 result is a violation, named the same both ways
    bad = SiteLog(site.numel, np.array(sorted(entries + [offsets[1] + 3]), dtype=np.int64),
                  np.zeros(len(entries) + 1, dtype=bool))
    assert same_replay(ys, bounds, bad, monkeypatch)[0] == "violation"


@needs_fused
@pytest.mark.parametrize("threads", [1, 2])
def test_sites_of_many_chunks_give_the_torch_bits_on_any_thread_count(threads, monkeypatch):
    """Sites larger than the fused passes' unit of parallel work (8 to 32 Ki elements), so that
    the chunks run on torch's threads: the band pass in relative, row and outer modes and the
    exact-sum rule over rows, columns and all but a run give the torch ops' bits, candidates
    in order, on 1 and 2 threads."""
    from protocol.engine.bounds import BoundContext, _sum
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rng = np.random.default_rng(9)
        y = hard_values(rng, (300, 700))
        norms = lambda *s: torch.from_numpy(rng.uniform(0, 4, size=s))  # noqa: E731
        for bound in (Affine(2.0**-44, 1e-320), Affine(1e-14, 0.0, norms(300, 1)),
                      Affine(2.0**-40, 1e-322, norms(300), norms(700), norms(700))):
            _, cand, _ = fused_as_torch(y, bound, monkeypatch)
            assert cand.numel() > 100
        ctx = BoundContext(POLICY)
        x = torch.from_numpy(np.ldexp(rng.integers(-64, 65, size=(40, 30, 90)).astype(float),
                                      rng.integers(-30, -20, size=(40, 30, 90))))
        x[3, 5, 7] = 2.0**20  # the sums that hold it are not exact
        for dims in ([2], [0], [1], [0, 2], [0, 1]):
            args = (x, dims, False)
            out = torch.ops.aten.sum.dim_IntList(*args)
            got = []
            for on in (True, False):
                monkeypatch.setattr(fused, "ENABLED", on)
                [b] = _sum(ctx, torch.ops.aten.sum.dim_IntList, args, {}, [out])
                got.append(b.dense(out).expand(out.shape))
            assert torch.equal(got[0].view(torch.int64), got[1].view(torch.int64)), dims
            assert bool((got[0] == 0).any()) and bool((got[0] > 0).any()), dims
    finally:
        torch.set_num_threads(saved)


@needs_fused
def test_replayed_entries_beside_empty_results(monkeypatch):
    """A site whose entries fall in one result beside empty ones (a foreach op over an empty
    parameter), whatever form the empty results' bounds take: replayed, as by the torch ops."""
    from protocol.codec.roundinglog import SiteLog
    y = torch.tensor([1.0 + 2.0**-24 + 2.0**-50], dtype=F64)
    empties = [(torch.zeros(0, dtype=F64), 1e-10),
               (torch.zeros(0, dtype=F64), torch.tensor(1e-10, dtype=F64)),
               (torch.zeros(5, 0, dtype=F64),
                Affine(1.0, 0.0, torch.ones(5, dtype=F64), torch.ones(0, dtype=F64)))]
    for empty, bound in empties:
        site = SiteLog(1, np.array([0], dtype=np.int64), np.array([True]))
        verdict, applied = same_replay([empty, y], [bound, 1e-10], site, monkeypatch)
        assert verdict == "ok" and applied == [True]  # (no entry falls in the empty result)


@needs_fused
def test_the_entry_decisions_are_the_torch_ops_decisions(monkeypatch):
    """`rounding.entry_kinds`, one C++ call (`decide`) against the torch ops, on the candidates
    where a decision can go either way: values at float32 rounding boundaries and a few float64
    ULPs off them (normal, at powers of two, subnormal, at the overflow threshold), zeros,
    infinities and NaNs, each with bounds from 0 to +inf around its distance — the same kind
    (none, down, up, value) for every one."""
    from protocol.engine.rounding import entry_kinds
    policy = PrecisionPolicy()
    rng = np.random.default_rng(11)
    r = np.concatenate([rng.standard_normal(300).astype(np.float32),
                        np.float32(2.0) ** rng.integers(-149, 128, 200).astype(np.float32),
                        np.array([np.finfo(np.float32).max, np.finfo(np.float32).tiny,
                                  np.float32(1.4e-45), 0.0], dtype=np.float32)])
    r = np.concatenate([r, -r]).astype(np.float64)
    with np.errstate(over="ignore"):  # (the largest float32's next one: +inf)
        ulp = np.spacing(np.abs(r).astype(np.float32)).astype(np.float64)
    boundaries = np.concatenate([r + ulp / 2, r - ulp / 2, r - ulp / 4, r])
    steps = np.array([-3, -1, 0, 1, 3], dtype=np.float64)
    y = (boundaries[:, None] + steps[None, :] * np.spacing(np.abs(boundaries))[:, None]).ravel()
    y = np.concatenate([y, [np.inf, -np.inf, np.nan, 3.4028235677973366e38, -0.0]])
    distance = np.abs(np.spacing(np.abs(y)))
    scales = np.array([0.0, 0.25, 0.5, 1.0, 2.0, 2.0**20, np.inf])
    zero_bounds = [0.0, 1e-300, 2.0**-160, 2.0**-20, 1.0, 1e30, np.inf]  # (zeros' candidates)
    finite = y[np.isfinite(y)]
    with np.errstate(over="ignore"):  # bounds of exactly WIDE·e = the rounding's float32 ULP
        at_wide = target_ulp(torch.from_numpy(finite).float(), policy).numpy() / 16
    yy = np.concatenate([np.repeat(y, scales.size), np.zeros(len(zero_bounds)), finite])
    e = np.concatenate([np.nan_to_num((distance[:, None] * scales[None, :]).ravel(), nan=np.inf),
                        zero_bounds, at_wide])
    yt, et = torch.from_numpy(yy.copy()), torch.from_numpy(e.copy())
    fused_kinds = entry_kinds(yt, et, policy)
    monkeypatch.setattr(fused, "ENABLED", False)
    torch_kinds = entry_kinds(yt, et, policy)
    assert fused_kinds.dtype == torch_kinds.dtype == np.uint8
    assert np.array_equal(fused_kinds, torch_kinds)
    assert {0, 1, 2, 3} <= set(np.unique(fused_kinds).tolist())  # (every decision was met)
