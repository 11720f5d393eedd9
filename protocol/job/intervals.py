"""Audit intervals: a job's replay cut at the trainer's checkpoints, each piece replayed alone.

The trainer stores S_c at every checkpoint c (each multiple of the job's checkpoint interval,
and S_n) and serves any S_t checked against its own leaf (SPEC §4). So the steps c+1..c' up to
the next checkpoint can be replayed from the trainer's S_c alone — checked here against h_c in
the trainer's signed leaf c, S_0 against the job's h_0 — independently of every other
interval: several at once in worker processes (`IntervalRunner`), or only a sample of them
(`protocol.job.sampling`).

Where the auditor agrees with the trainer up to c, an interval's replay starts from the very
state whose hash both leaves c hold, so its leaves are the ones a sequential replay would
store. Stitched into the auditor's store in step order (`replay_in_intervals`), they give
`protocol.job.run.replay_job`'s leaves, root and signed commitment, and the first divergent
step of the first interval that diverges is the challenge of SPEC §5.1, as there.

A worker writes what it replayed to a segment folder in the auditor's store
(`<store>/<job id>/intervals/<first>-<last>/`: each step's log, and the last step's state when
a checkpoint is due there) and returns the leaves it computed; the parent stitches them into
the store, which checks each log against its leaf and each checkpoint against h_t, and removes
the folder. Segments are scratch: after a crash the store keeps every leaf stitched so far
(durable as ever) and the next audit replays the other intervals again. Nothing crosses between
processes but this module's dataclasses, files the auditor itself wrote, and what `sources`
fetches in the worker: nothing from a peer is ever unpickled.

    runner = IntervalRunner(2, sources, Profile.parse("emulated-gpu"))
    outcome = replay_in_intervals(store, claims, key, runner)  # = replay_job's outcome
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Protocol

import safetensors.torch
import torch

from protocol.codec.roundinglog import log_digest
from protocol.codec.state import load_safetensors, state_digest
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.engine.executor import Executor
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, PeerError, StateFormatError, StoreError, WorkerError
from protocol.job.create import job_executor
from protocol.job.run import (
    STATE_DIFFERS,
    AuditOutcome,
    ClaimSource,
    Progress,
    StepHooks,
    begin_replay,
    finish_replay,
    replay_step,
)
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore, checkpoint_due

SEGMENTS = "intervals"  # the scratch folder under a job's store
_STATE_FILE = "state.safetensors"


@dataclass(frozen=True, order=True)
class Interval:
    """Steps `first`..`last` of a job, replayed from S_{first-1} (the interval's `start`)."""

    first: int
    last: int

    @property
    def start(self) -> int:
        return self.first - 1

    @property
    def steps(self) -> range:
        return range(self.first, self.last + 1)

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


def plan_intervals(spec: JobSpec, after: int = 0, upto: int | None = None) -> list[Interval]:
    """Steps after+1..upto (default: the job's last) cut after every trainer checkpoint (each
    multiple of the checkpoint interval), in step order. An interval starts at a checkpoint
    unless it is the first and `after` is not one (an audit resumed mid-interval)."""
    upto = spec.steps if upto is None else upto
    every = spec.checkpoint_interval
    plan: list[Interval] = []
    first = after + 1
    while first <= upto:
        last = min((first - 1) // every * every + every, upto)
        plan.append(Interval(first, last))
        first = last + 1
    return plan


class StateSource(Protocol):
    """What a worker reads from the trainer: S_t and L_t's bytes, unchecked (`replay_interval`
    checks them against the trainer's leaves), and `close` when the worker is done."""

    def state(self, step: int) -> dict[str, torch.Tensor]: ...

    def log_bytes(self, step: int) -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class IntervalTask:
    """One interval to replay: the trainer's leaves start..last, verified by the parent under
    the trainer's signed root, and the segment folder the worker writes into."""

    interval: Interval
    trainer_leaves: tuple[Leaf, ...]
    segment: Path


@dataclass(frozen=True)
class IntervalResult:
    """An interval as replayed: the auditor's leaves from `first` on (ending at the first
    divergent step, included when it was replayed: a rejected log is not), and that step and
    its reason (None: every leaf matched the trainer's)."""

    interval: Interval
    leaves: tuple[Leaf, ...]
    divergent_step: int | None
    reason: str | None
    segment: Path


def make_task(store: JobStore, source: ClaimSource, interval: Interval) -> IntervalTask:
    """The task of `interval`, with the trainer's leaves from `source` (which verifies them)."""
    return IntervalTask(interval, tuple(source.leaf(t) for t in range(interval.start,
                                                                      interval.last + 1)),
                        store.dir / SEGMENTS / f"{interval.first:09d}-{interval.last:09d}")


def replay_interval(spec: JobSpec, task: IntervalTask, source: StateSource, ex: Executor,
                    hooks: StepHooks | None = None) -> IntervalResult:
    """Replay `task`'s interval on `ex` from the trainer's S_start, writing its segment.

    Each step is `protocol.job.run.replay_step`'s: the trainer's log checked against its leaf,
    then replayed; the interval stops at the first step whose log is rejected or whose state
    hash differs from the trainer's. Raises PeerError for an S_start that does not hash to the
    trainer's h_start (S_0: to the job's h_0), and what `source`, the step and the filesystem
    raise."""
    iv, trainer = task.interval, {leaf.step: leaf for leaf in task.trainer_leaves}
    state = source.state(iv.start)
    expected = spec.h0 if iv.start == 0 else trainer[iv.start].state_hash
    if state_digest(state) != expected:
        raise PeerError(f"the trainer's S_{iv.start} does not hash to h_{iv.start} of its own "
                        f"signed leaf {iv.start}")
    ex.load_state(state)
    shutil.rmtree(task.segment, ignore_errors=True)  # a crashed audit's stale files
    task.segment.mkdir(parents=True)
    leaves: list[Leaf] = []
    for t in iv.steps:
        replayed = replay_step(spec, ex, t, trainer[t], source.log_bytes(t), hooks)
        if isinstance(replayed, str):
            return IntervalResult(iv, tuple(leaves), t, replayed, task.segment)
        state, log = replayed
        leaf = Leaf(t, state_digest(state), log_digest(log))
        (task.segment / _log_name(t)).write_bytes(log)
        if checkpoint_due(spec, t):
            (task.segment / _STATE_FILE).write_bytes(safetensors.torch.save(
                {k: v.contiguous() for k, v in state.items()}))
        leaves.append(leaf)
        if leaf.state_hash != trainer[t].state_hash:
            return IntervalResult(iv, tuple(leaves), t, STATE_DIFFERS, task.segment)
    return IntervalResult(iv, tuple(leaves), None, None, task.segment)


def stitch(store: JobStore, result: IntervalResult, progress: Progress | None = None) -> None:
    """Append `result`'s leaves, with the logs and checkpoint of its segment, to the auditor's
    store, calling `progress(t, n)` after each. Raises StoreError for a segment that lacks a
    file or whose log or state is not its leaf's (see `JobStore.append_leaf`)."""
    for leaf in result.leaves:
        state = _segment_state(result.segment) if checkpoint_due(store.spec, leaf.step) else None
        try:
            log = (result.segment / _log_name(leaf.step)).read_bytes()
        except OSError as err:
            raise StoreError(f"interval {result.interval}'s log of step {leaf.step} is "
                             f"unreadable: {err}") from None
        store.append_leaf(leaf, log, state)
        if progress:
            progress(leaf.step, store.spec.steps)


def _log_name(step: int) -> str:
    return f"{step:09d}.ovtl"


def _segment_state(segment: Path) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors((segment / _STATE_FILE).read_bytes())
    except (OSError, StateFormatError) as err:
        raise StoreError(f"the state in {segment} is missing or damaged: {err}") from None


def replay_in_intervals(store: JobStore, source: ClaimSource, key: KeyPair,
                        runner: IntervalRunner, *, upto: int | None = None,
                        known: Mapping[Interval, IntervalResult] | None = None,
                        progress: Progress | None = None) -> AuditOutcome:
    """`replay_job` with the remaining steps cut into intervals (`plan_intervals`), replayed
    by `runner` and stitched into the store in step order; the same leaves, root and outcome.

    Resumes as `replay_job` does (`begin_replay`). `upto` ends the replay early, at an interval
    end (a sampled audit's divergent interval); `known` holds intervals already replayed whose
    segments are still in place (that audit's sample), which are stitched without replaying
    them again. Raises what `begin_replay`, `make_task`, the runner and `stitch` raise, and
    whatever `progress` raises (the replay then resumes from the store on the next call)."""
    known = known or {}
    trainer, last, divergent, reason = begin_replay(store, source)
    plan = plan_intervals(store.spec, after=last, upto=upto) if divergent is None else []
    fresh = runner(store.spec, [make_task(store, source, iv) for iv in plan if iv not in known])
    try:
        for iv in plan:
            result = known[iv] if iv in known else next(fresh)
            stitch(store, result, progress)
            shutil.rmtree(result.segment, ignore_errors=True)
            if result.divergent_step is not None:
                divergent, reason = result.divergent_step, result.reason
                break
    finally:
        fresh.close()  # stops the workers still replaying later intervals
        shutil.rmtree(store.dir / SEGMENTS, ignore_errors=True)
    return finish_replay(store, key, trainer, divergent, reason)


StateSources = Callable[[JobSpec], StateSource]
Results = Generator[IntervalResult, None, None]


@dataclass(frozen=True)
class _Setup:
    """What every interval of one runner shares, sent once to each worker process."""

    spec_bytes: bytes
    sources: StateSources
    profile: Profile
    hooks: StepHooks | None
    data_dir: Path | None


class _Replayer:
    """Replays tasks in one process with one executor, built on first use. In a worker, the
    runner's `stop` event ends a task between two steps (`_Stopped`)."""

    def __init__(self, setup: _Setup, stop: Event | None = None) -> None:
        self.setup, self.spec = setup, JobSpec.from_bytes(setup.spec_bytes)
        self.stop = stop
        self._ex: Executor | None = None

    def replay(self, task: IntervalTask) -> IntervalResult:
        if self._ex is None:
            self._ex = job_executor(self.spec, self.setup.profile, self.setup.data_dir)
        source = self.setup.sources(self.spec)
        try:
            return replay_interval(self.spec, task, source if self.stop is None else
                                   _Stoppable(source, self.stop), self._ex, self.setup.hooks)
        finally:
            source.close()


class _Stopped(Exception):
    """A worker's task ended early: the runner was closed (nobody reads its result)."""


class _Stoppable:
    """A StateSource that stops answering (raises _Stopped) once `stop` is set."""

    def __init__(self, source: StateSource, stop: Event) -> None:
        self.source, self.stop = source, stop

    def state(self, step: int) -> dict[str, torch.Tensor]:
        return self.source.state(step)

    def log_bytes(self, step: int) -> bytes:  # asked once per step, before the step runs
        if self.stop.is_set():
            raise _Stopped(f"stopped before step {step}")
        return self.source.log_bytes(step)

    def close(self) -> None:
        self.source.close()


_worker: _Replayer | None = None  # a worker process's replayer (`_start_worker`)


def _start_worker(setup: _Setup, threads: int, stop: Event) -> None:
    global _worker
    torch.set_num_threads(threads)
    _worker = _Replayer(setup, stop)


def _replay_in_worker(task: IntervalTask) -> IntervalResult:
    assert _worker is not None  # the pool's initializer made it
    return _worker.replay(task)


def _result(future: Future[IntervalResult]) -> IntervalResult:
    """A worker's result, or what its replay raised. Raises WorkerError if the worker process
    died (killed, out of memory) instead of answering."""
    try:
        return future.result()
    except BrokenProcessPool:
        raise WorkerError("an audit worker process died before answering (out of memory? "
                          "try fewer processes)") from None


class IntervalRunner:
    """Replays interval tasks in `processes` processes, yielding their results in task order.

    `sources(spec)` opens a worker's `StateSource`; like `hooks` (FAULT INJECTION only, see
    `StepHooks`) it must pickle, since each worker process (started with "spawn": a fresh
    interpreter, no state inherited) gets its own. One process replays in this one, on
    `profile` as it is. With P > 1, each worker runs `profile` on max(1, cores // P) threads,
    cores being the CPUs this process may use, so P workers do not oversubscribe the machine:
    the thread count changes no replayed bit (a profile's accumulation orders are what the
    job fixes, SPEC §3.2), which the tests check by hash equality with a sequential replay.
    """

    def __init__(self, processes: int, sources: StateSources, profile: Profile, *,
                 hooks: StepHooks | None = None, data_dir: Path | None = None) -> None:
        """Raises ConfigError for fewer than one process."""
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
            raise ConfigError(f"the number of audit processes must be at least 1, got "
                              f"{processes!r}")
        self.processes, self.sources, self.profile = processes, sources, profile
        self.hooks, self.data_dir = hooks, data_dir

    @property
    def threads(self) -> int:
        """Each worker's torch thread count when several run."""
        return max(1, len(os.sched_getaffinity(0)) // self.processes)

    def __call__(self, spec: JobSpec, tasks: Sequence[IntervalTask]
                 ) -> Results:
        """The results of `tasks`, in order, computed lazily; closing the iterator stops the
        workers (results not yet taken are dropped). Raises what a task's replay raises."""
        if self.processes == 1 or len(tasks) <= 1:
            return self._inline(spec, tasks)
        return self._pooled(spec, tasks)

    def _setup(self, spec: JobSpec, profile: Profile) -> _Setup:
        return _Setup(spec.to_bytes(), self.sources, profile, self.hooks, self.data_dir)

    def _inline(self, spec: JobSpec, tasks: Sequence[IntervalTask]) -> Results:
        replayer = _Replayer(self._setup(spec, self.profile))
        for task in tasks:
            yield replayer.replay(task)

    def _pooled(self, spec: JobSpec, tasks: Sequence[IntervalTask]) -> Results:
        threads = self.threads
        setup = self._setup(spec, dataclasses.replace(self.profile, threads=threads))
        context = multiprocessing.get_context("spawn")
        stop = context.Event()
        with ProcessPoolExecutor(min(self.processes, len(tasks)), mp_context=context,
                                 initializer=_start_worker,
                                 initargs=(setup, threads, stop)) as pool:
            futures = [pool.submit(_replay_in_worker, task) for task in tasks]
            try:
                for future in futures:
                    yield _result(future)
            finally:  # closed early, or failed: the workers stop after their current step
                stop.set()
                for future in futures:
                    future.cancel()
