"""FAULT INJECTION: a lying auditor (`false-challenge:k`) against an honest trainer replays the
job, stores its S_k one ULP off and files a (false) challenge at exactly k whose auditor leaf
differs from the trainer's; through `run_audit`, the audit runner, and `ovt-auditor audit`."""

from __future__ import annotations

import logging

import pytest

from auditor_node.audit import CHALLENGE_FILE, DIVERGED, run_audit
from auditor_node.cli import main
from auditor_node.faults import AuditorFaults, parse_auditor_fault
from auditor_node.runner import AuditRunner
from auditor_node.server import AuditorNode
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.errors import ConfigError
from protocol.job.faults import Fault
from protocol.job.store import JobStore

from .conftest import AUDITOR_PROFILE

pytestmark = pytest.mark.network
K = 7


def _assert_false_challenge(trained, record, root, k=K):
    assert record.state == DIVERGED and record.divergent_step == k
    assert record.reason == "state hash differs from the trainer's"
    assert record.challenge == root / trained.spec.job_id.hex() / CHALLENGE_FILE
    challenge = Challenge.from_bytes(record.challenge.read_bytes())
    challenge.verify(trained.spec)
    honest = JobStore(trained.root, trained.spec)
    assert challenge.step == k
    assert challenge.trainer_leaf.state_hash == honest.leaf(k).state_hash
    assert challenge.auditor_leaf.state_hash != honest.leaf(k).state_hash
    assert challenge.auditor_leaf.log_hash == honest.leaf(k).log_hash  # it replayed L_k
    own = JobStore(root, trained.spec)
    assert own.leaves()[:k] == honest.leaves()[:k]  # it lied only at k


def test_a_lying_auditor_challenges_an_honest_trainer_at_k(trained, trainer_address, tmp_path):
    hooks = AuditorFaults([parse_auditor_fault(f"false-challenge:{K}")])
    record = run_audit(trainer_address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                       AUDITOR_PROFILE, hooks=hooks)
    _assert_false_challenge(trained, record, tmp_path)
    assert record.auditor_commitment.commitment.n == K


def test_the_audit_runner_passes_its_faults_on(trained, trainer_address, tmp_path):
    runner = AuditRunner(tmp_path, KeyPair.generate(), AUDITOR_PROFILE,
                         hooks=AuditorFaults([Fault("false-challenge", 3)]))
    runner.start()
    try:
        status = runner.submit(trained.spec.job_id, trainer_address)
        while not status.finished:
            newer = runner.wait(trained.spec.job_id, status.version, 60)
            assert newer.version > status.version, "no progress within the timeout"
            status = newer
    finally:
        runner.stop(timeout=60)
    _assert_false_challenge(trained, status.record, tmp_path, k=3)


def test_the_auditor_daemon_warns_of_its_faults(tmp_path, caplog):
    node = AuditorNode(tmp_path, KeyPair.generate(), AUDITOR_PROFILE, listen="127.0.0.1:0",
                       faults=[Fault("false-challenge", 2)])
    try:
        assert isinstance(node.runner.hooks, AuditorFaults)
        assert any("FAULT INJECTION" in r.getMessage() and "false-challenge:2" in
                   r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    finally:
        node.server.stop(None)


def test_cli_audit_with_a_false_challenge_exits_1(trained, trainer_address, auditor_key,
                                                 tmp_path, capsys):
    store = tmp_path / "store"
    code = main(["audit", "--trainer", trainer_address, "--job", trained.spec.job_id.hex(),
                 "--store", str(store), "--key", str(auditor_key),
                 "--inject-fault", "false-challenge:4"])
    captured = capsys.readouterr()
    assert code == 1
    assert "DIVERGED at step 4" in captured.out
    assert "FAULT INJECTION" in captured.err


@pytest.mark.parametrize("bad", ["relabel:3", "false-challenge:0", "false-challenge"])
def test_cli_refuses_a_bad_fault_with_exit_2(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as exit_:
        main(["audit", "--trainer", "127.0.0.1:1", "--job", "00" * 32, "--store",
              str(tmp_path), "--key", str(tmp_path / "k"), "--inject-fault", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and f"bad fault '{bad}'" in errors[0]
    assert "Traceback" not in err


def test_an_auditor_refuses_trainer_faults():
    with pytest.raises(ConfigError, match="not an auditor fault"):
        AuditorFaults([Fault("relabel", 1)])
