"""Sampled audits: replay a fraction of a job's intervals, chosen where the trainer cannot see.

SPEC §5.1 lets an auditor replay "all n steps (or a range)"; a sampled audit replays some of the
job's intervals between the trainer's checkpoints (`protocol.job.intervals`), each from the
trainer's S_c checked against its signed h_c. The rule, for a fraction 0 < F <= 1:

1. The plan: the job's intervals from step 1, I of them (`plan_intervals`).
2. The size: s = max(1, min(I, floor(F·I + 1/2))): F·I rounded half up, at least one. A sample
   of all I intervals (F = 1, or F·I rounding up to I) is a full audit, which it runs instead:
   it signs, and may report matched. So is a sample of more than MAX_SAMPLED intervals, more
   than the job's record of it (rule 7) may hold.
3. What the draw depends on: R = job_id (32 bytes) ‖ u64be(n) ‖ root (32 bytes), from the
   trainer's signed commitment (SPEC §2 "Commitment") — nothing else in it: not its `time`,
   not its signature, not the signer's key, all of which the trainer may change freely by
   signing the same root again.
4. The secret: σ = Ed25519-sign(auditor key, "ovt-sample-secret-v2\\0" ‖ R). Ed25519 signing
   is deterministic (RFC 8032), so every draw for one root is the same; no one without the
   auditor's private key can compute σ. The prefix differs from the one every ovt signature
   covers ("ovt-signature-v1\\0", `protocol.commit.keys.signing_message`), so σ is never a
   signature over an ovt object, and the key's own bytes are never hashed or shown. σ
   verifies under the auditor's public key: revealing it proves the sample followed the rule.
5. The seed: ρ = SHA-256("ovt-sample-seed-v2\\0" ‖ R ‖ σ).
6. The choice: interval i (0-based, in step order) gets the rank key SHA-256(ρ ‖ u64be(i));
   the s intervals with the smallest keys (ties, never seen, by i) are sampled, without
   replacement, each s-subset equally likely while SHA-256 behaves as a random function.
   Every interval is ranked (I hashes), but only the s smallest keys are kept, and an
   interval is computed from its index (`Plan`): the draw's memory is the sample's, not the
   job's.
7. One draw per job: the auditor records the sample, with the root it was drawn for, in the
   job's store (`SAMPLE_FILE`) before it fetches any leaf, state or log, and never draws again
   for that job. A later sampled audit of the same root replays the recorded sample, whatever
   its F; one of another root (the trainer signed two roots for one job, or the record is
   unreadable) is refused for sampling and runs as a full audit, saying why.

So the trainer cannot foresee the sample (it signs R before the audit and cannot compute σ),
and cannot steer it: re-signing its root changes nothing (rule 3), signing another root gets
it a full audit instead of a fresh draw (rule 7), and what it does during the audit cannot
skip a sampled interval. A sampled interval whose S_c it refuses, or serves not hashing to
h_c, is escalated exactly as a divergent one is: the auditor replays the job from step 1 up to
that interval's end from its own states (S_0 checked against h_0, then its own replay), which
need no S_c from the trainer. Its only way out is to refuse S_0, leaves or logs, which fails
a sequential audit too (and the next attempt replays the same sample). What it does know, once
asked for S_c or L_t, is which intervals are sampled — too late to change a signed leaf.

A sampled audit that finds no divergence is "sampled, not verified" and signs nothing: a
commitment is a party's claim to every leaf under its root (SPEC §2), and the auditor did not
replay most of them. When a sampled interval diverges, the auditor replays the job in full from
step 1 to the first divergent step (`replay_intervals`, reusing the intervals the sample
replayed) and signs over those steps, so its challenge is exactly a full audit's: the
arbiter's bisection asks the auditor for any leaf below the disputed step (SPEC §5.2), and
the evidence of §5.3 may ask it for S_{j-1}; it answers each from its own replay, never from
a leaf it only took from the trainer.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import shutil
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from protocol.codec.canonical import decode_object, encode
from protocol.codec.fields import require_bytes, require_fields, require_uint
from protocol.commit.commitments import Commitment, SignedCommitment
from protocol.commit.hashing import HASH_SIZE
from protocol.commit.keys import KeyPair
from protocol.errors import ConfigError, EncodingError
from protocol.files import atomic_write
from protocol.job.intervals import (
    SEGMENTS,
    Interval,
    IntervalResult,
    IntervalRunner,
    make_task,
    plan_intervals,
    replay_in_intervals,
    replay_intervals,
)
from protocol.job.run import AuditOutcome, ClaimSource, Progress, finish_replay
from protocol.job.store import JobStore

SECRET_DOMAIN = b"ovt-sample-secret-v2\x00"
SEED_DOMAIN = b"ovt-sample-seed-v2\x00"
SAMPLE_FILE = "sample.ovt"  # the job's one recorded sample (rule 7), in its store
REPORTED_CHEATS = (1, 2, 5, 10)  # the cheating step counts a sample's report names
RECORD_BYTES = 1 << 20  # the largest recorded sample `Sample.from_bytes` reads
MAX_SAMPLED = 50_000  # intervals: a record of that many (19 bytes a pair at most) fits RECORD_BYTES


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


def drawn_over(commitment: Commitment) -> bytes:
    """R of rule 3: job_id ‖ u64be(n) ‖ root, fixed widths, so one byte string per value."""
    return commitment.job_id + struct.pack(">Q", commitment.n) + commitment.root


def sample_secret(key: KeyPair, trainer: SignedCommitment) -> bytes:
    """σ of rule 4: the auditor's signature over the secret's prefix and R."""
    return key.sign(SECRET_DOMAIN + drawn_over(trainer.commitment))


def sample_seed(trainer: SignedCommitment, secret: bytes) -> bytes:
    """ρ of rule 5."""
    return hashlib.sha256(SEED_DOMAIN + drawn_over(trainer.commitment) + secret).digest()


def choose(seed: bytes, intervals: int, size: int) -> list[int]:
    """Rule 6: the indexes (ascending) of the `size` of `intervals` intervals `seed` picks,
    holding `size` keys at a time (`nsmallest` is `sorted(...)[:size]`, keys never tie)."""
    def rank(i: int) -> tuple[bytes, int]:
        return hashlib.sha256(seed + struct.pack(">Q", i)).digest(), i

    return sorted(heapq.nsmallest(size, range(intervals), key=rank))


def catch_probability(intervals: int, sampled: int, touched: int) -> Fraction:
    """P(caught) = 1 − C(I − m', s) / C(I, s), exactly: I intervals, s of them sampled, a
    cheating trainer's bad steps in m' distinct intervals.

    A bad step t is caught exactly when the interval holding t is sampled: that interval is
    replayed from the trainer's own S_c, checked against its signed h_c (or, when the trainer
    does not serve that, from the auditor's own replay up to it), so its first step whose
    signed leaf is not what the honest step gives (or whose log is invalid) is found there,
    whatever the trainer did before c. (A "cheat" that changes neither S_t nor L_t is none,
    and no audit sees it.) The sample is a uniform s-subset of the I intervals, so it misses
    all m' of them with probability C(I − m', s) / C(I, s) (the s-subsets of the other
    I − m', out of all; zero when s > I − m'). A trainer cheating at m steps picks where: all
    in one interval (m' = 1) is its best, s / I; in distinct intervals, m' = min(m, I).
    Raises ValueError for counts outside 0 <= m' <= I, 0 <= s <= I.
    """
    if not (0 <= touched <= intervals and 0 <= sampled <= intervals):
        raise ValueError(f"need 0 <= m' ({touched}) and s ({sampled}) <= I ({intervals})")
    return 1 - Fraction(math.comb(intervals - touched, sampled), math.comb(intervals, sampled))


@dataclass(frozen=True)
class Sample:
    """The intervals drawn for a job: `chosen` of its `intervals`, for the trainer's `root`
    over the job's `steps` steps."""

    root: bytes
    steps: int
    intervals: int
    chosen: tuple[Interval, ...]

    def replayed_steps(self, prefix: int = 0) -> int:
        """The distinct steps replayed: the chosen intervals', and 1..prefix when the audit
        replayed those in full (an escalation that found no divergence)."""
        return prefix + sum(max(0, iv.last - max(iv.start, prefix)) for iv in self.chosen)

    def caught(self, cheats: int) -> tuple[Fraction, Fraction]:
        """The probability that this sample catches a trainer cheating at `cheats` steps:
        (at least, whatever their placement: all in one interval; with each in its own
        interval). See `catch_probability`."""
        s, n = len(self.chosen), self.intervals
        return catch_probability(n, s, 1), catch_probability(n, s, min(cheats, n))

    def describe(self, prefix: int = 0) -> str:
        """One line: what was replayed, out of the job's steps, and what it bounds; never a
        claim to have verified. `prefix`: as in `replayed_steps`."""
        probabilities = ", ".join(
            f"{m} step{'s' * (m > 1)}: {float(self.caught(m)[1]):.3f}"
            for m in REPORTED_CHEATS if m <= self.intervals)
        full = f" and steps 1-{prefix} in full from its own states" if prefix else ""
        return (f"sampled, not verified: replayed {len(self.chosen)} of {self.intervals} "
                f"intervals (steps {', '.join(map(str, self.chosen))}){full}: "
                f"{self.replayed_steps(prefix)} of the job's {self.steps} steps, no divergence "
                f"found; a trainer cheating at m steps is caught with probability at least "
                f"{float(self.caught(1)[0]):.3f} (all its bad steps in one interval), or, each "
                f"bad step in its own interval, {probabilities}")

    def to_body(self) -> dict:
        return {"root": self.root, "steps": self.steps, "intervals": self.intervals,
                "chosen": [[iv.first, iv.last] for iv in self.chosen]}

    def to_bytes(self) -> bytes:
        """Canonical bytes (the job's recorded sample, `SAMPLE_FILE`)."""
        return encode(self.to_body())

    @classmethod
    def from_bytes(cls, data: bytes) -> Sample:
        """Parse a recorded sample (SPEC §2, `decode_object`). Raises EncodingError."""
        return decode_object(data, cls.from_body, cls.to_bytes, what="recorded sample",
                             max_bytes=RECORD_BYTES)

    @classmethod
    def from_body(cls, body: object) -> Sample:
        """The sample of a stored record. Raises EncodingError if `body` is not one that a
        draw can give: a 32-byte root, 1 <= intervals <= steps, and 1 to `intervals` chosen
        [first, last] pairs within 1..steps, each first <= last, ascending, not overlapping."""
        fields = require_fields("a sample", body, ("root", "steps", "intervals", "chosen"))
        require_bytes("a sample's root", fields["root"], HASH_SIZE)
        require_uint("a sample's steps", fields["steps"], 1)
        require_uint("a sample's interval count", fields["intervals"], 1, fields["steps"])
        chosen = fields["chosen"]
        if not isinstance(chosen, list) or not all(
                isinstance(iv, list) and len(iv) == 2 for iv in chosen):
            raise EncodingError("a sample's intervals are [first, last] pairs")
        if not 1 <= len(chosen) <= fields["intervals"]:
            raise EncodingError(f"a sample holds 1 to {fields['intervals']} intervals, got "
                                f"{len(chosen)}")
        after = 0
        for first, last in chosen:
            require_uint("a sample's first step", first, after + 1, fields["steps"])
            require_uint("a sample's last step", last, first, fields["steps"])
            after = last
        return cls(fields["root"], fields["steps"], fields["intervals"],
                   tuple(Interval(first, last) for first, last in chosen))


def draw_sample(plan: Sequence[Interval], fraction: float, key: KeyPair,
                trainer: SignedCommitment) -> Sample:
    """The sample of `plan` rules 2-6 give. Raises ConfigError for a bad F."""
    size = sample_size(fraction, len(plan))
    seed = sample_seed(trainer, sample_secret(key, trainer))
    return Sample(trainer.commitment.root, trainer.commitment.n, len(plan),
                  tuple(plan[i] for i in choose(seed, len(plan), size)))


def job_sample(store: JobStore, plan: Sequence[Interval], fraction: float, key: KeyPair,
               trainer: SignedCommitment) -> Sample | str:
    """The job's sample (rule 7): the one recorded in its store, or, when there is none, one
    drawn now and recorded durably before anything else is fetched; or why this audit must be
    full instead (a sample of every interval or of more than MAX_SAMPLED, another root than
    the recorded sample's, or a recorded sample that is unreadable). Raises ConfigError for a
    bad F, OSError as the filesystem does."""
    size = sample_size(fraction, len(plan))
    if size == len(plan):
        return (f"a sample of F = {fraction:g} holds all {len(plan)} intervals: a full audit "
                f"(rule 2)")
    if size > MAX_SAMPLED:
        return (f"a sample of F = {fraction:g} holds {size} of the job's {len(plan)} "
                f"intervals, more than the {MAX_SAMPLED} its record may hold: a full audit "
                f"(rule 2)")
    path, root = store.dir / SAMPLE_FILE, trainer.commitment.root
    try:
        recorded = Sample.from_bytes(path.read_bytes())
    except FileNotFoundError:
        drawn = draw_sample(plan, fraction, key, trainer)
        atomic_write(path, drawn.to_bytes())
        return drawn
    except (OSError, EncodingError) as err:
        return (f"the sample recorded for this job in {path} is unreadable ({err}); a second "
                f"draw could miss what the first would have caught, so this audit is full")
    if recorded.steps != store.spec.steps or recorded.intervals != len(plan) or \
            not all(iv in plan for iv in recorded.chosen):
        return (f"the sample recorded in {path} is not one of this job's plans, so this audit "
                f"is full")
    if recorded.root != root:
        return (f"the trainer signed two roots for job {store.spec.job_id.hex()}: "
                f"{recorded.root.hex()}, sampled before, and now {root.hex()}; a sample of the "
                f"second would be a second draw, so this audit is full")
    return recorded


@dataclass(frozen=True)
class SampleOutcome:
    """A sampled audit: the trainer's root; the sample (None: the audit ran in full, `note`
    says why); `audit`, the signed outcome of that full audit or of an escalation that found
    a divergence (None: sampled, not verified, nothing signed); `prefix`: steps 1..prefix
    replayed in full from the auditor's own states by escalations that found none; `note`:
    why the audit replayed more than its sample (None: it did not)."""

    trainer_commitment: SignedCommitment
    sample: Sample | None
    audit: AuditOutcome | None
    prefix: int = 0
    note: str | None = None


def sample_job(store: JobStore, source: ClaimSource, key: KeyPair, runner: IntervalRunner, *,
               fraction: float, progress: Progress | None = None) -> SampleOutcome:
    """Audit the job's sample (see the module docstring), escalating to a replay from step 1
    up to each sampled interval that diverges or cannot start from the trainer's S_c.

    `progress(k, K)` follows the sample, K its steps; an escalation's is `replay_job`'s.
    Raises ConfigError for a bad `fraction`, SignatureError for a trainer commitment that does
    not verify, and what the runner, `replay_intervals`, the store and `progress` raise (a
    restarted sampled audit replays the recorded sample again)."""
    spec = store.spec
    trainer = source.commitment()
    trainer.verify(job_id=spec.job_id, role="trainer", n=spec.steps)
    sample = job_sample(store, plan_intervals(spec), fraction, key, trainer)
    if isinstance(sample, str):
        return SampleOutcome(trainer, None, replay_in_intervals(store, source, key, runner,
                                                                progress=progress), note=sample)
    if source.leaf(0).state_hash != spec.h0:  # a divergence at 0: no interval to replay
        return SampleOutcome(trainer, sample, replay_in_intervals(store, source, key, runner,
                                                                  upto=0))
    pending, prefix, notes = list(sample.chosen), 0, []
    found: dict[Interval, IntervalResult] = {}
    try:
        while (escalate := _replay_sample(store, source, runner, pending, found, sample,
                                          progress)) is not None:
            last = escalate.interval.last
            if escalate.unstarted is not None:
                notes.append(f"the trainer did not serve sampled interval {escalate.interval}'s"
                             f" S_{escalate.interval.start} ({escalate.unstarted}), so the "
                             f"auditor replayed steps 1-{last} from its own states")
            _, divergent, reason = replay_intervals(store, source, runner, upto=last,
                                                    known=found, progress=progress)
            if divergent is not None:
                return SampleOutcome(trainer, sample, finish_replay(
                    store, key, trainer, divergent, reason), prefix, "; ".join(notes) or None)
            prefix, pending = last, [iv for iv in pending if iv.first > last]
            found.clear()  # stitched
    finally:
        shutil.rmtree(store.dir / SEGMENTS, ignore_errors=True)
    return SampleOutcome(trainer, sample, None, prefix, "; ".join(notes) or None)


def _replay_sample(store: JobStore, source: ClaimSource, runner: IntervalRunner,
                   pending: Sequence[Interval], found: dict[Interval, IntervalResult],
                   sample: Sample, progress: Progress | None) -> IntervalResult | None:
    """Replay the `pending` sampled intervals from the trainer's S_c into `found`, in order,
    up to the first that diverges or cannot start, which is returned (None: none did)."""
    results = runner(store.spec, [make_task(store, source, iv) for iv in pending])
    try:
        for result in results:
            if result.unstarted is not None:
                return result
            found[result.interval] = result
            if progress:
                progress(sum(len(iv.steps) for iv in found), sample.replayed_steps())
            if result.divergent_step is not None:
                return result
    finally:
        results.close()
    return None
