"""RFC 6962 trees and inclusion proofs (protocol.commit.merkle, SPEC §2 "Leaf").

Known-answer vectors, a deliberately naive reference implementation, golden sets of corrupted
proofs (every one must fail), and a cross-check against an independent library (merkly).
"""

from __future__ import annotations

import hashlib
import random

import pytest

from protocol.commit.hashing import EMPTY_ROOT, LEAF_PREFIX, NODE_PREFIX, leaf_hash, node_hash
from protocol.commit.merkle import (
    MerkleTree,
    inclusion_proof,
    merkle_root,
    root_from_proof,
    verify_inclusion,
)
from protocol.errors import ProofError, RootMismatchError

# ---- known-answer vectors --------------------------------------------------------------------
# The classic 8-leaf RFC 6962 vector set, copied from transparency-dev/merkle
# `testonly/constants.go` (LeafInputs, NodeHashes, RootHashes) and `proof/verify_test.go`
# (inclusionProofs). The same values appear in google/certificate-transparency
# `cpp/merkletree/merkle_tree_test.cc` (kInputs, kSHA256Roots, kSHA256Paths).

LEAF_INPUTS = [bytes.fromhex(h) for h in (
    "", "00", "10", "2021", "3031", "40414243", "5051525354555657",
    "606162636465666768696a6b6c6d6e6f",
)]

# NodeHashes: level 0 holds the leaf hashes, level k the complete subtrees of 2**k leaves.
NODE_HASHES = [[bytes.fromhex(h) for h in level] for level in (
    ("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
     "96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
     "0298d122906dcfc10892cb53a73992fc5b9f493ea4c9badb27b791b4127a7fe7",
     "07506a85fd9dd2f120eb694f86011e5bb4662e5c415a62917033d4a9624487e7",
     "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
     "4271a26be0d8a84f0bd54c8c302e7cb3a3b5d1fa6780a40bcce2873477dab658",
     "b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f",
     "46f6ffadd3d06a09ff3c5860d2755c8b9819db7df44251788c7d8e3180de8eb1"),
    ("fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
     "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
     "0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a",
     "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0"),
    ("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
     "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"),
    ("5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",),
)]

# RootHashes, indexed by tree size.
ROOTS = [bytes.fromhex(h) for h in (
    "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
)]

# inclusionProofs as (leaf index, tree size, proof). The sources number leaves from 1
# ({1, 8}, {6, 8}, {3, 3}, {2, 5}); the indices here are 0-based.
INCLUSION_VECTORS = [
    (0, 1, []),
    (0, 8, ["96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"]),
    (5, 8, ["bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b",
            "ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0",
            "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"]),
    (2, 3, ["fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"]),
    (1, 5, ["6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
            "5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e",
            "bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"]),
]

# sha256SomeHash in proof/verify_test.go: a 32-byte value that is no node of the vector tree.
SOME_HASH = bytes.fromhex("abacaba000000000000000000000000000000000000000000060061e00123456")

VECTOR_LEAVES = [leaf_hash(data) for data in LEAF_INPUTS]


def _vector_proof(hexes: list[str]) -> list[bytes]:
    return [bytes.fromhex(h) for h in hexes]


# ---- a deliberately naive reference (RFC 6962 §2.1, word for word) ---------------------------


def _naive_mth(leaves: list[bytes]) -> bytes:
    """MTH(D[n]) as RFC 6962 writes it, on the leaves' hashes; only for cross-checking."""
    n = len(leaves)
    if n == 0:
        return hashlib.sha256(b"").digest()
    if n == 1:
        return leaves[0]
    k = 1
    while k * 2 < n:
        k *= 2
    return hashlib.sha256(b"\x01" + _naive_mth(leaves[:k]) + _naive_mth(leaves[k:])).digest()


def _tree_leaves(size: int) -> list[bytes]:
    return [leaf_hash(b"ovt-leaf-%d" % i) for i in range(size)]


