"""A sampled audit of a trainer whose signed leaf c carries a made-up S_c (review 26, finding
4): a state that hashes to the signed h_c but is no S_c of the program (no step counter, a
stray tensor). Loading it used to raise out of the audit (a bare KeyError, a ConfigError), and
every retry failed the same way; now the sampled interval starting at c cannot start, and the
audit escalates to a replay from its own states that finds the divergence at step c, exactly
as for an S_c that does not hash to h_c. Likewise for a made-up S_c that loads but fails the
interval's first step (review 30, finding A: an Adam state without one parameter's
exp_avg_sq, a bare KeyError from torch's Adam) (in-process Claims server on 127.0.0.1)."""

from __future__ import annotations

import pytest
import torch

from auditor_node.audit import run_audit
from proto.claims import ClaimsServicer, StoreDirectory
from protocol.codec.state import state_digest
from protocol.commit.commitments import Commitment, sign_commitment
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from protocol.job.intervals import Interval, plan_intervals
from protocol.job.run import run_job
from protocol.job.sampling import draw_sample
from protocol.job.store import JobStore

from .conftest import serve_claims

pytestmark = pytest.mark.network
TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
ADAM = {**TINY, "optimizer": "adam"}
STEPS, MADE_UP = 4, 2  # intervals 1-2 and 3-4; leaf 2's S_2 is made up
PROFILE = Profile.parse("cpu-1t")


def _trainer_with_made_up_state(root, config, change) -> tuple:
    """A store of the tiny job on `config` whose leaf MADE_UP and checkpoint are a made-up S_2
    (the honest one changed by `change`), under a validly signed root over those leaves."""
    spec, state0 = build_job(program="image-cnn", config=config, preset=None, steps=STEPS,
                             seed=0, init_seed=1, policy=PrecisionPolicy(),
                             checkpoint_interval=2, commit_interval=STEPS)
    store = JobStore(root, spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=PROFILE)
    made_up = store.checkpoint(MADE_UP)
    change(made_up)
    store._write_checkpoint(MADE_UP, made_up)
    store._put_leaf(Leaf(MADE_UP, state_digest(made_up), store.leaf(MADE_UP).log_hash))
    key = KeyPair.generate()
    signed = sign_commitment(Commitment(
        job_id=spec.job_id, n=STEPS, root=store.tree().root,
        h_n=store.leaf(STEPS).state_hash, public_key=key.public_key, role="trainer", time=0),
        key)
    store.save_commitment(signed)
    store.close()
    return spec, signed


def _key_sampling(spec, signed, interval: Interval) -> KeyPair:
    """An auditor key whose half-sample is `interval` alone (the test picks the auditor)."""
    plan = plan_intervals(spec)
    for _ in range(200):
        key = KeyPair.generate()
        if draw_sample(plan, 0.5, key, signed).chosen == (interval,):
            return key
    raise AssertionError("no key in 200 draws sampled the interval")


@pytest.mark.parametrize("config, change, why", [
    (TINY, lambda s: s.pop("step"), "its step counter 'step' must be one int64, it has none"),
    (TINY, lambda s: s.update({"extra.x": torch.zeros(1)}), "unexpected ['extra.x']"),
    (ADAM, lambda s: s.pop("optim.head.weight.exp_avg_sq"), "KeyError: 'exp_avg_sq'"),
], ids=["no-step", "stray", "adam-no-exp_avg_sq"])
def test_a_made_up_sampled_start_state_escalates_and_finds_the_divergence(tmp_path, config,
                                                                          change, why):
    spec, signed = _trainer_with_made_up_state(tmp_path / "trainer", config, change)
    key = _key_sampling(spec, signed, Interval(MADE_UP + 1, STEPS))
    with serve_claims(ClaimsServicer(StoreDirectory(tmp_path / "trainer"))) as address:
        record = run_audit(address, spec.job_id, tmp_path / "auditor", key, PROFILE,
                           sample=0.5, deadline_s=20)
    assert (record.state, record.divergent_step) == ("diverged", MADE_UP)
    assert record.note is not None  # why the sampled interval did not start
    assert "the trainer's S_2 hashes to h_2 but is no state of this job's program at step 2: " \
        in record.note
    assert why in record.note
