"""Ed25519 keys, domain-separated signatures, commitments and claims (SPEC §2, §5.1, §6).

Every signature covers `signing_message(kind, body)`:

    b"ovt-signature-v1\\x00" + encode({"kind": kind, "protocol_version": 1, "body": body})

so a signature made over one kind of object (or under another protocol version) never verifies
as another. A `Commitment` binds a party's root over leaves 0..n to a job, a role and a key; its
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

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.codec.canonical import decode, encode
from protocol.commit.merkle import leaf_hash, verify_inclusion
from protocol.errors import ConfigError, EncodingError, ProofError, SignatureError

PROTOCOL_VERSION = 1
SIGNATURE_DOMAIN = b"ovt-signature-v1\x00"
KIND_COMMITMENT = "commitment"
KIND_CLAIM = "claim"
ROLES = ("trainer", "auditor")

HASH_SIZE = 32
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
MAX_PROOF_LEN = 64  # a tree of at most 2**63 leaves has proofs of at most 63 hashes
_MAX_UINT = 2**63 - 1
_MAX_KEY_FILE_BYTES = 64 * 1024
_MAX_SIGNED_COMMITMENT_BYTES = 1024
_MAX_CLAIM_BYTES = 256 + MAX_PROOF_LEN * (HASH_SIZE + 2)


# --- keys -------------------------------------------------------------------------------------

class KeyPair:
    """An Ed25519 signing key. `repr` shows only the public key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self._public = private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                             serialization.PublicFormat.Raw)

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self._public

    @classmethod
    def generate(cls) -> KeyPair:
        return cls(Ed25519PrivateKey.generate())

    def sign(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of `message` (raw: no domain prefix is added)."""
        return self._private.sign(message)

    def __repr__(self) -> str:
        return f"KeyPair(public_key={self.public_key.hex()})"

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        """Write the private key as unencrypted PKCS8 PEM, mode 0600, atomically.

        Raises ConfigError if `path` exists and `overwrite` is false, or it cannot be written.
        """
        path = Path(path)
        if path.exists() and not overwrite:
            raise ConfigError(f"key file {path} already exists; refusing to overwrite it")
        pem = self._private.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())
        try:
            _write_private_file(path, pem, overwrite=overwrite)
        except FileExistsError:
            raise ConfigError(f"key file {path} already exists; refusing to overwrite it") from None
        except OSError as e:
            raise ConfigError(f"cannot write key file {path}: {e.strerror or e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyPair:
        """Read a key written by `save` (any unencrypted PEM Ed25519 private key).

        Raises ConfigError if the file is missing, unreadable, not a PEM private key, encrypted,
        or a key of another algorithm.
        """
        path = Path(path)
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_KEY_FILE_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"cannot read key file {path}: {e.strerror or e}") from None
        if len(data) > _MAX_KEY_FILE_BYTES:
            raise ConfigError(f"key file {path} is too large to be a private key")
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError, UnsupportedAlgorithm) as e:
            raise ConfigError(f"key file {path} is not an unencrypted PEM private key: {e}") \
                from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 "
                              f"private key")
        return cls(key)


def _write_private_file(path: Path, data: bytes, *, overwrite: bool) -> None:
    """Write `data` to a 0600 temp file beside `path`, then move it into place.

    Without `overwrite` the move is a hard link, which fails if `path` appeared meanwhile
    (FileExistsError); filesystems without hard links fall back to os.replace.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:
            if path.exists():
                raise FileExistsError(path) from None
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> None:
    """Check a raw Ed25519 signature. Raises SignatureError (also for wrong key/sig lengths)."""
    if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_SIZE:
        raise SignatureError(f"public key must be {PUBLIC_KEY_SIZE} bytes")
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_SIZE:
        raise SignatureError(f"signature must be {SIGNATURE_SIZE} bytes")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        raise SignatureError(f"signature does not verify under public key "
                             f"{public_key.hex()}") from None


# --- domain-separated signed objects -----------------------------------------------------------

def signing_message(kind: str, body: dict[str, Any]) -> bytes:
    """The one byte string a signature over an object of `kind` with `body` covers."""
    return SIGNATURE_DOMAIN + encode({"kind": kind, "protocol_version": PROTOCOL_VERSION,
                                      "body": body})


def sign_object(kind: str, body: dict[str, Any], key: KeyPair) -> bytes:
    """Sign `body` as an object of `kind` (see `signing_message`)."""
    return key.sign(signing_message(kind, body))


def verify_object(kind: str, body: dict[str, Any], public_key: bytes, signature: bytes) -> None:
    """Raises SignatureError unless `signature` signs `body` as an object of `kind`."""
    verify_signature(public_key, signing_message(kind, body), signature)


# --- field validation (shape problems are EncodingError) ---------------------------------------

def _require_bytes(name: str, value: object, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise EncodingError(f"{name} must be {size} bytes, got {_describe(value)}")


def _require_uint(name: str, value: object, minimum: int = 0, maximum: int = _MAX_UINT) -> None:
    if type(value) is not int or not minimum <= value <= maximum:
        raise EncodingError(f"{name} must be an integer in [{minimum}, {maximum}], "
                            f"got {_describe(value)}")


def _require_fields(what: str, body: object, fields: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise EncodingError(f"{what} must be a map, got {_describe(body)}")
    if set(body) != set(fields):
        missing, extra = sorted(set(fields) - set(body)), sorted(set(body) - set(fields), key=str)
        raise EncodingError(f"{what} has the wrong fields (missing {missing}, unexpected {extra})")
    return body


def _describe(value: object) -> str:
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    if isinstance(value, int | float | bool) or value is None:
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


# --- commitments -------------------------------------------------------------------------------

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
        _require_bytes("commitment job_id", self.job_id, HASH_SIZE)
        _require_uint("commitment n", self.n, maximum=_MAX_UINT - 1)  # n + 1 leaves fit too
        _require_bytes("commitment root", self.root, HASH_SIZE)
        _require_bytes("commitment h_n", self.h_n, HASH_SIZE)
        _require_bytes("commitment public_key", self.public_key, PUBLIC_KEY_SIZE)
        if type(self.role) is not str or self.role not in ROLES:
            raise EncodingError(f"commitment role must be one of {ROLES}, got {self.role!r}")
        _require_uint("commitment time", self.time)

    def to_body(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _COMMITMENT_FIELDS}

    @classmethod
    def from_body(cls, body: object) -> Commitment:
        """Build from a decoded map with exactly the commitment's fields. Raises EncodingError."""
        body = _require_fields("commitment", body, _COMMITMENT_FIELDS)
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
        _require_bytes("commitment signature", self.signature, SIGNATURE_SIZE)

    def to_bytes(self) -> bytes:
        return encode({"commitment": self.commitment.to_body(), "signature": self.signature})

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedCommitment:
        """Parse untrusted bytes (canonical encoding only). Raises EncodingError.

        Does not check the signature: call `verify`.
        """
        obj = _require_fields("signed commitment",
                              decode(data, max_bytes=_MAX_SIGNED_COMMITMENT_BYTES),
                              ("commitment", "signature"))
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
                                 f"{_hex(job_id)}")
        if c.role != role:
            raise SignatureError(f"commitment role is {c.role!r}, expected {role!r}")
        if n is not None and c.n != n:
            raise SignatureError(f"commitment is over n = {c.n} steps, expected n = {n}")
        if public_key is not None and c.public_key != public_key:
            raise SignatureError(f"commitment is signed by key {c.public_key.hex()}, expected "
                                 f"key {_hex(public_key)}")


def _hex(value: object) -> str:
    return value.hex() if isinstance(value, bytes) else repr(value)


def sign_commitment(commitment: Commitment, key: KeyPair) -> SignedCommitment:
    """Sign `commitment` with `key`. Raises ConfigError if the commitment names another key."""
    if commitment.public_key != key.public_key:
        raise ConfigError(f"commitment names public key {commitment.public_key.hex()}, but the "
                          f"signing key's is {key.public_key.hex()}")
    return SignedCommitment(commitment, sign_object(KIND_COMMITMENT, commitment.to_body(), key))


# --- claims ------------------------------------------------------------------------------------

def leaf_data(step: int, state_hash: bytes, log_hash: bytes) -> bytes:
    """canonical(t, h_t, ℓ_t): the bytes whose RFC 6962 leaf hash is leaf t (SPEC §2 "Leaf")."""
    return encode([step, state_hash, log_hash])


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
        _require_bytes("claim job_id", self.job_id, HASH_SIZE)
        _require_uint("claim step", self.step)
        _require_bytes("claim state_hash", self.state_hash, HASH_SIZE)
        _require_bytes("claim log_hash", self.log_hash, HASH_SIZE)
        _require_uint("claim size", self.size, minimum=1)
        if self.step >= self.size:
            raise EncodingError(f"claim step {self.step} is outside a tree of {self.size} leaves")
        if not isinstance(self.proof, Sequence) or isinstance(self.proof, bytes | str):
            raise EncodingError(f"claim proof must be a list of hashes, got "
                                f"{_describe(self.proof)}")
        if len(self.proof) > MAX_PROOF_LEN:
            raise EncodingError(f"claim proof has {len(self.proof)} hashes, at most "
                                f"{MAX_PROOF_LEN} allowed")
        for i, node in enumerate(self.proof):
            _require_bytes(f"claim proof[{i}]", node, HASH_SIZE)
        object.__setattr__(self, "proof", tuple(self.proof))

    def leaf_hash(self) -> bytes:
        return leaf_hash(leaf_data(self.step, self.state_hash, self.log_hash))

    def to_body(self) -> dict[str, Any]:
        body = {name: getattr(self, name) for name in _CLAIM_FIELDS}
        body["proof"] = list(self.proof)
        return body

    @classmethod
    def from_body(cls, body: object) -> Claim:
        """Build from a decoded map with exactly the claim's fields. Raises EncodingError."""
        body = _require_fields("claim", body, _CLAIM_FIELDS)
        if not isinstance(body["proof"], list):
            raise EncodingError(f"claim proof must be a list, got {_describe(body['proof'])}")
        return cls(**body)

    def to_bytes(self) -> bytes:
        return encode(self.to_body())

    @classmethod
    def from_bytes(cls, data: bytes) -> Claim:
        """Parse untrusted bytes (canonical encoding only). Raises EncodingError."""
        return cls.from_body(decode(data, max_bytes=_MAX_CLAIM_BYTES))

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
