"""SubmitStream: S_0 streamed in chunks, so a job whose S_0 exceeds the gRPC message size still
reaches the trainer; every malformed stream is refused with a one-line status; and what a peer
can make the trainer hold is bounded (issue 10, finding 6): S_0 streams to a temporary file that
never outlives the call, within one budget for all streams in flight, and a spec's model size is
bounded before anything is built (in-process trainer on 127.0.0.1)."""

from __future__ import annotations

import dataclasses
import threading
import time
import tracemalloc
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.submit import submit_job, submit_parts
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs import char_transformer
from protocol.job.create import build_job
from trainer_node.server import TrainerConfig, TrainerNode

from .daemon import watch_until

pytestmark = pytest.mark.network
MESSAGE_LIMIT = 256 << 10  # smaller than the job's S_0 (about 430 KiB)
CHUNK = 64 << 10
BUDGET = 600 << 10  # in flight: one of the job's S_0 at a time, not two
TEST_PRESET_PARAMS = 108_465  # char-transformer's "test" preset
WAIT_S = 30.0


@pytest.fixture(scope="module")
def job():
    spec, state0 = build_job(program="char-transformer", config={}, preset="test", steps=2,
                             seed=0, init_seed=1, policy=PrecisionPolicy(),
                             checkpoint_interval=1, commit_interval=2)
    return spec, safetensors.torch.save(state0)


@dataclass(frozen=True)
class Trainer:
    channel: grpc.Channel
    store: Path

    def temp_files(self) -> list[Path]:
        return sorted(self.store.rglob(".*.tmp"))


@contextmanager
def serving(store: Path, **limits):
    node = TrainerNode(TrainerConfig(
        listen="127.0.0.1:0", store=store, key=KeyPair.generate(),
        profile=Profile.parse("cpu-1t"), max_message_bytes=MESSAGE_LIMIT,
        max_state_bytes=1 << 20, **limits))
    port = node.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Trainer(channel, store)
    finally:
        assert node.stop()


@pytest.fixture
def trainer(tmp_path):
    with serving(tmp_path / "store", max_inflight_bytes=BUDGET,
                 max_params=TEST_PRESET_PARAMS) as started:
        yield started


@pytest.fixture
def channel(trainer):
    return trainer.channel


