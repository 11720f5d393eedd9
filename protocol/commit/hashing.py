"""The hash scheme of every ovt tree, alone with its named domain prefixes (SPEC §2 "Leaf").

SHA-256 with a one-byte domain prefix, 0x00 for a leaf and 0x01 for an interior node, so a leaf
can never be passed off as a node (RFC 6962 §2.1). Every hash ovt commits to (h_t, ℓ_t, a job
id, a leaf, a node) is `HASH_SIZE` bytes.
"""

from __future__ import annotations

import hashlib

HASH_SIZE = 32
LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"


def leaf_hash(data: bytes) -> bytes:
    """SHA-256(0x00 || data): the hash of one leaf's canonical bytes."""
    return hashlib.sha256(LEAF_PREFIX + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """SHA-256(0x01 || left || right): the hash of an interior node."""
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


EMPTY_ROOT = hashlib.sha256(b"").digest()  # RFC 6962: MTH({}) = SHA-256()