def _flip(value: bytes, bit: int) -> bytes:
    out = bytearray(value)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def _shape(index: int, size: int) -> tuple[int, int]:
    """(inner, border) lengths of the proof for (index, size), RFC 9162 §2.1.3.2."""
    inner = (index ^ (size - 1)).bit_length()
    return inner, bin(index >> inner).count("1")


# ---- hash scheme and vectors -----------------------------------------------------------------


def test_domain_prefixes_are_rfc6962():
    assert (LEAF_PREFIX, NODE_PREFIX) == (b"\x00", b"\x01")
    assert EMPTY_ROOT == ROOTS[0]
    assert leaf_hash(b"x") == hashlib.sha256(b"\x00x").digest()
    left, right = b"a" * 32, b"b" * 32
    assert node_hash(left, right) == hashlib.sha256(b"\x01" + left + right).digest()


def test_leaf_and_node_hashes_match_vectors():
    assert VECTOR_LEAVES == NODE_HASHES[0]
    for level, parents in zip(NODE_HASHES, NODE_HASHES[1:], strict=False):
        assert [node_hash(level[i], level[i + 1]) for i in range(0, len(level), 2)] == parents


@pytest.mark.parametrize("size", range(len(ROOTS)))
def test_roots_match_vectors(size):
    assert merkle_root(VECTOR_LEAVES[:size]) == ROOTS[size]
    assert MerkleTree(VECTOR_LEAVES[:size]).root == ROOTS[size]
    assert MerkleTree(VECTOR_LEAVES[:size]).size == size


@pytest.mark.parametrize(("index", "size", "proof_hex"), INCLUSION_VECTORS)
def test_inclusion_proofs_match_vectors(index, size, proof_hex):
    proof = _vector_proof(proof_hex)
    assert inclusion_proof(VECTOR_LEAVES[:size], index) == proof
    assert MerkleTree(VECTOR_LEAVES[:size]).proof(index) == proof
    assert root_from_proof(VECTOR_LEAVES[index], index, size, proof) == ROOTS[size]
    verify_inclusion(VECTOR_LEAVES[index], index, size, proof, ROOTS[size])


