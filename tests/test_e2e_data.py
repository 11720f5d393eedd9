"""End to end on a user's data file (issue 12): `ovt job create` on a job file with a [data]
section, `ovt-trainer serve --data-dir` trains it, `ovt-auditor serve --data-dir` (its own copy
of the file, another accumulation order) audits it to `matched` with the trainer's root. Both
daemons run as real processes on 127.0.0.1 (ephemeral ports); every wait is bounded and every
process started is killed at the end.

Around the tokens run, what a node must refuse: a job whose file is not in the trainer's data
folder (refused at submission), and an audit without a data folder or on a file that is not
the committed one (refused before anything is replayed)."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import safetensors.torch
import torch

from auditor_node.audit import run_audit
from proto import ovt_pb2, ovt_pb2_grpc
from protocol.cli.main import main
from protocol.commit.commitments import SignedCommitment
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError
from protocol.job.spec import JobSpec
from tests.auditor_node.daemon import watch_audit

pytestmark = pytest.mark.network
CALL_TIMEOUT_S = 30
TRAIN_TIMEOUT_S = 120.0
STEPS = 6

TOKEN_JOB = f"""
program = "token-lm"
preset = "test"
steps = {STEPS}
checkpoint_interval = 2
commit_interval = 3
[data]
kind = "tokens"
path = "data/train.bin"
dtype = "uint16"
window = 16
"""
TENSOR_JOB = f"""
program = "image-cnn"
preset = "test"
steps = {STEPS}
checkpoint_interval = 2
commit_interval = 3
[data]
kind = "tensors"
path = "data/images.safetensors"
"""


def _user_folder(tmp_path: Path, job_text: str, files: dict[str, bytes]) -> Path:
    """The user's folder: the job file and its data, then `ovt job create` on it."""
    folder = tmp_path / "user"
    (folder / "data").mkdir(parents=True)
    for name, data in files.items():
        (folder / "data" / name).write_bytes(data)
    (folder / "job.toml").write_text(job_text)
    assert main(["job", "create", str(folder / "job.toml"), "--out",
                 str(folder / "job.ovtjob")]) == 0
    return folder


def _operator_copy(user: Path, name: str) -> Path:
    """An operator's own data folder: a copy of the user's data/ (as each would fetch it)."""
    shutil.copytree(user / "data", user.parent / name / "data")
    return user.parent / name


def _submit(channel, user: Path) -> JobSpec:
    spec_bytes = (user / "job.ovtjob").read_bytes()
    reply = ovt_pb2_grpc.TrainerStub(channel).Submit(ovt_pb2.SubmitRequest(
        spec=spec_bytes, initial_state=(user / "job.s0.safetensors").read_bytes()),
        timeout=CALL_TIMEOUT_S)
    spec = JobSpec.from_bytes(spec_bytes)
    assert reply.job_id == spec.job_id
    return spec


def _wait_done(channel, job_id) -> ovt_pb2.JobStatus:
    stub, deadline = ovt_pb2_grpc.TrainerStub(channel), time.monotonic() + TRAIN_TIMEOUT_S
    while True:
        status = stub.Status(ovt_pb2.JobRef(job_id=job_id), timeout=CALL_TIMEOUT_S)
        if status.state in ("done", "failed") or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def _trained_and_audited(trainer, auditor, spec: JobSpec) -> None:
    """Wait for the trainer to finish `spec`, have the auditor audit it: matched, same root."""
    with grpc.insecure_channel(trainer.address) as to_trainer:
        status = _wait_done(to_trainer, spec.job_id)
        assert status.state == "done", (status, trainer.log_text())
        trainer_signed = SignedCommitment.from_bytes(ovt_pb2_grpc.ClaimsStub(to_trainer)
                                                     .GetCommitment(ovt_pb2.CommitmentRequest(
                                                         job_id=spec.job_id, n=STEPS),
                                                         timeout=CALL_TIMEOUT_S)
                                                     .signed_commitment)
    auditor.wait_serving()
    with grpc.insecure_channel(auditor.address) as to_auditor:
        ovt_pb2_grpc.AuditorStub(to_auditor).Audit(
            ovt_pb2.AuditRequest(trainer_address=trainer.address, job_id=spec.job_id),
            timeout=CALL_TIMEOUT_S)
        verdict = watch_audit(to_auditor, spec.job_id)[-1]
        assert verdict.state == "matched", (verdict, auditor.log_text())
    auditor_signed = SignedCommitment.from_bytes(verdict.commitment)
    auditor_signed.verify(job_id=spec.job_id, role="auditor", n=STEPS)
    assert auditor_signed.commitment.root == trainer_signed.commitment.root


