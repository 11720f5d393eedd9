"""Sampled audits: replay a fraction of a job's intervals, chosen where the trainer cannot see.

SPEC §5.1 lets an auditor replay "all n steps (or a range)"; a sampled audit replays some of the
job's intervals between the trainer's checkpoints (`protocol.job.intervals`), each from the
trainer's S_c checked against its signed h_c. The rule, for a fraction 0 < F <= 1:

1. The plan: the job's intervals from step 1, I of them (`plan_intervals`).
2. The size: s = max(1, min(I, floor(F·I + 1/2))): F·I rounded half up, at least one.
3. The secret: σ = Ed25519-sign(auditor key, "ovt-sample-secret-v1\\0" ‖ C), C the canonical
   bytes of the trainer's signed commitment (SPEC §2 "Commitment"). Ed25519 signing is
   deterministic (RFC 8032), so a restarted audit draws the same sample; no one without the
   auditor's private key can compute σ, so the trainer, which fixes C by signing its root
   before the audit, cannot foresee the sample. The prefix differs from the one every ovt
   signature covers ("ovt-signature-v1\\0", `protocol.commit.keys.signing_message`), so σ is
   never a signature over an ovt object, and the key's own bytes are never hashed or shown.
   σ verifies under the auditor's public key: revealing it proves the sample followed the rule.
4. The seed: ρ = SHA-256("ovt-sample-seed-v1\\0" ‖ C ‖ σ).
5. The choice: interval i (0-based, in step order) gets the rank key SHA-256(ρ ‖ u64be(i));
   the s intervals with the smallest keys (ties, never seen, by i) are sampled, without
   replacement, each s-subset equally likely while SHA-256 behaves as a random function.

A sampled audit that finds no divergence is "sampled, not verified" and signs nothing: a
commitment is a party's claim to every leaf under its root (SPEC §2), and the auditor did not
replay most of them. When a sampled interval diverges, the auditor replays the job in full from
step 1 to the first divergent step (`replay_in_intervals`, reusing the intervals the sample
replayed) and signs over those steps, so its challenge is exactly a full audit's: the
arbiter's bisection asks the auditor for any leaf below the disputed step (SPEC §5.2), and
the evidence of §5.3 may ask it for S_{j-1}; it answers each from its own replay, never from
a leaf it only took from the trainer.
"""

from __future__ import annotations

import hashlib
import math
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from protocol.codec.fields import require_fields, require_uint
from protocol.commit.commitments import SignedCommitment
from protocol.commit.keys import KeyPair
from protocol.errors import ConfigError, EncodingError
from protocol.job.intervals import (
    SEGMENTS,
    Interval,
    IntervalResult,
    IntervalRunner,
    make_task,
    plan_intervals,
    replay_in_intervals,
)
from protocol.job.run import AuditOutcome, ClaimSource, Progress
from protocol.job.store import JobStore

SECRET_DOMAIN = b"ovt-sample-secret-v1\x00"
SEED_DOMAIN = b"ovt-sample-seed-v1\x00"
REPORTED_CHEATS = (1, 2, 5, 10)  # the cheating step counts a sample's report names


def require_fraction(fraction: object) -> float:
    """`fraction` if it is a number with 0 < F <= 1 (not a bool), else ConfigError."""
    if isinstance(fraction, bool) or not isinstance(fraction, int | float) or \
            not 0 < fraction <= 1:
        raise ConfigError(f"a sampled audit replays a fraction F of the intervals with "
                          f"0 < F <= 1, got {fraction!r}")
    return float(fraction)


def sample_size(fraction: float, intervals: int) -> int:
    """s = max(1, min(I, floor(F·I + 1/2))) (rule 2). Raises ConfigError for a bad F."""
    return max(1, min(intervals, math.floor(require_fraction(fraction) * intervals + 0.5)))


def sample_secret(key: KeyPair, trainer: SignedCommitment) -> bytes:
    """σ of rule 3: the auditor's signature over the secret's prefix and C."""
    return key.sign(SECRET_DOMAIN + trainer.to_bytes())


def sample_seed(trainer: SignedCommitment, secret: bytes) -> bytes:
    """ρ of rule 4."""
    return hashlib.sha256(SEED_DOMAIN + trainer.to_bytes() + secret).digest()


def choose(seed: bytes, intervals: int, size: int) -> list[int]:
    """Rule 5: the indexes (ascending) of the `size` of `intervals` intervals `seed` picks."""
    def rank(i: int) -> tuple[bytes, int]:
        return hashlib.sha256(seed + struct.pack(">Q", i)).digest(), i

    return sorted(sorted(range(intervals), key=rank)[:size])


def catch_probability(intervals: int, sampled: int, touched: int) -> Fraction:
    """P(caught) = 1 − C(I − m', s) / C(I, s), exactly: I intervals, s of them sampled, a
    cheating trainer's bad steps in m' distinct intervals.

    A bad step t is caught exactly when the interval holding t is sampled: that interval is
    replayed from the trainer's own S_c, checked against its signed h_c, so its first step
    whose signed leaf is not what the honest step gives (or whose log is invalid) is found
    there, whatever the trainer did before c. (A "cheat" that changes neither S_t nor L_t is
    none, and no audit sees it.) The sample is a uniform s-subset of the I intervals, so it
    misses all m' of them with probability C(I − m', s) / C(I, s) (the s-subsets of the
    other I − m', out of all; zero when s > I − m'). A trainer cheating at m steps picks
    where: all in one interval (m' = 1) is its best, s / I; in distinct intervals,
    m' = min(m, I). Raises ValueError for counts outside 0 <= m' <= I, 0 <= s <= I.
    """
    if not (0 <= touched <= intervals and 0 <= sampled <= intervals):
        raise ValueError(f"need 0 <= m' ({touched}) and s ({sampled}) <= I ({intervals})")
    return 1 - Fraction(math.comb(intervals - touched, sampled), math.comb(intervals, sampled))


