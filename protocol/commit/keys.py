"""Ed25519 keys and domain-separated signatures (SPEC §2 "Commitment", §6 replayed signatures).

Every signature covers `signing_message(kind, body)`:

    b"ovt-signature-v1\\x00" + encode({"kind": kind, "protocol_version": 1, "body": body})

so a signature made over one kind of object (or under another protocol version) never verifies
as another. Objects that are signed (`protocol.commit.commitments`, `protocol.dispute.verdict`)
call `sign_object` / `verify_object` with their own kind.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from protocol.codec.canonical import PROTOCOL_VERSION, encode
from protocol.errors import ConfigError, SignatureError
from protocol.files import atomic_write

SIGNATURE_DOMAIN = b"ovt-signature-v1\x00"
PUBLIC_KEY_SIZE = 32
SIGNATURE_SIZE = 64
_MAX_KEY_FILE_BYTES = 64 * 1024


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
            atomic_write(path, pem, mode=0o600, overwrite=overwrite)
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
