"""An audit is of a job at one trainer: another trainer's commitment to the same job never
joins it, takes its place or is challenged on its replay (reviews 26 and 30).

A decoy (any peer serving the job's public spec and S_0) has the auditor audit the job at its
own address; the client then asks for the audit of the job at the real trainer. Or the
trainer itself first serves the decoy's commitment and then its own, at one address."""

from __future__ import annotations

import shutil
import zlib

import pytest

from arbiter.adjudicate import adjudicate
from arbiter.parties import StoreParty
from auditor_node.audit import CHALLENGE_FILE, DIVERGED, FAILED, MATCHED
from auditor_node.runner import AuditRunner
from proto.claims import ClaimsServicer, StoreDirectory
from protocol.codec.roundinglog import decode_log, encode_log, log_digest
from protocol.codec.state import state_digest
from protocol.commit.commitments import Commitment, sign_commitment
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.dispute.challenge import Challenge
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import RefusedError
from protocol.job.create import build_job, job_executor
from protocol.job.faults import Fault
from protocol.job.run import run_job
from protocol.job.store import JobStore
from trainer_node.faults import TrainerFaults, _flip_entry

from .conftest import TINY, serve_claims, wait_finished

pytestmark = pytest.mark.network
STEPS, CHEAT, FLIPPED = 4, 4, 3  # the cheat at step 4; the decoy's other L_3
PROFILE = Profile.parse("cpu-1t")
TIMEOUT_S = 60.0


def _job():
    return build_job(program="image-cnn", config=TINY, preset=None, steps=STEPS, seed=0,
                     init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=2,
                     commit_interval=2)


def _trained(root, faults=()):
    spec, state0 = _job()
    store = JobStore(root, spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=PROFILE,
            hooks=TrainerFaults(faults) if faults else None)
    store.close()
    return spec


def _sign_all(store: JobStore) -> None:
    """Replace the store's commitments by one over all its leaves, under a fresh key."""
    store._db.execute("DELETE FROM commitments")
    store._db.commit()
    key = KeyPair.generate()
    store.save_commitment(sign_commitment(Commitment(
        job_id=store.spec.job_id, n=STEPS, root=store.tree().root,
        h_n=store.leaf(STEPS).state_hash, public_key=key.public_key, role="trainer", time=0),
        key))


def _decoy(cheater_root, root):
    """The cheater's store with one legal, absorbed direction flip in L_FLIPPED (the same
    S_FLIPPED, another ℓ), no L_{FLIPPED + 1} (so an audit of it fails there), signed anew."""
    shutil.copytree(cheater_root, root)
    spec = _job()[0]
    store = JobStore(root, spec)
    ex = job_executor(spec, PROFILE)
    before, log = store.state_at(FLIPPED - 1, ex), decode_log(store.log_bytes(FLIPPED))
    for w, site in enumerate(log.sites):
        for e in range(site.indices.size):
            flipped = encode_log(_flip_entry(log, w, e))
            ex.load_state(before)
            ex.step(decode_log(flipped))
            if state_digest(ex.state()) == store.leaf(FLIPPED).state_hash:
                store._log_path(FLIPPED).write_bytes(zlib.compress(flipped, 6))
                store._put_leaf(Leaf(FLIPPED, store.leaf(FLIPPED).state_hash,
                                     log_digest(flipped)))
                store._log_path(FLIPPED + 1).unlink()
                _sign_all(store)
                store.close()
                return
    raise AssertionError(f"no entry of L_{FLIPPED} flips without changing S_{FLIPPED}")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    base = tmp_path_factory.mktemp("other-trainer")
    honest, cheater, mallory = base / "honest", base / "cheater", base / "mallory"
    _trained(honest)
    _trained(cheater, (Fault("lr", CHEAT),))
    _trained(mallory, (Fault("lr", 2),))
    _decoy(cheater, base / "decoy")
    return {name: base / name for name in ("honest", "cheater", "mallory", "decoy")}


def _serve(root):
    return serve_claims(ClaimsServicer(StoreDirectory(root)))


class _Switch:
    """A trainer's Claims service at one address whose store can be switched between calls:
    a trainer that serves one commitment to the job, then another."""

    def __init__(self, root) -> None:
        self.switch(root)

    def switch(self, root) -> None:
        self.current = ClaimsServicer(StoreDirectory(root))


for _name in ("GetSpec", "GetCommitment", "GetLeaf", "GetLeaves", "GetLog", "GetCheckpoint",
              "GetBatch"):
    setattr(_Switch, _name, (lambda name: lambda self, request, context:
                             getattr(self.current, name)(request, context))(_name))


