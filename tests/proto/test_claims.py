"""The Claims service over real gRPC on 127.0.0.1 (ephemeral port): an auditor replays a job
through `RemoteClaims` and matches; bad requests get the right status codes and the server keeps
serving; a lying server's leaves do not verify."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import struct
from concurrent import futures

import grpc
import pytest

from auditor_node.cli import main as auditor_main
from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import ClaimsServicer, RemoteClaims, StoreDirectory, chunks, join_chunks
from protocol.codec.state import decode_state, load_safetensors, state_digest
from protocol.commit.commitments import Claim, Commitment, sign_commitment
from protocol.commit.data import ProvenExample, verify_examples
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.engine.batches import batch_indices
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import PeerError
from protocol.job.create import build_job
from protocol.job.run import replay_job, run_job
from protocol.job.store import JobStore

pytestmark = pytest.mark.network
TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=STEPS, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=5,
                             commit_interval=STEPS)
    root = tmp_path_factory.mktemp("trainer")
    store = JobStore(root, spec)
    store.put_initial(state0)
    signed = run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-2t"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ovt_pb2_grpc.add_ClaimsServicer_to_server(ClaimsServicer(StoreDirectory(root)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield spec, store, signed, channel
    channel.close()
    server.stop(grace=None)


def test_auditor_replays_through_the_service(served, tmp_path):
    spec, _, signed, channel = served
    outcome = replay_job(JobStore(tmp_path, spec), RemoteClaims(channel, spec),
                         KeyPair.generate(), profile=Profile.parse("emulated-gpu"))
    assert outcome.matches
    assert outcome.commitment.commitment.root == signed.commitment.root


def test_checkpoint_stream_reassembles(served):
    spec, store, _, channel = served
    stub = ovt_pb2_grpc.ClaimsStub(channel)
    payload = join_chunks(stub.GetCheckpoint(ovt_pb2.StepRef(job_id=spec.job_id, step=7),
                                             timeout=30), 1 << 30)
    assert len(payload) > 0


@pytest.mark.parametrize("call, request_, code", [
    ("GetSpec", ovt_pb2.JobRef(job_id=b"short"), grpc.StatusCode.INVALID_ARGUMENT),
    ("GetSpec", ovt_pb2.JobRef(job_id=bytes(32)), grpc.StatusCode.NOT_FOUND),
    ("GetLog", "step:0", grpc.StatusCode.OUT_OF_RANGE),
    ("GetLog", "step:99", grpc.StatusCode.OUT_OF_RANGE),
    ("GetLeaf", "step:99", grpc.StatusCode.OUT_OF_RANGE),
    ("GetBatch", "step:0", grpc.StatusCode.OUT_OF_RANGE),
    ("GetCommitment", "n:5", grpc.StatusCode.FAILED_PRECONDITION),
    ("GetCommitment", f"n:{2**63}", grpc.StatusCode.OUT_OF_RANGE),  # SQLite's int64 overflows
    ("GetCommitment", f"n:{2**64 - 1}", grpc.StatusCode.OUT_OF_RANGE),
])
def test_bad_requests_get_status_codes_and_the_server_keeps_serving(served, call, request_,
                                                                    code):
    spec, _, _, channel = served
    stub = ovt_pb2_grpc.ClaimsStub(channel)
    if call == "GetCommitment":
        request_ = ovt_pb2.CommitmentRequest(job_id=spec.job_id, n=int(request_.split(":")[1]))
    elif isinstance(request_, str):
        request_ = ovt_pb2.StepRef(job_id=spec.job_id, step=int(request_.split(":")[1]))
    with pytest.raises(grpc.RpcError) as err:
        getattr(stub, call)(request_, timeout=10)
    assert err.value.code() == code
    assert "Traceback" not in (err.value.details() or "")
    assert stub.GetSpec(ovt_pb2.JobRef(job_id=spec.job_id), timeout=10).spec == spec.to_bytes()


def test_a_leaf_inconsistent_with_the_signed_root_is_refused(served, tmp_path):
    spec, store, _, channel = served
    leaf = store.leaf(4)
    store._put_leaf(Leaf(4, bytes(32), leaf.log_hash))  # served, but not what was signed
    try:
        fresh = ClaimsServicer(StoreDirectory(store.dir.parent))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        ovt_pb2_grpc.add_ClaimsServicer_to_server(fresh, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as lying:
            with pytest.raises(PeerError, match="leaf 4 does not verify"):
                RemoteClaims(lying, spec).leaf(4)
        server.stop(grace=None)
    finally:
        store._put_leaf(leaf)


def test_a_served_batch_verifies_against_the_data_commitment(served):
    spec, _, _, channel = served
    stub = ovt_pb2_grpc.ClaimsStub(channel)
    reply = stub.GetBatch(ovt_pb2.StepRef(job_id=spec.job_id, step=3), timeout=30)
    items = [ProvenExample(e.index, decode_state(e.tensors), list(e.proof))
             for e in reply.examples]
    indices = batch_indices(spec.seed, spec.data.count, TINY["batch_size"], 3)
    verify_examples(spec.data, items, indices)


def test_join_chunks_never_holds_more_than_was_announced():
    """A peer announcing 1 byte and streaming on is cut off at its first extra byte."""
    def endless():
        offset = 0
        while True:
            yield ovt_pb2.Chunk(data=b"x" * 1024, offset=offset, total_size=1)
            offset += 1024

    with pytest.raises(PeerError, match="more than the 1 bytes it announced"):
        join_chunks(endless(), max_bytes=1 << 20)


def test_empty_chunks_cannot_hold_a_stream_open():
    """Review of finding 5: a chunk stream of endless empty chunks (each with the right offset)
    kept a stream, its slot and its budget claim forever; only an empty payload is one empty
    chunk."""
    data = b"x" * 10

    def stalling():
        yield ovt_pb2.Chunk(data=b"", offset=0, total_size=len(data))
        yield ovt_pb2.Chunk(data=data, offset=0, total_size=len(data),
                            sha256=hashlib.sha256(data).digest())

    with pytest.raises(PeerError, match="empty chunk"):
        join_chunks(stalling(), max_bytes=1 << 20)
    assert join_chunks(chunks(b""), max_bytes=1 << 20) == b""
    assert join_chunks(chunks(data), max_bytes=1 << 20) == data


@contextlib.contextmanager
def _serving(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    ovt_pb2_grpc.add_ClaimsServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield f"127.0.0.1:{port}", channel
    finally:
        server.stop(grace=None)


def test_a_program_that_does_not_load_is_a_status_not_unknown(served, tmp_path):
    """Finding 7 (issue 10): GetCheckpoint (regenerating a missing S_t) and GetBatch load the
    job's program; a program that does not load (here: its source hash differs) is the
    program's error, FAILED_PRECONDITION, through `proto.status.rpc_errors`."""
    spec, store, _, _ = served
    other = dataclasses.replace(spec, program_source_hash=bytes(32))
    moved = JobStore(tmp_path, other)
    moved.put_initial(store.checkpoint(0))
    (moved.dir / "checkpoints" / f"{0:09d}.safetensors").write_bytes(b"damaged")
    with _serving(ClaimsServicer(StoreDirectory(tmp_path))) as (_, channel):
        stub = ovt_pb2_grpc.ClaimsStub(channel)
        ref = ovt_pb2.StepRef(job_id=other.job_id, step=0)
        for call in (lambda: list(stub.GetCheckpoint(ref, timeout=30)),
                     lambda: stub.GetBatch(ovt_pb2.StepRef(job_id=other.job_id, step=1),
                                           timeout=30)):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "differs from the one this job committed to" in err.value.details()


