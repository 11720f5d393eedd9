"""The Claims service, both ends: the servicer every node runs and the client every party uses.

`ClaimsServicer` answers from the `JobStore`s under one directory (SPEC §2, §4): spec,
commitments, leaves with inclusion proofs, rounding logs, checkpoints streamed in bounded
chunks, and batches with data proofs. Input is validated at this edge and every failure maps to
a gRPC status with a one-line message; no stack trace reaches the peer.

`RemoteClaims` is a `protocol.job.run.ClaimSource` over a channel: everything it returns has been
checked (leaves against the peer's signed root, logs against the leaves, S_0 against h_0), and
every failure of the peer is a `PeerError` naming the call.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import BinaryIO

import grpc
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.status import job_id_of, rpc_errors
from protocol.codec.fields import MAX_UINT
from protocol.codec.state import encode_state, load_safetensors, state_digest
from protocol.commit.commitments import SignedCommitment
from protocol.commit.leaf import Leaf
from protocol.commit.merkle import MerkleTree, verify_inclusion
from protocol.engine.batches import batch_indices
from protocol.engine.profiles import Profile
from protocol.errors import (
    NotFoundError,
    OutOfRangeError,
    OvtError,
    PeerError,
    RefusedError,
    StateFormatError,
)
from protocol.job.create import commit_job_examples, job_executor, load_job_program
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

CHUNK_BYTES = 1 << 20
MAX_RANGE = 10_000
LEAF_WINDOW = 64  # leaves RemoteClaims fetches per streamed GetLeaves
DEFAULT_DEADLINE_S = 30.0
_REGEN_PROFILE = Profile("regenerate")  # a node regenerating its own S_t: its own hardware


class StoreDirectory:
    """The job stores under one root, opened on first use and kept open."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._stores: dict[bytes, JobStore] = {}
        self._lock = threading.Lock()

    def get(self, job_id: bytes) -> JobStore | None:
        with self._lock:
            if job_id not in self._stores:
                if not (self.root / job_id.hex() / "spec.ovtjob").exists():
                    return None
                self._stores[job_id] = JobStore.open(self.root, job_id.hex())
            return self._stores[job_id]

    def add(self, store: JobStore) -> None:
        with self._lock:
            self._stores[store.spec.job_id] = store

    def job_ids(self) -> list[bytes]:
        return [bytes.fromhex(p.parent.name) for p in sorted(self.root.glob("*/spec.ovtjob"))]


LeafFault = Callable[[int, "ovt_pb2.LeafReply", grpc.ServicerContext], "ovt_pb2.LeafReply"]


