"""The audit queue with a scripted `run_audit` (no network, no training): join semantics, a
failed audit retried, a bug contained, a stop that interrupts an audit which the next runner
resumes, and verdicts that survive a restart."""

from __future__ import annotations

import time

import pytest

from auditor_node import runner as runner_module
from auditor_node.audit import AuditRecord
from auditor_node.runner import RECORD_FILE, REQUEST_FILE, AuditRunner, AuditStatus
from auditor_node.server import AuditorNode
from auditor_node.service import report
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import PeerError, RefusedError
from protocol.job.store import SPEC_FILE

from .conftest import wait_finished

JOB = bytes(range(32))
OTHER = bytes(32)
TIMEOUT_S = 10.0


class Script:
    """A stand-in for run_audit: reports `steps` steps, then does what `outcome` says; with
    `store`, it first makes the job's store (as run_audit does once it has verified the spec)."""

    def __init__(self, outcome="matched", steps=3, delay_s=0.0, store=False):
        self.outcome, self.steps, self.delay_s, self.store = outcome, steps, delay_s, store
        self.calls: list[tuple[str, bytes]] = []

    def __call__(self, trainer, job_id, store_root, key, profile, *, progress, **_):
        self.calls.append((trainer, job_id))
        if self.store:
            (store_root / job_id.hex() / SPEC_FILE).write_bytes(b"the job's spec")
        for t in range(1, self.steps + 1):
            time.sleep(self.delay_s)
            progress(t, self.steps)
        if self.outcome == "peer-error":
            raise PeerError("trainer GetSpec failed: UNAVAILABLE: down")
        if self.outcome == "bug":
            raise KeyError("oops")
        return AuditRecord(job_id=job_id, state=self.outcome, steps=self.steps,
                           replayed=self.steps)


def runner_for(tmp_path, script) -> AuditRunner:
    return AuditRunner(tmp_path, KeyPair.generate(), Profile.parse("emulated-gpu"), audit=script)


@pytest.fixture
def running(tmp_path):
    started = []

    def start(script):
        runner = runner_for(tmp_path, script)
        runner.start()
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.stop(timeout=TIMEOUT_S)


def test_an_audit_runs_and_a_second_request_joins_it(running, tmp_path):
    script = Script()
    runner = running(script)
    first = runner.submit(JOB, "127.0.0.1:7000")
    assert first.state in ("queued", "running", "matched")
    status = wait_finished(runner, JOB)
    assert (status.state, status.step, status.steps) == ("matched", 3, 3)
    assert runner.submit(JOB, "127.0.0.1:7000").state == "matched"
    assert script.calls == [("127.0.0.1:7000", JOB)]
    assert (tmp_path / JOB.hex() / REQUEST_FILE).exists()
    assert (tmp_path / JOB.hex() / RECORD_FILE).exists()


def test_a_failed_audit_is_reported_and_retried(running):
    script = Script("peer-error")
    runner = running(script)
    runner.submit(JOB, "127.0.0.1:7000")
    status = wait_finished(runner, JOB)
    assert status.state == "failed" and "UNAVAILABLE" in status.record.error
    script.outcome = "matched"
    runner.submit(JOB, "127.0.0.1:7000")
    assert wait_finished(runner, JOB).state == "matched"
    assert len(script.calls) == 2


def test_another_trainers_request_never_joins_nor_interrupts_the_audit(running):
    """An audit is of a job at one trainer (review 26, finding 2): a request naming another
    trainer is refused while the job's audit runs (which goes on) and once it is decided
    (whose verdict its client reads by the job id alone); the report names the trainer."""
    script = Script(steps=3, delay_s=0.1)
    runner = running(script)
    runner.submit(JOB, "127.0.0.1:7000")
    with pytest.raises(RefusedError, match=r"at trainer 127\.0\.0\.1:7000 \((queued|running)\)"):
        runner.submit(JOB, "127.0.0.1:7001")
    status = wait_finished(runner, JOB)
    assert (status.trainer, status.state) == ("127.0.0.1:7000", "matched")
    with pytest.raises(RefusedError, match=r"at trainer 127\.0\.0\.1:7000 \(matched\)"):
        runner.submit(JOB, "127.0.0.1:7001")
    assert runner.get(JOB) == status
    assert report(status).trainer == "127.0.0.1:7000"
    assert script.calls == [("127.0.0.1:7000", JOB)]


