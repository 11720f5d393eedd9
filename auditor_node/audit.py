"""One audit (SPEC §5.1): fetch a job from a trainer, replay it on this hardware, compare roots.

`run_audit` asks the trainer for the job spec (and checks that it hashes to the job id it was
asked for), then runs `protocol.job.run.replay_job` over a verified `RemoteClaims` into the
auditor's own `JobStore` under `store_root`, signing the auditor's own commitment. It resumes
after the auditor's own crash: replayed steps come from its store, and the trainer's leaves it
has already verified from `<store>/<job id>/trainer-leaves.ovt` (see `leafcache`). On a
mismatch it writes the challenge (see `challenge`) to `<store>/<job id>/challenge.ovt`.

With `processes` > 1 the replay is cut at the trainer's checkpoints and the intervals replay in
that many worker processes (`protocol.job.intervals`), giving the same leaves and signed root;
a trainer that refuses an S_c only makes the rest of the replay sequential. With `sample` = F
it replays only a fraction F of the intervals, drawn once per job where the trainer can
neither foresee nor steer it (`protocol.job.sampling`): finding nothing, the record is
"sampled" — sampled, not verified — and the auditor signs nothing; a sampled interval that
diverges, or whose S_c the trainer does not serve, is replayed up to in full from the
auditor's own states, signed and challenged exactly as a full audit's. A sample of every
interval, or of a job whose trainer signed another root than the one sampled before, runs as
a full audit, and the record's `note` says why.

    record = run_audit("127.0.0.1:50051", job_id, Path("auditor-store"), KeyPair.load(path),
                       Profile.parse("emulated-gpu"))
    record.state  # "matched", "diverged" or "sampled"; a failure raises an OvtError
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import grpc

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import DEFAULT_DEADLINE_S, RemoteClaims
from proto.serving import make_channel
from protocol.codec.canonical import decode_object, encode
from protocol.codec.fields import require_bytes, require_fields, require_uint
from protocol.commit.commitments import Claim, SignedCommitment
from protocol.commit.hashing import HASH_SIZE
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import require_allowed
from protocol.errors import ConfigError, EncodingError, OvtError, PeerError, ResourceLimitError
from protocol.files import atomic_write
from protocol.job.create import (
    DEFAULT_MAX_PARAMS,
    load_job_program,
    require_model_size,
)
from protocol.job.intervals import IntervalRunner, replay_in_intervals
from protocol.job.run import AuditOutcome, Progress, StepHooks, replay_job
from protocol.job.sampling import Sample, SampleOutcome, require_fraction, sample_job
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

from .leafcache import CachedClaims
from .states import RemoteStates

CHALLENGE_FILE = "challenge.ovt"
DEFAULT_MAX_STEPS = 1 << 20  # the most steps of a job an auditor takes on (--max-steps)
MATCHED, DIVERGED, SAMPLED, FAILED = "matched", "diverged", "sampled", "failed"
VERDICTS = (MATCHED, DIVERGED, SAMPLED, FAILED)
_RECORD_FIELDS = ("job_id", "state", "steps", "replayed", "divergent_step", "reason",
                  "trainer_commitment", "auditor_commitment", "challenge", "error")
_SAMPLE_FIELD, _NOTE_FIELD = "sample", "note"  # only in the records that have them


@dataclass(frozen=True)
class AuditRecord:
    """The outcome of one audit.

    state: matched | diverged | sampled | failed; steps: the job's steps; replayed: the steps
    the auditor's commitment covers (sampled: how many distinct steps it replayed, a count,
    not where it stopped); divergent_step/reason: the first step that differs and why
    (diverged; sampled: the sample's "sampled, not verified" report);
    trainer_commitment/auditor_commitment: both signed roots (absent when the audit failed
    before reaching them; a sampled audit that found nothing signs none); challenge: where the
    challenge was written; error: why it failed; sample: the intervals a sampled audit drew
    (None for a full audit); note: why an audit asked to sample replayed more than its sample
    (ran in full, or escalated because the trainer did not serve an S_c), None otherwise.
    """

    job_id: bytes
    state: str
    steps: int = 0
    replayed: int = 0
    divergent_step: int | None = None
    reason: str | None = None
    trainer_commitment: SignedCommitment | None = None
    auditor_commitment: SignedCommitment | None = None
    challenge: Path | None = None
    error: str | None = None
    sample: Sample | None = None
    note: str | None = None

    @classmethod
    def failed(cls, job_id: bytes, error: str) -> AuditRecord:
        return cls(job_id=job_id, state=FAILED, error=error)

    def to_bytes(self) -> bytes:
        """Canonical bytes (the runner keeps each verdict in the auditor's store). The sample
        and note fields are present only when set, so a full audit's record is what it always
        was."""
        body = {
            "job_id": self.job_id, "state": self.state, "steps": self.steps,
            "replayed": self.replayed, "divergent_step": self.divergent_step,
            "reason": self.reason, "error": self.error,
            "trainer_commitment": _opt_bytes(self.trainer_commitment),
            "auditor_commitment": _opt_bytes(self.auditor_commitment),
            "challenge": None if self.challenge is None else str(self.challenge)}
        if self.sample is not None:
            body[_SAMPLE_FIELD] = self.sample.to_body()
        if self.note is not None:
            body[_NOTE_FIELD] = self.note
        return encode(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> AuditRecord:
        """Parse a stored record: exactly the record's fields, each of its type, re-encoding
        to exactly `data` (SPEC §2, `decode_object`). Raises EncodingError if it is not one."""
        return decode_object(data, cls._from_body, cls.to_bytes, what="audit record",
                             max_bytes=64 * 1024)

    @classmethod
    def _from_body(cls, body: object) -> AuditRecord:
        sample = note = None
        if isinstance(body, dict):
            body = dict(body)
            if _SAMPLE_FIELD in body:
                sample = Sample.from_body(body.pop(_SAMPLE_FIELD))
            note = body.pop(_NOTE_FIELD, None)
            if note is not None and type(note) is not str:
                raise EncodingError("audit record note must be str")
        body = require_fields("an audit record", body, _RECORD_FIELDS)
        if body["state"] not in VERDICTS:
            raise EncodingError(f"an audit record's state is one of {', '.join(VERDICTS)}")
        require_bytes("audit record job_id", body["job_id"], HASH_SIZE)
        require_uint("audit record steps", body["steps"])
        require_uint("audit record replayed", body["replayed"])
        if body["divergent_step"] is not None:
            require_uint("audit record divergent_step", body["divergent_step"])
        for name, kind in (("reason", str), ("error", str), ("challenge", str),
                           ("trainer_commitment", bytes), ("auditor_commitment", bytes)):
            if body[name] is not None and type(body[name]) is not kind:
                raise EncodingError(f"audit record {name} must be {kind.__name__} or none")
        return cls(**{**body, "sample": sample, "note": note,
                      "challenge": _opt(body["challenge"], Path),
                      "trainer_commitment": _opt(body["trainer_commitment"],
                                                 SignedCommitment.from_bytes),
                      "auditor_commitment": _opt(body["auditor_commitment"],
                                                 SignedCommitment.from_bytes)})


def _opt_bytes(signed: SignedCommitment | None) -> bytes | None:
    return None if signed is None else signed.to_bytes()


def _opt(value, convert):
    return None if value is None else convert(value)


def run_audit(trainer_address: str, job_id: bytes, store_root: Path, key: KeyPair,
              profile: Profile, *, tls_ca: Path | None = None,
              allow_remote_plaintext: bool = False, progress: Progress | None = None,
              allowed_programs: Collection[str] = (),
              max_params: int = DEFAULT_MAX_PARAMS, max_steps: int = DEFAULT_MAX_STEPS,
              deadline_s: float = DEFAULT_DEADLINE_S,
              hooks: StepHooks | None = None, data_dir: Path | None = None,
              processes: int = 1, sample: float | None = None,
              check_stop: Callable[[], None] | None = None) -> AuditRecord:
    """Audit job `job_id` as served by the trainer at `trainer_address` (see module docstring).

    Returns a matched, diverged or (with `sample`) sampled record. Raises ConfigError for a
    malformed job id or address, fewer than one process or more than `usable_cpus()`, or a
    `sample` outside 0 < F <= 1 (all checked before the trainer is asked anything),
    PeerError for a trainer that does not answer or answers with anything that does not verify
    (a spec that does not hash to `job_id` included), ConfigError for a job whose program is
    neither a built-in nor in `allowed_programs` (loading a program imports code here, so a
    trainer may not choose an arbitrary one), ResourceLimitError for a built-in model of more
    than `max_params` parameters (checked before it is built) or a job of more than
    `max_steps` steps (`require_job_steps`; both before the job's store is made),
    ProgramError if this machine's program source differs from the job's, ConfigError for a
    job whose data file is not in `data_dir` (or leaves it, or `data_dir` is None: checked
    before the job's store is made) or differs from the committed one, StoreError for a
    damaged store, RefusedError for a store whose signed replay is of another commitment to
    the job (`protocol.job.run.begin_replay`: an unsigned one is cut back and replayed again);
    and whatever `progress` or `check_stop` raises (the audit then resumes from
    the store on the next call).

    `processes` > 1 replays the intervals between the trainer's checkpoints in that many
    worker processes (`replay_in_intervals`); `sample` = F replays a fraction F of them
    (`sample_job`). `check_stop` (the daemon's; None: never) is asked between steps and, while
    worker processes replay, every `protocol.job.intervals.POLL_S` seconds, so that a stop
    does not wait for a whole interval. `hooks` is FAULT INJECTION only (a lying auditor,
    `auditor_node.faults`), passed to the replay (to each worker process too); None audits
    honestly.
    """
    if not isinstance(job_id, bytes) or len(job_id) != 32:
        raise ConfigError("a job id is 32 bytes (64 hex digits)")
    runner = IntervalRunner(processes, RemoteStates(trainer_address, tls_ca,  # checks P
                                                    allow_remote_plaintext, deadline_s),
                            profile, hooks=hooks, data_dir=data_dir, check_stop=check_stop)
    if sample is not None:
        require_fraction(sample)
    with make_channel(trainer_address, tls_ca=tls_ca,
                      allow_remote_plaintext=allow_remote_plaintext) as channel:
        spec = fetch_spec(channel, job_id, deadline_s)
        require_allowed(spec.program, allowed_programs, "auditor")
        require_job_steps(spec, max_steps)
        require_model_size(spec, max_params)
        load_job_program(spec, data_dir)  # SPEC §2.1: its examples (and data file) committed
        store = JobStore(store_root, spec)
        try:
            source = CachedClaims(RemoteClaims(channel, spec, deadline_s=deadline_s), store.dir)
            sampled = None
            try:
                if sample is not None:
                    sampled = sample_job(store, source, key, runner, fraction=sample,
                                         progress=progress)
                elif processes > 1:
                    outcome = replay_in_intervals(store, source, key, runner, progress=progress)
                else:
                    outcome = replay_job(store, source, key, profile=profile,
                                         progress=progress, hooks=hooks, data_dir=data_dir)
            finally:
                source.close()
            if sampled is None:
                return _record(channel, store, outcome, deadline_s)
            if sampled.audit is None:  # no sampled interval diverged
                return _sampled_record(spec, sampled)
            return dataclasses.replace(_record(channel, store, sampled.audit, deadline_s),
                                       sample=sampled.sample, note=sampled.note)
        finally:
            store.close()


def require_job_steps(spec: JobSpec, max_steps: int) -> None:
    """Refuse a job of more than `max_steps` steps, before anything is planned or replayed: a
    trainer chooses its spec's n and signs a commitment over it at no cost, so without a bound
    a plain audit of n = 2**40 steps would hold this auditor's one worker for good, and a
    sampled one lay out a plan of that many intervals. Raises ResourceLimitError."""
    if spec.steps > max_steps:
        raise ResourceLimitError(f"job {spec.job_id.hex()} has {spec.steps} steps; at most "
                                 f"{max_steps} are audited here (--max-steps)")


def fetch_spec(channel: grpc.Channel, job_id: bytes, deadline_s: float) -> JobSpec:
    """The trainer's spec of `job_id`, checked to hash to it. Raises PeerError."""
    try:
        reply = ovt_pb2_grpc.ClaimsStub(channel).GetSpec(ovt_pb2.JobRef(job_id=job_id),
                                                         timeout=deadline_s)
    except grpc.RpcError as err:
        raise PeerError(f"trainer GetSpec failed: {err.code().name}: {err.details()}") from None
    if hashlib.sha256(reply.spec).digest() != job_id:
        raise PeerError(f"the trainer's spec hashes to {hashlib.sha256(reply.spec).hexdigest()},"
                        f" not to the job id {job_id.hex()} it was asked for")
    try:
        return JobSpec.from_bytes(reply.spec)
    except EncodingError as err:
        raise PeerError(f"the trainer's spec does not decode: {err}") from None


def _sampled_record(spec: JobSpec, sampled: SampleOutcome) -> AuditRecord:
    """A sampled audit that found nothing: no commitment of the auditor's, no challenge."""
    sample = sampled.sample
    assert sample is not None  # an audit run in full has its outcome
    return AuditRecord(job_id=spec.job_id, state=SAMPLED, steps=spec.steps,
                       replayed=sample.replayed_steps(sampled.prefix),
                       reason=sample.describe(sampled.prefix),
                       trainer_commitment=sampled.trainer_commitment, sample=sample,
                       note=sampled.note)


def _record(channel: grpc.Channel, store: JobStore, outcome: AuditOutcome,
            deadline_s: float) -> AuditRecord:
    spec, own = store.spec, outcome.commitment
    path = store.dir / CHALLENGE_FILE
    record = functools.partial(AuditRecord, job_id=spec.job_id, steps=spec.steps,
                               replayed=own.commitment.n,
                               trainer_commitment=outcome.trainer_commitment,
                               auditor_commitment=own)
    if outcome.matches:
        path.unlink(missing_ok=True)  # a stale one from an audit of another trainer root
        return record(state=MATCHED)
    step = outcome.first_divergent_step
    if step is None:  # every leaf matched, yet the roots differ: nothing to point at
        return record(state=DIVERGED, reason="the roots differ although every replayed leaf "
                      "matched")
    challenge = Challenge(
        job_id=spec.job_id, step=step, reason=outcome.reason or "",
        trainer_commitment=outcome.trainer_commitment,
        trainer_leaf=trainer_claim(channel, spec, step, outcome.trainer_commitment,
                                   deadline_s),
        auditor_commitment=own, auditor_leaf=own_claim(store, step, own),
        trainer_leaf0=trainer_claim(channel, spec, 0, outcome.trainer_commitment, deadline_s),
        auditor_leaf0=leaf_claim(store, 0, own))
    atomic_write(path, challenge.to_bytes())
    return record(state=DIVERGED, divergent_step=step, reason=outcome.reason, challenge=path)


def trainer_claim(channel: grpc.Channel, spec: JobSpec, step: int, signed: SignedCommitment,
                  deadline_s: float) -> Claim:
    """The trainer's leaf `step` with its inclusion proof, verified against `signed`.

    Asked the way the audit asked for every leaf, with the streamed GetLeaves (of one leaf):
    the challenge needs the leaf the trainer served the audit, and a point query is the
    arbiter's (a trainer that lies to point queries is the arbiter's to catch)."""
    try:
        replies = list(ovt_pb2_grpc.ClaimsStub(channel).GetLeaves(
            ovt_pb2.StepRange(job_id=spec.job_id, first=step, last=step), timeout=deadline_s))
    except grpc.RpcError as err:
        raise PeerError(f"trainer GetLeaves failed: {err.code().name}: {err.details()}") \
            from None
    if len(replies) != 1:
        raise PeerError(f"asked the trainer for leaf {step}, got {len(replies)} leaves")
    reply = replies[0]
    try:
        if reply.step != step:
            raise PeerError(f"asked for leaf {step}, got leaf {reply.step}")
        claim = Claim(spec.job_id, step, bytes(reply.state_hash), bytes(reply.log_hash),
                      tuple(bytes(p) for p in reply.proof), reply.tree_size)
        claim.verify(signed)
    except OvtError as err:
        raise PeerError(f"the trainer's leaf {step} with its proof does not verify: {err}") \
            from None
    return claim


def own_claim(store: JobStore, step: int, signed: SignedCommitment) -> Claim | None:
    """The auditor's own leaf `step` with its proof under its commitment (None: not replayed)."""
    return leaf_claim(store, step, signed) if step <= signed.commitment.n else None


def leaf_claim(store: JobStore, step: int, signed: SignedCommitment) -> Claim:
    """Leaf `step` of `store` with its proof under `signed`, whose n it must not exceed (leaf 0
    is under every commitment). Raises ValueError for a step past n."""
    n = signed.commitment.n
    if step > n:
        raise ValueError(f"leaf {step} is not under a commitment over {n} steps")
    leaf = store.leaf(step)
    return Claim(store.spec.job_id, step, leaf.state_hash, leaf.log_hash,
                 tuple(store.tree(n).proof(step)), n + 1)
