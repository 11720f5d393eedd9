"""The trainer's store and the library-level job run and audit (SPEC §4, §5.1).

One 200-step job with checkpoint_interval=50 (a tiny image-cnn, so it trains in seconds) serves
the module: S_137 regenerated from the store equals the state seen during training bit for bit;
a deleted or corrupted checkpoint is detected and regenerated around; a corrupted log is
refused; an interrupted run resumes to the same root; an auditor on another profile matches.
"""

from __future__ import annotations

import shutil
import struct

import pytest
import safetensors.torch
import torch

from protocol.codec.roundinglog import EMPTY_LOG_DIGEST
from protocol.codec.state import safetensors_file_digest, state_digest, states_equal
from protocol.commit.commitments import Commitment, sign_commitment
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import StoreError
from protocol.job.create import build_job, job_executor
from protocol.job.run import StoreSource, replay_job, run_job
from protocol.job.store import JobStore

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS, WATCHED = 200, 137
PROFILE = Profile.parse("cpu-2t")


def _job(steps=STEPS, checkpoint_interval=50, commit_interval=100):
    return build_job(program="image-cnn", config=TINY, preset=None, steps=steps, seed=0,
                     init_seed=1, policy=PrecisionPolicy(), commit_interval=commit_interval,
                     checkpoint_interval=checkpoint_interval)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    spec, state0 = _job()
    root = tmp_path_factory.mktemp("trainer")
    store = JobStore(root, spec)
    store.put_initial(state0)
    key = KeyPair.generate()
    signed = run_job(store, key, profile=PROFILE)
    # The state seen during training at step WATCHED, recomputed independently of the store.
    ex = job_executor(spec, PROFILE)
    ex.load_state(state0)
    for _ in range(WATCHED):
        ex.step()
    return spec, state0, root, store, key, signed, ex.state()


def _fresh_executor(spec):
    return job_executor(spec, PROFILE)


def test_commitment_covers_every_step(trained):
    spec, _, _, store, key, signed, _ = trained
    signed.verify(job_id=spec.job_id, role="trainer", n=STEPS)
    assert signed.commitment.root == store.tree().root
    assert [leaf.step for leaf in store.leaves()] == list(range(STEPS + 1))
    assert store.checkpoint_steps() == [0, 50, 100, 150, 200]
    assert store.commitment(100) is not None  # the commit_interval commitment


def test_regenerated_state_is_bit_identical(trained):
    spec, _, _, store, _, _, seen = trained
    regenerated = store.state_at(WATCHED, _fresh_executor(spec))
    assert states_equal(regenerated, seen)
    for name in seen:
        assert torch.equal(regenerated[name], seen[name]), name


def test_deleted_and_corrupted_checkpoints_are_regenerated_around(trained, tmp_path):
    spec, _, root, _, _, _, seen = trained
    copy_root = tmp_path / "copy"
    shutil.copytree(root, copy_root)
    store = JobStore(copy_root, spec)
    (store.dir / "checkpoints" / f"{100:09d}.safetensors").unlink()
    path = store.dir / "checkpoints" / f"{50:09d}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one bit of one tensor
    path.write_bytes(bytes(data))
    assert store.checkpoint(50) is None  # detected
    assert states_equal(store.state_at(WATCHED, _fresh_executor(spec)), seen)  # from S_0


def _damage_header(path, old=b'"dtype":"I64"', new=b'"dtype":"U64"'):
    """One changed header byte: a dtype safetensors loads and the state hash refuses."""
    data = path.read_bytes()
    assert old in data
    path.write_bytes(data.replace(old, new, 1))


def test_damaged_checkpoint_header_is_regenerated_around(trained, tmp_path):
    """Finding 7 (issue 10): one changed byte in a checkpoint's header made `checkpoint` raise
    (a TypeError), so GetCheckpoint answered UNKNOWN although S_50 was intact: an unparsable
    checkpoint is missing, like a damaged body."""
    spec, _, root, _, _, _, seen = trained
    shutil.copytree(root, tmp_path / "copy")
    store = JobStore(tmp_path / "copy", spec)
    _damage_header(store.dir / "checkpoints" / f"{100:09d}.safetensors")
    assert store.checkpoint(100) is None
    assert states_equal(store.state_at(WATCHED, _fresh_executor(spec)), seen)  # from S_50


def test_every_changed_header_byte_is_missing_or_the_same_state(trained, tmp_path):
    spec, _, root, _, _, _, _ = trained
    shutil.copytree(root, tmp_path / "copy")
    store = JobStore(tmp_path / "copy", spec)
    path = store.dir / "checkpoints" / f"{50:09d}.safetensors"
    data = path.read_bytes()
    (header_size,) = struct.unpack("<Q", data[:8])
    for pos in range(8 + header_size):
        for value in b"U0":
            damaged = bytearray(data)
            damaged[pos] = value
            path.write_bytes(bytes(damaged))
            state = store.checkpoint(50)
            assert state is None or state_digest(state) == store.leaf(50).state_hash


def test_a_resumed_run_regenerates_around_a_damaged_checkpoint_header(trained, tmp_path):
    """Finding 7 (issue 10): a job resuming after a crash must not fail for good on a damaged
    checkpoint header while an earlier checkpoint (here S_0) is intact."""
    spec, state0, _, _, key, signed, _ = trained
    store = JobStore(tmp_path, spec)
    store.put_initial(state0)

    def crash_at_73(t, n):
        if t == 73:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(store, key, profile=PROFILE, progress=crash_at_73)
    _damage_header(store.dir / "checkpoints" / f"{50:09d}.safetensors")
    resumed = run_job(store, key, profile=PROFILE)
    assert resumed.commitment.root == signed.commitment.root


