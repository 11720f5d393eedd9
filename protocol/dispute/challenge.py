"""The challenge an auditor files when its replay disagrees with the trainer (SPEC §5.1).

A challenge names the first step j whose leaf differs and carries what an arbiter needs to start
bisecting without trusting the auditor: the trainer's signed commitment with the trainer's leaf j
and its inclusion proof, and the auditor's signed commitment with the auditor's own leaf j and
its inclusion proof; and both parties' leaf 0 with proofs, so the arbiter checks leaf 0 against
the job's h_0 (SPEC §5.2) at the start instead of spending a round on it. Each leaf binds its
party, whoever delivers it: it verifies only under that party's signed root. The auditor's leaf
j is absent when it could not replay step j at all (the trainer's log for it was invalid or did
not match the trainer's leaf); its commitment then ends at step j - 1. `Challenge.verify` checks
all of it; the bytes are canonical (`protocol.codec.canonical`) and `from_bytes` is strict, so a
challenge file is checked the same way wherever it is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.codec.canonical import PROTOCOL_VERSION, decode, encode
from protocol.commit.commitments import Claim, SignedCommitment
from protocol.errors import EncodingError, ProofError

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
        if not isinstance(self.job_id, bytes) or len(self.job_id) != 32:
            raise EncodingError("challenge job_id must be 32 bytes")
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
        """Parse untrusted bytes (canonical only). Raises EncodingError; does not `verify`."""
        body = decode(data, max_bytes=_MAX_BYTES)
        if not isinstance(body, dict) or set(body) != set(_FIELDS):
            raise EncodingError(f"a challenge is a map with the fields {', '.join(_FIELDS)}")
        if body["protocol_version"] != PROTOCOL_VERSION:
            raise EncodingError(f"challenge has protocol version {body['protocol_version']!r}, "
                                f"this ovt speaks {PROTOCOL_VERSION}")
        for name in ("trainer_commitment", "auditor_commitment"):
            if not isinstance(body[name], bytes):
                raise EncodingError(f"challenge {name} must be bytes")
        auditor_leaf = body["auditor_leaf"]
        return cls(body["job_id"], body["step"], body["reason"],
                   SignedCommitment.from_bytes(body["trainer_commitment"]),
                   Claim.from_body(body["trainer_leaf"]),
                   SignedCommitment.from_bytes(body["auditor_commitment"]),
                   None if auditor_leaf is None else Claim.from_body(auditor_leaf),
                   Claim.from_body(body["trainer_leaf0"]), Claim.from_body(body["auditor_leaf0"]))

    def verify(self) -> None:
        """Check both commitments (signatures, this job, the right roles), every leaf against
        its party's signed root, and that the leaves j really differ. (Whether the leaves 0 are
        the job's h_0 is for the arbiter to judge: it is a finding, not a malformed challenge.)

        Raises SignatureError for a bad or misbound signature, ProofError (RootMismatchError)
        for a leaf that is not at `step` under its party's root or leaves that agree.
        """
        self.trainer_commitment.verify(job_id=self.job_id, role="trainer")
        self.auditor_commitment.verify(job_id=self.job_id, role="auditor")
        _require_step(self.trainer_leaf, self.step, "trainer")
        self.trainer_leaf.verify(self.trainer_commitment)
        for party, leaf0, signed in (("trainer", self.trainer_leaf0, self.trainer_commitment),
                                     ("auditor", self.auditor_leaf0, self.auditor_commitment)):
            _require_step(leaf0, 0, party)
            leaf0.verify(signed)
        if self.auditor_leaf is None:
            if self.auditor_commitment.commitment.n + 1 != self.step:
                raise ProofError(f"a challenge without the auditor's leaf {self.step} needs the "
                                 f"auditor's commitment to end at step {self.step - 1}, not "
                                 f"{self.auditor_commitment.commitment.n}")
            return
        _require_step(self.auditor_leaf, self.step, "auditor")
        self.auditor_leaf.verify(self.auditor_commitment)
        if self.auditor_leaf.state_hash == self.trainer_leaf.state_hash:
            raise ProofError(f"the challenged leaves {self.step} agree on the state hash")


def _require_step(claim: Claim, step: int, party: str) -> None:
    if claim.step != step:
        raise ProofError(f"the {party}'s leaf is for step {claim.step}, expected step {step}")
