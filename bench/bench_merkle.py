"""What Merkle commitments cost (protocol.commit.merkle): building a
tree, serving and checking proofs.

Builds a `MerkleTree` over `--leaves` leaf hashes (default 1e5, about the leaf count of a long
training job), then for `--samples` random leaf indices times `MerkleTree.proof` (what a node
does per arbiter question) and `verify_inclusion` (what the arbiter does per answer), and prints
one table: build time (fastest of `--repeats`), and the median and 99th percentile per proof
and per verification. For scale, one more row times the recursive RFC 6962 PATH
(`inclusion_proof`, which rehashes the sibling subtrees: O(n) per proof) on `--reference-samples`
of those indices.

    python bench/bench_merkle.py
    python bench/bench_merkle.py --leaves 1000000 --samples 2000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from protocol.commit.hashing import leaf_hash
from protocol.commit.merkle import MerkleTree, inclusion_proof, verify_inclusion


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _duration(seconds: float) -> str:
    if seconds >= 1e-2:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.1f} us"


def _time_each(calls) -> list[float]:
    times = []
    for call in calls:
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leaves", type=int, default=100_000)
    parser.add_argument("--samples", type=int, default=1000, help="random leaf indices")
    parser.add_argument("--repeats", type=int, default=3, help="tree builds; fastest counts")
    parser.add_argument("--reference-samples", type=int, default=5,
                        help="indices for the recursive inclusion_proof row (0: skip it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    leaves = [leaf_hash(i.to_bytes(8, "big")) for i in range(args.leaves)]
    build = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        tree = MerkleTree(leaves)
        build.append(time.perf_counter() - start)

    indices = random.Random(args.seed).choices(range(args.leaves), k=args.samples)
    proofs = {i: tree.proof(i) for i in indices}
    prove = _time_each(lambda i=i: tree.proof(i) for i in indices)
    verify = _time_each(lambda i=i: verify_inclusion(leaves[i], i, tree.size, proofs[i], tree.root)
                        for i in indices)
    reference = _time_each(lambda i=i: inclusion_proof(leaves, i)
                           for i in indices[:args.reference_samples])

    hashes = max(len(p) for p in proofs.values())
    print(f"Merkle tree of {args.leaves:,} leaves ({hashes} hashes per proof at most), "
          f"{args.samples} random indices")
    print(f"{'operation':<22}{'median':>12}{'p99':>12}")
    print(f"{'build tree (fastest)':<22}{_duration(min(build)):>12}")
    rows = [("MerkleTree.proof", prove), ("verify_inclusion", verify),
            ("inclusion_proof (ref)", reference)]
    for name, times in rows:
        if not times:
            continue
        print(f"{name:<22}{_duration(statistics.median(times)):>12}"
              f"{_duration(_percentile(times, 0.99)):>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
