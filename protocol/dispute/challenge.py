"""The challenge an auditor files when its replay disagrees with the trainer (SPEC §5.1).

A challenge names the first step j whose leaf differs and carries what an arbiter needs to start
bisecting without trusting the auditor: the trainer's signed commitment with the trainer's leaf j
and its inclusion proof, and the auditor's signed commitment with the auditor's own leaf j and
its inclusion proof; and both parties' leaf 0 with proofs, so the arbiter checks leaf 0 against
the job's h_0 (SPEC §5.2) at the start instead of spending a round on it. Each leaf binds its
party, whoever delivers it: it verifies only under that party's signed root. The auditor's leaf
j is absent when it could not replay step j at all (the trainer's log for it was invalid or did
not match the trainer's leaf); its commitment then ends at step j - 1. `Challenge.verify` checks
all of it by the bisection game's own rule (`game.start`: one rule, in one place); the bytes
are canonical (`protocol.codec.canonical`) and `from_bytes` is strict, so a
challenge file is checked the same way wherever it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.codec.canonical import PROTOCOL_VERSION, decode_object, encode
from protocol.codec.fields import require_bytes, require_fields, require_version
from protocol.commit.commitments import Claim, SignedCommitment
from protocol.commit.hashing import HASH_SIZE
from protocol.dispute.game import start
from protocol.errors import EncodingError, ProofError, SignatureError
from protocol.job.spec import JobSpec

_FIELDS = ("protocol_version", "job_id", "step", "reason", "trainer_commitment", "trainer_leaf",
           "auditor_commitment", "auditor_leaf", "trainer_leaf0", "auditor_leaf0")
_MAX_BYTES = 16 * 1024
_MAX_REASON = 2000


@dataclass(frozen=True)
class Challenge:
    """SPEC §5.1: step `step` is where the auditor's leaf first differs from the trainer's.

    Raises EncodingError on construction if a field has the wrong shape.
    """

    job_id: bytes
    step: int
    reason: str
    trainer_commitment: SignedCommitment
    trainer_leaf: Claim
    auditor_commitment: SignedCommitment
    auditor_leaf: Claim | None
    trainer_leaf0: Claim
    auditor_leaf0: Claim

    def __post_init__(self) -> None:
        require_bytes("challenge job_id", self.job_id, HASH_SIZE)
        if type(self.step) is not int or self.step < 0:
            raise EncodingError(f"challenge step must be a non-negative integer, got "
                                f"{self.step!r}")
        if not isinstance(self.reason, str) or len(self.reason) > _MAX_REASON:
            raise EncodingError(f"challenge reason must be a string of at most {_MAX_REASON} "
                                f"characters")
        for name in ("trainer_commitment", "auditor_commitment"):
            if not isinstance(getattr(self, name), SignedCommitment):
                raise EncodingError(f"challenge {name} must be a signed commitment")
        if not all(isinstance(c, Claim) for c in (self.trainer_leaf, self.trainer_leaf0,
                                                   self.auditor_leaf0)) or not (
                self.auditor_leaf is None or isinstance(self.auditor_leaf, Claim)):
            raise EncodingError("challenge leaves must be claims")

    def to_bytes(self) -> bytes:
        return encode({
            "protocol_version": PROTOCOL_VERSION, "job_id": self.job_id, "step": self.step,
            "reason": self.reason, "trainer_commitment": self.trainer_commitment.to_bytes(),
            "trainer_leaf": self.trainer_leaf.to_body(),
            "auditor_commitment": self.auditor_commitment.to_bytes(),
            "auditor_leaf": None if self.auditor_leaf is None else self.auditor_leaf.to_body(),
            "trainer_leaf0": self.trainer_leaf0.to_body(),
            "auditor_leaf0": self.auditor_leaf0.to_body(),
        })

    @classmethod
    def from_bytes(cls, data: bytes) -> Challenge:
        """Parse untrusted bytes: canonical, exactly the challenge's fields, and re-encoding to
        exactly `data` (SPEC §2, `decode_object`), so protocol_version `True` or a step `1.0`
        is refused. Raises EncodingError; does not `verify`."""
        return decode_object(data, cls._from_body, cls.to_bytes, what="challenge",
                             max_bytes=_MAX_BYTES)

    @classmethod
    def _from_body(cls, body: object) -> Challenge:
        body = require_fields("challenge", body, _FIELDS)
        require_version("challenge", body["protocol_version"])
        for name in ("trainer_commitment", "auditor_commitment"):
            if type(body[name]) is not bytes:
                raise EncodingError(f"challenge {name} must be bytes")
        auditor_leaf = body["auditor_leaf"]
        return cls(body["job_id"], body["step"], body["reason"],
                   SignedCommitment.from_bytes(body["trainer_commitment"]),
                   Claim.from_body(body["trainer_leaf"]),
                   SignedCommitment.from_bytes(body["auditor_commitment"]),
                   None if auditor_leaf is None else Claim.from_body(auditor_leaf),
                   Claim.from_body(body["trainer_leaf0"]), Claim.from_body(body["auditor_leaf0"]))

    def verify(self, spec: JobSpec) -> None:
        """Check this challenge against job `spec` by the game's own rule: the checks (a) and
        (b) of `protocol.dispute.game.start` (SPEC §5.1, §5.2), with each commitment's own key
        taken as its party's registered key. There is no second rule: what passes here is what
        an arbiter's game accepts (1 <= j <= n, both commitments, every leaf under its party's
        root, differing leaves j). Whether the leaves 0 are the job's h_0 is a finding for the
        arbiter, not a malformed challenge, and is not checked.

        Raises ProofError for a challenge of another job or one the game rules a bad challenge,
        SignatureError for one whose commitments the game refuses.
        """
        if self.job_id != spec.job_id:
            raise ProofError(f"the challenge is for job {self.job_id.hex()}, not "
                             f"{spec.job_id.hex()}")
        state = start(spec, self.trainer_commitment, self.auditor_commitment, self.step,
                      trainer_key=self.trainer_commitment.commitment.public_key,
                      auditor_key=self.auditor_commitment.commitment.public_key,
                      trainer_leaf=self.trainer_leaf, auditor_leaf=self.auditor_leaf,
                      trainer_leaf0=self.trainer_leaf0, auditor_leaf0=self.auditor_leaf0,
                      now=0.0, deadline_s=1.0)
        outcome = state.outcome
        if outcome is not None and outcome.kind == "bad-commitment":
            raise SignatureError(outcome.reason)
        if outcome is not None and outcome.kind == "bad-challenge":
            raise ProofError(outcome.reason)
