"""Leaf t of a job's tree: (t, h_t, ℓ_t) and its hash (SPEC §2 "Leaf").

The one leaf type: a store row, a served claim's leaf and a party's answer in the bisection game
are all a `Leaf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from protocol.codec.canonical import encode
from protocol.commit.hashing import leaf_hash


def leaf_data(step: int, state_hash: bytes, log_hash: bytes) -> bytes:
    """canonical(t, h_t, ℓ_t): the bytes whose RFC 6962 leaf hash is leaf t."""
    return encode([step, state_hash, log_hash])


def leaf_hash_of(step: int, state_hash: bytes, log_hash: bytes) -> bytes:
    """H(0x00 || canonical(t, h_t, ℓ_t))."""
    return leaf_hash(leaf_data(step, state_hash, log_hash))


@dataclass(frozen=True)
class Leaf:
    """Leaf t: step t, h_t (the state hash) and ℓ_t (the rounding log's hash)."""

    step: int
    state_hash: bytes
    log_hash: bytes

    @cached_property
    def hash(self) -> bytes:
        """H(0x00 || canonical(t, h_t, ℓ_t)), computed once per leaf (a store checks it on
        every read, and the tree is built from it)."""
        return leaf_hash_of(self.step, self.state_hash, self.log_hash)
