"""`run_audit(processes=2)`: the job's checkpoint intervals replayed in two worker processes,
each from the trainer's S_c (the first from the auditor's own S_0), stitched into one store:
the same leaves and signed root as one sequential replay, the same first divergent step and
challenge (which the arbiter settles), a crash that resumes from the auditor's own state
without losing a stitched leaf, a trainer whose S_c is not its h_c or who refuses it (the
audit goes on from the auditor's own state: still matched, or still challengeable), a lying
auditor's fault hooks, which reach the workers, and a daemon that stops in seconds."""

from __future__ import annotations

import time

import grpc
import pytest
import safetensors.torch

from arbiter.adjudicate import adjudicate
from arbiter.parties import StoreParty
from auditor_node.audit import DIVERGED, MATCHED, run_audit
from auditor_node.faults import AuditorFaults
from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory, chunks
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.engine.profiles import Profile
from protocol.job.faults import Fault, one_ulp_off
from protocol.job.intervals import SEGMENTS, usable_cpus
from protocol.job.store import JobStore
from tests.auditor_node.crashes import Crash, crash_at

from .conftest import AUDITOR_PROFILE, CHEAT_STEP, STEPS, Counting, serve_claims
from .daemon import Auditors

pytestmark = [pytest.mark.network,
              pytest.mark.skipif(usable_cpus() < 2, reason="2 audit processes need 2 CPUs")]
CALL_TIMEOUT_S = 10


class Refusing(Counting):
    """The trainer's Claims, counting calls, that refuses GetCheckpoint for the `refused`
    steps: a trainer that will not serve the S_c an interval starts from. With `hold_until`,
    GetLog of step 1 is answered only once GetCheckpoint of that step was asked (or after
    120 s): the worker on the first interval waits for the other to ask for its S_c, which,
    started first, it could otherwise replay on from the state it holds, never asking."""

    def __init__(self, stores, refused, log_delay_s: float = 0.0, hold_until: int | None = None):
        super().__init__(stores, log_delay_s)
        self.refused = frozenset(refused)
        self.hold_until = hold_until

    def GetLog(self, request, context):
        if request.step == 1 and self.hold_until is not None:
            deadline = time.monotonic() + 120
            while self.hold_until not in self.steps("GetCheckpoint") and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
        return super().GetLog(request, context)

    def GetCheckpoint(self, request, context):
        if request.step in self.refused:
            self.calls.append(("GetCheckpoint", request.step))
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "not serving checkpoints")
        yield from super().GetCheckpoint(request, context)


def _checkpoints(store: JobStore) -> dict[int, bytes]:
    return {t: store.leaf(t).state_hash for t in store.checkpoint_steps()
            if store.checkpoint(t) is not None}


def test_two_processes_sign_the_sequential_root(trained, trainer_address, tmp_path):
    key = KeyPair.generate()
    one = run_audit(trainer_address, trained.spec.job_id, tmp_path / "one", key,
                    AUDITOR_PROFILE)
    two = run_audit(trainer_address, trained.spec.job_id, tmp_path / "two", key,
                    AUDITOR_PROFILE, processes=2)
    assert one.state == two.state == MATCHED and two.replayed == STEPS
    signed = two.auditor_commitment
    signed.verify(job_id=trained.spec.job_id, role="auditor", n=STEPS,
                  public_key=key.public_key)
    assert signed.commitment.root == one.auditor_commitment.commitment.root == \
        trained.signed.commitment.root
    assert signed.commitment.h_n == one.auditor_commitment.commitment.h_n
    seq, par = JobStore(tmp_path / "one", trained.spec), JobStore(tmp_path / "two", trained.spec)
    assert par.leaves() == seq.leaves()
    assert [par.log_bytes(t) for t in range(1, STEPS + 1)] == \
        [seq.log_bytes(t) for t in range(1, STEPS + 1)]
    assert _checkpoints(par) == _checkpoints(seq) and sorted(_checkpoints(par)) == \
        [0, 5, 10, 15, 20]
    assert not (par.dir / SEGMENTS).exists()  # the workers' scratch is gone


