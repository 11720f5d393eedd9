"""The bisection game's transcript: canonical bytes and offline replay (SPEC §5.4).

A verdict signs `transcript_bytes(state)`: the job, both signed commitments, the registered keys
and every record of the game. `replay_transcript` re-derives the game from those bytes alone,
through the game's own transitions, and accepts a transcript only if every recorded decision and
the outcome are exactly the re-derived ones, so a verdict whose finding does not follow from its
moves is rejected whoever signed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.codec.canonical import PROTOCOL_VERSION, decode_object, encode
from protocol.codec.fields import describe, require_fields, require_version
from protocol.commit.commitments import Claim, SignedCommitment
from protocol.dispute.game import (
    MAX_ANSWER_BYTES,
    Answer,
    Decision,
    GameState,
    Outcome,
    Question,
    Record,
    Start,
    Timeout,
    ask,
    receive,
    start,
    timeout,
)
from protocol.errors import EncodingError, GameError, TranscriptError
from protocol.job.spec import JobSpec

TRANSCRIPT_KIND = "ovt-bisection-transcript"
MAX_TRANSCRIPT_BYTES = 4 * 2**20


@dataclass(frozen=True)
class Transcript:
    """A decoded transcript: the commitments and keys it was played under, and its records."""

    job_id: bytes
    trainer: SignedCommitment
    auditor: SignedCommitment
    trainer_key: bytes
    auditor_key: bytes
    records: tuple[Record, ...]


_RECORD_FIELDS: dict[str, tuple[type, dict[str, tuple[type, ...]]]] = {
    Start.TYPE: (Start, {"challenge_step": (int,), "at": (float,), "deadline_s": (float,),
                         "trainer_leaf": (bytes,), "auditor_leaf": (bytes, type(None)),
                         "trainer_leaf0": (bytes,), "auditor_leaf0": (bytes,)}),
    Question.TYPE: (Question, {"round": (int,), "step": (int,), "at": (float,)}),
    Answer.TYPE: (Answer, {"party": (str,), "step": (int,), "at": (float,), "data": (bytes,),
                           "length": (int,)}),
    Timeout.TYPE: (Timeout, {"at": (float,)}),
    Decision.TYPE: (Decision, {"step": (int,), "agreed": (bool,), "lo": (int,), "hi": (int,)}),
    Outcome.TYPE: (Outcome, {"fault": (str,), "kind": (str,), "step": (int, type(None)),
                             "reason": (str,)}),
}


def record_body(record: Record) -> dict[str, Any]:
    """A record as a map: its fields plus "type"."""
    _, fields = _RECORD_FIELDS[record.TYPE]
    return {"type": record.TYPE, **{name: getattr(record, name) for name in fields}}


def record_from_body(body: object) -> Record:
    """The record a map describes. Raises EncodingError for anything but a map with a known
    "type" and exactly that record's fields, each of its exact type (a step `True` or a time
    `1` is refused: SPEC §2)."""
    kind = body.get("type") if isinstance(body, dict) else None
    if type(kind) is not str or kind not in _RECORD_FIELDS:
        raise EncodingError("a transcript record is a map with a known \"type\"")
    cls, fields = _RECORD_FIELDS[kind]
    body = require_fields(f"a {kind} record", body, ("type", *fields))
    for name, types in fields.items():
        if type(body[name]) not in types:
            raise EncodingError(f"{kind} record field {name} has the wrong type")
    return cls(**{name: body[name] for name in fields})


def transcript_bytes(state: GameState) -> bytes:
    """The canonical bytes of the game so far: job, both signed commitments, the registered
    keys, and every record (the outcome last, once over). What a verdict signs."""
    if not isinstance(state, GameState):
        raise TypeError(f"state must be a GameState, not {type(state).__name__}")
    return encode_transcript(Transcript(state.job_id, state.trainer, state.auditor,
                                        state.trainer_key, state.auditor_key, state.transcript))


def encode_transcript(transcript: Transcript) -> bytes:
    """The canonical bytes of a transcript (the one encoding `decode_transcript` inverts)."""
    return encode({
        "kind": TRANSCRIPT_KIND, "protocol_version": PROTOCOL_VERSION,
        "job_id": transcript.job_id, "trainer_commitment": transcript.trainer.to_bytes(),
        "auditor_commitment": transcript.auditor.to_bytes(),
        "trainer_key": transcript.trainer_key, "auditor_key": transcript.auditor_key,
        "records": [record_body(r) for r in transcript.records],
    })


_TRANSCRIPT_FIELDS = ("kind", "protocol_version", "job_id", "trainer_commitment",
                      "auditor_commitment", "trainer_key", "auditor_key", "records")


def decode_transcript(data: bytes) -> Transcript:
    """Strictly parse transcript bytes: canonical, exactly the transcript's fields and
    records, and re-encoding to exactly `data` (SPEC §2, `decode_object`), so a
    protocol_version `True` or `1.0` is refused. Raises EncodingError; does not replay."""
    return decode_object(data, _transcript_from_body, encode_transcript, what="transcript",
                         max_bytes=MAX_TRANSCRIPT_BYTES)


def _transcript_from_body(body: object) -> Transcript:
    body = require_fields("a transcript", body, _TRANSCRIPT_FIELDS)
    if body["kind"] != TRANSCRIPT_KIND:
        raise EncodingError(f"not a bisection transcript (kind {describe(body['kind'])})")
    require_version("transcript", body["protocol_version"])
    for name in ("job_id", "trainer_commitment", "auditor_commitment", "trainer_key",
                 "auditor_key"):
        if type(body[name]) is not bytes:
            raise EncodingError(f"transcript field {name} must be bytes")
    if type(body["records"]) is not list:
        raise EncodingError("transcript records must be a list")
    return Transcript(body["job_id"], SignedCommitment.from_bytes(body["trainer_commitment"]),
                      SignedCommitment.from_bytes(body["auditor_commitment"]),
                      body["trainer_key"], body["auditor_key"],
                      tuple(record_from_body(r) for r in body["records"]))


def replay_transcript(spec: JobSpec, trainer: SignedCommitment, auditor: SignedCommitment, *,
                      trainer_key: bytes, auditor_key: bytes,
                      transcript: bytes | Transcript | Sequence[Record]) -> GameState:
    """Re-derive a game from its transcript alone: replay every move (start, questions,
    answers with their proof bytes, timeouts) through the same transitions, and require the
    recorded decisions and outcome to be exactly the re-derived ones.

    `transcript` is `transcript_bytes` output (whose embedded job, commitments and keys must be
    the ones given), a decoded `Transcript`, or a sequence of records. Returns the re-derived
    state (its `outcome` is the game's). Raises TranscriptError if the transcript does not
    replay to itself, EncodingError if its bytes do not parse.
    """
    if isinstance(transcript, bytes | bytearray | memoryview):
        transcript = decode_transcript(bytes(transcript))
    if isinstance(transcript, Transcript):
        given = (spec.job_id, trainer.to_bytes(), auditor.to_bytes(), trainer_key, auditor_key)
        held = (transcript.job_id, transcript.trainer.to_bytes(), transcript.auditor.to_bytes(),
                transcript.trainer_key, transcript.auditor_key)
        if given != held:
            raise TranscriptError("the transcript was played under another job, commitment or "
                                  "key than the ones given")
        records = transcript.records
    else:
        records = tuple(transcript)
    if not records or not isinstance(records[0], Start):
        raise TranscriptError("a transcript starts with a start record")
    first = records[0]
    try:
        leaves = [None if b is None else Claim.from_bytes(b)
                  for b in (first.trainer_leaf, first.auditor_leaf, first.trainer_leaf0,
                            first.auditor_leaf0)]
    except EncodingError as err:
        raise TranscriptError(f"the start record's challenged leaves do not parse: {err}") \
            from None
    if leaves[0] is None:
        raise TranscriptError("the start record has no trainer leaf")
    if leaves[2] is None or leaves[3] is None:
        raise TranscriptError("the start record lacks a party's leaf-0 claim")
    try:
        state = start(spec, trainer, auditor, first.challenge_step, trainer_key=trainer_key,
                      auditor_key=auditor_key, trainer_leaf=leaves[0], auditor_leaf=leaves[1],
                      trainer_leaf0=leaves[2], auditor_leaf0=leaves[3], now=first.at,
                      deadline_s=first.deadline_s)
        for i, record in enumerate(records[1:], 1):
            if isinstance(record, Question):
                state, _ = ask(state, record.at)
            elif isinstance(record, Answer):
                kept = record.length if record.length <= MAX_ANSWER_BYTES else 0
                if len(record.data) != kept:
                    raise TranscriptError(f"record {i}: answer data does not match its length")
                state = receive(state, record.party, record.data, record.length, record.at)
            elif isinstance(record, Timeout):
                state = timeout(state, record.at)
            elif not isinstance(record, Decision | Outcome):
                raise TranscriptError(f"record {i} is not a transcript record")
    except (GameError, TypeError, ValueError) as err:
        if isinstance(err, TranscriptError):
            raise
        raise TranscriptError(f"the transcript does not replay: {err}") from None
    if state.transcript != records:
        at = next((k for k, (x, y) in enumerate(zip(state.transcript, records, strict=False))
                   if x != y), min(len(state.transcript), len(records)))
        raise TranscriptError(f"the transcript's record {at} differs from the re-derived game")
    return state
