"""SubmitStream: S_0 streamed in chunks, so a job whose S_0 exceeds the gRPC message size still
reaches the trainer; and every malformed stream is refused with a one-line status (in-process
trainer on 127.0.0.1)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.submit import submit_job, submit_parts
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from trainer_node.server import TrainerConfig, TrainerNode

from .daemon import watch_until

pytestmark = pytest.mark.network
MESSAGE_LIMIT = 256 << 10  # smaller than the job's S_0 (about 430 KiB)
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def job():
    spec, state0 = build_job(program="char-transformer", config={}, preset="test", steps=2,
                             seed=0, init_seed=1, policy=PrecisionPolicy(),
                             checkpoint_interval=1, commit_interval=2)
    return spec, safetensors.torch.save(state0)


@pytest.fixture
def channel(tmp_path):
    node = TrainerNode(TrainerConfig(
        listen="127.0.0.1:0", store=tmp_path / "store", key=KeyPair.generate(),
        profile=Profile.parse("cpu-1t"), max_message_bytes=MESSAGE_LIMIT,
        max_state_bytes=1 << 20))
    port = node.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        assert node.stop()


def test_a_state_beyond_the_message_size_goes_through_the_stream(job, channel):
    spec, state0 = job
    assert len(state0) > MESSAGE_LIMIT
    with pytest.raises(grpc.RpcError) as caught:
        ovt_pb2_grpc.TrainerStub(channel).Submit(
            ovt_pb2.SubmitRequest(spec=spec.to_bytes(), initial_state=state0), timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    job_id = submit_job(channel, spec.to_bytes(), state0, timeout=60, chunk_bytes=CHUNK)
    assert job_id == spec.job_id
    done = watch_until(channel, job_id, lambda s: s.state in ("done", "failed"))
    assert done.state == "done", done.error


def _refused(channel, parts) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        ovt_pb2_grpc.TrainerStub(channel).SubmitStream(iter(parts), timeout=30)
    return caught.value


def test_malformed_streams_are_refused(job, channel):
    spec, state0 = job
    good = list(submit_parts(spec.to_bytes(), state0, CHUNK))
    no_spec = good[1:]
    late_spec = good[:2] + [ovt_pb2.SubmitPart(spec=spec.to_bytes())] + good[2:]
    truncated = good[:-1]
    reordered = [good[0], good[2], good[1], *good[3:]]
    other = ovt_pb2.Chunk()
    other.CopyFrom(good[-1].initial_state)
    other.sha256 = bytes(32)
    bad_digest = good[:-1] + [ovt_pb2.SubmitPart(initial_state=other)]
    for parts, words in ((no_spec, "first part"), (late_spec, "only the first part"),
                         (truncated, "truncated"), (reordered, "out of order"),
                         (bad_digest, "sha256"), ([], "first part")):
        err = _refused(channel, parts)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details()


def test_a_state_over_the_trainers_bound_is_refused(job, channel):
    spec, _ = job
    big = b"\0" * (2 << 20)  # the fixture's trainer takes at most 1 MiB
    err = _refused(channel, submit_parts(spec.to_bytes(), big, CHUNK))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "more than" in err.details()


def test_a_disallowed_program_is_refused_before_the_state(job, channel):
    spec, _ = job
    foreign = dataclasses.replace(spec, program="evil.module:prog").to_bytes()
    err = _refused(channel, [ovt_pb2.SubmitPart(spec=foreign)])  # no state sent at all
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "not allowed" in err.details()
