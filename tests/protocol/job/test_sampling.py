"""protocol.job.sampling: the sample's size, its draw from the auditor's key and the trainer's
(job id, n, root) alone (deterministic; the same for a re-signed root, another for another key
or root), one recorded draw per job that a second root cannot replace, the catch probability
against exact enumeration, and the report, which never claims to have verified anything."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import struct
import tracemalloc
from fractions import Fraction

import pytest

from protocol.commit.commitments import Commitment, sign_commitment
from protocol.commit.keys import SIGNATURE_DOMAIN, KeyPair, verify_signature
from protocol.engine.precision import PrecisionPolicy
from protocol.errors import ConfigError, EncodingError
from protocol.job.create import build_job
from protocol.job.intervals import Interval, Plan, plan_intervals
from protocol.job.sampling import (
    MAX_SAMPLED,
    RECORD_BYTES,
    SAMPLE_FILE,
    SECRET_DOMAIN,
    Sample,
    catch_probability,
    choose,
    draw_sample,
    drawn_over,
    job_sample,
    require_fraction,
    sample_secret,
    sample_seed,
    sample_size,
)
from protocol.job.store import JobStore

PLAN = [Interval(10 * i + 1, 10 * i + 10) for i in range(40)]  # 40 intervals of 10 steps
ROOT = bytes(range(32))
TRAINER = KeyPair.generate()


def _signed(time: int = 0, key: KeyPair | None = None, root: bytes = ROOT,
            job_id: bytes = bytes(32), n: int = 400):
    key = key or TRAINER
    return sign_commitment(Commitment(job_id=job_id, n=n, root=root, h_n=bytes(32),
                                      public_key=key.public_key, role="trainer", time=time), key)


@pytest.mark.parametrize("fraction, intervals, size", [
    (0.25, 4, 1), (0.25, 8, 2), (0.25, 2, 1),  # 0.5 rounds up
    (0.25, 6, 2),  # 1.5 rounds up, not to even
    (0.3, 5, 2), (0.01, 4, 1),  # at least one
    (1, 7, 7), (1.0, 1, 1), (0.999, 3, 3)])
def test_the_size_is_f_times_i_rounded_half_up_and_at_least_one(fraction, intervals, size):
    assert sample_size(fraction, intervals) == size


@pytest.mark.parametrize("fraction", [0, 0.0, -0.25, 1.0001, float("nan"), float("inf"), True,
                                      "0.5", None])
def test_a_fraction_outside_0_to_1_is_refused(fraction):
    with pytest.raises(ConfigError, match="0 < F <= 1"):
        require_fraction(fraction)


def test_choose_picks_size_distinct_indexes_in_order_and_is_a_function_of_its_seed():
    first = choose(b"seed", 100, 25)
    assert len(first) == len(set(first)) == 25 and first == sorted(first)
    assert all(0 <= i < 100 for i in first)
    assert choose(b"seed", 100, 25) == first
    assert choose(b"other seed", 100, 25) != first
    assert choose(b"seed", 100, 100) == list(range(100))


def _rule_6(seed: bytes, intervals: int, size: int) -> list[int]:
    """Rule 6 as the module docstring words it: every interval's rank key, the smallest kept."""
    keys = {i: hashlib.sha256(seed + struct.pack(">Q", i)).digest() for i in range(intervals)}
    return sorted(sorted(range(intervals), key=lambda i: (keys[i], i))[:size])


@pytest.mark.parametrize("intervals, size", [(1, 1), (40, 10), (1000, 1), (1000, 999),
                                             (1000, 1000)])
def test_choose_is_rule_6_bit_for_bit(intervals, size):
    for seed in (b"seed", bytes(32), bytes(range(32))):
        assert choose(seed, intervals, size) == _rule_6(seed, intervals, size)


def test_a_draw_holds_the_samples_keys_not_the_jobs():
    """Review 26, finding 5: the draw sorted every interval's rank key (and the plan held
    every interval), so a sampled auditor's memory grew with the job's steps, not its sample."""
    auditor, signed = KeyPair.generate(), _signed(n=10**5)
    plan = Plan(1, 10**5, 1)
    tracemalloc.start()
    try:
        drawn = draw_sample(plan, 1e-4, auditor, signed)
        assert tracemalloc.get_traced_memory()[1] < 100_000
    finally:
        tracemalloc.stop()
    seed = sample_seed(signed, sample_secret(auditor, signed))
    assert drawn.chosen == tuple(Interval(i + 1, i + 1) for i in _rule_6(seed, 10**5, 10))


