"""RFC 6962 Merkle trees over leaf hashes (SPEC §2 "Leaf", §2.1), and their inclusion proofs.

The hash scheme lives alone in `protocol.commit.hashing`; everything here works on 32-byte leaf
hashes and calls `node_hash` only.

The tree's shape is fixed by its leaf count n (RFC 6962 MTH: the left subtree holds the largest
power of two < n leaves). Built bottom-up, that is the same tree as pairing neighbours level by
level and promoting an unpaired last node unchanged (never duplicating it), which is how
`merkle_root` and `MerkleTree` build it.

What the size binds: two trees of different sizes cannot share a root short of a SHA-256
collision (their shapes differ, and the prefixes keep a leaf hash from standing in for a node); a
verifier given (leaf, index, size, proof) checks `size` only through the proof's shape: for some
sizes n and n±1 the same proof recomputes the same root. The size to verify against must
therefore come from a signed commitment (SPEC §2 "Commitment" signs n next to the root), never
from the prover.

>>> from protocol.commit.hashing import leaf_hash
>>> leaves = [leaf_hash(bytes([i])) for i in range(5)]
>>> tree = MerkleTree(leaves)
>>> tree.root == merkle_root(leaves)
True
>>> verify_inclusion(leaves[3], 3, tree.size, tree.proof(3), tree.root)  # returns None: verified
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.commit.hashing import EMPTY_ROOT, HASH_SIZE, node_hash
from protocol.errors import ProofError, RootMismatchError

MAX_PROOF_LEN = 64  # a tree of at most 2**63 leaves has proofs of at most 63 hashes

# ---- building trees and proofs (the prover's side) -------------------------------------------


def merkle_root(leaf_hashes: Sequence[bytes]) -> bytes:
    """RFC 6962 MTH over `leaf_hashes` (each 32 bytes); EMPTY_ROOT for no leaves.

    O(n) hashes, built level by level. Raises ValueError for a leaf hash that is not 32 bytes.
    """
    leaves = _checked_leaves(leaf_hashes)
    return _mth(leaves) if leaves else EMPTY_ROOT


def inclusion_proof(leaf_hashes: Sequence[bytes], index: int) -> list[bytes]:
    """RFC 6962 PATH(index, D[n]): the sibling hashes from the leaf up to the root.

    The direct recursive definition (it rehashes the sibling subtrees, O(n) per call): use
    `MerkleTree.proof` to serve many proofs. Raises IndexError unless 0 <= index < n and
    ValueError for a leaf hash that is not 32 bytes.
    """
    leaves = _checked_leaves(leaf_hashes)
    if not 0 <= index < len(leaves):
        raise IndexError(f"leaf index {index} is outside a tree of {len(leaves)} leaves")
    return _path(leaves, index, 0, len(leaves))


def _path(leaves: list[bytes], index: int, lo: int, hi: int) -> list[bytes]:
    """PATH for leaf `index` within the subtree over leaves[lo:hi]."""
    if hi - lo == 1:
        return []
    split = lo + _largest_power_of_two_below(hi - lo)
    if index < split:
        return _path(leaves, index, lo, split) + [_mth(leaves[split:hi])]
    return _path(leaves, index, split, hi) + [_mth(leaves[lo:split])]


class MerkleTree:
    """An RFC 6962 tree built once over all its leaf hashes; every level is kept, so each proof
    is O(log n) lookups and never rehashes anything.

    Raises ValueError for a leaf hash that is not 32 bytes.
    """

    def __init__(self, leaf_hashes: Sequence[bytes]) -> None:
        level = _checked_leaves(leaf_hashes)
        self._levels = [level]
        while len(level) > 1:
            level = _parent_level(level)
            self._levels.append(level)

    @property
    def size(self) -> int:
        """The number of leaves."""
        return len(self._levels[0])

    @property
    def root(self) -> bytes:
        """The tree head, MTH of all leaves (EMPTY_ROOT for no leaves)."""
        return self._levels[-1][0] if self.size else EMPTY_ROOT

    def proof(self, index: int) -> list[bytes]:
        """The inclusion proof of leaf `index`, equal to `inclusion_proof(leaves, index)`.

        Raises IndexError unless 0 <= index < size.
        """
        if not 0 <= index < self.size:
            raise IndexError(f"leaf index {index} is outside a tree of {self.size} leaves")
        proof = []
        for level in self._levels[:-1]:
            sibling = index ^ 1
            if sibling < len(level):  # else this node is promoted unpaired: no sibling here
                proof.append(level[sibling])
            index >>= 1
        return proof


def _mth(level: list[bytes]) -> bytes:
    """The root over a non-empty list of checked leaf hashes."""
    while len(level) > 1:
        level = _parent_level(level)
    return level[0]


def _parent_level(level: list[bytes]) -> list[bytes]:
    parents = [node_hash(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
    if len(level) % 2:
        parents.append(level[-1])
    return parents


def _checked_leaves(leaf_hashes: Sequence[bytes]) -> list[bytes]:
    leaves = list(leaf_hashes)
    if not (set(map(type, leaves)) <= {bytes} and set(map(len, leaves)) <= {HASH_SIZE}):
        i, leaf = next((i, leaf) for i, leaf in enumerate(leaves)
                       if type(leaf) is not bytes or len(leaf) != HASH_SIZE)
        raise ValueError(f"leaf hash {i} is not {HASH_SIZE} bytes: {leaf!r:.80}")
    return leaves


def _largest_power_of_two_below(n: int) -> int:
    return 1 << ((n - 1).bit_length() - 1)


# ---- checking proofs (the verifier's side; every input untrusted) ----------------------------


def root_from_proof(leaf_hash: bytes, index: int, size: int, proof: Sequence[bytes]) -> bytes:
    """The root that `proof` proves leaf `index` of a `size`-leaf tree under, O(log n).

    RFC 9162 §2.1.3.2, iterative as transparency-dev/merkle `proof/verify.go`: the proof splits
    into an inner part, below the point where the paths to `index` and to `size - 1` diverge,
    and a border part along the tree's right edge. Raises ProofError for index or size that are
    not ints with 0 <= index < size, a leaf hash or proof element that is not 32 bytes, or a proof
    whose length is not the one this (index, size) requires.
    """
    _require_index(index, size)
    _require_hash(leaf_hash, "leaf hash")
    inner = (index ^ (size - 1)).bit_length()
    border = (index >> inner).bit_count()
    if isinstance(proof, bytes | str) or not isinstance(proof, Sequence):
        raise ProofError(f"proof must be a sequence of hashes, not {type(proof).__name__}")
    if len(proof) != inner + border:
        raise ProofError(f"proof for leaf {index} of a {size}-leaf tree must have "
                         f"{inner + border} hashes, has {len(proof)}")
    for i, element in enumerate(proof):
        if type(element) is not bytes or len(element) != HASH_SIZE:
            _require_hash(element, f"proof element {i}")  # raises, naming the element
    node = leaf_hash
    for level, sibling in enumerate(proof[:inner]):
        node = node_hash(sibling, node) if (index >> level) & 1 else node_hash(node, sibling)
    for sibling in proof[inner:]:
        node = node_hash(sibling, node)
    return node


def verify_inclusion(leaf_hash: bytes, index: int, size: int, proof: Sequence[bytes],
                     root: bytes) -> None:
    """Check that `proof` proves leaf `index` with hash `leaf_hash` in the `size`-leaf tree with
    head `root`. Returns None when it does.

    Raises RootMismatchError (carrying both roots) when the proof recomputes another root, and
    ProofError for malformed input (see `root_from_proof`; also a root that is not 32 bytes).
    """
    _require_hash(root, "root")
    computed = root_from_proof(leaf_hash, index, size, proof)
    if computed != root:
        raise RootMismatchError(root, computed, f"inclusion proof of leaf {index} of {size}")


def _require_index(index: int, size: int) -> None:
    for name, value in (("index", index), ("size", size)):
        if type(value) is not int:
            raise ProofError(f"{name} must be an int, not {type(value).__name__}")
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is outside a tree of {size} leaves")


def _require_hash(value: bytes, what: str) -> None:
    if type(value) is not bytes or len(value) != HASH_SIZE:
        raise ProofError(f"{what} is not a {HASH_SIZE}-byte hash: {value!r:.80}")
