"""The arbiter's verdict (SPEC §5.4): the signed record, its offline check, its summary.

A `Verdict` signs the decision together with everything it follows from: the canonical job spec,
the full game transcript (every question and answer with its proof bytes, the commitments and
the registered keys), the re-execution record, the round count, timings and bytes moved, the
arbiter's key and the time. `verify_verdict` re-checks it offline from those bytes alone (SPEC
§5.4 "re-checkable offline from the transcript alone"): the signature, then a replay of every
move through the game's own transitions, then `decide` (`protocol.dispute.decision`) again,
which must give exactly the signed decision. So an arbiter that signs a decision the transcript
does not support, even with its own valid key, is caught by anyone. What a replay cannot
re-derive is h_i* itself (it needs the state, examples and log); `protocol.dispute.evidence`
lets a client re-run that step.
"""
from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from protocol.codec.canonical import PROTOCOL_VERSION, decode_object, encode
from protocol.codec.fields import (
    MAX_UINT,
    hex_or_repr,
    require_bytes,
    require_fields,
    require_uint,
    require_version,
)
from protocol.commit.hashing import HASH_SIZE
from protocol.commit.keys import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    KeyPair,
    sign_object,
    verify_object,
)
from protocol.dispute.decision import FINDINGS, Finding, decide, describe_finding
from protocol.dispute.game import GameState, Start, dispute, is_over, rounds
from protocol.dispute.reexecute import Reexecution
from protocol.dispute.transcript import decode_transcript, replay_transcript, transcript_bytes
from protocol.errors import EncodingError, OvtError, SignatureError, VerdictError
from protocol.job.spec import JobSpec

SIGNATURE_KIND = "verdict"
MAX_VERDICT_BYTES = 8 * 2**20
MAX_REASON_CHARS = 2000
MAX_METRICS = 32
MAX_METRIC_NAME = 64
VERDICT_FAULTS = ("trainer", "auditor", "both", "none")

_FIELDS = ("protocol_version", "job_id", "spec", "transcript", "fault", "finding", "step",
           "reason", "reexecution", "rounds", "timings", "bytes_moved",
           "arbiter_key", "time", "signature")


