"""A job whose data commitment is not its built-in program's own dataset (review 26, finding
3): the trainer takes it at Submit, where nothing is built (hashing every example is a job's
work, which the queue bounds), and fails it when it starts training, naming the dataset, before
a step is trained: no one could prove its batches (SPEC §2.1, §5.3), so an honest auditor's
challenge of a cheat in it would be ruled against both (in-process trainer on 127.0.0.1)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import safetensors.torch

from proto.submit import submit_job
from protocol.commit.data import DataCommitment
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from trainer_node.server import TrainerConfig, TrainerNode

from .daemon import watch_until

pytestmark = pytest.mark.network
TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
WAIT_S = 60.0


@pytest.fixture(scope="module")
def job():
    return build_job(program="image-cnn", config=TINY, preset=None, steps=2, seed=0,
                     init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=1,
                     commit_interval=2)


@pytest.mark.parametrize("data, error", [
    (lambda d: DataCommitment(b"\x11" * 32, d.count),
     "the dataset of program 'image-cnn' differs from the one this job committed to (its "
     "examples give root "),
    (lambda d: DataCommitment(d.root, d.count + 1),
     "the dataset of program 'image-cnn' holds 64 examples, but the job commits to 65"),
], ids=["root", "count"])
def test_a_job_on_other_examples_than_its_commitment_fails_when_it_starts(job, tmp_path, data,
                                                                         error):
    spec, state0 = job
    forged = dataclasses.replace(spec, data=data(spec.data))
    node = TrainerNode(TrainerConfig(listen="127.0.0.1:0", store=tmp_path / "store",
                                     key=KeyPair.generate(), profile=Profile.parse("cpu-1t")))
    port = node.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            job_id = submit_job(channel, forged.to_bytes(), safetensors.torch.save(state0),
                                timeout=WAIT_S)
            status = watch_until(channel, job_id, lambda s: s.state in ("done", "failed"),
                                 timeout=WAIT_S)
    finally:
        assert node.stop()
    assert (status.state, status.step) == ("failed", 0)
    assert error in status.error