def test_another_trainers_request_never_takes_the_place_of_a_failed_audit(running):
    """Review 30, finding 1: a failed audit replaced by another trainer's answered the client
    who asked for the first (reading the job's audit by its id) with the other's verdict.
    The job stays with the trainer asked for first, which may ask again."""
    script = Script("peer-error", store=True)
    runner = running(script)
    runner.submit(JOB, "127.0.0.1:7000")
    assert wait_finished(runner, JOB).state == "failed"
    with pytest.raises(RefusedError, match=r"at trainer 127\.0\.0\.1:7000 \(failed\)"):
        runner.submit(JOB, "127.0.0.1:7001")
    script.outcome = "matched"
    assert runner.submit(JOB, "127.0.0.1:7000").trainer == "127.0.0.1:7000"
    assert wait_finished(runner, JOB).state == "matched"
    assert script.calls == [("127.0.0.1:7000", JOB), ("127.0.0.1:7000", JOB)]


def test_another_trainers_request_takes_the_place_of_an_audit_that_made_no_store(running,
                                                                                 tmp_path):
    """An audit that failed before the job's store was made holds nothing: a request naming
    another trainer takes its place, or one request to a dead address would shut the job
    out of this node."""
    script = Script("peer-error")
    runner = running(script)
    runner.submit(JOB, "127.0.0.1:7000")
    assert wait_finished(runner, JOB).state == "failed"
    script.outcome = "matched"
    assert runner.submit(JOB, "127.0.0.1:7001").trainer == "127.0.0.1:7001"
    assert wait_finished(runner, JOB).state == "matched"
    assert script.calls == [("127.0.0.1:7000", JOB), ("127.0.0.1:7001", JOB)]
    assert runner_module._read_request(tmp_path / JOB.hex() / REQUEST_FILE) == "127.0.0.1:7001"


def test_a_bug_fails_one_audit_and_the_runner_goes_on(running, capsys):
    script = Script("bug")
    runner = running(script)
    runner.submit(JOB, "127.0.0.1:7000")
    status = wait_finished(runner, JOB)
    assert status.state == "failed" and status.record.error == "internal error (KeyError)"
    script.outcome = "matched"
    runner.submit(OTHER, "127.0.0.1:7000")
    assert wait_finished(runner, OTHER).state == "matched"
    assert "KeyError" in capsys.readouterr().err  # the operator sees the traceback


def test_stop_interrupts_an_audit_which_the_next_runner_resumes(tmp_path):
    first = runner_for(tmp_path, Script(steps=100_000, delay_s=0.005))
    first.start()
    try:
        first.submit(JOB, "127.0.0.1:7000")
        status = first.get(JOB)
        while status.step < 2:
            status = first.wait(JOB, status.version, TIMEOUT_S)
    finally:
        stopped = first.stop(timeout=TIMEOUT_S)
    assert stopped  # the worker thread ended
    assert first.get(JOB).state == "running"
    assert not (tmp_path / JOB.hex() / RECORD_FILE).exists()
    script = Script()
    second = runner_for(tmp_path, script)
    second.start()
    try:
        assert wait_finished(second, JOB).state == "matched"
        assert script.calls == [("127.0.0.1:7000", JOB)]
    finally:
        second.stop(timeout=TIMEOUT_S)


def test_verdicts_survive_a_restart_without_rerunning(tmp_path):
    runner = runner_for(tmp_path, Script("diverged"))
    runner.start()
    try:
        runner.submit(JOB, "127.0.0.1:7000")
        assert wait_finished(runner, JOB).state == "diverged"
    finally:
        runner.stop(timeout=TIMEOUT_S)
    script = Script()
    again = runner_for(tmp_path, script)
    again.start()
    try:
        status = again.get(JOB)
        assert status.state == "diverged" and status.record.steps == 3
        assert again.submit(JOB, "127.0.0.1:7000").state == "diverged"
        assert script.calls == []
    finally:
        again.stop(timeout=TIMEOUT_S)


