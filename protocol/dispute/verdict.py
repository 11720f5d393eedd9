"""The arbiter's verdict (SPEC §5.4): the decision table, the signed record, its offline check.

A dispute ends in one of two ways. Either the bisection game itself ended against a party
(a bad commitment or challenge, leaf 0 not matching h_0, a malformed or unprovable answer, a
missed deadline: `protocol.dispute.game`), and that is the verdict; or it ended with leaf
i - 1 agreed and leaf i disagreed, and the arbiter re-executed step i (SPEC §5.3,
`protocol.dispute.reexecute`).
`decide` is the one table mapping (game, re-execution) to (fault, finding, step, reason):

| game / re-execution                     | fault    | finding          |
|-----------------------------------------|----------|------------------|
| game over against a party               | it       | the game's kind  |
| evidence withheld by p                  | p        | withheld         |
| L_i does not decode / violates / misfits| trainer  | invalid-log      |
| h_i* equals the trainer's h_i           | auditor  | false-challenge  |
| h_i* equals the auditor's h_i           | trainer  | wrong-state      |
| h_i* equals neither                     | none     | inconclusive     |
| no auditor h_i; h_i* is the trainer's   | none     | not-upheld       |
| no auditor h_i; h_i* is not the trainer's | trainer | wrong-state     |

An auditor files no h_i of its own when it could not replay step i: the trainer served it a
log that did not match ℓ_i, or one that was invalid. If the log the arbiter gets re-executes to
the trainer's h_i, nobody is provably at fault (the trainer may have served the auditor another
log than the arbiter), so the challenge is not upheld rather than false; if it re-executes to
anything else, the trainer's signed h_i does not follow from its own valid log.

A `Verdict` signs the decision together with everything it follows from: the canonical job spec,
the full game transcript (every question and answer with its proof bytes, the commitments and
the registered keys), the re-execution record, the round count, timings and bytes moved, the
arbiter's key and the time. `verify_verdict` re-checks it offline from those bytes alone (SPEC
§5.4 "re-checkable offline from the transcript alone"): the signature, then a replay of every
move through the game's own transitions, then `decide` again, which must give exactly the
signed decision. So an arbiter that signs a decision the transcript does not support, even with
its own valid key, is caught by anyone. What a replay cannot re-derive is h_i* itself (it needs
the state, examples and log); `save_evidence` / `recheck_evidence` let a client re-run that step.
"""

from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from protocol.codec.canonical import decode, encode
from protocol.codec.state import decode_state, encode_state
from protocol.commit.data import ProvenExample
from protocol.commit.signing import PROTOCOL_VERSION, KeyPair, sign_object, verify_object
from protocol.dispute.game import (
    KINDS,
    GameState,
    Start,
    decode_transcript,
    dispute,
    is_over,
    replay_transcript,
    rounds,
    transcript_bytes,
)
from protocol.dispute.reexecute import Reexecution, reexecute
from protocol.engine.profiles import Profile
from protocol.errors import (
    EncodingError,
    OvtError,
    SignatureError,
    StateFormatError,
    VerdictError,
)
from protocol.job.spec import JobSpec
from protocol.job.store import atomic_write

SIGNATURE_KIND = "verdict"
MAX_VERDICT_BYTES = 8 * 2**20
MAX_REASON_CHARS = 2000
MAX_METRICS = 32
MAX_METRIC_NAME = 64
REEXECUTION_FINDINGS = ("withheld", "invalid-log", "false-challenge", "wrong-state",
                        "inconclusive", "not-upheld")
FINDINGS = tuple(k for k in KINDS if k != "disagreed-at") + REEXECUTION_FINDINGS
VERDICT_FAULTS = ("trainer", "auditor", "both", "none")

_FIELDS = ("protocol_version", "job_id", "spec", "transcript", "fault", "finding", "step",
           "reason", "reexecution", "rounds", "timings", "bytes_moved",
           "arbiter_key", "time", "signature")
_MAX_UINT = 2**63 - 1


# ============================================================================================
# The decision table (SPEC §5.4)
# ============================================================================================