@dataclass(frozen=True)
class Verdict:
    """The arbiter's signed verdict (SPEC §5.4).

    `spec` and `transcript` are canonical bytes (JobSpec.to_bytes, transcript_bytes);
    `job_id` is the spec's hash, kept in the clear for readers. `rounds` counts the game's
    questions, every one a bisection round (leaf 0 is checked at start from the claims the
    challenge carries: SPEC §5.2), at most ⌈log2 j⌉. `timings` (seconds, e.g.
    bisection_s, evidence_s, reexecution_s, total_s) and `bytes_moved` (e.g. trainer,
    auditor) are the arbiter's measurements. `signature` is the arbiter's Ed25519 signature,
    kind "verdict", over `body()`. Construction checks every field's shape (EncodingError); it
    does not check the signature or the decision: `verify_verdict` does.
    """

    protocol_version: int
    job_id: bytes
    spec: bytes
    transcript: bytes
    fault: str
    finding: str
    step: int | None
    reason: str
    reexecution: Reexecution | None
    rounds: int
    timings: dict[str, float]
    bytes_moved: dict[str, int]
    arbiter_key: bytes
    time: int
    signature: bytes

    def __post_init__(self) -> None:
        require_version("verdict", self.protocol_version)
        require_bytes("verdict job_id", self.job_id, HASH_SIZE)
        for name in ("spec", "transcript"):
            if type(getattr(self, name)) is not bytes or not getattr(self, name):
                raise EncodingError(f"verdict {name} must be non-empty bytes")
        if type(self.fault) is not str or self.fault not in VERDICT_FAULTS:
            raise EncodingError(f"verdict fault must be one of {', '.join(VERDICT_FAULTS)}")
        if type(self.finding) is not str or self.finding not in FINDINGS:
            raise EncodingError(f"verdict finding {self.finding!r} is not a known finding")
        if self.step is not None:
            require_uint("verdict step", self.step)
        if type(self.reason) is not str or len(self.reason) > MAX_REASON_CHARS:
            raise EncodingError(f"verdict reason must be a string of at most "
                                f"{MAX_REASON_CHARS} characters")
        if self.reexecution is not None and not isinstance(self.reexecution, Reexecution):
            raise EncodingError("verdict reexecution must be a re-execution record or none")
        require_uint("verdict rounds", self.rounds)
        object.__setattr__(self, "timings", _metrics("timings", self.timings, float))
        object.__setattr__(self, "bytes_moved", _metrics("bytes_moved", self.bytes_moved, int))
        require_bytes("verdict arbiter_key", self.arbiter_key, PUBLIC_KEY_SIZE)
        require_uint("verdict time", self.time)
        require_bytes("verdict signature", self.signature, SIGNATURE_SIZE)

    def body(self) -> dict[str, Any]:
        """Every field but the signature: what the signature covers."""
        body = {name: getattr(self, name) for name in _FIELDS if name != "signature"}
        body["reexecution"] = None if self.reexecution is None else self.reexecution.to_body()
        body["timings"], body["bytes_moved"] = dict(self.timings), dict(self.bytes_moved)
        return body

    def to_bytes(self) -> bytes:
        return encode({**self.body(), "signature": self.signature})

    @classmethod
    def from_bytes(cls, data: bytes) -> Verdict:
        """Strictly parse verdict bytes: canonical encoding, at most MAX_VERDICT_BYTES, exactly
        the verdict's fields, each of the right shape, re-encoding to exactly `data` (SPEC §2,
        `decode_object`). Raises EncodingError. Checks neither the signature nor the decision
        (`verify_verdict` does)."""
        return decode_object(data, cls._from_body, cls.to_bytes, what="verdict",
                             max_bytes=MAX_VERDICT_BYTES)

    @classmethod
    def _from_body(cls, body: object) -> Verdict:
        fields = dict(require_fields("a verdict", body, _FIELDS))
        if fields["reexecution"] is not None:
            fields["reexecution"] = Reexecution.from_body(fields["reexecution"])
        return cls(**fields)


def sign_verdict(spec: JobSpec, game: GameState, reexec: Reexecution | None, *,
                 timings: dict[str, float], bytes_moved: dict[str, int], key: KeyPair,
                 now: int | None = None) -> Verdict:
    """Decide (`decide`) and sign the verdict for a finished game of `spec`'s job.

    `now` is the signing time in unix seconds (default: the clock). Raises ValueError when
    `decide` does, when the game is of another job, or when a field has the wrong shape.
    """
    if not isinstance(spec, JobSpec):
        raise TypeError(f"spec must be a JobSpec, not {type(spec).__name__}")
    finding = decide(game, reexec)
    if game.job_id != spec.job_id:
        raise ValueError("the game was played for another job than the spec's")
    if isinstance(timings, dict):  # whole seconds are still seconds: encode them as floats
        timings = {k: float(v) if type(v) is int else v for k, v in timings.items()}
    try:
        verdict = Verdict(
            protocol_version=PROTOCOL_VERSION, job_id=spec.job_id, spec=spec.to_bytes(),
            transcript=transcript_bytes(game), fault=finding.fault, finding=finding.finding,
            step=finding.step, reason=finding.reason, reexecution=reexec,
            rounds=rounds(game), timings=timings, bytes_moved=bytes_moved,
            arbiter_key=key.public_key, time=int(_time.time()) if now is None else now,
            signature=bytes(64))
        verdict = replace(verdict, signature=sign_object(SIGNATURE_KIND, verdict.body(), key))
        if len(verdict.to_bytes()) > MAX_VERDICT_BYTES:
            raise EncodingError(f"the verdict is over {MAX_VERDICT_BYTES} bytes")
    except EncodingError as err:
        raise ValueError(f"cannot sign this verdict: {err}") from None
    return verdict


