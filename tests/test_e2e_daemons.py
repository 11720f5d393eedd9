"""End to end (issue 4): `ovt-trainer serve` and `ovt-auditor serve` as real processes on
127.0.0.1 (ephemeral ports). A tiny built-in job, written as `ovt job create` writes it, is
submitted with `ovt-trainer submit` and trained on profile cpu-2t; the auditor daemon, replaying
on emulated-gpu (another accumulation order), is asked to audit it, reaches `matched`, and its
signed root equals the trainer's. Both daemons exit 0 on SIGTERM."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from protocol.commit.commitments import SignedCommitment
from protocol.engine.precision import PrecisionPolicy
from protocol.job.create import build_job
from tests.auditor_node.daemon import watch_audit

pytestmark = pytest.mark.network
TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS = 20
CALL_TIMEOUT_S = 10
TRAIN_TIMEOUT_S = 120.0


def _create_job(tmp_path):
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=STEPS, seed=0,
                             init_seed=3, policy=PrecisionPolicy(), checkpoint_interval=5,
                             commit_interval=10)
    spec_path = tmp_path / "tiny.ovtjob"  # as `ovt job create` writes it
    spec_path.write_bytes(spec.to_bytes())
    (tmp_path / "tiny.s0.safetensors").write_bytes(safetensors.torch.save(state0))
    return spec, spec_path


def _wait_done(channel, job_id) -> ovt_pb2.JobStatus:
    stub, deadline = ovt_pb2_grpc.TrainerStub(channel), time.monotonic() + TRAIN_TIMEOUT_S
    while True:
        status = stub.Status(ovt_pb2.JobRef(job_id=job_id), timeout=CALL_TIMEOUT_S)
        if status.state in ("done", "failed") or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def test_the_auditor_daemon_matches_the_trainer_daemon_on_other_hardware(launched, tmp_path):
    start_trainer, auditors = launched
    trainer = start_trainer()  # both start at once: their imports overlap
    auditor = auditors.launch(tmp_path / "auditor-store", "--profile", "emulated-gpu")
    spec, spec_path = _create_job(tmp_path)
    trainer.wait_serving()
    submitted = subprocess.run(
        [sys.executable, "-m", "trainer_node.cli", "submit", "--trainer", trainer.address,
         str(spec_path)], capture_output=True, text=True, timeout=120)
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.strip() == spec.job_id.hex()

    with grpc.insecure_channel(trainer.address) as to_trainer:
        status = _wait_done(to_trainer, spec.job_id)
        assert status.state == "done", (status, trainer.log_text())
        trainer_signed = SignedCommitment.from_bytes(ovt_pb2_grpc.ClaimsStub(to_trainer)
                                                     .GetCommitment(ovt_pb2.CommitmentRequest(
                                                         job_id=spec.job_id, n=STEPS),
                                                         timeout=CALL_TIMEOUT_S)
                                                     .signed_commitment)
    trainer_signed.verify(job_id=spec.job_id, role="trainer", n=STEPS)

    auditor.wait_serving()
    with grpc.insecure_channel(auditor.address) as to_auditor:
        ovt_pb2_grpc.AuditorStub(to_auditor).Audit(
            ovt_pb2.AuditRequest(trainer_address=trainer.address, job_id=spec.job_id),
            timeout=CALL_TIMEOUT_S)
        verdict = watch_audit(to_auditor, spec.job_id)[-1]
        assert verdict.state == "matched", (verdict, auditor.log_text())
        auditor_signed = SignedCommitment.from_bytes(verdict.commitment)
        served = ovt_pb2_grpc.ClaimsStub(to_auditor).GetCommitment(
            ovt_pb2.CommitmentRequest(job_id=spec.job_id, n=STEPS), timeout=CALL_TIMEOUT_S)
        assert served.signed_commitment == verdict.commitment
    auditor_signed.verify(job_id=spec.job_id, role="auditor", n=STEPS)
    assert auditor_signed.commitment.root == trainer_signed.commitment.root
    assert auditor_signed.commitment.public_key != trainer_signed.commitment.public_key

    assert auditor.terminate() == 0, auditor.log_text()
    assert trainer.terminate() == 0, trainer.log_text()