@rpc_errors
class ClaimsServicer(ovt_pb2_grpc.ClaimsServicer):
    """The Claims service over the stores under one directory.

    `data_dir` is the folder this node's operator offers data files in: a job with a data file
    reads it there to serve its batches or regenerate a state (none: such a job's GetBatch, and
    a GetCheckpoint that must regenerate, fail, saying why).

    `leaf_fault` is FAULT INJECTION only (a cheating trainer for tests and demos, see
    `trainer_node.faults`): when set, every unary GetLeaf answer passes through
    `leaf_fault(step, reply, context)`, which may forge it or stall. GetLeaves is left alone, so
    a cheater can lie to point queries (the arbiter's bisection, a challenged leaf) while an
    auditor's bulk download stays honest. An honest node leaves it None.
    """

    def __init__(self, stores: StoreDirectory, *, data_dir: Path | None = None,
                 leaf_fault: LeafFault | None = None) -> None:
        self.stores = stores
        self.data_dir = data_dir
        self.leaf_fault = leaf_fault
        self._data_trees: dict[bytes, object] = {}
        # Per job, the tree of its latest commitment (the only one GetLeaf and GetLeaves serve
        # under), so a job that commits every few steps keeps one tree here, not one per
        # commitment it ever had.
        self._trees: dict[bytes, MerkleTree] = {}
        # Two locks: committing a dataset (GetBatch's first call for a job) hashes every example
        # and must never hold up GetLeaf, which a party answers under the arbiter's deadline.
        self._lock = threading.Lock()
        self._data_lock = threading.Lock()

    def _tree(self, store: JobStore, signed: SignedCommitment) -> MerkleTree:
        """The tree of the latest commitment `signed`, built once per commitment: known by its
        root, not its size alone, since an auditor's store may be cut back and replayed again
        to as many steps (`JobStore.truncate`), when a cached tree of that size would prove
        leaves under a root no longer served."""
        n = signed.commitment.n
        with self._lock:
            tree = self._trees.get(store.spec.job_id)
            if tree is None or tree.size != n + 1 or tree.root != signed.commitment.root:
                tree = self._trees[store.spec.job_id] = store.tree(n)
            return tree

    # -- validation ----------------------------------------------------------------------------

    def _store(self, job_id: bytes) -> JobStore:
        store = self.stores.get(job_id_of(job_id))
        if store is None:
            raise NotFoundError(f"unknown job {job_id.hex()}")
        return store

    def _step(self, store: JobStore, step: int, *, allow_zero: bool = True) -> int:
        last = store.last_step()
        if step > last or (step == 0 and not allow_zero):
            raise OutOfRangeError(f"step {step} is not available "
                                  f"(steps {0 if allow_zero else 1}..{last})")
        return step

    def _commitment(self, store: JobStore, n: int) -> SignedCommitment:
        if n > MAX_UINT:  # a uint64 field; SQLite, like every count in ovt, holds 2**63 - 1
            raise OutOfRangeError(f"n = {n} is beyond any job's steps (at most {MAX_UINT})")
        signed = store.commitment(n or None)
        if signed is None:
            raise RefusedError("no commitment yet" if not n else f"no commitment over {n} steps")
        return signed

    # -- RPCs ----------------------------------------------------------------------------------

    def GetSpec(self, request, context):
        return ovt_pb2.SpecReply(spec=self._store(request.job_id).spec.to_bytes())

    def GetCommitment(self, request, context):
        store = self._store(request.job_id)
        return ovt_pb2.CommitmentReply(
            signed_commitment=self._commitment(store, request.n).to_bytes())

    def GetLeaf(self, request, context):
        store = self._store(request.job_id)
        signed = self._commitment(store, 0)
        n = signed.commitment.n
        if request.step > n:
            raise OutOfRangeError(f"step {request.step} is beyond the committed {n} steps")
        reply = self._leaf_reply(store, request.step, self._tree(store, signed))
        if self.leaf_fault is not None:
            reply = self.leaf_fault(request.step, reply, context)
        return reply

    def GetLeaves(self, request, context):
        store = self._store(request.job_id)
        signed = self._commitment(store, 0)
        n = signed.commitment.n
        if request.first > request.last or request.last > n or \
                request.last - request.first >= MAX_RANGE:
            raise OutOfRangeError(
                   f"bad range {request.first}..{request.last} (committed steps 0..{n}, at "
                   f"most {MAX_RANGE} per call)")
        tree = self._tree(store, signed)
        for step in range(request.first, request.last + 1):
            yield self._leaf_reply(store, step, tree)

    def GetLog(self, request, context):
        store = self._store(request.job_id)
        self._step(store, request.step, allow_zero=False)
        return ovt_pb2.LogReply(log=store.log_bytes(request.step))

    def GetCheckpoint(self, request, context):
        store = self._store(request.job_id)
        self._step(store, request.step)
        state = store.checkpoint(request.step)
        if state is None:  # not stored or damaged: regenerate from an earlier one (SPEC §4)
            ex = job_executor(store.spec, _REGEN_PROFILE, self.data_dir)
            state = store.state_at(request.step, ex)
        yield from chunks(safetensors.torch.save(state))

    def GetBatch(self, request, context):
        store = self._store(request.job_id)
        spec = store.spec
        if not 1 <= request.step <= spec.steps:
            raise OutOfRangeError(f"step {request.step} is outside 1..{spec.steps}")
        source, tree, batch_size = self._data(spec)
        indices = batch_indices(spec.seed, len(source), batch_size, request.step)
        return ovt_pb2.BatchReply(examples=[
            ovt_pb2.Example(index=int(i), tensors=encode_state(source.example(int(i))),
                            proof=tree.proof(int(i))) for i in indices])

    def _data(self, spec: JobSpec):
        with self._data_lock:
            if spec.job_id not in self._data_trees:
                program = load_job_program(spec, self.data_dir)
                self._data_trees[spec.job_id] = (
                    program.dataset, commit_job_examples(spec, program)[1], program.batch_size)
            return self._data_trees[spec.job_id]

    @staticmethod
    def _leaf_reply(store: JobStore, step: int, tree) -> ovt_pb2.LeafReply:
        leaf = store.leaf(step)
        return ovt_pb2.LeafReply(step=step, state_hash=leaf.state_hash, log_hash=leaf.log_hash,
                                 proof=tree.proof(step), tree_size=tree.size)