def test_the_draw_depends_on_the_key_and_the_job_id_n_and_root_only():
    auditor, signed = KeyPair.generate(), _signed()
    drawn = draw_sample(PLAN, 0.25, auditor, signed)
    assert drawn.intervals == 40 and len(drawn.chosen) == 10
    assert (drawn.root, drawn.steps) == (ROOT, 400)
    assert set(drawn.chosen) <= set(PLAN) and list(drawn.chosen) == sorted(drawn.chosen)
    assert draw_sample(PLAN, 0.25, auditor, signed) == drawn  # a restarted audit: the same
    # a trainer that signs the same root again (another time, so another signature), or has
    # another key sign it, gets the same draw: it cannot redraw until the sample misses a cheat
    assert draw_sample(PLAN, 0.25, auditor, _signed(time=1)) == drawn
    assert draw_sample(PLAN, 0.25, auditor, _signed(key=KeyPair.generate())) == drawn
    # C(40, 10) = 847,660,528 samples: two equal draws below would be a bug
    assert draw_sample(PLAN, 0.25, KeyPair.generate(), signed).chosen != drawn.chosen
    for other in (_signed(root=bytes(32)), _signed(job_id=bytes([1]) * 32), _signed(n=401)):
        assert draw_sample(PLAN, 0.25, auditor, other).chosen != drawn.chosen


def test_the_draw_is_over_a_fixed_width_encoding_of_job_id_n_and_root():
    commitment = _signed(n=0x0102).commitment
    assert drawn_over(commitment) == bytes(32) + bytes(6) + b"\x01\x02" + ROOT


def test_the_secret_is_the_auditors_signature_under_its_own_prefix():
    auditor, signed = KeyPair.generate(), _signed()
    secret = sample_secret(auditor, signed)
    verify_signature(auditor.public_key, SECRET_DOMAIN + drawn_over(signed.commitment), secret)
    # never a signature over an ovt object, which all start with SIGNATURE_DOMAIN
    assert not SECRET_DOMAIN.startswith(SIGNATURE_DOMAIN)
    assert not SIGNATURE_DOMAIN.startswith(SECRET_DOMAIN)


def _enumerated(intervals: int, sampled: int, touched: int) -> Fraction:
    """The naive reference: every s-subset of the I intervals, counting those that hold at
    least one of the m' cheating intervals (which m', by symmetry, does not matter)."""
    cheats = set(range(touched))
    subsets = list(itertools.combinations(range(intervals), sampled))
    return Fraction(sum(1 for subset in subsets if cheats & set(subset)), len(subsets))


@pytest.mark.parametrize("intervals", range(1, 8))
def test_the_catch_probability_is_exact_enumerations(intervals):
    for sampled in range(intervals + 1):
        for touched in range(intervals + 1):
            assert catch_probability(intervals, sampled, touched) == \
                _enumerated(intervals, sampled, touched), (intervals, sampled, touched)


def test_the_catch_probability_edges():
    assert catch_probability(8, 2, 1) == Fraction(1, 4)  # s / I
    assert catch_probability(8, 2, 7) == 1  # every sample of 2 meets 7 of 8 intervals
    assert catch_probability(8, 0, 3) == 0
    with pytest.raises(ValueError):
        catch_probability(4, 1, 5)


def test_a_sample_reports_its_bounds_and_never_verified():
    sample = Sample(ROOT, 200, 8, (Interval(26, 50), Interval(151, 175)))
    assert sample.replayed_steps() == 50
    assert sample.caught(1) == (Fraction(1, 4), Fraction(1, 4))
    assert sample.caught(2) == (Fraction(1, 4), 1 - Fraction(15, 28))  # C(6,2)/C(8,2)
    assert sample.caught(20) == (Fraction(1, 4), 1)  # m' = min(m, I) = 8
    text = sample.describe()
    assert text.startswith("sampled, not verified: replayed 2 of 8 intervals (steps 26-50, "
                           "151-175): 50 of the job's 200 steps, no divergence found")
    assert "at least 0.250" in text and "2 steps: 0.464" in text and "10 steps" not in text
    assert "verified" not in text.replace("not verified", "")
    # an escalation replayed steps 1-30 in full: 26-30 are not counted twice
    assert sample.replayed_steps(30) == 30 + 20 + 25
    assert "151-175) and steps 1-30 in full from its own states: 75 of the job's 200 steps" \
        in sample.describe(30)


def _body(**changes):
    return {**Sample(ROOT, 200, 8, (Interval(26, 50), Interval(151, 175))).to_body(),
            **changes}