@dataclass(frozen=True)
class Finding:
    """Who is at fault ("trainer", "auditor", "both" or "none"), the finding (a game kind or
    one of REEXECUTION_FINDINGS), the step concerned (None when the game ended at its start on
    a bad commitment) and one readable line saying why."""

    fault: str
    finding: str
    step: int | None
    reason: str


def decide(game: GameState, reexec: Reexecution | None) -> Finding:
    """The verdict's decision for a finished game and the re-execution of its disputed step
    (SPEC §5.4; the table is in the module docstring).

    A game that ended against a party decides alone, and `reexec` must be None: nothing was
    re-executed. A game that ended "disagreed-at" step i needs `reexec` for step i. Raises
    ValueError for a running game, a missing, superfluous or other-step re-execution, and for
    "bad-evidence" (the driver handed evidence that does not match the dispute: no verdict may
    rest on that). Deterministic, so `verify_verdict` can recompute it from the transcript.
    """
    if not isinstance(game, GameState):
        raise TypeError(f"expected a GameState, not {type(game).__name__}")
    if reexec is not None and not isinstance(reexec, Reexecution):
        raise TypeError(f"expected a Reexecution or None, not {type(reexec).__name__}")
    if not is_over(game):
        raise ValueError("the game is still running: a verdict needs a finished game")
    outcome = game.outcome
    if outcome.kind != "disagreed-at":
        # SPEC §5.4: a party that failed to answer, sent a bad proof or contradicted its signed
        # root is at fault; the game already decided who.
        if reexec is not None:
            raise ValueError(f"the game ended with {outcome.kind!r} ({outcome.fault} at fault): "
                             f"no step is disputed, so there is no re-execution to record")
        return Finding(outcome.fault, outcome.kind, outcome.step, outcome.reason)

    d = dispute(game)
    i = d.step
    if reexec is None:
        raise ValueError(f"step {i} is disputed: the verdict needs its re-execution")
    if reexec.step != i:
        raise ValueError(f"the re-execution is of step {reexec.step}, but step {i} is disputed")
    if reexec.finding == "bad-evidence":
        raise ValueError(f"the re-execution of step {i} ran on bad evidence ({reexec.detail}); "
                         f"fetch the evidence again: no verdict may rest on it")
    if reexec.finding == "withheld":
        who = "both parties" if reexec.withheld_by == "both" else f"the {reexec.withheld_by}"
        return Finding(reexec.withheld_by, "withheld", i,
                       f"step {i}: {who} did not serve the evidence re-execution needs "
                       f"({reexec.detail})")
    if reexec.finding == "invalid-log":
        return Finding("trainer", "invalid-log", i,
                       f"step {i}: the trainer's rounding log L_{i} (ℓ_{i} = "
                       f"{_short(d.trainer.log_hash)}) is invalid: {reexec.detail}")
    h_star, trainer_h = reexec.state_hash, d.trainer.state_hash
    if d.auditor is None:  # the auditor could not replay step i at all (module docstring)
        if h_star == trainer_h:
            return Finding("none", "not-upheld", i,
                           f"step {i}: the trainer's L_{i} is valid and re-executes to its "
                           f"h_{i} = {_short(trainer_h)}; the auditor, which could not replay "
                           f"the step, filed no h_{i} to weigh: nobody is provably at fault")
        return Finding("trainer", "wrong-state", i,
                       f"step {i}: the trainer's own valid L_{i} re-executes to h_{i}* = "
                       f"{_short(h_star)}, not to its signed h_{i} = {_short(trainer_h)}")
    auditor_h = d.auditor.state_hash
    if h_star == trainer_h:
        return Finding("auditor", "false-challenge", i,
                       f"step {i}: re-executed h_{i}* = {_short(h_star)} equals the trainer's "
                       f"h_{i}; the auditor's challenge (its h_{i} = {_short(auditor_h)}) is "
                       f"false")
    if h_star == auditor_h:
        return Finding("trainer", "wrong-state", i,
                       f"step {i}: re-executed h_{i}* = {_short(h_star)} equals the auditor's "
                       f"h_{i}, not the trainer's h_{i} = {_short(trainer_h)}")
    return Finding("none", "inconclusive", i,
                   f"step {i}: re-executed h_{i}* = {_short(h_star)} equals neither the "
                   f"trainer's h_{i} = {_short(trainer_h)} nor the auditor's h_{i} = "
                   f"{_short(auditor_h)}")


