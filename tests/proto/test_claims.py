"""The Claims service over real gRPC on 127.0.0.1 (ephemeral port): an auditor replays a job
through `RemoteClaims` and matches; bad requests get the right status codes and the server keeps
serving; a lying server's leaves do not verify."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import ClaimsServicer, RemoteClaims, StoreDirectory, join_chunks
from protocol.codec.state import decode_state
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
])
def test_bad_requests_get_status_codes_and_the_server_keeps_serving(served, call, request_,
                                                                    code):
    spec, _, _, channel = served
    stub = ovt_pb2_grpc.ClaimsStub(channel)
    if request_ == "n:5":
        request_ = ovt_pb2.CommitmentRequest(job_id=spec.job_id, n=5)
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
