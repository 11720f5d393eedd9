"""protocol.job.intervals: the plan of a job's checkpoint intervals, and their replay in worker
processes from local stores (no network): the same leaves, logs, checkpoints and root as
`replay_job`'s, bit for bit, whatever each worker's thread count; a state that is not the
trainer's h_c refused; a damaged segment never stitched."""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, PeerError, StoreError, WorkerError
from protocol.job.create import build_job, job_executor
from protocol.job.faults import one_ulp_off
from protocol.job.intervals import (
    SEGMENTS,
    Interval,
    IntervalRunner,
    make_task,
    plan_intervals,
    replay_in_intervals,
    replay_interval,
    stitch,
)
from protocol.job.run import StepHooks, StoreSource, replay_job, run_job
from protocol.job.store import JobStore

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS, EVERY = 12, 4
AUDITOR = Profile.parse("emulated-gpu")  # 2 threads; its workers get cores // 2


@pytest.fixture(scope="module")
def trainer(tmp_path_factory) -> JobStore:
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=STEPS, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=EVERY,
                             commit_interval=STEPS)
    store = JobStore(tmp_path_factory.mktemp("trainer"), spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-2t"))
    return store


@dataclass(frozen=True)
class StoreStates:
    """Opens, in a worker, a StateSource over the trainer's store at `root` (picklable)."""

    root: Path
    shift: int | None = None  # serve S_shift one ULP off: a trainer whose S_c is not its h_c

    def __call__(self, spec):
        return _States(JobStore(self.root, spec), self.shift)


class _States:
    def __init__(self, store: JobStore, shift: int | None) -> None:
        self.store, self.shift = store, shift

    def state(self, step):
        state = self.store.checkpoint(step)
        return one_ulp_off(state) if step == self.shift else state

    def log_bytes(self, step):
        return self.store.log_bytes(step)

    def close(self):
        self.store.close()


@dataclass(frozen=True)
class DyingStates:
    """A worker's source whose process dies when asked for a state (killed, out of memory)."""

    def __call__(self, spec):
        return self

    def state(self, step):
        os._exit(9)


@dataclass(frozen=True)
class ThreadsSeen(StepHooks):
    """Honest hooks noting, per replayed step, the process and its torch thread count."""

    folder: Path

    def before(self, t, ex):
        (self.folder / str(t)).write_text(f"{os.getpid()} {torch.get_num_threads()}")


def _spec(steps, every):
    return dataclasses.replace(_SPEC, steps=steps, checkpoint_interval=every)


_SPEC = build_job(program="image-cnn", config=TINY, preset=None, steps=1, seed=0, init_seed=1,
                  policy=PrecisionPolicy(), checkpoint_interval=1, commit_interval=1)[0]


@pytest.mark.parametrize("steps, every, after, upto, plan", [
    (12, 4, 0, None, [(1, 4), (5, 8), (9, 12)]),
    (10, 4, 0, None, [(1, 4), (5, 8), (9, 10)]),  # the last one ends at S_n
    (10, 4, 5, None, [(6, 8), (9, 10)]),  # resumed mid-interval: the rest of it first
    (10, 4, 0, 6, [(1, 4), (5, 6)]),
    (3, 5, 0, None, [(1, 3)]),
    (4, 4, 4, None, []),
])
def test_the_plan_cuts_after_every_checkpoint(steps, every, after, upto, plan):
    intervals = plan_intervals(_spec(steps, every), after=after, upto=upto)
    assert [(iv.first, iv.last) for iv in intervals] == plan
    assert all(iv.start == iv.first - 1 for iv in intervals)


def test_two_worker_processes_stitch_replay_jobs_leaves_bit_for_bit(trainer, tmp_path):
    key = KeyPair.generate()
    sequential = JobStore(tmp_path / "sequential", trainer.spec)
    one = replay_job(sequential, StoreSource(trainer), key, profile=AUDITOR)
    seen = tmp_path / "seen"
    seen.mkdir()
    runner = IntervalRunner(2, StoreStates(trainer.dir.parent), AUDITOR, hooks=ThreadsSeen(seen))
    parallel = JobStore(tmp_path / "parallel", trainer.spec)
    two = replay_in_intervals(parallel, StoreSource(trainer), key, runner)
    assert one.matches and two.matches
    assert two.commitment.commitment.root == one.commitment.commitment.root
    assert parallel.leaves() == sequential.leaves()
    for t in range(1, STEPS + 1):
        assert parallel.log_bytes(t) == sequential.log_bytes(t)
    assert parallel.checkpoint_steps() == sequential.checkpoint_steps() == [0, 4, 8, 12]
    # the 3 intervals ran in worker processes, not this one (at most 2: a worker that starts
    # late may find the others took every task), each on cores // 2 threads (the emulated
    # GPU's 2 threads in the sequential replay): the same bits
    workers = {tuple(map(int, (seen / str(t)).read_text().split())) for t in range(1, 13)}
    assert 1 <= len(dict(workers)) <= 2 and os.getpid() not in dict(workers)
    assert {threads for _, threads in workers} == {max(1, len(os.sched_getaffinity(0)) // 2)}
    assert not (parallel.dir / SEGMENTS).exists()


def test_a_trainer_state_that_is_not_its_leafs_h_c_is_refused(trainer, tmp_path):
    auditor = JobStore(tmp_path, trainer.spec)
    task = make_task(auditor, StoreSource(trainer), Interval(5, 8))
    source = StoreStates(trainer.dir.parent, shift=4)(trainer.spec)
    with pytest.raises(PeerError, match="S_4 does not hash to h_4 of its own signed leaf 4"):
        replay_interval(trainer.spec, task, source, job_executor(trainer.spec, AUDITOR))


@pytest.fixture(scope="module")
def interval1(trainer, tmp_path_factory):
    """Interval 1-4 replayed in this process (its segment in a store of its own)."""
    auditor = JobStore(tmp_path_factory.mktemp("interval1"), trainer.spec)
    task = make_task(auditor, StoreSource(trainer), Interval(1, 4))
    result = replay_interval(trainer.spec, task, StoreStates(trainer.dir.parent)(trainer.spec),
                             job_executor(trainer.spec, AUDITOR))
    assert result.divergent_step is None and [leaf.step for leaf in result.leaves] == [1, 2, 3, 4]
    return result


@pytest.fixture
def replayed(trainer, interval1, tmp_path):
    """An auditor store holding S_0, and a copy of interval 1-4's segment to stitch into it."""
    auditor = JobStore(tmp_path / "auditor", trainer.spec)
    auditor.put_initial(trainer.checkpoint(0))
    segment = shutil.copytree(interval1.segment, tmp_path / "segment")
    return auditor, dataclasses.replace(interval1, segment=segment)


def test_a_segment_stitches_into_the_store(replayed, trainer):
    auditor, result = replayed
    stitch(auditor, result)
    assert auditor.leaves() == trainer.leaves()[:5]
    assert auditor.checkpoint(4) is not None


@pytest.mark.parametrize("damage, message", [
    (lambda seg: (seg / "000000002.ovtl").write_bytes(b"another log"), "not its leaf's"),
    (lambda seg: (seg / "000000003.ovtl").unlink(), "log of step 3 is unreadable"),
    (lambda seg: (seg / "state.safetensors").unlink(), "missing or damaged"),
    (lambda seg: (seg / "state.safetensors").write_bytes(b"\x00" * 16), "missing or damaged"),
], ids=["log-replaced", "log-missing", "state-missing", "state-garbage"])
def test_a_damaged_segment_is_never_stitched(replayed, damage, message):
    auditor, result = replayed
    damage(result.segment)
    with pytest.raises(StoreError, match=message):
        stitch(auditor, result)
    assert auditor.last_step() < 4  # nothing after the damage was stored


def test_a_worker_that_dies_fails_the_replay_instead_of_hanging(trainer, tmp_path):
    auditor = JobStore(tmp_path, trainer.spec)
    tasks = [make_task(auditor, StoreSource(trainer), iv) for iv in plan_intervals(trainer.spec)]
    results = IntervalRunner(2, DyingStates(), AUDITOR)(trainer.spec, tasks)
    with pytest.raises(WorkerError, match="an audit worker process died before answering"):
        next(results)


@pytest.mark.parametrize("processes", [0, -1, True, 1.5])
def test_a_runner_needs_at_least_one_process(trainer, processes):
    with pytest.raises(ConfigError, match="at least 1"):
        IntervalRunner(processes, StoreStates(trainer.dir.parent), AUDITOR)
