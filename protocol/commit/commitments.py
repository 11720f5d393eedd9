"""Commitments and claims, signed by a party (SPEC §2 "Commitment", "Claim", §5.1, §6).

A `Commitment` binds a party's root over leaves 0..n to a job, a role and a key; its
`SignedCommitment.verify` also checks that the job, the role (and n) are the ones expected, so a
signature replayed from another job or presented for the other role is rejected. A `Claim` is one
leaf with its inclusion proof; `Claim.verify` checks it against a signed root.

    >>> key = KeyPair.generate()
    >>> c = Commitment(bytes(32), 3, bytes(32), bytes(32), key.public_key, "trainer", 0)
    >>> signed = SignedCommitment.from_bytes(sign_commitment(c, key).to_bytes())
    >>> signed.verify(job_id=bytes(32), role="trainer", n=3)
    >>> signed.verify(job_id=bytes(32), role="auditor")
    Traceback (most recent call last):
    ...
    protocol.errors.SignatureError: commitment role is 'trainer', expected 'auditor'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protocol.codec.canonical import decode_object, encode
from protocol.codec.fields import (
    MAX_UINT,
    describe,
    hex_or_repr,
    require_bytes,
    require_fields,
    require_uint,
)
from protocol.commit.hashing import HASH_SIZE
from protocol.commit.keys import (
    PUBLIC_KEY_SIZE,
    SIGNATURE_SIZE,
    KeyPair,
    sign_object,
    verify_object,
)
from protocol.commit.leaf import Leaf, leaf_hash_of
from protocol.commit.merkle import MAX_PROOF_LEN, verify_inclusion
from protocol.errors import ConfigError, EncodingError, ProofError, SignatureError

KIND_COMMITMENT = "commitment"
KIND_CLAIM = "claim"
ROLES = ("trainer", "auditor")
_MAX_SIGNED_COMMITMENT_BYTES = 1024
_MAX_CLAIM_BYTES = 256 + MAX_PROOF_LEN * (HASH_SIZE + 2)


_COMMITMENT_FIELDS = ("job_id", "n", "root", "h_n", "public_key", "role", "time")


@dataclass(frozen=True)
class Commitment:
    """A party's commitment to its leaves 0..n (SPEC §2 "Commitment").

    job_id, root, h_n: 32-byte hashes; n: number of steps (the tree has n + 1 leaves);
    public_key: the party's raw 32-byte Ed25519 key; role: "trainer" or "auditor";
    time: unix seconds. Raises EncodingError on construction if a field has the wrong shape.
    """

    job_id: bytes
    n: int
    root: bytes
    h_n: bytes
    public_key: bytes
    role: str
    time: int

    def __post_init__(self) -> None:
        require_bytes("commitment job_id", self.job_id, HASH_SIZE)
        require_uint("commitment n", self.n, maximum=MAX_UINT - 1)  # n + 1 leaves fit too
        require_bytes("commitment root", self.root, HASH_SIZE)
        require_bytes("commitment h_n", self.h_n, HASH_SIZE)
        require_bytes("commitment public_key", self.public_key, PUBLIC_KEY_SIZE)
        if type(self.role) is not str or self.role not in ROLES:
            raise EncodingError(f"commitment role must be one of {ROLES}, got {self.role!r}")
        require_uint("commitment time", self.time)

    def to_body(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _COMMITMENT_FIELDS}

    @classmethod
    def from_body(cls, body: object) -> Commitment:
        """Build from a decoded map with exactly the commitment's fields. Raises EncodingError."""
        body = require_fields("commitment", body, _COMMITMENT_FIELDS)
        return cls(**body)


@dataclass(frozen=True)
class SignedCommitment:
    """A Commitment and its party's signature over it (kind "commitment").

    Construction checks shapes only; `verify` checks the signature and the binding.
    """

    commitment: Commitment
    signature: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.commitment, Commitment):
            raise EncodingError("signed commitment must hold a Commitment")
        require_bytes("commitment signature", self.signature, SIGNATURE_SIZE)

    def to_bytes(self) -> bytes:
        return encode({"commitment": self.commitment.to_body(), "signature": self.signature})

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedCommitment:
        """Parse untrusted bytes: canonical, and re-encoding to exactly `data` (SPEC §2,
        `decode_object`). Raises EncodingError.

        Does not check the signature: call `verify`.
        """
        return decode_object(data, cls._from_body, cls.to_bytes, what="signed commitment",
                             max_bytes=_MAX_SIGNED_COMMITMENT_BYTES)

    @classmethod
    def _from_body(cls, body: object) -> SignedCommitment:
        obj = require_fields("signed commitment", body, ("commitment", "signature"))
        return cls(Commitment.from_body(obj["commitment"]), obj["signature"])

    def verify_signature(self) -> None:
        """Raises SignatureError unless the signature is the commitment's own key's over it."""
        verify_object(KIND_COMMITMENT, self.commitment.to_body(), self.commitment.public_key,
                      self.signature)

    def verify(self, *, job_id: bytes, role: str, n: int | None = None,
               public_key: bytes | None = None) -> None:
        """Check the signature, then that the commitment is for the expected job and role (and
        n, and signer key, when given).

        Raises SignatureError naming the first field that differs (a signature replayed from
        another job or role, or made by another key than the one expected).
        """
        if role not in ROLES:
            raise ConfigError(f"expected role must be one of {ROLES}, got {role!r}")
        self.verify_signature()
        c = self.commitment
        if c.job_id != job_id:
            raise SignatureError(f"commitment is for job {c.job_id.hex()}, expected job "
                                 f"{hex_or_repr(job_id)}")
        if c.role != role:
            raise SignatureError(f"commitment role is {c.role!r}, expected {role!r}")
        if n is not None and c.n != n:
            raise SignatureError(f"commitment is over n = {c.n} steps, expected n = {n}")
        if public_key is not None and c.public_key != public_key:
            raise SignatureError(f"commitment is signed by key {c.public_key.hex()}, expected "
                                 f"key {hex_or_repr(public_key)}")