# ============================================================================================
# The signed record
# ============================================================================================

@dataclass(frozen=True)
class Verdict:
    """The arbiter's signed verdict (SPEC §5.4).

    `spec` and `transcript` are canonical bytes (JobSpec.to_bytes, game.transcript_bytes);
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
        if type(self.protocol_version) is not int or self.protocol_version != PROTOCOL_VERSION:
            raise EncodingError(f"not a protocol {PROTOCOL_VERSION} verdict")
        _bytes("verdict job_id", self.job_id, 32)
        for name in ("spec", "transcript"):
            if type(getattr(self, name)) is not bytes or not getattr(self, name):
                raise EncodingError(f"verdict {name} must be non-empty bytes")
        if type(self.fault) is not str or self.fault not in VERDICT_FAULTS:
            raise EncodingError(f"verdict fault must be one of {', '.join(VERDICT_FAULTS)}")
        if type(self.finding) is not str or self.finding not in FINDINGS:
            raise EncodingError(f"verdict finding {self.finding!r} is not a known finding")
        if self.step is not None:
            _uint("verdict step", self.step)
        if type(self.reason) is not str or len(self.reason) > MAX_REASON_CHARS:
            raise EncodingError(f"verdict reason must be a string of at most "
                                f"{MAX_REASON_CHARS} characters")
        if self.reexecution is not None and not isinstance(self.reexecution, Reexecution):
            raise EncodingError("verdict reexecution must be a re-execution record or none")
        _uint("verdict rounds", self.rounds)
        object.__setattr__(self, "timings", _metrics("timings", self.timings, float))
        object.__setattr__(self, "bytes_moved", _metrics("bytes_moved", self.bytes_moved, int))
        _bytes("verdict arbiter_key", self.arbiter_key, 32)
        _uint("verdict time", self.time)
        _bytes("verdict signature", self.signature, 64)

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
        the verdict's fields, each of the right shape. Raises EncodingError. Checks neither the
        signature nor the decision (`verify_verdict` does)."""
        body = decode(data, max_bytes=MAX_VERDICT_BYTES)
        if not isinstance(body, dict) or set(body) != set(_FIELDS):
            raise EncodingError(f"a verdict is a map with the fields {', '.join(sorted(_FIELDS))}")
        fields = dict(body)
        if fields["reexecution"] is not None:
            fields["reexecution"] = Reexecution.from_body(fields["reexecution"])
        verdict = cls(**fields)
        if verdict.to_bytes() != bytes(data):
            raise EncodingError("the verdict does not re-encode to its own bytes")
        return verdict


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
                           f"not the expected {_hex(arbiter_key)}")
    _, game = _replayed(verdict)
    try:
        expected = decide(game, verdict.reexecution)
    except (ValueError, TypeError) as err:
        raise VerdictError(f"the verdict's re-execution does not fit the transcript: {err}") \
            from None
    signed = Finding(verdict.fault, verdict.finding, verdict.step, verdict.reason)
    if signed != expected:
        raise VerdictError(f"the decision does not follow from the transcript: the verdict says "
                           f"{_describe(signed)}, the transcript and re-execution give "
                           f"{_describe(expected)}")
    asked = rounds(game)
    if verdict.rounds != asked:
        raise VerdictError(f"the verdict counts {verdict.rounds} rounds, the transcript shows "
                           f"{asked}")
    reexec, d = verdict.reexecution, dispute(game)
    if reexec is not None and reexec.finding in ("computed", "invalid-log"):
        # SPEC §5.3: h_i* counts only if computed from S_{i-1} with the agreed h_{i-1} and the
        # trainer's L_i with its committed ℓ_i.
        if reexec.prev_state_hash != d.agreed.state_hash:
            raise VerdictError(f"the re-execution of step {d.step} started from a state hashing "
                               f"to {_hex(reexec.prev_state_hash)}, not the agreed "
                               f"h_{d.step - 1} = {d.agreed.state_hash.hex()}")
        if reexec.log_digest != d.trainer.log_hash:
            raise VerdictError(f"the re-execution of step {d.step} used a log hashing to "
                               f"{_hex(reexec.log_digest)}, not the trainer's ℓ_{d.step} = "
                               f"{d.trainer.log_hash.hex()}")
    return verdict