def _vector_probes(index, size, proof, root, leaf):
    """The corruption set of transparency-dev/merkle proof/verify_test.go corruptInclusionProof
    (also its testdata/inclusion/*): each probe is (description, leaf, index, size, proof, root)."""
    probes = [
        ("leafIndex - 1", leaf, index - 1, size, proof, root),
        ("leafIndex + 1", leaf, index + 1, size, proof, root),
        ("leafIndex ^ 2", leaf, index ^ 2, size, proof, root),
        ("treeSize * 2", leaf, index, size * 2, proof, root),
        ("treeSize / 2", leaf, index, size // 2, proof, root),
        ("wrong leaf", b"WrongLeaf", index, size, proof, root),
        ("empty root", leaf, index, size, proof, EMPTY_ROOT),
        ("random root", leaf, index, size, proof, SOME_HASH),
        ("trailing garbage", leaf, index, size, proof + [b""], root),
        ("trailing root", leaf, index, size, proof + [root], root),
        ("preceding garbage", leaf, index, size, [b""] + proof, root),
        ("preceding root", leaf, index, size, [root] + proof, root),
    ]
    for i in range(len(proof)):
        wrong = list(proof)
        wrong[i] = _flip(wrong[i], 3)  # wrongProof[i][0] ^= 8
        probes.append((f"modified proof[{i}] bit 3", leaf, index, size, wrong, root))
    if proof:
        probes.append(("removed component", leaf, index, size, proof[:-1], root))
    if len(proof) > 1:
        probes.append(("inserted component", leaf, index, size,
                       [proof[0], SOME_HASH] + proof[1:], root))
    return probes


@pytest.mark.parametrize(("index", "size", "proof_hex"), INCLUSION_VECTORS[1:])
def test_corrupted_vector_proofs_are_rejected(index, size, proof_hex):
    proof = _vector_proof(proof_hex)
    for desc, leaf, idx, sz, prf, root in _vector_probes(index, size, proof, ROOTS[size],
                                                        VECTOR_LEAVES[index]):
        with pytest.raises(ProofError):
            verify_inclusion(leaf, idx, sz, prf, root)
            pytest.fail(f"verified a corrupted proof: {desc}")


@pytest.mark.parametrize(("leaf", "root", "error"), [
    (VECTOR_LEAVES[0], VECTOR_LEAVES[0], None),
    (VECTOR_LEAVES[0], ROOTS[2], RootMismatchError),
    (b"", VECTOR_LEAVES[0], ProofError),
    (VECTOR_LEAVES[0], b"", ProofError),
    (b"", b"", ProofError),
])
def test_single_leaf_tree(leaf, root, error):
    """A one-leaf tree's root is its leaf hash and the proof is empty (TestVerifyInclusion-
    SingleEntry); empty hashes are malformed (ProofError itself), never a mismatch."""
    assert _rejection(leaf, 0, 1, [], root) is error


@pytest.mark.parametrize(("index", "size"), [(0, 0), (1, 0), (2, 1), (1, 1), (-1, 4), (4, 4)])
def test_index_outside_tree_is_a_proof_error(index, size):
    for root in (SOME_HASH, EMPTY_ROOT):
        with pytest.raises(ProofError, match="outside"):
            verify_inclusion(SOME_HASH, index, size, [], root)
    with pytest.raises(ProofError, match="outside"):
        root_from_proof(SOME_HASH, index, size, [])


@pytest.mark.parametrize(("index", "size", "proof", "match"), [
    (True, 2, [SOME_HASH], "index must be an int"),
    (0, 2.0, [SOME_HASH], "size must be an int"),
    (0, 2, SOME_HASH, "sequence of hashes"),
    (0, 2, "ab" * 32, "sequence of hashes"),
    (0, 2, [bytearray(SOME_HASH)], "proof element 0"),
    (0, 2, [SOME_HASH[:31]], "proof element 0"),
    (0, 2, [SOME_HASH + b"\x00"], "proof element 0"),
    (0, 2, [SOME_HASH.hex()], "proof element 0"),
    (0, 2, [None], "proof element 0"),
])
def test_malformed_proof_inputs_are_proof_errors(index, size, proof, match):
    with pytest.raises(ProofError, match=match):
        verify_inclusion(SOME_HASH, index, size, proof, EMPTY_ROOT)


def test_producers_reject_bad_leaf_hashes_and_indices():
    for bad in ([b"short"], [SOME_HASH, SOME_HASH.hex()], [bytearray(SOME_HASH)]):
        for build in (merkle_root, MerkleTree):
            with pytest.raises(ValueError, match="not 32 bytes"):
                build(bad)
    tree = MerkleTree(VECTOR_LEAVES)
    for index in (-1, 8):
        with pytest.raises(IndexError):
            tree.proof(index)
        with pytest.raises(IndexError):
            inclusion_proof(VECTOR_LEAVES, index)
    with pytest.raises(IndexError):
        MerkleTree([]).proof(0)
    assert MerkleTree([]).root == EMPTY_ROOT and MerkleTree([]).size == 0


def test_root_mismatch_error_carries_both_roots():
    proof = MerkleTree(VECTOR_LEAVES).proof(5)
    with pytest.raises(RootMismatchError) as info:
        verify_inclusion(VECTOR_LEAVES[5], 5, 8, proof, SOME_HASH)
    assert info.value.expected == SOME_HASH
    assert info.value.computed == ROOTS[8]


# ---- every tree up to 300 leaves against the reference ---------------------------------------


def test_merkle_root_matches_naive_reference():
    leaves = _tree_leaves(300)
    for size in range(301):
        expected = _naive_mth(leaves[:size])
        assert merkle_root(leaves[:size]) == expected, size
        assert MerkleTree(leaves[:size]).root == expected, size


def test_size_is_bound_only_by_the_proof_shape():
    """RFC 6962 verification checks the size only through the proof's length and layout: the
    proof of leaf 0 in a 3-leaf tree also verifies leaf 0 in a 4-leaf tree whose right subtree
    hash happens to be leaf 2's hash. Nobody can build such a 4-leaf tree (leaf 2's hash would
    have to be a node hash: domain separation), so the root does commit to its size, but the
    verifier must take `size` from the signed commitment (SPEC §2 Commitment), not the prover."""
    tree = MerkleTree(VECTOR_LEAVES[:3])
    proof = tree.proof(0)
    verify_inclusion(VECTOR_LEAVES[0], 0, 3, proof, tree.root)
    verify_inclusion(VECTOR_LEAVES[0], 0, 4, proof, tree.root)
    assert MerkleTree(VECTOR_LEAVES[:4]).root != tree.root


SIZES = range(1, 301)
CHUNK = 25


@pytest.mark.parametrize("first", range(SIZES.start, SIZES.stop, CHUNK))
def test_every_proof_of_every_tree_up_to_300(first):
    """For each size and each index: the fast proof equals RFC 6962 PATH, it verifies, and every
    corruption fails: a bit flip (a random bit, fixed seed) in the leaf hash, in each proof
    element and in the root; index ± 1; size ± 1 (see below); truncated, extended, reordered."""
    leaves = _tree_leaves(SIZES.stop)
    for size in range(first, min(first + CHUNK, SIZES.stop)):
        tree = MerkleTree(leaves[:size])
        rng = random.Random(size)
        for index in range(size):
            proof = tree.proof(index)
            assert proof == inclusion_proof(leaves[:size], index), (size, index)
            assert len(proof) == sum(_shape(index, size))
            _check_proof_and_corruptions(leaves, index, size, proof, tree.root, rng)


def _check_proof_and_corruptions(leaves, index, size, proof, root, rng):
    leaf = leaves[index]
    verify_inclusion(leaf, index, size, proof, root)
    mismatches = [(_flip(leaf, rng.randrange(256)), index, size, proof, root),
                  (leaf, index, size, proof, _flip(root, rng.randrange(256)))]
    for i in range(len(proof)):
        wrong = list(proof)
        wrong[i] = _flip(wrong[i], rng.randrange(256))
        mismatches.append((leaf, index, size, wrong, root))
    if len(proof) > 1:
        mismatches.append((leaf, index, size, proof[::-1], root))
    for other in (index - 1, index + 1):  # a neighbour's slot, same size: mismatch or bad length
        if 0 <= other < size:
            assert _rejection(leaf, other, size, proof, root) is not None, (size, index, other)
    for probe in mismatches:
        assert _rejection(*probe) is RootMismatchError, (size, index, probe)
    for wrong in (proof[:-1], proof[1:], proof + [root], [root] + proof, proof + [SOME_HASH],
                  proof[:1] + [SOME_HASH] + proof[1:]):
        if len(wrong) != len(proof):
            assert _rejection(leaf, index, size, wrong, root) is ProofError, (size, index, wrong)
    for other in (size - 1, size + 1):
        if other > index:
            _check_wrong_size(leaf, index, size, other, proof, root)


def _rejection(leaf, index, size, proof, root) -> type | None:
    """The type of the error verify_inclusion raises, None if it verifies (pytest.raises costs
    more than the verification itself in this loop)."""
    try:
        verify_inclusion(leaf, index, size, proof, root)
    except ProofError as exc:
        return type(exc)
    return None


def _check_wrong_size(leaf, index, size, other, proof, root):
    """A wrong size is rejected unless it gives the proof the same (inner, border) shape, in which
    case the very same hashes are chained and the root comes out equal: the size is bound only
    through the proof shape (test_size_is_bound_only_by_the_proof_shape)."""
    if _shape(index, other) == _shape(index, size):
        expected = None
    elif sum(_shape(index, other)) == len(proof):
        expected = RootMismatchError
    else:
        expected = ProofError
    assert _rejection(leaf, index, other, proof, root) is expected, (size, index, other)


@pytest.mark.parametrize(("index", "size"), [(0, 8), (5, 8), (2, 3), (1, 5), (6, 7)])
def test_every_single_bit_flip_is_rejected(index, size):
    """Exhaustive on the vector tree: all 256 bits of the leaf hash, of every proof element and
    of the root."""
    leaves = VECTOR_LEAVES[:size]
    proof, root, leaf = inclusion_proof(leaves, index), ROOTS[size], leaves[index]
    for bit in range(256):
        probes = [(_flip(leaf, bit), proof, root), (leaf, proof, _flip(root, bit))]
        for i in range(len(proof)):
            probes.append((leaf, proof[:i] + [_flip(proof[i], bit)] + proof[i + 1:], root))
        for bad_leaf, bad_proof, bad_root in probes:
            with pytest.raises(RootMismatchError):
                verify_inclusion(bad_leaf, index, size, bad_proof, bad_root)


def test_large_tree_proofs_verify():
    leaves = _tree_leaves(100_003)
    tree = MerkleTree(leaves)
    assert tree.root == merkle_root(leaves)
    rng = random.Random(7)
    for index in [0, 1, 65_535, 65_536, 100_002] + rng.sample(range(100_003), 50):
        verify_inclusion(leaves[index], index, tree.size, tree.proof(index), tree.root)


# ---- cross-check with an independent implementation: merkly 1.0.2 ---------------------------
# merkly (merkly/mtree.py) takes its leaves as str and hashes each as hash_function(s.encode(),
# b""), then each pair as hash_function(left, right); its default is keccak(left + right), with
# no domain separation. It builds level by level and promotes an unpaired last node unchanged
# (`make_root`, `up_layer`), which is exactly RFC 6962's shape: the trees agree for every leaf
# count n >= 2 (merkly refuses n < 2), roots and proofs alike. The hook below restores RFC 6962's
# hashing: a call with an empty right half is a leaf (every node has two 32-byte children).
# merkly finds a proof's leaf with list.index, so the leaves must be distinct.


def _rfc6962_hook(left: bytes, right: bytes) -> bytes:
    return leaf_hash(left) if right == b"" else node_hash(left, right)


@pytest.fixture(scope="module")
def merkly_tree():
    return pytest.importorskip("merkly.mtree").MerkleTree


def _merkly_case(merkly_tree, size):
    raw = [f"ovt-merkly-{i}" for i in range(size)]
    return raw, merkly_tree(raw, _rfc6962_hook), [leaf_hash(r.encode()) for r in raw]


def test_merkly_roots_agree(merkly_tree):
    for size in range(2, 301):
        _, theirs, leaves = _merkly_case(merkly_tree, size)
        assert theirs.root == merkle_root(leaves), size


def test_merkly_proofs_agree(merkly_tree):
    for size in range(2, 65):
        raw, theirs, leaves = _merkly_case(merkly_tree, size)
        ours = MerkleTree(leaves)
        for index in range(size):
            their_proof = theirs.proof(raw[index])
            assert [node.data for node in their_proof] == ours.proof(index), (size, index)
            assert theirs.verify(their_proof, raw[index])


def test_merkly_default_hash_is_not_rfc6962(merkly_tree):
    """Without the hook merkly hashes with keccak and no prefixes: a different tree head."""
    raw = [f"ovt-merkly-{i}" for i in range(4)]
    assert merkly_tree(raw).root != merkle_root([leaf_hash(r.encode()) for r in raw])
