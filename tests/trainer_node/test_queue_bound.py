"""The trainer's job queue is bounded (MAX_QUEUED): a job beyond it is refused before anything
is written, one already held is still accepted."""

from __future__ import annotations

import grpc
import pytest
import safetensors.torch

import trainer_node.runner as runner_module
from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import StoreDirectory
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import ResourceLimitError
from protocol.job.create import build_job
from protocol.job.store import JobStore
from trainer_node.runner import JobRunner
from trainer_node.server import TrainerConfig, TrainerNode

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}


def _job(seed: int):
    return build_job(program="image-cnn", config=TINY, preset=None, steps=2, seed=seed,
                     init_seed=seed, policy=PrecisionPolicy(), checkpoint_interval=1,
                     commit_interval=2)


def _store(root, seed: int) -> JobStore:
    spec, state0 = _job(seed)
    store = JobStore(root, spec)
    store.put_initial(state0)
    return store


def test_the_runner_refuses_a_job_beyond_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_module, "MAX_QUEUED", 2)
    runner = JobRunner(StoreDirectory(tmp_path), KeyPair.generate(), Profile.parse("cpu-1t"))
    first, second, third = (_store(tmp_path, seed) for seed in (1, 2, 3))
    runner.submit(first)
    runner.submit(second)  # the worker is not started: both wait
    assert not runner.accepts(third.spec.job_id)
    with pytest.raises(ResourceLimitError, match="2 jobs are already waiting"):
        runner.submit(third)
    assert runner.status(third.spec.job_id) is None
    assert runner.accepts(first.spec.job_id)  # a job it holds is still taken, idempotently
    assert runner.submit(first).state == "queued"


@pytest.mark.network
def test_submit_beyond_the_bound_is_resource_exhausted_and_writes_nothing(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(runner_module, "MAX_QUEUED", 0)
    node = TrainerNode(TrainerConfig(listen="127.0.0.1:0", store=tmp_path / "store",
                                     key=KeyPair.generate(), profile=Profile.parse("cpu-1t")))
    port = node.start()
    try:
        spec, state0 = _job(4)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as caught:
                ovt_pb2_grpc.TrainerStub(channel).Submit(ovt_pb2.SubmitRequest(
                    spec=spec.to_bytes(), initial_state=safetensors.torch.save(state0)),
                    timeout=30)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not (tmp_path / "store" / spec.job_id.hex()).exists()
    finally:
        assert node.stop()
