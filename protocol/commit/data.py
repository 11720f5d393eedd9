"""Data commitment: a Merkle root over per-example hashes, plus the count (SPEC §2.1).

Example i's hash is the canonical state hash of its named tensors (the same encoding as S_t,
`protocol.codec.state`), and leaf i of the data tree is the RFC 6962 leaf hash of that 32-byte
digest. A party hands out the examples of one batch with inclusion proofs, so the arbiter never
needs the whole dataset: it checks each example against the committed root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from protocol.codec.state import state_digest
from protocol.commit.hashing import leaf_hash
from protocol.commit.merkle import MerkleTree, verify_inclusion
from protocol.errors import ProofError


class ExampleSource(Protocol):
    """A fixed, finite sequence of training examples."""

    def __len__(self) -> int: ...

    def example(self, index: int) -> dict[str, torch.Tensor]:
        """Example `index` as named CPU tensors (same names and shapes for every index)."""
        ...


@dataclass(frozen=True)
class DataCommitment:
    root: bytes
    count: int

    def to_body(self) -> dict:
        return {"root": self.root, "count": self.count}

    @classmethod
    def from_body(cls, body: dict) -> DataCommitment:
        return cls(root=body["root"], count=body["count"])


@dataclass(frozen=True)
class ProvenExample:
    """One example of a batch with its inclusion proof against the data root."""

    index: int
    example: dict[str, torch.Tensor]
    proof: list[bytes]


def example_digest(example: dict[str, torch.Tensor]) -> bytes:
    return state_digest(example)


def commit_dataset(source: ExampleSource) -> tuple[DataCommitment, MerkleTree]:
    """The commitment to every example of `source`, and the tree that proves batches."""
    tree = MerkleTree([leaf_hash(example_digest(source.example(i)))
                       for i in range(len(source))])
    return DataCommitment(tree.root, tree.size), tree


def prove_examples(source: ExampleSource, tree: MerkleTree, indices) -> list[ProvenExample]:
    """The examples at `indices` with their proofs (what a party sends for one batch)."""
    return [ProvenExample(int(i), source.example(int(i)), tree.proof(int(i))) for i in indices]


def verify_examples(commitment: DataCommitment, items: list[ProvenExample], indices) -> None:
    """Check that `items` are exactly the committed examples at `indices`, in order.

    Raises ProofError (or RootMismatchError) naming the first example that fails.
    """
    wanted = [int(i) for i in indices]
    if [item.index for item in items] != wanted:
        raise ProofError(f"batch examples are for indices {[it.index for it in items][:8]}..., "
                         f"expected {wanted[:8]}...")
    for item in items:
        if not 0 <= item.index < commitment.count:
            raise ProofError(f"example index {item.index} outside the dataset of "
                             f"{commitment.count}")
        verify_inclusion(leaf_hash(example_digest(item.example)), item.index, commitment.count,
                         item.proof, commitment.root)