def chunks(payload: bytes, chunk_bytes: int = CHUNK_BYTES):
    """`payload` as a stream of `Chunk`s of at most `chunk_bytes`, the last carrying the
    payload's sha256 (how checkpoints and a submitted S_0 travel; `receive_chunks` and
    `join_chunks` reverse it)."""
    digest = hashlib.sha256(payload).digest()
    total = len(payload)
    for offset in range(0, max(total, 1), chunk_bytes):
        last = offset + chunk_bytes >= total
        yield ovt_pb2.Chunk(data=payload[offset:offset + chunk_bytes], offset=offset,
                            total_size=total, sha256=digest if last else b"")


def receive_chunks(chunks: Iterable[ovt_pb2.Chunk], max_bytes: int, out: BinaryIO,
                   admit: Callable[[int], object] = lambda total: None) -> None:
    """Write a chunk stream, as `chunks` makes it, to `out` as it arrives, holding one chunk at
    a time. Every chunk must follow the previous one and announce the same total size, of at
    most `max_bytes`; no more than that may arrive, and the whole must have the sha256 the last
    chunk carries. `admit(total)` is called with the announced size before the first byte is
    written; it may raise to refuse the stream. Raises PeerError for a broken stream, OSError as
    `out` does."""
    expected_offset, total, digest, hasher = 0, None, b"", hashlib.sha256()
    for chunk in chunks:
        if chunk.offset != expected_offset or (total is not None and chunk.total_size != total):
            raise PeerError("chunk stream out of order or inconsistent")
        if not chunk.data and (total is not None or chunk.total_size != 0):
            # only an empty payload is one empty chunk; empty chunks would hold a stream open
            raise PeerError("empty chunk in a chunk stream")
        if total is None:
            total = chunk.total_size
            if total > max_bytes:
                raise PeerError(f"peer announced {total} bytes, more than the {max_bytes} "
                                f"allowed")
            admit(total)
        expected_offset += len(chunk.data)
        if expected_offset > total:  # never take more than was announced
            raise PeerError(f"peer sent more than the {total} bytes it announced")
        hasher.update(chunk.data)
        out.write(chunk.data)
        digest = chunk.sha256
    if total is None or expected_offset != total or hasher.digest() != digest:
        raise PeerError("chunk stream truncated or its sha256 does not match")


def join_chunks(chunks: Iterable[ovt_pb2.Chunk], max_bytes: int) -> bytes:
    """Reassemble a chunk stream in memory, checked as `receive_chunks` checks it. Raises
    PeerError."""
    out = io.BytesIO()
    receive_chunks(chunks, max_bytes, out)
    return out.getvalue()