def _replayed(verdict: Verdict) -> tuple[JobSpec, GameState]:
    """The verdict's job spec and its game re-derived from the transcript alone."""
    try:
        spec = JobSpec.from_bytes(verdict.spec)
    except (OvtError, KeyError, TypeError, ValueError) as err:
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
        what = {"computed": f"h_{r.step}* = {_hex(r.state_hash)}",
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


# ============================================================================================
# Evidence for an offline re-check of h_i* (SPEC §5.3)
# ============================================================================================

STATE_FILE = "prev_state.safetensors"
EXAMPLES_FILE = "examples.ovtx"
LOG_FILE = "log.ovtl"
EXAMPLES_KIND = "ovt-evidence-examples"
MAX_EXAMPLES_BYTES = 256 * 2**20
MAX_EVIDENCE_FILE_BYTES = 4 * 2**30
_MAX_PROOF_LEN = 64


def save_evidence(directory: str | Path, prev_state: dict[str, torch.Tensor],
                  examples: list[ProvenExample], log: bytes) -> None:
    """Write the re-execution's evidence so anyone can re-run step i offline: S_{i-1} as
    safetensors, B_i's examples (index, canonical state encoding, proof) as canonical bytes,
    and L_i's bytes. Nothing is pickled (SPEC §4). Files are written atomically."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().cpu().contiguous().clone() for name, t in prev_state.items()}
    atomic_write(directory / STATE_FILE, safetensors.torch.save(tensors))
    items = [{"index": int(e.index), "example": encode_state(e.example),
              "proof": [bytes(p) for p in e.proof]} for e in examples]
    atomic_write(directory / EXAMPLES_FILE, encode({"kind": EXAMPLES_KIND, "examples": items}))
    atomic_write(directory / LOG_FILE, bytes(log))


def load_evidence(directory: str | Path) -> tuple[dict[str, torch.Tensor], list[ProvenExample],
                                                  bytes]:
    """Read what `save_evidence` wrote: (S_{i-1}, B_i's proven examples, L_i bytes).

    Strict and pickle-free: safetensors for the state, the canonical encoding (exact fields,
    32-byte proof hashes, canonical example encodings) for the examples. Raises VerdictError
    for a missing, oversized or malformed file. Does not check the evidence against a dispute:
    `reexecute` does.
    """
    directory = Path(directory)
    raw = _read(directory / STATE_FILE)
    try:
        prev_state = safetensors.torch.load(raw)
    except Exception as err:  # untrusted bytes: any parser failure is a bad file
        raise VerdictError(f"{directory / STATE_FILE} is not a safetensors state: {err}") \
            from None
    try:
        body = decode(_read(directory / EXAMPLES_FILE, MAX_EXAMPLES_BYTES),
                      max_bytes=MAX_EXAMPLES_BYTES)
    except EncodingError as err:
        raise VerdictError(f"{directory / EXAMPLES_FILE} does not parse: {err}") from None
    examples = _examples_from_body(body, directory / EXAMPLES_FILE)
    return prev_state, examples, _read(directory / LOG_FILE)


def _examples_from_body(body: object, path: Path) -> list[ProvenExample]:
    if not isinstance(body, dict) or set(body) != {"kind", "examples"} \
            or body["kind"] != EXAMPLES_KIND or not isinstance(body["examples"], list):
        raise VerdictError(f"{path} is not an ovt evidence examples file")
    examples = []
    for k, item in enumerate(body["examples"]):
        if not isinstance(item, dict) or set(item) != {"index", "example", "proof"}:
            raise VerdictError(f"{path}: example {k} must have the fields example, index, proof")
        index, data, proof = item["index"], item["example"], item["proof"]
        if type(index) is not int or not 0 <= index <= _MAX_UINT:
            raise VerdictError(f"{path}: example {k} has a bad index")
        if type(data) is not bytes:
            raise VerdictError(f"{path}: example {k} must be encoded bytes")
        if type(proof) is not list or len(proof) > _MAX_PROOF_LEN or \
                not all(type(p) is bytes and len(p) == 32 for p in proof):
            raise VerdictError(f"{path}: example {k} has a malformed proof")
        try:
            example = decode_state(data)
        except StateFormatError as err:
            raise VerdictError(f"{path}: example {k} does not decode: {err}") from None
        examples.append(ProvenExample(index, example, list(proof)))
    return examples


def _read(path: Path, limit: int = MAX_EVIDENCE_FILE_BYTES) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as err:
        raise VerdictError(f"cannot read evidence file {path}: {err.strerror or err}") from None
    if len(data) > limit:
        raise VerdictError(f"evidence file {path} is over {limit} bytes")
    return data


def recheck_evidence(verdict: Verdict | bytes, directory: str | Path, *,
                     profile: Profile) -> Reexecution:
    """Re-run the verdict's re-execution from saved evidence on `profile` (SPEC §5.3) and
    require the same finding and h_i*: the one part of a verdict a transcript replay cannot
    re-derive. Verdict bytes are verified first (`verify_verdict`); a Verdict object is taken
    as already verified, but its dispute is still re-derived from its transcript.

    Returns the new re-execution. Raises VerdictError when the verdict re-executed nothing
    (no disputed step, or withheld evidence), the evidence does not match the dispute, or the
    finding or h_i* differs.
    """
    if not isinstance(verdict, Verdict):
        verdict = verify_verdict(verdict)
    signed = verdict.reexecution
    if signed is None:
        raise VerdictError(f"the verdict ({verdict.finding}) re-executed no step: there is no "
                           f"evidence to re-check")
    if signed.finding not in ("computed", "invalid-log"):
        raise VerdictError(f"the verdict's re-execution of step {signed.step} is "
                           f"{signed.finding!r}: there is no evidence to re-check")
    spec, game = _replayed(verdict)
    d = dispute(game)
    if d is None or d.step != signed.step:
        raise VerdictError(f"the verdict's transcript does not dispute step {signed.step}")
    prev_state, examples, log = load_evidence(directory)
    again = reexecute(spec, d, prev_state, examples, log, profile=profile)
    if again.finding == "bad-evidence":
        raise VerdictError(f"the evidence in {directory} is not the evidence of step {d.step}: "
                           f"{again.detail}")
    if (again.finding, again.state_hash) != (signed.finding, signed.state_hash):
        raise VerdictError(
            f"re-executing step {d.step} on {profile.name} gives {again.finding} "
            f"{_hex(again.state_hash)}, the verdict says {signed.finding} "
            f"{_hex(signed.state_hash)}")
    return again


# ============================================================================================
# Helpers
# ============================================================================================

def _short(digest: bytes) -> str:
    return digest.hex()[:16] + "…"


def _hex(value: object) -> str:
    return value.hex() if isinstance(value, bytes) else repr(value)


def _describe(f: Finding) -> str:
    return f"{f.fault} at fault, {f.finding} at step {f.step} ({f.reason!r})"


def _bytes(name: str, value: object, size: int) -> None:
    if type(value) is not bytes or len(value) != size:
        raise EncodingError(f"{name} must be {size} bytes")


def _uint(name: str, value: object) -> None:
    if type(value) is not int or not 0 <= value <= _MAX_UINT:
        raise EncodingError(f"{name} must be an integer in [0, 2**63 - 1], got {value!r}")


def _metrics(name: str, value: object, kind: type) -> dict:
    """A small map of named measurements: str keys, finite non-negative `kind` values."""
    if type(value) is not dict or len(value) > MAX_METRICS:
        raise EncodingError(f"verdict {name} must be a map of at most {MAX_METRICS} entries")
    for key, item in value.items():
        if type(key) is not str or not 1 <= len(key) <= MAX_METRIC_NAME:
            raise EncodingError(f"verdict {name} keys must be names of 1..{MAX_METRIC_NAME} "
                                f"characters")
        if type(item) is not kind or not math.isfinite(item) or item < 0 \
                or (kind is int and item > _MAX_UINT):
            raise EncodingError(f"verdict {name}[{key!r}] must be a non-negative finite "
                                f"{kind.__name__}, got {item!r}")
    return dict(value)