def test_corrupted_log_is_refused(trained, tmp_path):
    spec, _, root, _, _, _, _ = trained
    shutil.copytree(root, tmp_path / "copy")
    store = JobStore(tmp_path / "copy", spec)
    path = store.dir / "logs" / f"{7:09d}.ovtl.z"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(StoreError, match="step 7"):
        store.log_bytes(7)
    with pytest.raises(StoreError, match="step 7"):
        store.state_at(10, _fresh_executor(spec))


def test_store_refuses_another_spec_and_out_of_order_steps(trained, tmp_path):
    spec, state0, root, _, _, _, _ = trained
    other, _ = _job(steps=10)
    (tmp_path / spec.job_id.hex()).mkdir()
    (tmp_path / spec.job_id.hex() / "spec.ovtjob").write_bytes(other.to_bytes())
    with pytest.raises(StoreError, match="another job spec"):
        JobStore(tmp_path, spec)
    fresh = JobStore(tmp_path / "fresh", spec)
    fresh.put_initial(state0)
    with pytest.raises(StoreError, match="does not follow"):
        fresh.append_step(2, state0, b"")
    assert JobStore.open(root, spec.job_id.hex()).last_step() == STEPS


def test_interrupted_run_resumes_to_the_same_root(trained, tmp_path):
    spec, state0, _, _, key, signed, _ = trained
    store = JobStore(tmp_path, spec)
    store.put_initial(state0)

    def crash_at_73(t, n):
        if t == 73:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_job(store, key, profile=PROFILE, progress=crash_at_73)
    store.close()
    reopened = JobStore.open(tmp_path, spec.job_id.hex())
    assert reopened.last_step() == 73
    resumed = run_job(reopened, key, profile=PROFILE)
    assert resumed.commitment.root == signed.commitment.root


def test_auditor_on_another_profile_matches(trained, tmp_path):
    spec, _, _, store, _, signed, _ = trained
    outcome = replay_job(JobStore(tmp_path, spec), StoreSource(store), KeyPair.generate(),
                         profile=Profile.parse("emulated-gpu"))
    assert outcome.matches
    assert outcome.commitment.commitment.root == signed.commitment.root
    outcome.commitment.verify(job_id=spec.job_id, role="auditor", n=STEPS)


def test_auditor_finds_the_step_of_a_falsified_leaf(trained, tmp_path):
    spec, _, root, _, _, _, _ = trained
    shutil.copytree(root, tmp_path / "trainer")
    trainer = JobStore(tmp_path / "trainer", spec)
    leaf = trainer.leaf(120)
    trainer._put_leaf(Leaf(120, bytes(32), leaf.log_hash))  # a lying trainer's leaf 120...
    key = KeyPair.generate()  # ...under a validly signed root over its leaves
    tree = trainer.tree()
    trainer.save_commitment(sign_commitment(Commitment(
        job_id=spec.job_id, n=STEPS, root=tree.root, h_n=trainer.leaf(STEPS).state_hash,
        public_key=key.public_key, role="trainer", time=0), key))
    outcome = replay_job(JobStore(tmp_path / "auditor", spec), StoreSource(trainer),
                         KeyPair.generate(), profile=PROFILE)
    assert not outcome.matches
    assert outcome.first_divergent_step == 120
    assert outcome.commitment.commitment.n == 120


def test_put_initial_file_moves_a_checked_s0_into_place(tmp_path):
    """Issue 10, finding 6 (review): a submitted S_0 is stored as the file it came in, hashed
    where it lies (`safetensors_file_digest`), never loaded and saved again."""
    spec, state0 = _job(steps=2)
    sent = tmp_path / ".submitted-s0.abcdefgh.tmp"
    sent.write_bytes(safetensors.torch.save(state0, metadata={"from": "a client"}))
    store = JobStore(tmp_path, spec)
    with pytest.raises(StoreError, match="h_0"):
        store.put_initial_file(sent, bytes(32))
    assert sent.exists() and store.last_step() == -1
    data = sent.read_bytes()
    store.put_initial_file(sent, safetensors_file_digest(sent))
    assert not sent.exists()
    assert store.leaf(0) == Leaf(0, spec.h0, EMPTY_LOG_DIGEST)
    assert (store.dir / "checkpoints" / "000000000.safetensors").read_bytes() == data
    assert states_equal(store.checkpoint(0), state0)


def test_a_store_cut_back_forgets_the_later_steps_and_runs_on_to_the_same_root(trained,
                                                                              tmp_path):
    """`truncate` (an auditor's replay of another commitment's logs, replayed again): leaves,
    commitments over more steps, logs and checkpoints after the step go; what stays regenerates
    and runs on to the same leaves."""
    spec, _, root, _, key, signed, _ = trained
    shutil.copytree(root, tmp_path / "copy")
    store = JobStore(tmp_path / "copy", spec)
    store.truncate(120)
    assert store.last_step() == 120
    assert store.commitment(STEPS) is None and store.commitment(100) is not None
    assert store.checkpoint_steps() == [0, 50, 100]
    assert [int(p.name[:9]) for p in (store.dir / "logs").iterdir()] and \
        max(int(p.name[:9]) for p in (store.dir / "logs").iterdir()) == 120
    assert state_digest(store.state_at(120, _fresh_executor(spec))) == \
        store.leaf(120).state_hash
    assert run_job(store, key, profile=PROFILE).commitment.root == signed.commitment.root
    with pytest.raises(StoreError, match="S_0 stays"):
        store.truncate(-1)
