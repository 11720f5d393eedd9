"""Jobs, cheating trainers, lying auditors and their challenges, built from local stores.

Everything here is the library path of the protocol (run_job, replay_job, the challenge of SPEC
§5.1), so the arbiter's tests can play many disputes fast; the daemons' own path is tested in
test_cli.py and tests/test_e2e_arbiter.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from arbiter.adjudicate import adjudicate
from arbiter.parties import StoreParty
from auditor_node.audit import own_claim
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from protocol.job.run import StoreSource, replay_job, run_job
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS = 8
TRAINER_PROFILE = Profile.parse("cpu-2t")
AUDITOR_PROFILE = Profile.parse("emulated-gpu")
ARBITER_PROFILE = Profile.parse("cpu-1t")
DEADLINE_S = 5.0


def tiny_job(seed: int = 0, steps: int = STEPS):
    return build_job(program="image-cnn", config=TINY, preset=None, steps=steps, seed=seed,
                     init_seed=seed + 1, policy=PrecisionPolicy(), checkpoint_interval=3,
                     commit_interval=steps)


def train(root: Path, spec: JobSpec, state0, *, profile=TRAINER_PROFILE, hooks=None,
          workers: int = 1) -> JobStore:
    store = JobStore(root, spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=profile, hooks=hooks, workers=workers)
    return store


@dataclass
class Dispute:
    spec: JobSpec
    trainer: JobStore
    auditor: JobStore
    challenge: Challenge | None  # None: the audit matched


def audit(root: Path, trainer: JobStore, *, profile=AUDITOR_PROFILE, hooks=None,
          workers: int = 1) -> Dispute:
    """Replay `trainer`'s job on `profile` (on `workers` processes) and, on divergence, file
    the challenge."""
    spec = trainer.spec
    store = JobStore(root, spec)
    outcome = replay_job(store, StoreSource(trainer), KeyPair.generate(), profile=profile,
                         hooks=hooks, workers=workers)
    if outcome.matches:
        return Dispute(spec, trainer, store, None)
    j = outcome.first_divergent_step
    challenge = Challenge(
        job_id=spec.job_id, step=j, reason=outcome.reason or "",
        trainer_commitment=outcome.trainer_commitment,
        trainer_leaf=own_claim(trainer, j, outcome.trainer_commitment),
        auditor_commitment=outcome.commitment,
        auditor_leaf=own_claim(store, j, outcome.commitment),
        trainer_leaf0=own_claim(trainer, 0, outcome.trainer_commitment),
        auditor_leaf0=own_claim(store, 0, outcome.commitment))
    return Dispute(spec, trainer, store, challenge)


def settle(dispute: Dispute, *, profile=ARBITER_PROFILE, trainer=None, auditor=None,
           deadline_s=DEADLINE_S, **keys):
    """Adjudicate between the two stores (or the given parties); `keys`: registered keys."""
    assert dispute.challenge is not None, "the audit matched: nothing to adjudicate"
    return adjudicate(dispute.spec, dispute.challenge,
                      trainer or StoreParty("trainer", dispute.trainer),
                      auditor or StoreParty("auditor", dispute.auditor),
                      key=KeyPair.generate(), profile=profile, deadline_s=deadline_s, **keys)


def log2_bound(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


@pytest.fixture(scope="module")
def job():
    return tiny_job()
