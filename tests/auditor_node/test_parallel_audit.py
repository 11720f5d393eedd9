"""`run_audit(processes=2)`: the job's checkpoint intervals replayed in two worker processes,
each from the trainer's S_c, stitched into one store: the same leaves and signed root as one
sequential replay, the same first divergent step and challenge (which the arbiter settles), a
crash that resumes without losing a stitched leaf, a trainer whose S_c is not its h_c, and
a lying auditor's fault hooks, which reach the workers."""

from __future__ import annotations

import pytest
import safetensors.torch

from arbiter.adjudicate import adjudicate
from arbiter.parties import StoreParty
from auditor_node.audit import DIVERGED, MATCHED, run_audit
from auditor_node.faults import AuditorFaults
from proto.claims import ClaimsServicer, StoreDirectory, chunks
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.engine.profiles import Profile
from protocol.errors import PeerError
from protocol.job.faults import Fault, one_ulp_off
from protocol.job.intervals import SEGMENTS
from protocol.job.store import JobStore
from tests.auditor_node.crashes import Crash, crash_at

from .conftest import AUDITOR_PROFILE, CHEAT_STEP, STEPS, Counting, serve_claims

pytestmark = pytest.mark.network


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
    # the relabelled step's recorded log does not fit the honest step: the auditor cannot
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
    # resumed after step 7: the rest of its interval from the trainer's S_7, then 10 and 15
    assert sorted(counting.steps("GetCheckpoint")) == [7, 10, 15]
    assert sorted(counting.steps("GetLog")) == list(range(8, STEPS + 1))


class _SwappedCheckpoint(ClaimsServicer):
    """Serves an S_10 one ULP off the S_10 its signed leaf 10 hashes."""

    def GetCheckpoint(self, request, context):
        if request.step != 10:
            yield from super().GetCheckpoint(request, context)
            return
        state = one_ulp_off(self.stores.get(request.job_id).checkpoint(10))
        yield from chunks(safetensors.torch.save(state))


def test_a_checkpoint_that_is_not_the_trainers_h_c_fails_the_audit(trained, tmp_path):
    with serve_claims(_SwappedCheckpoint(StoreDirectory(trained.root))) as address:
        with pytest.raises(PeerError, match="S_10 does not hash to h_10"):
            run_audit(address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                      AUDITOR_PROFILE, processes=2)