def _audit(runner, job_id, address):
    runner.submit(job_id, address)
    return wait_finished(runner, job_id, TIMEOUT_S)


@pytest.fixture
def runner(tmp_path):
    runner = AuditRunner(tmp_path / "auditor", KeyPair.generate(), PROFILE)
    runner.start()
    yield runner
    runner.stop(timeout=TIMEOUT_S)


def test_a_replay_of_another_commitment_is_replayed_again_not_challenged(stores, runner,
                                                                          tmp_path):
    """Review 26 finding 1, review 30 finding 2: the cheater first serves the decoy's
    commitment (its L_3 flipped, S_3 the same; no L_4), so the audit fails with leaves 0..3
    stored, leaf 3 holding the decoy's ℓ_3; then its own, at the same address. Resumed on a
    state-only comparison, the audit challenged step 4, a challenge the arbiter bisects to
    leaf 3 and rules false: the cheater won. Refused instead, the job could never be audited
    here again. Now the store is cut back to step 2 and replays the cheater's L_3 onwards:
    the challenge is of step 4, and the arbiter rules against the cheater there."""
    spec = _job()[0]
    switch = _Switch(stores["decoy"])
    with serve_claims(switch) as trainer:
        first = _audit(runner, spec.job_id, trainer)
        assert first.state == FAILED and "GetLog" in first.record.error
        switch.switch(stores["cheater"])
        second = _audit(runner, spec.job_id, trainer)
    assert second.state == DIVERGED and second.record.divergent_step == CHEAT
    auditor = JobStore(tmp_path / "auditor", spec)
    challenge = Challenge.from_bytes(
        (tmp_path / "auditor" / spec.job_id.hex() / CHALLENGE_FILE).read_bytes())
    verdict = adjudicate(spec, challenge,
                         StoreParty("trainer", JobStore(stores["cheater"], spec)),
                         StoreParty("auditor", auditor), key=KeyPair.generate(),
                         profile=PROFILE, deadline_s=TIMEOUT_S).verdict
    assert (verdict.fault, verdict.step) == ("trainer", CHEAT)


def test_a_decoys_audit_is_never_taken_over_by_the_real_trainer(stores, runner):
    """The decoy at its own address, its audit failed with its replay stored: a request for
    the job at the real trainer is refused (the job's audit is the decoy's, read by the job's
    id alone), never resumed on the decoy's replay nor answered with it."""
    job_id = _job()[0].job_id
    with _serve(stores["decoy"]) as decoy, _serve(stores["cheater"]) as cheater:
        assert _audit(runner, job_id, decoy).state == FAILED
        with pytest.raises(RefusedError, match="at trainer .* \\(failed\\)"):
            runner.submit(job_id, cheater)
    assert runner.get(job_id).trainer == decoy


def test_a_fresh_audit_catches_the_cheater_at_its_step(stores, runner):
    """The same cheater, audited on a store without the decoy's replay: diverged at its step."""
    with _serve(stores["cheater"]) as cheater:
        status = _audit(runner, _job()[0].job_id, cheater)
    assert status.state == DIVERGED and status.record.divergent_step == CHEAT


def test_another_peers_audit_never_answers_for_the_trainer(stores, runner):
    """Finding 2: Mallory has the job audited at its own address (a cheat at step 2); the
    client's request for the honest trainer joined that audit and was told "diverged at 2",
    and its challenge blamed the honest auditor before an arbiter. It is refused now, naming
    the audit the node holds; Mallory's audit stays as it was."""
    job_id = _job()[0].job_id
    with _serve(stores["mallory"]) as mallory, _serve(stores["honest"]) as honest:
        decided = _audit(runner, job_id, mallory)
        assert decided.state == DIVERGED and decided.record.divergent_step == 2
        with pytest.raises(RefusedError, match=r"at trainer .* \(diverged\)"):
            runner.submit(job_id, honest)
    assert runner.get(job_id) == decided


def test_the_trainer_is_audited_after_an_audit_at_a_dead_address(stores, runner):
    """An audit that failed before the job's store was made (nothing answers at its address)
    holds nothing: the trainer's request takes its place."""
    job_id = _job()[0].job_id
    with _serve(stores["honest"]) as honest:
        with _serve(stores["honest"]) as gone:
            pass
        assert _audit(runner, job_id, gone).state == FAILED
        status = _audit(runner, job_id, honest)
    assert status.trainer == honest and status.state == MATCHED
    assert status.record.auditor_commitment.commitment.root == \
        JobStore(stores["honest"], _job()[0]).tree().root