# ============================================================================================
# Offline verification (SPEC §5.4)
# ============================================================================================

def verify_verdict(data: bytes, *, arbiter_key: bytes | None = None) -> Verdict:
    """Accept verdict bytes only if every part of them checks out, offline:

    1. they parse strictly (`Verdict.from_bytes`);
    2. the signature verifies under the embedded arbiter key, which must be `arbiter_key`
       when given (the client's trusted arbiter);
    3. the spec parses and hashes to the job id, and the transcript is that job's;
    4. the transcript replays: every move, proof and deadline re-derived by the game's own
       transitions, to a finished game (`game.replay_transcript`);
    5. `decide` on the replayed game and the signed re-execution gives exactly the signed
       fault, finding, step and reason, and the round count is the transcript's;
    6. the re-execution used the evidence the dispute names: S_{i-1} with the agreed h_{i-1},
       and the trainer's L_i with its ℓ_i.

    Returns the verdict. Raises VerdictError naming the first check that failed.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"verify_verdict takes bytes, not {type(data).__name__}")
    try:
        verdict = Verdict.from_bytes(bytes(data))
    except EncodingError as err:
        raise VerdictError(f"the verdict does not parse: {err}") from None
    try:
        verify_object(SIGNATURE_KIND, verdict.body(), verdict.arbiter_key, verdict.signature)
    except SignatureError as err:
        raise VerdictError(f"the verdict's signature does not verify: {err}") from None
    if arbiter_key is not None and verdict.arbiter_key != arbiter_key:
        raise VerdictError(f"the verdict is signed by arbiter key {verdict.arbiter_key.hex()}, "
                           f"not the expected {hex_or_repr(arbiter_key)}")
    _, game = replayed(verdict)
    try:
        expected = decide(game, verdict.reexecution)
    except (ValueError, TypeError) as err:
        raise VerdictError(f"the verdict's re-execution does not fit the transcript: {err}") \
            from None
    signed = Finding(verdict.fault, verdict.finding, verdict.step, verdict.reason)
    if signed != expected:
        raise VerdictError(f"the decision does not follow from the transcript: the verdict says "
                           f"{describe_finding(signed)}, the transcript and re-execution give "
                           f"{describe_finding(expected)}")
    asked = rounds(game)
    if verdict.rounds != asked:
        raise VerdictError(f"the verdict counts {verdict.rounds} rounds, the transcript shows "
                           f"{asked}")
    reexec, d = verdict.reexecution, dispute(game)
    if reexec is not None and reexec.finding in ("computed", "invalid-log"):
        if d is None:  # `decide` above refuses a re-execution when no step is disputed
            raise VerdictError("the verdict records a re-execution but no step is disputed")
        # SPEC §5.3: h_i* counts only if computed from S_{i-1} with the agreed h_{i-1} and the
        # trainer's L_i with its committed ℓ_i.
        if reexec.prev_state_hash != d.agreed.state_hash:
            raise VerdictError(f"the re-execution of step {d.step} started from a state hashing "
                               f"to {hex_or_repr(reexec.prev_state_hash)}, not the agreed "
                               f"h_{d.step - 1} = {d.agreed.state_hash.hex()}")
        if reexec.log_digest != d.trainer.log_hash:
            raise VerdictError(f"the re-execution of step {d.step} used a log hashing to "
                               f"{hex_or_repr(reexec.log_digest)}, not the trainer's ℓ_{d.step} = "
                               f"{d.trainer.log_hash.hex()}")
    return verdict


def replayed(verdict: Verdict) -> tuple[JobSpec, GameState]:
    """The verdict's job spec and its game re-derived from the transcript alone."""
    try:
        spec = JobSpec.from_bytes(verdict.spec)
    except EncodingError as err:
        raise VerdictError(f"the verdict's job spec does not parse: {err}") from None
    if spec.job_id != verdict.job_id:
        raise VerdictError(f"the verdict's job spec hashes to job {spec.job_id.hex()}, not the "
                           f"verdict's job {verdict.job_id.hex()}")
    try:
        t = decode_transcript(verdict.transcript)
    except EncodingError as err:
        raise VerdictError(f"the verdict's transcript does not parse: {err}") from None
    if t.job_id != spec.job_id:
        raise VerdictError(f"the transcript is of job {t.job_id.hex()}, not the verdict's job "
                           f"{spec.job_id.hex()}")
    try:
        game = replay_transcript(spec, t.trainer, t.auditor, trainer_key=t.trainer_key,
                                 auditor_key=t.auditor_key, transcript=verdict.transcript)
    except (OvtError, TypeError, ValueError) as err:
        raise VerdictError(f"the verdict's transcript does not replay: {err}") from None
    if not is_over(game):
        raise VerdictError("the verdict's transcript is of a game that is not over")
    return spec, game


