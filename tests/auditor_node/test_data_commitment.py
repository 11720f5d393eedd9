"""The auditor never replays a job whose data commitment is not its program's own dataset
(review 26, finding 3). A cheat trains such a job (its trainer skips the check an honest one
makes when the job starts, tests/trainer_node/test_data_commitment.py) and cheats at step 2:
an audit used to challenge it, and since neither party can prove B_2 against the spec's data
root, the arbiter ruled both at fault, the honest auditor blamed and the cheat not convicted
alone. `run_audit` now refuses the job before it makes its store (in-process Claims server on
127.0.0.1)."""

from __future__ import annotations

import dataclasses

import pytest

from auditor_node.audit import run_audit
from proto.claims import ClaimsServicer, StoreDirectory
from protocol.commit.data import DataCommitment
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError
from protocol.job.create import build_job
from protocol.job.faults import Fault
from protocol.job.run import run_job
from protocol.job.store import JobStore
from trainer_node.faults import TrainerFaults

from .conftest import serve_claims

pytestmark = pytest.mark.network
TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
PROFILE = Profile.parse("cpu-1t")


def test_the_auditor_refuses_a_job_whose_data_root_is_not_its_programs(tmp_path, monkeypatch):
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=4, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=2,
                             commit_interval=4)
    forged = dataclasses.replace(spec, data=DataCommitment(b"\x11" * 32, spec.data.count))
    with monkeypatch.context() as unchecked:  # the cheat's trainer trains it all the same
        unchecked.setattr("protocol.job.create.require_committed_data", lambda *a, **k: None)
        store = JobStore(tmp_path / "trainer", forged)
        store.put_initial(state0)
        run_job(store, KeyPair.generate(), profile=PROFILE,
                hooks=TrainerFaults([Fault("lr", 2)]))
        store.close()
    with serve_claims(ClaimsServicer(StoreDirectory(tmp_path / "trainer"))) as address, \
            pytest.raises(ConfigError, match=r"the dataset of program 'image-cnn' differs from "
                                             r"the one this job committed to \(its examples "
                                             r"give root [0-9a-f]{16}… over 64, the job's is "
                                             r"1111111111111111… over 64\)"):
        run_audit(address, forged.job_id, tmp_path / "auditor", KeyPair.generate(), PROFILE,
                  deadline_s=20)
    assert not (tmp_path / "auditor").exists()  # no store was made
