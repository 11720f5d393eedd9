"""protocol.job.intervals: the plan of a job's checkpoint intervals, and their replay in worker
processes from local stores (no network): the same leaves, logs, checkpoints and root as
`replay_job`'s, bit for bit, whatever each worker's thread count; the first interval from the
auditor's own state; a trainer state that is refused or not its h_c making the parent go on
from its own; a state the executor holds not fetched again; a damaged segment never stitched;
a stop that takes a poll, not an interval; at most as many processes as CPUs."""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import threading
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import pytest
import safetensors.torch
import torch

from protocol.codec.state import state_digest
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, PeerError, StoreError, WorkerError
from protocol.job.create import build_job, job_executor
from protocol.job.faults import one_ulp_off
from protocol.job.intervals import (
    GRACE_S,
    POLL_S,
    SEGMENTS,
    Interval,
    IntervalRunner,
    IntervalTask,
    make_task,
    plan_intervals,
    replay_in_intervals,
    replay_interval,
    stitch,
    usable_cpus,
)
from protocol.job.run import StepHooks, StoreSource, replay_job, run_job
from protocol.job.store import JobStore

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS, EVERY = 12, 4
AUDITOR = Profile.parse("emulated-gpu")  # 2 threads; its workers get cores // 2
two_cpus = pytest.mark.skipif(usable_cpus() < 2, reason="2 audit processes need 2 CPUs")


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
    refuse: int | None = None  # refuse S_refuse (PeerError), as a trainer may
    notes: Path | None = None  # note each request here: a file state-<t> or log-<pid>-<t>
    log_delay_s: float = 0.0  # a slow trainer: each log takes this long
    # log 1 is served only once `notes` holds this note (or after HOLD_S): the worker on the
    # first interval waits until another has asked for what the test is about
    hold_first_log_until: str | None = None

    def __call__(self, spec):
        return _States(JobStore(self.root, spec), self)


class _States:
    def __init__(self, store: JobStore, how: StoreStates) -> None:
        self.store, self.how = store, how

    def _note(self, name):
        if self.how.notes is not None:
            (self.how.notes / name).touch()

    def state(self, step):
        self._note(f"state-{step}")
        if step == self.how.refuse:
            raise PeerError(f"trainer GetCheckpoint {step} failed: PERMISSION_DENIED: no")
        state = self.store.checkpoint(step)
        return one_ulp_off(state) if step == self.how.shift else state

    def log_bytes(self, step):
        self._note(f"log-{os.getpid()}-{step}")
        time.sleep(self.how.log_delay_s)
        if step == 1 and self.how.hold_first_log_until is not None:
            assert self.how.notes is not None
            deadline = time.monotonic() + HOLD_S
            while not (self.how.notes / self.how.hold_first_log_until).exists() and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
        return self.store.log_bytes(step)

    def close(self):
        self.store.close()


HOLD_S = 120.0  # how long a held log waits for its note: a worker's start, on a loaded machine


def _states_asked(notes: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in notes.glob("state-*"))


@dataclass(frozen=True)
class DyingStates:
    """A worker's source whose process dies when asked for a state (killed, out of memory)."""

    def __call__(self, spec):
        return self

    def state(self, step):
        os._exit(9)


@dataclass(frozen=True)
class ThreadsSeen(StepHooks):
    """Honest hooks noting, per replayed step, the process and the thread count its executor's
    profile runs the step on."""

    folder: Path

    def before(self, t, ex):
        (self.folder / str(t)).write_text(f"{os.getpid()} {ex.profile.threads}")


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