def test_a_token_file_job_is_trained_and_audited_by_the_daemons(launched, tmp_path):
    start_trainer, auditors = launched
    tokens = np.random.default_rng(0).integers(0, 512, 16 * 24 + 1).astype(np.uint16)
    user = _user_folder(tmp_path, TOKEN_JOB, {"train.bin": tokens.tobytes()})
    trainer_data, auditor_data = _operator_copy(user, "trainer-data"), \
        _operator_copy(user, "auditor-data")
    (trainer_data / "data" / "train.bin").rename(trainer_data / "data" / "kept.bin")
    # both start at once: their imports overlap
    trainer = start_trainer("--data-dir", str(trainer_data))
    auditor = auditors.launch(tmp_path / "auditor-store", "--profile", "emulated-gpu",
                              "--data-dir", str(auditor_data))
    trainer.wait_serving()
    with grpc.insecure_channel(trainer.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:  # the file is not in the trainer's folder
            _submit(channel, user)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "data file 'data/train.bin'" in refused.value.details()
        assert "is not in the data folder" in refused.value.details()
        (trainer_data / "data" / "kept.bin").rename(trainer_data / "data" / "train.bin")
        spec = _submit(channel, user)
    _trained_and_audited(trainer, auditor, spec)

    # An auditor without a data folder, or whose file is not the committed one, refuses
    # (in-process audits against the live trainer).
    key = KeyPair.load(auditors.key)
    with pytest.raises(ConfigError, match=r"no data folder \(--data-dir\)"):
        run_audit(trainer.address, spec.job_id, tmp_path / "store-a", key,
                  Profile.parse("cpu-1t"))
    assert not (tmp_path / "store-a" / spec.job_id.hex()).exists()
    tokens[40] = (tokens[40] + 1) % 512
    (auditor_data / "data" / "train.bin").write_bytes(tokens.tobytes())
    with pytest.raises(ConfigError, match="differs from the one this job committed to"):
        run_audit(trainer.address, spec.job_id, tmp_path / "store-b", key,
                  Profile.parse("cpu-1t"), data_dir=auditor_data)

    assert auditor.terminate() == 0, auditor.log_text()
    trainer.proc.send_signal(signal.SIGTERM)
    assert trainer.proc.wait(timeout=30) == 0, trainer.log_text()


@pytest.mark.slow
def test_a_tensor_file_job_is_trained_and_audited_by_the_daemons(launched, tmp_path):
    start_trainer, auditors = launched
    gen = torch.Generator().manual_seed(0)
    images = {"image": torch.randn(64, 3, 16, 16, generator=gen),  # image-cnn "test": 16x16
              "label": torch.randint(0, 10, (64,), generator=gen)}
    user = _user_folder(tmp_path, TENSOR_JOB,
                        {"images.safetensors": safetensors.torch.save(images)})
    trainer = start_trainer("--data-dir", str(_operator_copy(user, "trainer-data")))
    auditor = auditors.launch(tmp_path / "auditor-store", "--profile", "emulated-gpu",
                              "--data-dir", str(_operator_copy(user, "auditor-data")))
    trainer.wait_serving()
    with grpc.insecure_channel(trainer.address) as channel:
        spec = _submit(channel, user)
    assert spec.data.count == 64 and spec.data_file is not None
    _trained_and_audited(trainer, auditor, spec)
    assert auditor.terminate() == 0, auditor.log_text()
    trainer.proc.send_signal(signal.SIGTERM)
    assert trainer.proc.wait(timeout=30) == 0, trainer.log_text()