@pytest.mark.parametrize("body", [
    {"intervals": 8}, _body(chosen=[[1]]), _body(intervals=-1), _body(chosen=[[1, 2.0]]),
    _body(chosen="1-2"), [8, []], _body(root=b"short"),
    _body(chosen=[]),  # a draw picks at least one
    _body(intervals=1),  # more chosen than intervals
    _body(intervals=201),  # more intervals than steps
    _body(chosen=[[50, 26]]),  # first > last
    _body(chosen=[[0, 25]]), _body(chosen=[[176, 201]]),  # out of the job's steps 1..200
    _body(chosen=[[151, 175], [26, 50]]), _body(chosen=[[26, 50], [50, 75]]),  # not in order
], ids=repr)
def test_a_sample_body_round_trips_and_inconsistent_ones_are_refused(body):
    sample = Sample(ROOT, 200, 8, (Interval(26, 50), Interval(151, 175)))
    assert Sample.from_body(sample.to_body()) == sample
    assert Sample.from_bytes(sample.to_bytes()) == sample
    with pytest.raises(EncodingError):
        Sample.from_body(body)


@pytest.fixture
def store(tmp_path):
    spec, _ = build_job(program="image-cnn", config={"image_size": 8, "channels": 4,
                                                     "batch_size": 8, "dataset_size": 64},
                        preset=None, steps=400, seed=0, init_seed=1, policy=PrecisionPolicy(),
                        checkpoint_interval=10, commit_interval=400)
    return JobStore(tmp_path, spec)


def _for(store, **changes):
    return _signed(job_id=store.spec.job_id, n=store.spec.steps, **changes)


def test_a_job_has_one_recorded_draw_and_a_second_root_gets_a_full_audit(store):
    auditor, plan = KeyPair.generate(), plan_intervals(store.spec)
    first = job_sample(store, plan, 0.25, auditor, _for(store))
    assert first == draw_sample(plan, 0.25, auditor, _for(store))
    assert Sample.from_bytes((store.dir / SAMPLE_FILE).read_bytes()) == first  # recorded
    # the same root re-signed, asked with another F: the recorded sample, not a new draw
    assert job_sample(store, plan, 0.5, auditor, _for(store, time=7)) == first
    # another root for the job: no second draw, a full audit, saying why
    why = job_sample(store, plan, 0.25, auditor, _for(store, root=bytes(32)))
    assert isinstance(why, str) and "the trainer signed two roots for job" in why
    assert ROOT.hex() in why and bytes(32).hex() in why and why.endswith("this audit is full")
    assert Sample.from_bytes((store.dir / SAMPLE_FILE).read_bytes()) == first  # kept


@pytest.mark.parametrize("damage, message", [
    (b"garbage", "is unreadable"),
    (Sample(ROOT, 400, 40, (Interval(1, 7),)).to_bytes(), "not one of this job's plans"),
], ids=["garbage", "another-plan"])
def test_a_damaged_recorded_sample_gets_a_full_audit_not_a_second_draw(store, damage, message):
    (store.dir / SAMPLE_FILE).write_bytes(damage)
    why = job_sample(store, plan_intervals(store.spec), 0.25, KeyPair.generate(), _for(store))
    assert isinstance(why, str) and message in why and why.endswith("this audit is full")
    assert (store.dir / SAMPLE_FILE).read_bytes() == damage


def test_a_record_of_max_sampled_intervals_is_readable():
    pairs = tuple(Interval(2**62 + 2 * i, 2**62 + 2 * i + 1) for i in range(MAX_SAMPLED))
    sample = Sample(ROOT, 2**63 - 1, 2**63 - 1, pairs)  # every count a 9-byte msgpack uint
    assert len(sample.to_bytes()) <= RECORD_BYTES
    assert Sample.from_bytes(sample.to_bytes()) == sample


def test_a_sample_larger_than_its_record_may_hold_is_a_full_audit(store, tmp_path):
    """Review 26, finding 5: a job's sample of F = 0.25 holds a quarter of its intervals; of a
    peer's 2**40 intervals that is no sample an auditor can hold or record (rule 7)."""
    for steps in (4 * MAX_SAMPLED + 4, 2**40):
        spec = dataclasses.replace(store.spec, steps=steps, checkpoint_interval=1)
        job = JobStore(tmp_path / str(steps), spec)
        why = job_sample(job, plan_intervals(spec), 0.25, KeyPair.generate(),
                         _signed(job_id=spec.job_id, n=steps))
        assert why == (f"a sample of F = 0.25 holds {steps // 4} of the job's {steps} "
                       f"intervals, more than the {MAX_SAMPLED} its record may hold: a full "
                       f"audit (rule 2)")
        assert not (job.dir / SAMPLE_FILE).exists()


@pytest.mark.parametrize("fraction", [1, 0.99])
def test_a_sample_of_every_interval_is_a_full_audit(store, fraction):
    plan = plan_intervals(store.spec)
    why = job_sample(store, plan, fraction, KeyPair.generate(), _for(store))
    assert why == f"a sample of F = {fraction:g} holds all 40 intervals: a full audit (rule 2)"
    assert not (store.dir / SAMPLE_FILE).exists()