def test_a_plan_takes_no_memory_per_interval():
    """Review 26, finding 5: the plan was a list of every interval, so a peer's spec of 2**40
    one-step intervals exhausted a sampled auditor's memory before it fetched anything."""
    spec = _spec(10**5, 1)
    tracemalloc.start()
    try:
        plan = plan_intervals(spec)
        assert len(plan) == 10**5 and plan[-1] == Interval(10**5, 10**5)
        assert tracemalloc.get_traced_memory()[1] < 10_000
    finally:
        tracemalloc.stop()
    huge = plan_intervals(_spec(2**40, 3), after=4)  # 2**40 = 1 (mod 3): a last 1-step interval
    assert len(huge) == (2**40 - 1) // 3
    assert list(itertools.islice(huge, 3)) == [Interval(5, 6), Interval(7, 9), Interval(10, 12)]
    assert huge[-2:] == [Interval(2**40 - 3, 2**40 - 1), Interval(2**40, 2**40)]
    assert Interval(2**40 - 3, 2**40 - 1) in huge and Interval(7, 9) in huge
    assert Interval(4, 6) not in huge and Interval(7, 8) not in huge
    assert Interval(2**40 - 3, 2**40) not in huge and (7, 9) not in huge
    with pytest.raises(IndexError):
        huge[len(huge)]