def _wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_state_beyond_the_message_size_goes_through_the_stream(job, trainer):
    spec, state0 = job
    channel = trainer.channel
    assert len(state0) > MESSAGE_LIMIT
    with pytest.raises(grpc.RpcError) as caught:
        ovt_pb2_grpc.TrainerStub(channel).Submit(
            ovt_pb2.SubmitRequest(spec=spec.to_bytes(), initial_state=state0), timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    job_id = submit_job(channel, spec.to_bytes(), state0, timeout=60, chunk_bytes=CHUNK)
    assert job_id == spec.job_id
    done = watch_until(channel, job_id, lambda s: s.state in ("done", "failed"))
    assert done.state == "done", done.error
    assert trainer.temp_files() == []


def _refused(channel, parts) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        ovt_pb2_grpc.TrainerStub(channel).SubmitStream(iter(parts), timeout=30)
    return caught.value


def test_malformed_streams_are_refused_and_leave_no_temp_file(job, trainer):
    spec, state0 = job
    channel = trainer.channel
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
        assert trainer.temp_files() == []


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


# -- issue 10, finding 6: peer-controlled memory -----------------------------------------------

class Held:
    """A SubmitStream request stream that sends the spec and S_0's first chunk, then waits for
    `release` before it sends the rest."""

    def __init__(self, spec: bytes, state0: bytes) -> None:
        self.parts = list(submit_parts(spec, state0, CHUNK))
        self.release = threading.Event()

    def __iter__(self):
        yield from self.parts[:2]
        self.release.wait(WAIT_S)
        yield from self.parts[2:]


def _one_temp_file_with_data(trainer: Trainer) -> bool:
    files = trainer.temp_files()
    return len(files) == 1 and files[0].stat().st_size > 0


def test_finding_6_a_stream_beyond_the_inflight_budget_is_resource_exhausted(job, trainer):
    spec, state0 = job
    stub = ovt_pb2_grpc.TrainerStub(trainer.channel)
    over = b"\0" * (BUDGET + 1)  # within --max-state-mb, beyond the budget on its own
    err = _refused(trainer.channel, submit_parts(spec.to_bytes(), over, CHUNK))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "budget" in err.details()
    assert trainer.temp_files() == []

    held = Held(spec.to_bytes(), state0)  # holds the job's S_0 of the budget while it waits
    first = stub.SubmitStream.future(iter(held), timeout=WAIT_S)
    try:
        _wait_for(lambda: _one_temp_file_with_data(trainer), "the first stream's first chunk")
        err = _refused(trainer.channel, submit_parts(spec.to_bytes(), state0, CHUNK))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "budget" in err.details()
        assert len(trainer.temp_files()) == 1  # the refused stream's file is gone
    finally:
        held.release.set()
    assert first.result().job_id == spec.job_id
    assert trainer.temp_files() == []
    # the budget was given back: the same S_0 goes through again
    assert submit_job(trainer.channel, spec.to_bytes(), state0, timeout=WAIT_S,
                      chunk_bytes=CHUNK) == spec.job_id
    assert trainer.temp_files() == []


def test_finding_6_a_cancelled_stream_leaves_no_temp_file(job, trainer):
    spec, state0 = job
    held = Held(spec.to_bytes(), state0)
    call = ovt_pb2_grpc.TrainerStub(trainer.channel).SubmitStream.future(iter(held),
                                                                         timeout=WAIT_S)
    try:
        _wait_for(lambda: _one_temp_file_with_data(trainer), "the stream's first chunk")
        call.cancel()
        _wait_for(lambda: trainer.temp_files() == [], "the temp file to be removed")
    finally:
        held.release.set()
    # nothing of the cancelled stream stayed held: the whole budget is there for the next one
    assert submit_job(trainer.channel, spec.to_bytes(), state0, timeout=WAIT_S,
                      chunk_bytes=CHUNK) == spec.job_id


def test_finding_6_a_model_over_max_params_is_refused_before_anything_is_built(
        job, trainer, monkeypatch):
    spec, _ = job
    built = []

    def record_the_build(*args):
        built.append(args)
        raise RuntimeError("the model was built")

    monkeypatch.setattr(char_transformer, "CharTransformer", record_the_build)
    bigger = dataclasses.replace(spec, config={**spec.config, "d_model": 128}).to_bytes()
    assert char_transformer.parameter_count({**spec.config, "d_model": 128}) > \
        TEST_PRESET_PARAMS
    err = _refused(trainer.channel, [ovt_pb2.SubmitPart(spec=bigger)])  # no S_0 sent at all
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert "parameters" in err.details() and str(TEST_PRESET_PARAMS) in err.details()
    with pytest.raises(grpc.RpcError) as caught:
        ovt_pb2_grpc.TrainerStub(trainer.channel).Submit(
            ovt_pb2.SubmitRequest(spec=bigger, initial_state=b""), timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert built == [] and list(trainer.store.iterdir()) == []


def test_a_model_of_exactly_max_params_is_taken(job, trainer):
    spec, state0 = job
    assert char_transformer.parameter_count(spec.config) == TEST_PRESET_PARAMS
    assert submit_job(trainer.channel, spec.to_bytes(), state0, timeout=WAIT_S,
                      chunk_bytes=CHUNK) == spec.job_id


def test_finding_9_the_trainer_removes_stale_temp_files_on_start(tmp_path):
    """Issue 10, finding 9: a kill can leave a temporary file (an S_0 streaming in, an atomic
    write); the daemon removes them when it starts."""
    store = tmp_path / "store"
    (store / "somejob" / "checkpoints").mkdir(parents=True)
    stale = [store / ".submitted-s0.abcdefgh.tmp",
             store / "somejob" / "checkpoints" / ".000000010.safetensors.abcdefgh.tmp"]
    for path in stale:
        path.write_bytes(b"half written")
    with serving(store) as started:
        assert started.temp_files() == []


def test_finding_6_a_submitted_s0_is_hashed_on_disk_and_stored_as_it_came(tmp_path):
    """Finding 6 (review): the trainer read a submitted S_0 whole into memory, loaded it,
    hashed it twice and saved it again. Now it is hashed where it lies and moved into the
    store: the checkpoint holds the bytes sent (with the client's own metadata), and the
    submission allocates far less than the S_0 (Python allocations: what reading, loading or
    saving it would take shows up here; the runner is not started, so nothing trains)."""
    spec, state = build_job(program="char-transformer", preset="test", steps=2, seed=0,
                            config={"d_model": 256, "n_heads": 4, "n_layers": 2}, init_seed=1,
                            policy=PrecisionPolicy(), checkpoint_interval=1, commit_interval=2)
    state0 = safetensors.torch.save(state, metadata={"sent by": "a client"})
    assert len(state0) > 6 << 20
    node = TrainerNode(TrainerConfig(
        listen="127.0.0.1:0", store=tmp_path / "store", key=KeyPair.generate(),
        profile=Profile.parse("cpu-1t"), max_message_bytes=MESSAGE_LIMIT,
        max_state_bytes=16 << 20))
    node.server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{node.port}") as channel:
            tracemalloc.start()
            try:
                assert submit_job(channel, spec.to_bytes(), state0, timeout=WAIT_S,
                                  chunk_bytes=16 << 10) == spec.job_id
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    finally:
        assert node.stop()
    stored = tmp_path / "store" / spec.job_id.hex() / "checkpoints" / "000000000.safetensors"
    assert stored.read_bytes() == state0
    assert peak < len(state0) / 3, (peak, len(state0))