def test_get_checkpoint_regenerates_around_a_damaged_checkpoint_header(served, tmp_path):
    """Finding 7 (issue 10): one changed header byte in a stored checkpoint made GetCheckpoint
    UNKNOWN; it is treated as missing and S_10 regenerated from S_5."""
    spec, store, _, _ = served
    shutil.copytree(store.dir, tmp_path / store.dir.name)
    path = tmp_path / store.dir.name / "checkpoints" / f"{10:09d}.safetensors"
    path.write_bytes(path.read_bytes().replace(b'"dtype":"I64"', b'"dtype":"U64"', 1))
    with _serving(ClaimsServicer(StoreDirectory(tmp_path))) as (_, channel):
        payload = join_chunks(ovt_pb2_grpc.ClaimsStub(channel).GetCheckpoint(
            ovt_pb2.StepRef(job_id=spec.job_id, step=10), timeout=60), 1 << 30)
    assert state_digest(load_safetensors(payload)) == store.leaf(10).state_hash


def _hostile_s0(dtype: str = "U64") -> bytes:
    """A safetensors S_0 with a tensor of a dtype that is no state dtype."""
    header = json.dumps({"step": {"dtype": dtype, "shape": [], "data_offsets": [0, 8]}})
    return struct.pack("<Q", len(header)) + header.encode() + bytes(8)