# ============================================================================================
# Human summary
# ============================================================================================

def summary(verdict: Verdict) -> str:
    """A readable account of a verdict: who is at fault at which step and why, the rounds
    played against the ⌈log2 j⌉ bound of SPEC §5.2, timings, bytes moved and the arbiter."""
    fault = {"none": "no party is at fault", "both": "both parties are at fault"}.get(
        verdict.fault, f"the {verdict.fault} is at fault")
    where = "" if verdict.step is None else f" at step {verdict.step}"
    lines = [f"verdict for job {verdict.job_id.hex()}",
             f"outcome: {fault}{where} ({verdict.finding})",
             f"reason:  {verdict.reason}"]
    r = verdict.reexecution
    if r is not None:
        what = {"computed": f"h_{r.step}* = {hex_or_repr(r.state_hash)}",
                "withheld": f"evidence withheld by {r.withheld_by}"}.get(r.finding, r.finding)
        lines.append(f"re-execution of step {r.step} on {r.profile}: {what} "
                     f"({r.seconds:.3f} s)")
    j = _challenge_step(verdict.transcript)
    bound = f"; bound ⌈log2 {j}⌉ = {math.ceil(math.log2(j))}" if j else ""
    lines.append(f"bisection: {verdict.rounds} round{'s' if verdict.rounds != 1 else ''}"
                 f"{f' for a challenge at step {j}' if j else ''}{bound}")
    if verdict.timings:
        lines.append("timings: " + ", ".join(f"{k} {v:.3f} s"
                                             for k, v in sorted(verdict.timings.items())))
    if verdict.bytes_moved:
        lines.append("bytes moved: " + ", ".join(f"{k} {v} B"
                                                 for k, v in sorted(verdict.bytes_moved.items())))
    try:
        signed_at = datetime.fromtimestamp(verdict.time, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):  # a signed but absurd time: show it raw
        signed_at = f"at unix time {verdict.time}"
    lines.append(f"arbiter: {verdict.arbiter_key.hex()}, signed {signed_at}")
    return "\n".join(lines)


def _challenge_step(transcript: bytes) -> int | None:
    try:
        records = decode_transcript(transcript).records
    except EncodingError:
        return None
    first = records[0] if records else None
    return first.challenge_step if isinstance(first, Start) and first.challenge_step >= 1 \
        else None


def _metrics(name: str, value: object, kind: type) -> dict:
    """A small map of named measurements: str keys, finite non-negative `kind` values."""
    if type(value) is not dict or len(value) > MAX_METRICS:
        raise EncodingError(f"verdict {name} must be a map of at most {MAX_METRICS} entries")
    for key, item in value.items():
        if type(key) is not str or not 1 <= len(key) <= MAX_METRIC_NAME:
            raise EncodingError(f"verdict {name} keys must be names of 1..{MAX_METRIC_NAME} "
                                f"characters")
        if type(item) is not kind or not isinstance(item, int | float) \
                or not math.isfinite(item) or item < 0 \
                or (kind is int and item > MAX_UINT):
            raise EncodingError(f"verdict {name}[{key!r}] must be a non-negative finite "
                                f"{kind.__name__}, got {item!r}")
    return dict(value)