@two_cpus
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
    # every interval ran in a worker process (at most 2: a worker that starts late may find
    # the other took them all), the first from the auditor's own S_0 handed over as a file,
    # each on cores // 2 threads, so no more compute streams than processes: the same bits
    workers = {tuple(map(int, (seen / str(t)).read_text().split())) for t in range(1, 13)}
    assert 1 <= len(dict(workers)) <= 2 and os.getpid() not in dict(workers)
    assert {threads for _, threads in workers} == {max(1, usable_cpus() // 2)}
    assert not (parallel.dir / SEGMENTS).exists()


@pytest.mark.parametrize("how, why", [
    ({"shift": 4}, "the trainer's S_4 does not hash to h_4 of its own signed leaf 4"),
    ({"refuse": 4}, "trainer GetCheckpoint 4 failed: PERMISSION_DENIED: no"),
], ids=["wrong", "refused"])
def test_an_interval_whose_trainer_state_is_wrong_or_refused_does_not_start(trainer, tmp_path,
                                                                           how, why):
    auditor = JobStore(tmp_path, trainer.spec)
    task = make_task(auditor, StoreSource(trainer), Interval(5, 8))
    source = StoreStates(trainer.dir.parent, **how)(trainer.spec)
    result = replay_interval(trainer.spec, task, source, job_executor(trainer.spec, AUDITOR))
    assert (result.unstarted, result.leaves, result.divergent_step) == (why, (), None)
    assert not task.segment.exists()  # nothing was replayed


class MadeUp:
    """A StateSource whose S_4 is `state`, over the trainer's store otherwise."""

    def __init__(self, trainer: JobStore, state) -> None:
        self.trainer, self.made_up = trainer, state

    def state(self, step):
        return self.made_up if step == 4 else self.trainer.checkpoint(step)

    def log_bytes(self, step):
        return self.trainer.log_bytes(step)

    def close(self):
        pass


def _made_up_task(trainer: JobStore, auditor: JobStore, made_up) -> IntervalTask:
    """The task of steps 5-8 under a cheat's leaf 4, whose h_4 is `made_up`'s hash."""
    task = make_task(auditor, StoreSource(trainer), Interval(5, 8))
    leaf4 = task.trainer_leaves[0]
    return dataclasses.replace(task, trainer_leaves=(
        Leaf(4, state_digest(made_up), leaf4.log_hash), *task.trainer_leaves[1:]))


@pytest.fixture(scope="module")
def adam_trainer(tmp_path_factory) -> JobStore:
    """An Adam job of 8 steps (intervals 1-4 and 5-8), trained honestly."""
    spec, state0 = build_job(program="image-cnn", config={**TINY, "optimizer": "adam"},
                             preset=None, steps=8, seed=0, init_seed=1,
                             policy=PrecisionPolicy(), checkpoint_interval=EVERY,
                             commit_interval=8)
    store = JobStore(tmp_path_factory.mktemp("adam-trainer"), spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-2t"))
    return store


NOT_S4 = "the trainer's S_4 hashes to h_4 but is no state of this job's program at step 4: "


def _counters_as(dtype):
    return lambda s: s.update({k: v.to(dtype) for k, v in s.items()
                               if k.startswith("optim.") and k.endswith(".step")})


@pytest.mark.parametrize("job, change, why", [
    ("trainer", lambda s: s.pop("step"),
     "ConfigError: state does not fit the program: its step counter 'step' must be one "
     "int64, it has none"),
    ("trainer", lambda s: s.update({"extra.x": torch.zeros(1)}), "unexpected ['extra.x']"),
    ("trainer", lambda s: s.update(step=torch.tensor(10**12)),
     "holds step counter 1000000000000, not 4"),
    ("adam_trainer", lambda s: s.pop("optim.head.weight.exp_avg_sq"), "KeyError: 'exp_avg_sq'"),
    ("adam_trainer", _counters_as(torch.int64),
     ".step' is torch.int64 (), a step counter torch.optim keeps as torch.float32 ()"),
], ids=["no-step", "stray", "other-step", "adam-no-exp_avg_sq", "adam-int-counters"])
def test_a_made_up_trainer_state_that_hashes_to_its_leaf_but_does_not_run_does_not_start(
        request, tmp_path, job, change, why):
    """A cheat signs a leaf 4 whose S_4 hashes to it but is no S_4 of the program: the interval
    does not start (the caller replays it from its own state, which finds the cheat) instead
    of failing the audit. Loading it raised (a bare KeyError without a step counter), or it
    loaded and the first step raised (review 30, finding A: an Adam state without one
    parameter's exp_avg_sq, a bare KeyError from torch's Adam), and every retry of a sampled
    audit drew the same interval and failed the same way."""
    trainer = request.getfixturevalue(job)
    made_up = trainer.checkpoint(4)
    change(made_up)
    task = _made_up_task(trainer, JobStore(tmp_path, trainer.spec), made_up)
    result = replay_interval(trainer.spec, task, MadeUp(trainer, made_up),
                             job_executor(trainer.spec, AUDITOR))
    assert result.unstarted is not None and (result.leaves, result.divergent_step) == ((), None)
    assert result.unstarted.startswith(NOT_S4)
    assert why in result.unstarted
    assert not task.segment.exists()


@pytest.mark.parametrize("start", ["held", "own-start"])
def test_the_auditors_own_start_state_is_trusted_when_its_step_fails(adam_trainer, tmp_path,
                                                                    start):
    """Only the trainer's S_start is untrusted: a step that fails from the auditor's own
    (the state its executor holds, or its S_start handed over as a file) is the auditor's own
    failure, and raises."""
    made_up = adam_trainer.checkpoint(4)
    del made_up["optim.head.weight.exp_avg_sq"]
    auditor = JobStore(tmp_path / "auditor", adam_trainer.spec)
    task = _made_up_task(adam_trainer, auditor, made_up)
    ex = job_executor(adam_trainer.spec, AUDITOR)
    held = None
    if start == "held":
        ex.load_state(made_up, step=4)  # a load does not tell that a buffer is missing
        held = state_digest(made_up)
    else:
        own = tmp_path / "own-start.safetensors"
        own.write_bytes(safetensors.torch.save(made_up))
        task = dataclasses.replace(task, own_start=own)
    with pytest.raises(KeyError, match="exp_avg_sq"):
        replay_interval(adam_trainer.spec, task, MadeUp(adam_trainer, made_up), ex, held=held)


@dataclass(frozen=True)
class FailsAt(StepHooks):
    """Honest hooks but for step `step`, which raises before it runs."""

    step: int

    def before(self, t, ex):
        if t == self.step:
            raise RuntimeError(f"step {t} failed")


def test_only_the_first_step_from_the_trainers_state_makes_an_interval_unstarted(trainer,
                                                                                  tmp_path):
    """Once step 5 has run from the trainer's S_4, what the interval's later steps raise is
    the replay's failure, as in any replay, not the trainer's state's."""
    auditor = JobStore(tmp_path, trainer.spec)
    task = make_task(auditor, StoreSource(trainer), Interval(5, 8))
    first = replay_interval(trainer.spec, task, MadeUp(trainer, trainer.checkpoint(4)),
                            job_executor(trainer.spec, AUDITOR), FailsAt(5))
    assert (first.unstarted, first.leaves) == (NOT_S4 + "RuntimeError: step 5 failed", ())
    with pytest.raises(RuntimeError, match="step 6 failed"):
        replay_interval(trainer.spec, task, MadeUp(trainer, trainer.checkpoint(4)),
                        job_executor(trainer.spec, AUDITOR), FailsAt(6))


@two_cpus
def test_a_refused_trainer_state_makes_the_parent_go_on_from_its_own(trainer, tmp_path):
    """A trainer refusing S_4 costs the audit its parallelism, not its outcome: the parent
    replays 5-12 from its own state and signs replay_job's root. The worker on steps 1-4 waits
    for the other to ask for S_4 (else, started first, it could replay 5-8 too, from the S_4
    it holds, and never ask)."""
    notes = tmp_path / "notes"
    notes.mkdir()
    runner = IntervalRunner(2, StoreStates(trainer.dir.parent, refuse=4, notes=notes,
                                           hold_first_log_until="state-4"), AUDITOR)
    store = JobStore(tmp_path / "auditor", trainer.spec)
    outcome = replay_in_intervals(store, StoreSource(trainer), KeyPair.generate(), runner)
    assert outcome.matches and store.leaves() == trainer.leaves()
    assert store.checkpoint_steps() == [0, 4, 8, 12]
    # the workers asked for S_4 (and perhaps S_8, already in flight), never for S_0: the first
    # interval starts from the auditor's own
    assert 4 in _states_asked(notes) and set(_states_asked(notes)) <= {4, 8}


def test_one_process_does_not_fetch_a_state_its_executor_holds(trainer, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    auditor = JobStore(tmp_path / "auditor", trainer.spec)
    tasks = [make_task(auditor, StoreSource(trainer), iv) for iv in plan_intervals(trainer.spec)]
    results = list(IntervalRunner(1, StoreStates(trainer.dir.parent, notes=notes),
                                  AUDITOR)(trainer.spec, tasks))
    assert [leaf for result in results for leaf in result.leaves] == trainer.leaves()[1:]
    assert _states_asked(notes) == [0]  # S_4 and S_8 were the executor's already


class Halt(Exception):
    """What the test's stop check raises (the daemon's is `Stopped`)."""


@two_cpus
def test_a_stop_takes_a_poll_and_ends_workers_stuck_in_a_step(trainer, tmp_path):
    """Both workers wait 60 s for a log (a stalled trainer): stopping ends the replay within a
    poll, and closing terminates them after the grace period instead of waiting."""
    notes = tmp_path / "notes"
    notes.mkdir()
    stop = threading.Event()

    def check_stop():
        if stop.is_set():
            raise Halt

    auditor = JobStore(tmp_path / "auditor", trainer.spec)
    tasks = [make_task(auditor, StoreSource(trainer), iv) for iv in plan_intervals(trainer.spec)]
    runner = IntervalRunner(2, StoreStates(trainer.dir.parent, notes=notes, log_delay_s=60),
                            AUDITOR, check_stop=check_stop)
    results = runner(trainer.spec, tasks)  # the workers start now, before the first `next`
    deadline = time.monotonic() + 60
    while len(pids := {int(p.name.split("-")[1]) for p in notes.glob("log-*")}) < 2:
        assert time.monotonic() < deadline, "the workers did not start"
        time.sleep(0.05)
    assert len(list(notes.glob("log-*"))) == 2  # the third interval waits here, unsubmitted
    stop.set()
    started = time.monotonic()
    with pytest.raises(Halt):
        next(results)
    assert time.monotonic() - started < POLL_S + GRACE_S + 3
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # terminated and reaped


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


@two_cpus
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


def test_a_runner_has_at_most_a_process_per_cpu(trainer):
    cpus = usable_cpus()
    with pytest.raises(ConfigError, match=f"^{cpus + 1} audit processes are more than the "
                                          f"{cpus} CPUs this process may use$"):
        IntervalRunner(cpus + 1, StoreStates(trainer.dir.parent), AUDITOR)
    assert IntervalRunner(cpus, StoreStates(trainer.dir.parent), AUDITOR).processes == cpus


def test_the_usable_cpus_are_the_cpu_count_where_there_is_no_affinity_mask(monkeypatch):
    assert usable_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 3)
    assert usable_cpus() == 3
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert usable_cpus() == 1
