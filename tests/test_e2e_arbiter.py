"""End to end (issue 5): the daemons and the arbiter as real processes on 127.0.0.1.

`ovt-arbiter demo` (the README's main job) on a tiny job: an honest trainer verified, a trainer
started with --inject-fault caught at its step. Then a lying auditor daemon
(--inject-fault false-challenge) against an honest trainer daemon, settled by
`ovt-arbiter adjudicate` asking the auditor for its challenge over gRPC, and re-checked by
`ovt-arbiter verify`."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from protocol.commit.keys import KeyPair
from protocol.dispute.verdict import verify_verdict
from protocol.job.create import create_job
from tests.auditor_node.daemon import Auditors, watch_audit
from tests.trainer_node.daemon import Trainers, watch_until

pytestmark = pytest.mark.network
TINY_JOB = """\
program = "image-cnn"
steps = 10
seed = 4
init_seed = 5
checkpoint_interval = 4
commit_interval = 10
[config]
image_size = 8
channels = 4
batch_size = 8
dataset_size = 64
"""
RUN_TIMEOUT_S = 600
CALL_TIMEOUT_S = 10


def _run(*args, timeout=RUN_TIMEOUT_S):
    return subprocess.run([sys.executable, "-m", "arbiter.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # ~13 s on 2 cores: the whole demo, three daemons
def test_the_demo_verifies_the_honest_trainer_and_catches_the_cheat(tmp_path):
    (tmp_path / "tiny.toml").write_text(TINY_JOB)
    proc = _run("demo", "--job-file", tmp_path / "tiny.toml", "--fault", "skip-step:7",
                "--workdir", tmp_path / "work")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the trainer is at fault at step 7" in proc.stdout
    assert "demo passed" in proc.stderr
    verdict = verify_verdict((tmp_path / "work" / "verdict.ovtv").read_bytes())
    assert (verdict.fault, verdict.step) == ("trainer", 7)
    logs = {p.name: p.read_text() for p in (tmp_path / "work").glob("*.log")}
    assert "FAULT INJECTION" in logs["cheating-trainer.log"]
    assert "FAULT INJECTION" not in logs["honest-trainer.log"]


@pytest.mark.slow  # ~30 s on 2 cores: the demo with both trainers on 2 processes each
def test_the_demo_catches_a_cheat_trained_on_two_processes(tmp_path):
    """Issue 14: both trainer daemons compute their micro-batches on 2 processes (gloo over
    127.0.0.1); the honest one is verified and the cheat adjudicated at its step."""
    (tmp_path / "tiny.toml").write_text(TINY_JOB.replace("[config]", "micro_batches = 2\n[config]"))
    proc = _run("demo", "--job-file", tmp_path / "tiny.toml", "--fault", "skip-step:7",
                "--trainer-workers", 2, "--workdir", tmp_path / "work")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "trainers on 2 processes" in proc.stderr
    verdict = verify_verdict((tmp_path / "work" / "verdict.ovtv").read_bytes())
    assert (verdict.fault, verdict.step) == ("trainer", 7)
    assert "on 2 processes" in (tmp_path / "work" / "honest-trainer.log").read_text()


SCHEDULED_JOB = """\
program = "char-transformer"
steps = 8
seed = 2
init_seed = 3
checkpoint_interval = 4
commit_interval = 8
micro_batches = 4
[config]
warmup_steps = 4
decay_steps = 4
min_lr = 1e-4
clip_grad_norm = 0.5
"""


@pytest.mark.slow  # ~1 min on 2 cores: the demo's three daemons on a transformer
def test_a_scheduled_clipped_micro_batched_job_through_the_daemons(tmp_path):
    """SPEC §3.5 end to end: a warm-up + cosine schedule, clipping and 4 micro-batches; the
    honest trainer is verified, one that cuts the warm-up short from step 3 is caught there."""
    (tmp_path / "scheduled.toml").write_text(SCHEDULED_JOB)
    proc = _run("demo", "--job-file", tmp_path / "scheduled.toml", "--fault", "skip-warmup:3",
                "--workdir", tmp_path / "work")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the trainer is at fault at step 3" in proc.stdout
    verdict = verify_verdict((tmp_path / "work" / "verdict.ovtv").read_bytes())
    assert (verdict.fault, verdict.step) == ("trainer", 3)


@pytest.fixture
def processes(tmp_path):
    """Launchers of trainer and auditor daemons; whatever is still running is killed at the
    end."""
    trainers, auditors = Trainers(tmp_path), Auditors(tmp_path, tmp_path / "auditor.key")
    KeyPair.generate().save(auditors.key)
    try:
        yield trainers, auditors
    finally:
        auditors.close()
        trainers.close()


def test_a_lying_auditor_daemon_is_found_at_fault(processes, tmp_path):
    trainers, auditors = processes
    liar = auditors.launch(tmp_path / "auditor-store", "--inject-fault", "false-challenge:6")
    trainer = trainers.start(tmp_path / "trainer-store")  # waits until it serves
    liar.wait_serving()
    (tmp_path / "tiny.toml").write_text(TINY_JOB)
    spec, state0 = create_job(tmp_path / "tiny.toml")
    with grpc.insecure_channel(trainer.address) as tc, grpc.insecure_channel(liar.address) as ac:
        ovt_pb2_grpc.TrainerStub(tc).Submit(ovt_pb2.SubmitRequest(
            spec=spec.to_bytes(), initial_state=safetensors.torch.save(state0)),
            timeout=CALL_TIMEOUT_S)
        assert watch_until(tc, spec.job_id, lambda s: s.state in ("done", "failed"),
                           timeout=RUN_TIMEOUT_S).state == "done", trainer.log_text()
        ovt_pb2_grpc.AuditorStub(ac).Audit(ovt_pb2.AuditRequest(
            trainer_address=trainer.address, job_id=spec.job_id), timeout=CALL_TIMEOUT_S)
        reports = watch_audit(ac, spec.job_id)
    assert (reports[-1].state, reports[-1].divergent_step) == ("diverged", 6)

    out = tmp_path / "verdict.ovtv"
    proc = _run("adjudicate", "--trainer", trainer.address, "--auditor", liar.address,
                "--job", spec.job_id.hex(), "--out", out, "--profile", "cpu-1t")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the auditor is at fault at step 6" in proc.stdout
    verdict = verify_verdict(out.read_bytes())
    assert (verdict.fault, verdict.finding, verdict.step) == ("auditor", "false-challenge", 6)
    check = _run("verify", out, timeout=120)
    assert check.returncode == 0 and "VALID" in check.stdout
    assert liar.terminate() == 0