class RemoteClaims:
    """A verified `ClaimSource` over a peer's Claims service (SPEC §5: trust nothing).

    Leaves come in windows of up to `LEAF_WINDOW` through the streamed GetLeaves (one call per
    window instead of one per leaf), each checked against the peer's signed root before any is
    handed out; a leaf leaves the window once handed out. Unary GetLeaf is for point queries
    (a challenged leaf, the arbiter's bisection).
    """

    def __init__(self, channel: grpc.Channel, spec: JobSpec, *, role: str = "trainer",
                 deadline_s: float = DEFAULT_DEADLINE_S, max_state_bytes: int = 1 << 31) -> None:
        self.stub = ovt_pb2_grpc.ClaimsStub(channel)
        self.spec, self.role = spec, role
        self.deadline_s, self.max_state_bytes = deadline_s, max_state_bytes
        self._commitment: SignedCommitment | None = None
        self._window: dict[int, Leaf] = {}

    def _call(self, name: str, request):
        try:
            return getattr(self.stub, name)(request, timeout=self.deadline_s)
        except grpc.RpcError as err:
            raise PeerError(f"{self.role} {name} failed: {err.code().name}: {err.details()}") \
                from None

    def commitment(self) -> SignedCommitment:
        if self._commitment is None:
            reply = self._call("GetCommitment", ovt_pb2.CommitmentRequest(
                job_id=self.spec.job_id, n=self.spec.steps))
            signed = SignedCommitment.from_bytes(reply.signed_commitment)
            signed.verify(job_id=self.spec.job_id, role=self.role, n=self.spec.steps)
            self._commitment = signed
        return self._commitment

    def leaf(self, step: int) -> Leaf:
        if step not in self._window:
            self._window = self._fetch_leaves(step)
        return self._window.pop(step)

    def _fetch_leaves(self, first: int) -> dict[int, Leaf]:
        """Leaves first..first+LEAF_WINDOW-1 (at most to n), each verified; raises PeerError."""
        root = self.commitment().commitment
        if not 0 <= first <= root.n:
            raise PeerError(f"leaf {first} is outside the committed steps 0..{root.n}")
        last = min(first + LEAF_WINDOW - 1, root.n)
        request = ovt_pb2.StepRange(job_id=self.spec.job_id, first=first, last=last)
        leaves: dict[int, Leaf] = {}
        try:
            for step, reply in zip(range(first, last + 1),
                                   self.stub.GetLeaves(request, timeout=self.deadline_s),
                                   strict=True):
                leaves[step] = self._verified(step, reply, root)
        except ValueError:  # zip: the stream was longer or shorter than asked
            raise PeerError(f"{self.role} answered GetLeaves {first}..{last} with another "
                            f"number of leaves") from None
        except grpc.RpcError as err:
            raise PeerError(f"{self.role} GetLeaves failed: {err.code().name}: "
                            f"{err.details()}") from None
        return leaves

    def _verified(self, step: int, reply, root) -> Leaf:
        leaf = Leaf(step, bytes(reply.state_hash), bytes(reply.log_hash))
        if reply.step != step or reply.tree_size != root.n + 1:
            raise PeerError(f"{self.role} answered leaf {reply.step} of a tree of "
                            f"{reply.tree_size} for leaf {step} of {root.n + 1}")
        try:
            verify_inclusion(leaf.hash, step, root.n + 1, list(reply.proof), root.root)
        except OvtError as err:
            raise PeerError(f"{self.role}'s leaf {step} does not verify: {err}") from None
        return leaf

    def log_bytes(self, step: int) -> bytes:
        return bytes(self._call("GetLog", ovt_pb2.StepRef(job_id=self.spec.job_id,
                                                          step=step)).log)

    def initial_state(self):
        try:
            stream = self.stub.GetCheckpoint(ovt_pb2.StepRef(job_id=self.spec.job_id, step=0),
                                             timeout=self.deadline_s)
            payload = join_chunks(stream, self.max_state_bytes)
        except grpc.RpcError as err:
            raise PeerError(f"{self.role} GetCheckpoint failed: {err.code().name}: "
                            f"{err.details()}") from None
        try:
            state = load_safetensors(payload)
        except StateFormatError as err:
            raise PeerError(f"{self.role} sent an S_0 that is not a safetensors state: {err}") \
                from None
        if state_digest(state) != self.spec.h0:
            raise PeerError(f"{self.role} sent an S_0 that does not hash to the job's h_0")
        return state