@dataclass(frozen=True)
class Sample:
    """The intervals a sampled audit replayed: `chosen` of the job's `intervals`."""

    intervals: int
    chosen: tuple[Interval, ...]

    @property
    def replayed_steps(self) -> int:
        return sum(len(iv.steps) for iv in self.chosen)

    def caught(self, cheats: int) -> tuple[Fraction, Fraction]:
        """The probability that this sample catches a trainer cheating at `cheats` steps:
        (at least, whatever their placement: all in one interval; with each in its own
        interval). See `catch_probability`."""
        s, n = len(self.chosen), self.intervals
        return catch_probability(n, s, 1), catch_probability(n, s, min(cheats, n))

    def describe(self) -> str:
        """One line: what was replayed and what it bounds; never a claim to have verified."""
        probabilities = ", ".join(
            f"{m} step{'s' * (m > 1)}: {float(self.caught(m)[1]):.3f}"
            for m in REPORTED_CHEATS if m <= self.intervals)
        return (f"sampled, not verified: replayed {len(self.chosen)} of {self.intervals} "
                f"intervals (steps {', '.join(map(str, self.chosen))}; "
                f"{self.replayed_steps} steps), no divergence found; a trainer cheating at m "
                f"steps is caught with probability at least {float(self.caught(1)[0]):.3f} "
                f"(all its bad steps in one interval), or, each bad step in its own interval, "
                f"{probabilities}")

    def to_body(self) -> dict:
        return {"intervals": self.intervals,
                "chosen": [[iv.first, iv.last] for iv in self.chosen]}

    @classmethod
    def from_body(cls, body: object) -> Sample:
        """The sample of a stored audit record. Raises EncodingError if `body` is not one."""
        fields = require_fields("a sample", body, ("intervals", "chosen"))
        chosen = fields["chosen"]
        if not isinstance(chosen, list) or not all(
                isinstance(iv, list) and len(iv) == 2 for iv in chosen):
            raise EncodingError("a sample's intervals are [first, last] pairs")
        for value in (fields["intervals"], *(x for iv in chosen for x in iv)):
            require_uint("a sample's count or step", value)
        return cls(fields["intervals"], tuple(Interval(first, last) for first, last in chosen))


def draw_sample(plan: Sequence[Interval], fraction: float, key: KeyPair,
                trainer: SignedCommitment) -> Sample:
    """The sample of `plan` the module's rule gives. Raises ConfigError for a bad F."""
    size = sample_size(fraction, len(plan))
    seed = sample_seed(trainer, sample_secret(key, trainer))
    return Sample(len(plan), tuple(plan[i] for i in choose(seed, len(plan), size)))


@dataclass(frozen=True)
class SampleOutcome:
    """A sampled audit: the trainer's root, the sample, and, when a sampled interval diverged,
    the full replay up to it (`audit`, signed and diverged like any full audit's); None: no
    sampled interval diverged, and nothing was signed."""

    trainer_commitment: SignedCommitment
    sample: Sample
    audit: AuditOutcome | None


def sample_job(store: JobStore, source: ClaimSource, key: KeyPair, runner: IntervalRunner, *,
               fraction: float, progress: Progress | None = None) -> SampleOutcome:
    """Audit a sample of the job's intervals (see the module docstring), escalating to a full
    replay up to the first sampled interval that diverges.

    `progress(k, K)` follows the sample, K its steps; the escalation's is `replay_job`'s.
    Raises ConfigError for a bad `fraction`, SignatureError for a trainer commitment that does
    not verify, and what the runner, `replay_in_intervals` and `progress` raise (a restarted
    sampled audit draws the same sample and replays it again)."""
    spec = store.spec
    trainer = source.commitment()
    trainer.verify(job_id=spec.job_id, role="trainer", n=spec.steps)
    sample = draw_sample(plan_intervals(spec), fraction, key, trainer)
    if source.leaf(0).state_hash != spec.h0:  # a divergence at 0: no interval to replay
        return SampleOutcome(trainer, sample, replay_in_intervals(store, source, key, runner,
                                                                  upto=0))
    results = runner(spec, [make_task(store, source, iv) for iv in sample.chosen])
    found: dict[Interval, IntervalResult] = {}
    try:
        for result in results:
            found[result.interval] = result
            if progress:
                progress(sum(len(iv.steps) for iv in found), sample.replayed_steps)
            if result.divergent_step is not None:
                results.close()
                return SampleOutcome(trainer, sample, replay_in_intervals(
                    store, source, key, runner, upto=result.interval.last, known=found,
                    progress=progress))
    finally:
        results.close()
        shutil.rmtree(store.dir / SEGMENTS, ignore_errors=True)
    return SampleOutcome(trainer, sample, None)