def test_unknown_jobs_have_no_status(running):
    runner = running(Script())
    assert runner.get(JOB) is None
    assert runner.wait(JOB, 0, 0.01) is None


def test_a_diverged_status_reports_its_step_and_reason():
    record = AuditRecord(job_id=JOB, state="diverged", steps=20, replayed=12, divergent_step=12,
                         reason="state hash differs from the trainer's")
    message = report(AuditStatus(JOB, "127.0.0.1:7000", "diverged", step=12, steps=20,
                                 record=record, version=3))
    assert (message.state, message.step, message.steps, message.divergent_step) == \
        ("diverged", 12, 20, 12)
    assert message.reason == record.reason and message.commitment == b"" and not message.error


def test_finding_9_failed_audits_of_jobs_never_fetched_leave_no_directory(running, tmp_path):
    """Issue 10, finding 9: 300 Audit requests for random job ids left 300 directories. An
    audit that fails before the job's store exists leaves none; its failure is still known."""
    runner = running(Script("peer-error"))
    job_ids = [bytes([i]) * 32 for i in range(1, 9)]
    for job_id in job_ids:
        runner.submit(job_id, "127.0.0.1:7000")
    for job_id in job_ids:
        status = wait_finished(runner, job_id)
        assert status.state == "failed" and "UNAVAILABLE" in status.record.error
    assert list(tmp_path.iterdir()) == []


def test_failed_audits_of_jobs_never_fetched_are_remembered_up_to_a_bound(running,
                                                                          monkeypatch):
    """Issue 10 review: each such failure was kept in memory for good, so a peer asking for
    random job ids grew the auditor without end. The latest MAX_UNSTORED_FAILURES are kept."""
    monkeypatch.setattr(runner_module, "MAX_UNSTORED_FAILURES", 3)
    script = Script("peer-error")
    runner = running(script)
    job_ids = [bytes([i]) * 32 for i in range(1, 6)]
    versions = []
    for job_id in job_ids:
        runner.submit(job_id, "127.0.0.1:7000")
        status = wait_finished(runner, job_id)
        assert status.state == "failed"
        versions.append(status.version)
    assert [runner.get(job_id) is not None for job_id in job_ids] == [False, False, True, True,
                                                                      True]
    runner.submit(job_ids[2], "127.0.0.1:7000")  # a remembered one, audited again: latest
    assert wait_finished(runner, job_ids[2]).version > versions[2]
    runner.submit(job_ids[0], "127.0.0.1:7000")  # a forgotten one starts afresh
    assert wait_finished(runner, job_ids[0]).version == versions[0]
    assert [runner.get(job_id) is not None for job_id in job_ids] == [True, False, True, False,
                                                                      True]
    assert len(script.calls) == 7


def test_a_failed_audit_of_a_stored_job_keeps_its_record(tmp_path):
    runner = runner_for(tmp_path, Script("peer-error", store=True))
    runner.start()
    try:
        runner.submit(JOB, "127.0.0.1:7000")
        assert wait_finished(runner, JOB).state == "failed"
    finally:
        runner.stop(timeout=TIMEOUT_S)
    assert (tmp_path / JOB.hex() / RECORD_FILE).exists()
    again = runner_for(tmp_path, Script())
    again.start()
    try:
        assert again.get(JOB).state == "failed"  # known across the restart
    finally:
        again.stop(timeout=TIMEOUT_S)


def test_finding_9_the_auditor_removes_stale_temp_files_on_start(tmp_path):
    """Issue 10, finding 9: a kill can leave an atomic write's temporary file; the daemon
    removes them when it starts."""
    job_dir = tmp_path / JOB.hex()
    job_dir.mkdir()
    stale = job_dir / ".audit.ovt.abcdefgh.tmp"
    stale.write_bytes(b"half a record")
    kept = job_dir / "audit-request.ovt.tmp"  # not a temporary file's name
    kept.write_bytes(b"x")
    node = AuditorNode(tmp_path, KeyPair.generate(), Profile.parse("emulated-gpu"),
                       listen="127.0.0.1:0")
    node.start()
    node.stop(grace_s=0)
    assert not stale.exists() and kept.exists()