class _HostileS0(ClaimsServicer):
    def GetCheckpoint(self, request, context):
        yield from chunks(_hostile_s0())


def test_a_hostile_s0_is_a_peer_error(served):
    """Finding 7 (issue 10): safetensors loaded a U64 tensor, and hashing it raised TypeError."""
    spec, store, _, _ = served
    with _serving(_HostileS0(StoreDirectory(store.dir.parent))) as (_, channel):
        with pytest.raises(PeerError, match="dtype 'U64'"):
            RemoteClaims(channel, spec).initial_state()


def test_ovt_auditor_audit_against_a_hostile_s0_exits_2_with_one_line(served, tmp_path,
                                                                     capsys):
    """Finding 7 (issue 10): it exited 1, the code for "diverged", with a traceback."""
    spec, store, _, _ = served
    key = tmp_path / "auditor.key"
    KeyPair.generate().save(key)
    with _serving(_HostileS0(StoreDirectory(store.dir.parent))) as (address, _):
        code = auditor_main(["audit", "--trainer", address, "--job", spec.job_id.hex(),
                             "--store", str(tmp_path / "store"), "--key", str(key)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "error:" in err and "dtype 'U64'" in err
    assert "Traceback" not in err


class _Halt(Exception):
    pass


def test_a_job_that_commits_again_keeps_one_merkle_tree_in_the_servicer(tmp_path):
    """Issue 10 review: the servicer cached a tree per (job, commitment) for good, so a long
    job committing every few steps grew every daemon that served it without end."""
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=4, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=2,
                             commit_interval=2)
    store = JobStore(tmp_path, spec)
    store.put_initial(state0)

    def halt_after_2(step, steps):
        if step == 3:
            raise _Halt

    with pytest.raises(_Halt):
        run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-1t"),
                progress=halt_after_2)
    servicer = ClaimsServicer(StoreDirectory(tmp_path))
    ref = ovt_pb2.StepRef(job_id=spec.job_id, step=1)
    assert servicer.GetLeaf(ref, None).tree_size == 3  # under the commitment over 2 steps
    run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-1t"))
    assert servicer.GetLeaf(ref, None).tree_size == 5  # under the one over 4 steps
    assert list(servicer._trees.values())[0].size == 5 and len(servicer._trees) == 1


def test_a_store_cut_back_and_committed_again_is_proved_under_its_new_root(tmp_path):
    """Review 30, finding 2: an auditor's store is cut back and replayed again to as many
    steps (`JobStore.truncate`); the servicer's tree, known by its size alone, would then
    prove its leaves under a root it no longer serves, and the auditor lose its dispute."""
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=4, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=2,
                             commit_interval=2)
    store = JobStore(tmp_path, spec)
    store.put_initial(state0)
    key = KeyPair.generate()
    first = run_job(store, key, profile=Profile.parse("cpu-1t"))
    servicer = ClaimsServicer(StoreDirectory(tmp_path))
    ref = ovt_pb2.StepRef(job_id=spec.job_id, step=1)
    assert servicer.GetLeaf(ref, None).tree_size == 5  # the tree of `first`, cached
    store.truncate(2)
    for step in (3, 4):  # other leaves 3 and 4 (what another commitment's logs replayed)
        store._put_leaf(Leaf(step, bytes([step]) * 32, bytes([step]) * 32))
    again = sign_commitment(Commitment(spec.job_id, 4, store.tree().root, bytes([4]) * 32,
                                       key.public_key, "auditor", 1), key)
    store.save_commitment(again)
    assert again.commitment.root != first.commitment.root
    reply = servicer.GetLeaf(ref, None)
    Claim(spec.job_id, 1, bytes(reply.state_hash), bytes(reply.log_hash),
          tuple(bytes(p) for p in reply.proof), reply.tree_size).verify(again)