@pytest.fixture(scope="module")
def caught(trained, cheater_address, tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-auditor")
    record = run_audit(cheater_address, trained.spec.job_id, root, KeyPair.generate(),
                       AUDITOR_PROFILE, processes=2)
    return record, root


def test_a_cheat_in_the_second_interval_is_challenged_at_its_step(caught, trained,
                                                                   cheater_address, tmp_path):
    record, _ = caught
    assert record.state == DIVERGED and record.divergent_step == CHEAT_STEP
    # the cheating step's recorded log does not fit the honest step: the auditor cannot
    # replay it, so its commitment ends just before it (as a sequential audit's does)
    assert record.reason.startswith("the trainer's rounding log is invalid: log violation at "
                                    f"step {CHEAT_STEP}")
    assert record.auditor_commitment.commitment.n == CHEAT_STEP - 1
    sequential = run_audit(cheater_address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                           AUDITOR_PROFILE)
    assert (sequential.divergent_step, sequential.reason) == (CHEAT_STEP, record.reason)
    assert sequential.auditor_commitment.commitment.root == \
        record.auditor_commitment.commitment.root
    challenge = Challenge.from_bytes(record.challenge.read_bytes())
    challenge.verify(trained.spec)
    assert challenge.step == CHEAT_STEP and challenge.auditor_leaf is None


def test_the_arbiter_settles_the_parallel_audits_challenge(caught, trained, cheater_root):
    record, root = caught
    challenge = Challenge.from_bytes(record.challenge.read_bytes())
    verdict = adjudicate(trained.spec, challenge,
                         StoreParty("trainer", JobStore(cheater_root, trained.spec)),
                         StoreParty("auditor", JobStore(root, trained.spec)),
                         key=KeyPair.generate(), profile=Profile.parse("cpu-1t")).verdict
    assert (verdict.fault, verdict.step) == ("trainer", CHEAT_STEP), verdict.reason


def test_fault_hooks_reach_the_workers(trained, trainer_address, tmp_path):
    """FAULT INJECTION: a lying auditor (`false-challenge:7`) lies in its worker processes too:
    its hooks travel to them, and the lie is its challenge, at 7, in the second interval."""
    record = run_audit(trainer_address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                       AUDITOR_PROFILE, processes=2,
                       hooks=AuditorFaults([Fault("false-challenge", 7)]))
    assert record.state == DIVERGED and record.divergent_step == 7
    assert record.auditor_commitment.commitment.n == 7
    honest = JobStore(trained.root, trained.spec)
    own = JobStore(tmp_path, trained.spec)
    assert own.leaves()[:7] == honest.leaves()[:7]
    assert own.leaf(7).state_hash != honest.leaf(7).state_hash


def test_a_crashed_parallel_audit_resumes_keeping_its_stitched_leaves(trained, tmp_path):
    counting = Counting(StoreDirectory(trained.root))
    key = KeyPair.generate()
    with serve_claims(counting) as address:
        with pytest.raises(Crash):
            run_audit(address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE,
                      processes=2, progress=crash_at(7))
        store = JobStore(tmp_path, trained.spec)
        kept = store.leaves()
        assert store.last_step() == 7 and not (store.dir / SEGMENTS).exists()
        counting.calls.clear()
        record = run_audit(address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE,
                           processes=2)
    assert record.state == MATCHED
    assert record.auditor_commitment.commitment.root == trained.signed.commitment.root
    assert store.leaves()[:8] == kept
    # resumed after step 7: the rest of its interval from the auditor's own S_7 (its S_5 and
    # logs 6-7), then the two later intervals from the trainer's S_10 and S_15 — fetched unless
    # the worker taking one already holds that state, having just replayed up to it (timing)
    assert set(counting.steps("GetCheckpoint")) <= {10, 15}
    assert sorted(counting.steps("GetLog")) == list(range(8, STEPS + 1))


class _SwappedCheckpoint(ClaimsServicer):
    """Serves an S_10 one ULP off the S_10 its signed leaf 10 hashes."""

    def GetCheckpoint(self, request, context):
        if request.step != 10:
            yield from super().GetCheckpoint(request, context)
            return
        state = one_ulp_off(self.stores.get(request.job_id).checkpoint(10))
        yield from chunks(safetensors.torch.save(state))


def test_a_checkpoint_that_is_not_the_trainers_h_c_costs_parallelism_not_the_audit(
        trained, tmp_path):
    with serve_claims(_SwappedCheckpoint(StoreDirectory(trained.root))) as address:
        record = run_audit(address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                           AUDITOR_PROFILE, processes=2)
    assert record.state == MATCHED and record.replayed == STEPS
    assert record.auditor_commitment.commitment.root == trained.signed.commitment.root
    assert JobStore(tmp_path, trained.spec).leaves() == JobStore(trained.root,
                                                                 trained.spec).leaves()


def test_a_cheater_refusing_its_checkpoints_is_still_challenged(caught, trained, cheater_root,
                                                                tmp_path):
    """The cheat is at 8, in 6-10: refusing S_5 (and every S_c) to the workers does not turn
    the divergence into a failure; the parent replays on from its own S_5, as a sequential
    audit does, and files the same challenge."""
    refusing = Refusing(StoreDirectory(cheater_root), range(1, STEPS + 1), hold_until=5)
    with serve_claims(refusing) as address:
        record = run_audit(address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                           AUDITOR_PROFILE, processes=2)
    assert 5 in refusing.steps("GetCheckpoint")  # asked, and refused
    parallel, _ = caught
    assert record.state == DIVERGED
    assert (record.divergent_step, record.reason) == (parallel.divergent_step, parallel.reason)
    assert record.auditor_commitment.commitment.root == \
        parallel.auditor_commitment.commitment.root
    challenge = Challenge.from_bytes(record.challenge.read_bytes())
    challenge.verify(trained.spec)
    assert challenge.step == CHEAT_STEP


@pytest.mark.slow
def test_sigterm_stops_a_parallel_audit_within_seconds(trained, auditor_key, tmp_path):
    """A slow trainer (2 s per log, 10 s per interval): SIGTERM while two workers replay ends
    the daemon in a few seconds, not after their intervals or the ones queued behind them."""
    slow = Counting(StoreDirectory(trained.root), log_delay_s=2.0)
    auditors = Auditors(tmp_path, auditor_key)
    try:
        with serve_claims(slow) as address:
            daemon = auditors.launch(tmp_path / "store", "--processes", "2")
            with grpc.insecure_channel(daemon.wait_serving().address) as channel:
                ovt_pb2_grpc.AuditorStub(channel).Audit(ovt_pb2.AuditRequest(
                    trainer_address=address, job_id=trained.spec.job_id),
                    timeout=CALL_TIMEOUT_S)
            deadline = time.monotonic() + 120
            while not any(step > 5 for step in slow.steps("GetLog")):  # a worker replays
                assert time.monotonic() < deadline, daemon.log_text()
                time.sleep(0.1)
            started = time.monotonic()
            assert daemon.terminate() == 0, daemon.log_text()
            assert time.monotonic() - started < 8, daemon.log_text()
    finally:
        auditors.close()