def sign_commitment(commitment: Commitment, key: KeyPair) -> SignedCommitment:
    """Sign `commitment` with `key`. Raises ConfigError if the commitment names another key."""
    if commitment.public_key != key.public_key:
        raise ConfigError(f"commitment names public key {commitment.public_key.hex()}, but the "
                          f"signing key's is {key.public_key.hex()}")
    return SignedCommitment(commitment, sign_object(KIND_COMMITMENT, commitment.to_body(), key))


_CLAIM_FIELDS = ("job_id", "step", "state_hash", "log_hash", "proof", "size")


@dataclass(frozen=True)
class Claim:
    """Leaf `step` (h_t = state_hash, ℓ_t = log_hash) with its inclusion proof in a tree of
    `size` = n + 1 leaves (SPEC §2 "Claim"). `proof` is stored as a tuple of 32-byte hashes.

    Raises EncodingError on construction if a field has the wrong shape or step >= size.
    """

    job_id: bytes
    step: int
    state_hash: bytes
    log_hash: bytes
    proof: tuple[bytes, ...]
    size: int

    def __post_init__(self) -> None:
        require_bytes("claim job_id", self.job_id, HASH_SIZE)
        require_uint("claim step", self.step)
        require_bytes("claim state_hash", self.state_hash, HASH_SIZE)
        require_bytes("claim log_hash", self.log_hash, HASH_SIZE)
        require_uint("claim size", self.size, minimum=1)
        if self.step >= self.size:
            raise EncodingError(f"claim step {self.step} is outside a tree of {self.size} leaves")
        if not isinstance(self.proof, Sequence) or isinstance(self.proof, bytes | str):
            raise EncodingError(f"claim proof must be a list of hashes, got "
                                f"{describe(self.proof)}")
        if len(self.proof) > MAX_PROOF_LEN:
            raise EncodingError(f"claim proof has {len(self.proof)} hashes, at most "
                                f"{MAX_PROOF_LEN} allowed")
        for i, node in enumerate(self.proof):
            require_bytes(f"claim proof[{i}]", node, HASH_SIZE)
        object.__setattr__(self, "proof", tuple(self.proof))

    @property
    def leaf(self) -> Leaf:
        """The leaf this claim is about (not yet verified: call `verify`)."""
        return Leaf(self.step, self.state_hash, self.log_hash)

    def leaf_hash(self) -> bytes:
        return leaf_hash_of(self.step, self.state_hash, self.log_hash)

    def to_body(self) -> dict[str, Any]:
        body = {name: getattr(self, name) for name in _CLAIM_FIELDS}
        body["proof"] = list(self.proof)
        return body

    @classmethod
    def from_body(cls, body: object) -> Claim:
        """Build from a decoded map with exactly the claim's fields. Raises EncodingError."""
        body = require_fields("claim", body, _CLAIM_FIELDS)
        if not isinstance(body["proof"], list):
            raise EncodingError(f"claim proof must be a list, got {describe(body['proof'])}")
        return cls(**body)

    def to_bytes(self) -> bytes:
        return encode(self.to_body())

    @classmethod
    def from_bytes(cls, data: bytes) -> Claim:
        """Parse untrusted bytes: canonical, and re-encoding to exactly `data` (SPEC §2,
        `decode_object`). Raises EncodingError."""
        return decode_object(data, cls.from_body, cls.to_bytes, what="claim",
                             max_bytes=_MAX_CLAIM_BYTES)

    def verify(self, signed: SignedCommitment) -> None:
        """Check this leaf against the signed root of `signed`.

        Checks the commitment's signature (not whether it is the expected party's: call
        `signed.verify` for that), that it is for this claim's job and has n + 1 == size leaves,
        then the inclusion proof. Raises SignatureError for a bad signature, ProofError for a
        claim about another job or tree size or a malformed proof, and RootMismatchError (a
        ProofError) for a proof that leads to another root.
        """
        signed.verify_signature()
        c = signed.commitment
        if self.job_id != c.job_id:
            raise ProofError(f"claim is for job {self.job_id.hex()}, but the commitment is for "
                             f"job {c.job_id.hex()}")
        if self.size != c.n + 1:
            raise ProofError(f"claim is for a tree of {self.size} leaves, but the commitment "
                             f"is over n + 1 = {c.n + 1} leaves")
        verify_inclusion(self.leaf_hash(), self.step, self.size, self.proof, c.root)
