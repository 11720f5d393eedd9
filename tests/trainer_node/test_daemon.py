"""`ovt-trainer serve` as a real process: trains a submitted job to the same signed root as an
in-process run while serving claims, resumes after SIGKILL and after SIGTERM without changing a
leaf, refuses plaintext off loopback, and works over TLS with a self-signed certificate."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import join_chunks
from proto.serving import make_self_signed_cert
from protocol.codec.state import state_digest
from protocol.commit.commitments import SignedCommitment
from protocol.commit.keys import KeyPair
from protocol.job.store import JobStore

from .daemon import STEPS, channel_to, submit, watch_until

pytestmark = pytest.mark.network


def _commitment(channel, job_id: bytes) -> SignedCommitment:
    reply = ovt_pb2_grpc.ClaimsStub(channel).GetCommitment(
        ovt_pb2.CommitmentRequest(job_id=job_id, n=STEPS), timeout=30)
    return SignedCommitment.from_bytes(reply.signed_commitment)


def _train_until(daemon, tiny_job, step: int):
    """Submit the job and return once the daemon reports at least `step` steps done."""
    with channel_to(daemon) as channel:
        assert submit(channel, tiny_job.spec.to_bytes(), tiny_job.state0_bytes) == \
            tiny_job.job_id
        status = watch_until(channel, tiny_job.job_id, lambda s: s.step >= step)
    assert status.state == "running", status


def _finish(daemon, tiny_job) -> SignedCommitment:
    with channel_to(daemon) as channel:
        status = watch_until(channel, tiny_job.job_id, lambda s: s.state in ("done", "failed"))
        assert status.state == "done", status.error
        return _commitment(channel, tiny_job.job_id)


def _interrupted_store(daemon, tiny_job) -> JobStore:
    store = JobStore.open(daemon.store, tiny_job.job_id.hex())
    assert store.commitment(STEPS) is None, "the job finished before it was interrupted"
    return store


def test_submit_train_and_commit(trainers, tiny_job, tmp_path):
    daemon = trainers.start(tmp_path / "store")
    with channel_to(daemon) as channel:
        job_id = submit(channel, tiny_job.spec.to_bytes(), tiny_job.state0_bytes)
        assert job_id == tiny_job.job_id
        steps_seen = []
        status = watch_until(channel, job_id, lambda s: steps_seen.append(s.step) or
                             s.state in ("done", "failed"))
        assert (status.state, status.step, status.steps) == ("done", STEPS, STEPS)
        assert steps_seen == sorted(steps_seen) and len(set(steps_seen)) > 2  # progress
        # resubmitting the same job is idempotent
        assert submit(channel, tiny_job.spec.to_bytes(), tiny_job.state0_bytes) == job_id
        signed = _commitment(channel, job_id)
    signed.verify(job_id=job_id, role="trainer", n=STEPS)
    assert signed.commitment.public_key == KeyPair.load(trainers.key).public_key
    assert signed.commitment.root == tiny_job.root


def test_serves_claims_while_training(trainers, tiny_job, tmp_path):
    daemon = trainers.start(tmp_path / "store")
    _train_until(daemon, tiny_job, 13)
    with channel_to(daemon) as channel:  # S_13 is no checkpoint: regenerated from S_10
        payload = join_chunks(ovt_pb2_grpc.ClaimsStub(channel).GetCheckpoint(
            ovt_pb2.StepRef(job_id=tiny_job.job_id, step=13), timeout=60), 1 << 30)
    leaf = JobStore.open(daemon.store, tiny_job.job_id.hex()).leaf(13)
    assert state_digest(safetensors.torch.load(payload)) == leaf.state_hash
    assert _finish(daemon, tiny_job).commitment.root == tiny_job.root


def test_sigkill_mid_job_then_restart_resumes_to_the_same_root(trainers, tiny_job, tmp_path):
    first = trainers.start(tmp_path / "store")
    _train_until(first, tiny_job, 10)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    before = _interrupted_store(first, tiny_job).leaves()
    second = trainers.start(tmp_path / "store")  # no resubmission: it resumes on its own
    signed = _finish(second, tiny_job)
    assert signed.commitment.root == tiny_job.root
    after = JobStore.open(second.store, tiny_job.job_id.hex()).leaves()
    assert after[:len(before)] == before


def test_sigterm_stops_after_a_step_and_exits_0_then_resumes(trainers, tiny_job, tmp_path):
    first = trainers.start(tmp_path / "store")
    _train_until(first, tiny_job, 10)
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0, first.log_text()
    assert "resumes on restart" in first.log_text()
    before = _interrupted_store(first, tiny_job).leaves()
    second = trainers.start(tmp_path / "store")
    assert _finish(second, tiny_job).commitment.root == tiny_job.root
    assert JobStore.open(second.store, tiny_job.job_id.hex()).leaves()[:len(before)] == before


def test_plaintext_off_loopback_is_refused(trainers, tmp_path):
    result = subprocess.run(trainers.command(tmp_path / "store", listen="0.0.0.0:0"),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ovt-trainer: error: refusing plaintext"), \
        result.stderr
    assert "--insecure-allow-remote-plaintext" in lines[0]


def test_tls_serve_submit_and_watch_with_the_cli(trainers, tiny_job, tmp_path):
    cert, key = make_self_signed_cert(tmp_path / "tls")
    daemon = trainers.start(tmp_path / "store", "--tls-cert", str(cert), "--tls-key", str(key))
    client = [sys.executable, "-m", "trainer_node.cli"]
    tls = ["--trainer", daemon.address, "--tls-ca", str(cert)]
    submitted = subprocess.run([*client, "submit", str(tiny_job.spec_path), *tls],
                               capture_output=True, text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    assert submitted.stdout.strip() == tiny_job.job_id.hex()
    watched = subprocess.run([*client, "status", "--job", tiny_job.job_id.hex(), "--watch",
                              *tls], capture_output=True, text=True, timeout=120)
    assert watched.returncode == 0, watched.stderr
    lines = watched.stdout.strip().splitlines()
    assert lines[-1] == f"job {tiny_job.job_id.hex()} done step {STEPS}/{STEPS}"
    assert len(lines) > 2
    plaintext = subprocess.run([*client, "status", "--job", tiny_job.job_id.hex(),
                                "--trainer", daemon.address], capture_output=True, text=True,
                               timeout=60)
    assert plaintext.returncode == 2
    assert plaintext.stderr.startswith("ovt-trainer: error: trainer Status failed: UNAVAILABLE")
