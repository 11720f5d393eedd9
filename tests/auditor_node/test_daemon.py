"""`ovt-auditor serve` as a real process: it audits the in-process trainer on request, streams
its progress to a verdict, serves its own commitment (role auditor) for the arbiter, answers bad
requests with the right status codes while it keeps serving, exits 0 on SIGTERM, and answers
for its verdicts after a restart."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import StoreDirectory
from protocol.commit.commitments import SignedCommitment

from .conftest import STEPS, Counting, serve_claims
from .daemon import AUDIT_TIMEOUT_S, STOP_TIMEOUT_S, TERMINAL, Auditors, watch_audit

pytestmark = pytest.mark.network
CALL_TIMEOUT_S = 10


@pytest.fixture
def auditors(tmp_path, auditor_key):
    launched = Auditors(tmp_path, auditor_key)
    try:
        yield launched
    finally:
        launched.close()


BAD_REQUESTS = [
    ("Audit", ovt_pb2.AuditRequest(trainer_address="127.0.0.1:1", job_id=b"short"),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("Audit", "empty-address", grpc.StatusCode.INVALID_ARGUMENT),
    ("Audit", "no-port", grpc.StatusCode.INVALID_ARGUMENT),
    ("GetAudit", ovt_pb2.JobRef(job_id=bytes(32)), grpc.StatusCode.NOT_FOUND),
    ("GetAudit", ovt_pb2.JobRef(job_id=b""), grpc.StatusCode.INVALID_ARGUMENT),
]


def _bad_requests(channel, job_id):
    stub = ovt_pb2_grpc.AuditorStub(channel)
    for call, request, code in BAD_REQUESTS:
        if request == "empty-address":
            request = ovt_pb2.AuditRequest(trainer_address="", job_id=job_id)
        elif request == "no-port":
            request = ovt_pb2.AuditRequest(trainer_address="127.0.0.1", job_id=job_id)
        with pytest.raises(grpc.RpcError) as err:
            getattr(stub, call)(request, timeout=CALL_TIMEOUT_S)
        assert err.value.code() == code, (call, request)
        assert "Traceback" not in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        watch_audit(channel, bytes(32))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_daemon_audits_serves_its_commitment_and_survives_bad_input(
        trained, trainer_address, auditors, tmp_path):
    job_id = trained.spec.job_id
    store = tmp_path / "auditor-store"
    daemon = auditors.launch(store).wait_serving()
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="ovt.v1.Auditor"), timeout=CALL_TIMEOUT_S)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        auditor = ovt_pb2_grpc.AuditorStub(channel)
        started = auditor.Audit(ovt_pb2.AuditRequest(trainer_address=trainer_address,
                                                     job_id=job_id), timeout=CALL_TIMEOUT_S)
        assert started.job_id == job_id and started.state in ("queued", "running", "matched")
        reports = watch_audit(channel, job_id)
        assert reports[-1].state == "matched", daemon.log_text()
        assert reports[-1].step == reports[-1].steps == STEPS
        signed = SignedCommitment.from_bytes(reports[-1].commitment)
        signed.verify(job_id=job_id, role="auditor", n=STEPS)
        assert signed.commitment.root == trained.signed.commitment.root

        claims = ovt_pb2_grpc.ClaimsStub(channel)  # what an arbiter asks the auditor
        served = SignedCommitment.from_bytes(claims.GetCommitment(
            ovt_pb2.CommitmentRequest(job_id=job_id), timeout=CALL_TIMEOUT_S).signed_commitment)
        assert served == signed
        leaf = claims.GetLeaf(ovt_pb2.StepRef(job_id=job_id, step=7), timeout=CALL_TIMEOUT_S)
        assert leaf.tree_size == STEPS + 1

        _bad_requests(channel, job_id)
        nowhere = auditor.Audit(ovt_pb2.AuditRequest(trainer_address="127.0.0.1:1",
                                                     job_id=bytes(32)), timeout=CALL_TIMEOUT_S)
        assert nowhere.job_id == bytes(32)
        failed = watch_audit(channel, bytes(32))[-1]
        assert failed.state == "failed" and "GetSpec failed: UNAVAILABLE" in failed.error
        again = auditor.GetAudit(ovt_pb2.JobRef(job_id=job_id), timeout=CALL_TIMEOUT_S)
        assert again.state == "matched" and again.commitment == reports[-1].commitment
    assert daemon.terminate() == 0, daemon.log_text()

    restarted = auditors.launch(store).wait_serving()
    with grpc.insecure_channel(restarted.address) as channel:
        report = ovt_pb2_grpc.AuditorStub(channel).GetAudit(ovt_pb2.JobRef(job_id=job_id),
                                                            timeout=CALL_TIMEOUT_S)
        assert report.state == "matched" and report.commitment == signed.to_bytes()
    assert restarted.terminate() == 0, restarted.log_text()


def test_the_daemon_refuses_remote_plaintext(auditors, tmp_path):
    daemon = auditors.launch(tmp_path / "store", "--listen", "0.0.0.0:0")
    assert daemon.proc.wait(timeout=60) == 2
    assert "refusing plaintext" in daemon.log_text()
    assert "Traceback" not in daemon.log_text()


def test_a_killed_daemon_resumes_its_audit_without_refetching(trained, auditors, tmp_path):
    job_id, store = trained.spec.job_id, tmp_path / "auditor-store"
    slow = Counting(StoreDirectory(trained.root), log_delay_s=0.1)
    with serve_claims(slow) as trainer_address:
        daemon = auditors.launch(store).wait_serving()
        with grpc.insecure_channel(daemon.address) as channel:
            ovt_pb2_grpc.AuditorStub(channel).Audit(ovt_pb2.AuditRequest(
                trainer_address=trainer_address, job_id=job_id), timeout=CALL_TIMEOUT_S)
            stream = ovt_pb2_grpc.AuditorStub(channel).WatchAudit(
                ovt_pb2.JobRef(job_id=job_id), timeout=AUDIT_TIMEOUT_S)
            try:
                replayed = next(r.step for r in stream if r.step >= 5 or r.state in TERMINAL)
            finally:
                stream.cancel()
            daemon.proc.kill()  # kill -9 mid-audit
            daemon.proc.wait(timeout=STOP_TIMEOUT_S)
        assert 5 <= replayed < STEPS
        before = list(slow.calls)
        slow.calls.clear()

        restarted = auditors.launch(store).wait_serving()  # resumes the audit by itself
        with grpc.insecure_channel(restarted.address) as channel:
            verdict = watch_audit(channel, job_id)[-1]
        assert verdict.state == "matched", restarted.log_text()
        assert restarted.terminate() == 0, restarted.log_text()
    assert ("GetCheckpoint", 0) in before and slow.steps("GetCheckpoint") == []
    assert min(slow.steps("GetLog")) > replayed  # no log of a replayed step is asked again
    assert min(slow.steps("GetLeaves")) > replayed  # nor a leaf verified before the crash
    assert sorted(set(slow.steps("GetLog"))) == list(range(min(slow.steps("GetLog")),
                                                           STEPS + 1))
