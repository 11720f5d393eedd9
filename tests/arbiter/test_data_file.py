"""A dispute on a job whose examples come from a user's data file: the parties serve B_i from
their own copies of the file, with inclusion proofs; the arbiter reads no file (SPEC §2.1,
§5.3): the verdict stands and re-checks offline with every copy of the file gone."""

from __future__ import annotations

import shutil

import pytest
import safetensors.torch
import torch

from arbiter.adjudicate import adjudicate
from arbiter.parties import StoreParty
from auditor_node.audit import own_claim
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.dispute.evidence import recheck_evidence, save_evidence
from protocol.dispute.verdict import verify_verdict
from protocol.errors import ConfigError
from protocol.job.create import create_job
from protocol.job.faults import parse_fault
from protocol.job.run import StoreSource, replay_job, run_job
from protocol.job.store import JobStore
from trainer_node.faults import TrainerFaults

from .conftest import ARBITER_PROFILE, AUDITOR_PROFILE, DEADLINE_S, TRAINER_PROFILE

STEPS, CHEAT_STEP = 6, 4
JOB = f"""
program = "image-cnn"
steps = {STEPS}
checkpoint_interval = 2
commit_interval = {STEPS}
[config]
image_size = 8
channels = 4
batch_size = 8
[data]
kind = "tensors"
path = "images.safetensors"
"""


def test_a_relabelling_trainer_on_a_data_file_is_at_fault_and_the_arbiter_reads_no_file(
        tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    gen = torch.Generator().manual_seed(0)
    (user / "images.safetensors").write_bytes(safetensors.torch.save(
        {"image": torch.randn(40, 3, 8, 8, generator=gen),
         "label": torch.randint(0, 10, (40,), generator=gen)}))
    (user / "job.toml").write_text(JOB)
    spec, state0 = create_job(user / "job.toml")
    trainer_data, auditor_data = tmp_path / "trainer-data", tmp_path / "auditor-data"
    shutil.copytree(user, trainer_data)
    shutil.copytree(user, auditor_data)

    trainer = JobStore(tmp_path / "trainer", spec)
    trainer.put_initial(state0)
    run_job(trainer, KeyPair.generate(), profile=TRAINER_PROFILE, data_dir=trainer_data,
            hooks=TrainerFaults([parse_fault(f"relabel:{CHEAT_STEP}")]))
    auditor = JobStore(tmp_path / "auditor", spec)
    with pytest.raises(ConfigError, match="no data folder"):
        replay_job(auditor, StoreSource(trainer), KeyPair.generate(), profile=AUDITOR_PROFILE)
    outcome = replay_job(auditor, StoreSource(trainer), KeyPair.generate(),
                         profile=AUDITOR_PROFILE, data_dir=auditor_data)
    j = outcome.first_divergent_step
    assert j == CHEAT_STEP
    challenge = Challenge(
        job_id=spec.job_id, step=j, reason=outcome.reason or "",
        trainer_commitment=outcome.trainer_commitment,
        trainer_leaf=own_claim(trainer, j, outcome.trainer_commitment),
        auditor_commitment=outcome.commitment, auditor_leaf=own_claim(auditor, j,
                                                                      outcome.commitment),
        trainer_leaf0=own_claim(trainer, 0, outcome.trainer_commitment),
        auditor_leaf0=own_claim(auditor, 0, outcome.commitment))
    shutil.rmtree(user)  # the arbiter's side has no copy: only the parties do

    result = adjudicate(spec, challenge, StoreParty("trainer", trainer, trainer_data),
                        StoreParty("auditor", auditor, auditor_data), key=KeyPair.generate(),
                        profile=ARBITER_PROFILE, deadline_s=DEADLINE_S)
    verdict = result.verdict
    assert (verdict.fault, verdict.step, verdict.finding) == ("trainer", CHEAT_STEP,
                                                              "invalid-log"), verdict.reason
    assert verify_verdict(verdict.to_bytes()).to_bytes() == verdict.to_bytes()

    assert result.evidence is not None
    save_evidence(tmp_path / "evidence", result.evidence.prev_state, result.evidence.examples,
                  result.evidence.log)
    shutil.rmtree(trainer_data)
    shutil.rmtree(auditor_data)
    again = recheck_evidence(verdict.to_bytes(), tmp_path / "evidence", profile=ARBITER_PROFILE)
    assert again.finding == "invalid-log"
