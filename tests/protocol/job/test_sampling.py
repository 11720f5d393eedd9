"""protocol.job.sampling: the sample's size, its draw from the auditor's key and the trainer's
signed root (deterministic, and another for another key or root), the catch probability against
exact enumeration, and the report, which never claims to have verified anything."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from protocol.commit.commitments import Commitment, sign_commitment
from protocol.commit.keys import SIGNATURE_DOMAIN, KeyPair, verify_signature
from protocol.errors import ConfigError, EncodingError
from protocol.job.intervals import Interval
from protocol.job.sampling import (
    SECRET_DOMAIN,
    Sample,
    catch_probability,
    choose,
    draw_sample,
    require_fraction,
    sample_secret,
    sample_size,
)

PLAN = [Interval(10 * i + 1, 10 * i + 10) for i in range(40)]  # 40 intervals of 10 steps


def _signed(time: int = 0, key: KeyPair | None = None):
    key = key or TRAINER
    return sign_commitment(Commitment(job_id=bytes(32), n=400, root=bytes(range(32)),
                                      h_n=bytes(32), public_key=key.public_key, role="trainer",
                                      time=time), key)


TRAINER = KeyPair.generate()


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


def test_the_draw_is_deterministic_and_changes_with_the_key_or_the_commitment():
    auditor, signed = KeyPair.generate(), _signed()
    drawn = draw_sample(PLAN, 0.25, auditor, signed)
    assert drawn.intervals == 40 and len(drawn.chosen) == 10
    assert set(drawn.chosen) <= set(PLAN) and list(drawn.chosen) == sorted(drawn.chosen)
    assert draw_sample(PLAN, 0.25, auditor, signed) == drawn  # a restarted audit: the same
    # C(40, 10) = 847,660,528 samples: two equal draws below would be a bug
    assert draw_sample(PLAN, 0.25, KeyPair.generate(), signed) != drawn
    assert draw_sample(PLAN, 0.25, auditor, _signed(time=1)) != drawn  # a re-signed root


def test_the_secret_is_the_auditors_signature_under_its_own_prefix():
    auditor, signed = KeyPair.generate(), _signed()
    secret = sample_secret(auditor, signed)
    verify_signature(auditor.public_key, SECRET_DOMAIN + signed.to_bytes(), secret)
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
    sample = Sample(8, (Interval(26, 50), Interval(151, 175)))
    assert sample.replayed_steps == 50
    assert sample.caught(1) == (Fraction(1, 4), Fraction(1, 4))
    assert sample.caught(2) == (Fraction(1, 4), 1 - Fraction(15, 28))  # C(6,2)/C(8,2)
    assert sample.caught(20) == (Fraction(1, 4), 1)  # m' = min(m, I) = 8
    text = sample.describe()
    assert text.startswith("sampled, not verified: replayed 2 of 8 intervals (steps 26-50, "
                           "151-175; 50 steps), no divergence found")
    assert "at least 0.250" in text and "2 steps: 0.464" in text and "10 steps" not in text
    assert "verified" not in text.replace("not verified", "")


def test_a_sample_body_round_trips_and_malformed_ones_are_refused():
    sample = Sample(8, (Interval(26, 50), Interval(151, 175)))
    assert Sample.from_body(sample.to_body()) == sample
    for body in ({"intervals": 8}, {"intervals": 8, "chosen": [[1]]},
                 {"intervals": -1, "chosen": []}, {"intervals": 8, "chosen": [[1, 2.0]]},
                 {"intervals": 8, "chosen": "1-2"}, [8, []]):
        with pytest.raises(EncodingError):
            Sample.from_body(body)
