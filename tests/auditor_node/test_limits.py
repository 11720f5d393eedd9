"""What a trainer's job may make the auditor do is bounded before it plans or replays anything
(`--max-steps`), and an operator's bad path is one line and exit 2, never a traceback and the
"diverged" exit 1 (review 26, findings 5 and 6)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from auditor_node.audit import DEFAULT_MAX_STEPS, FAILED, run_audit
from auditor_node.cli import main
from auditor_node.runner import AuditRunner
from proto import ovt_pb2, ovt_pb2_grpc
from protocol.commit.commitments import Commitment, sign_commitment
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import ResourceLimitError

from .conftest import serve_claims, wait_finished

pytestmark = pytest.mark.network
PROFILE = Profile.parse("cpu-1t")


class HugeJob(ovt_pb2_grpc.ClaimsServicer):
    """A "trainer" serving a tiny built-in job stretched to more steps than the auditor takes,
    with a signed commitment over all of them (a signature costs it nothing), and nothing else:
    every other call is UNIMPLEMENTED."""

    def __init__(self, spec):
        key = KeyPair.generate()
        self.spec = dataclasses.replace(spec, steps=DEFAULT_MAX_STEPS + 1,
                                        checkpoint_interval=1, commit_interval=1)
        self.signed = sign_commitment(Commitment(
            self.spec.job_id, self.spec.steps, b"\x01" * 32, b"\x02" * 32, key.public_key,
            "trainer", int(time.time())), key)

    def GetSpec(self, request, context):
        return ovt_pb2.SpecReply(spec=self.spec.to_bytes())

    def GetCommitment(self, request, context):
        return ovt_pb2.CommitmentReply(signed_commitment=self.signed.to_bytes())


@pytest.fixture(scope="module")
def huge(trained):
    servicer = HugeJob(trained.spec)
    with serve_claims(servicer) as address:
        yield servicer.spec, address


def test_a_sampled_audit_refuses_a_job_beyond_max_steps(huge, tmp_path):
    """A sampled audit laid out a plan of every interval of the trainer's n first (2**40 of
    them: a MemoryError), a plain one replayed until n; both are refused before the job's
    store is made."""
    spec, address = huge
    with pytest.raises(ResourceLimitError, match="--max-steps"):
        run_audit(address, spec.job_id, tmp_path, KeyPair.generate(), PROFILE, sample=0.25,
                  deadline_s=10)
    assert not (tmp_path / spec.job_id.hex()).exists()


def test_the_daemon_records_the_refusal_and_the_limit_is_the_operators(huge, tmp_path):
    spec, address = huge
    def audited(**limits):
        runner = AuditRunner(tmp_path, KeyPair.generate(), PROFILE, **limits)
        runner.start()
        try:
            runner.submit(spec.job_id, address)
            return wait_finished(runner, spec.job_id, 30)
        finally:
            runner.stop(timeout=30)

    # let through, the audit goes on to ask for leaves, which this "trainer" does not serve
    status = audited(max_steps=spec.steps)
    assert status.state == FAILED and "--max-steps" not in status.record.error
    status = audited()
    assert status.state == FAILED and "--max-steps" in status.record.error


def test_max_steps_must_be_positive(auditor_key, tmp_path, capsys):
    code = main(["audit", "--trainer", "127.0.0.1:1", "--job", "ab" * 32, "--store",
                 str(tmp_path / "s"), "--key", str(auditor_key), "--profile", "cpu-1t",
                 "--max-steps", "0"])
    assert code == 2 and "--max-steps must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["store", "port-file"])
def test_a_bad_path_is_one_line_and_exit_2(auditor_key, tmp_path, capsys, bad):
    """A --store under a regular file, or a --port-file in a missing folder, ended in an
    OSError's traceback and exit 1, which means "diverged" for the auditor."""
    (tmp_path / "afile").touch()
    store = tmp_path / ("afile/s" if bad == "store" else "s")
    args = ["serve", "--listen", "127.0.0.1:0", "--store", str(store), "--key",
            str(auditor_key), "--profile", "cpu-1t"]
    if bad == "port-file":
        args += ["--port-file", str(tmp_path / "missing" / "port")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert ("cannot make the store" if bad == "store" else "cannot write the port file") in err
