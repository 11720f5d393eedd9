"""Resuming an audit (`begin_replay`) compares whole leaves with the trainer's: a stored step
replayed with another log than the trainer's ℓ_t is no divergence to challenge, but a replay of
another commitment to the job, cut back and replayed again (reviews 26 and 30)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest

from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import RefusedError
from protocol.job.create import build_job
from protocol.job.run import STATE_DIFFERS, StoreSource, begin_replay, finish_replay, run_job
from protocol.job.store import JobStore

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS = 4


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=STEPS,
                             seed=0, init_seed=1, policy=PrecisionPolicy(),
                             checkpoint_interval=2, commit_interval=2)
    root = tmp_path_factory.mktemp("trainer")
    store = JobStore(root, spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-1t"))
    return store


class Altered(StoreSource):
    """The trainer's store, with leaf `step` served as `change` makes it."""

    def __init__(self, store, step, **change):
        super().__init__(store)
        self.step, self.change = step, change

    def leaf(self, step: int) -> Leaf:
        leaf = super().leaf(step)
        return dataclasses.replace(leaf, **self.change) if step == self.step else leaf


@pytest.fixture
def replayed(trained, tmp_path):
    """An auditor's store that replayed the honest trainer's leaves 0..STEPS (a copy: the same
    leaves), as a failed audit leaves it: nothing signed."""
    shutil.copytree(trained.dir, tmp_path / trained.dir.name)
    store = JobStore(tmp_path, trained.spec)
    with store._db:  # (the trainer's own commitments, copied with its leaves)
        store._db.execute("DELETE FROM commitments")
    return store


def test_a_stored_step_of_another_log_is_cut_back_not_challenged(trained, replayed):
    """The decoy's replay: the same h_3, another ℓ_3 than this trainer's. A state-only check
    resumed it as agreeing, and a challenge on it would lose before the arbiter; refused, the
    job could never be audited there again. The store is cut back to step 2 instead."""
    _, last, divergent, reason = begin_replay(replayed,
                                              Altered(trained, 3, log_hash=b"\x07" * 32))
    assert (last, divergent, reason) == (2, None, None)
    assert replayed.last_step() == 2


def test_a_signed_replay_of_another_commitment_is_kept_and_the_audit_refused(trained,
                                                                            replayed):
    """Review 32, finding 1: the auditor signed its replay (a challenge may stand on it), and
    the trainer then serves another ℓ_3. Cut back, the signed commitment and its leaves were
    gone, and the auditor lost every dispute on it (its leaves unprovable under it)."""
    signed = finish_replay(replayed, KeyPair.generate(), StoreSource(trained).commitment(),
                           None, None).commitment
    with pytest.raises(RefusedError, match="served two commitments"):
        begin_replay(replayed, Altered(trained, 3, log_hash=b"\x07" * 32))
    assert replayed.last_step() == STEPS and replayed.commitment() == signed


def test_a_stored_step_of_the_trainers_log_and_another_state_is_its_divergence(trained,
                                                                               replayed):
    _, _, divergent, reason = begin_replay(replayed, Altered(trained, 3,
                                                            state_hash=b"\x07" * 32))
    assert (divergent, reason) == (3, STATE_DIFFERS)


def test_a_trainer_leaf_0_of_another_log_is_a_divergence_at_0(trained, replayed):
    """Leaf 0 is (0, h_0, the empty log's hash) by rule: the trainer's fault, challenged."""
    _, _, divergent, _ = begin_replay(replayed, Altered(trained, 0, log_hash=b"\x07" * 32))
    assert divergent == 0


def test_the_trainers_own_leaves_resume(trained, replayed):
    _, last, divergent, reason = begin_replay(replayed, StoreSource(trained))
    assert (last, divergent, reason) == (STEPS, None, None)
