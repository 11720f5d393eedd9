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

The trainer's S_c only buys parallelism; an audit never depends on it. The first interval of
a replay starts where the auditor's store ends (S_0, or S_t after a crash), so its worker
gets that state from the parent, as a file of the auditor's own (P workers replay, the parent
only stitches: no more compute streams than processes); and when a worker's
interval cannot start because the trainer refused its S_c or served one that is not its h_c
(or hashes to it but is no state of the program at step c: a made-up S_c), every earlier
interval has been stitched, so the parent continues from its own S_c, step by
step to the end as `replay_job` would, and the audit ends matched or diverged as a sequential
one does. Only refusing S_0, leaves or rounding logs fails an audit, sequential or not.

A worker writes what it replayed to a segment folder in the auditor's store
(`<store>/<job id>/intervals/<first>-<last>/`: each step's log, and the last step's state when
a checkpoint is due there) and returns the leaves it computed; the parent stitches them into
the store, which checks each log against its leaf and each checkpoint against h_t, and removes
the folder. Segments are scratch: after a crash the store keeps every leaf stitched so far
(durable as ever) and the next audit replays the other intervals again. Nothing crosses between
processes but this module's dataclasses, files the auditor itself wrote, and what `sources`
fetches in the worker: nothing from a peer is ever unpickled.

At most P intervals are in the workers' hands at once, and the parent waits for them in short
polls of the runner's `check_stop`, so stopping an audit takes a step, not an interval: closing
the results cancels what has not started, lets each worker end its step, and terminates the
workers still busy after GRACE_S.

    runner = IntervalRunner(2, sources, Profile.parse("emulated-gpu"))
    outcome = replay_in_intervals(store, claims, key, runner)  # = replay_job's outcome
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Protocol, overload

import safetensors.torch
import torch

from protocol.codec.state import load_safetensors, state_digest
from protocol.commit.commitments import SignedCommitment
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.engine.executor import Executor
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, PeerError, StateFormatError, StoreError, WorkerError
from protocol.job.create import job_executor
from protocol.job.run import (
    AuditOutcome,
    ClaimSource,
    Progress,
    StepHooks,
    begin_replay,
    finish_replay,
    replay_step,
    replay_steps,
)
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore, checkpoint_due

SEGMENTS = "intervals"  # the scratch folder under a job's store
_STATE_FILE = "state.safetensors"
_OWN_START_FILE = "own-start.safetensors"  # the first interval's start state, the auditor's own
POLL_S = 0.2  # how often a wait for a worker asks whether the audit is stopping
GRACE_S = 2.0  # how long closed workers may take to end their step before they are terminated


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


@dataclass(frozen=True)
class Plan(Sequence[Interval]):
    """Steps `first`..`last` cut after every multiple of `every`, in step order: the intervals
    of `plan_intervals`, each computed when asked for, so that a plan takes the same memory
    for any job (a peer's spec may ask for 2**40 steps, one interval each)."""

    first: int
    last: int
    every: int

    def __len__(self) -> int:
        if self.first > self.last:
            return 0
        return (self.last - 1) // self.every - (self.first - 1) // self.every + 1

    @overload
    def __getitem__(self, index: int) -> Interval: ...

    @overload
    def __getitem__(self, index: slice) -> list[Interval]: ...

    def __getitem__(self, index: int | slice) -> Interval | list[Interval]:
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        # the checkpoint the interval starts at (the first interval may start after it)
        cut = ((self.first - 1) // self.every + range(len(self))[index]) * self.every
        return Interval(max(cut + 1, self.first), min(cut + self.every, self.last))

    def __contains__(self, interval: object) -> bool:
        return isinstance(interval, Interval) and self.first <= interval.first <= self.last \
            and self[(interval.first - 1) // self.every -
                     (self.first - 1) // self.every] == interval


def plan_intervals(spec: JobSpec, after: int = 0, upto: int | None = None) -> Plan:
    """Steps after+1..upto (default: the job's last) cut after every trainer checkpoint (each
    multiple of the checkpoint interval), in step order. An interval starts at a checkpoint
    unless it is the first and `after` is not one (an audit resumed mid-interval)."""
    return Plan(after + 1, spec.steps if upto is None else upto, spec.checkpoint_interval)


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS keeps one (Linux),
    else every CPU the machine has (`os.cpu_count()`, 1 when unknown)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def require_processes(processes: object) -> int:
    """`processes` if it is a whole number from 1 to `usable_cpus()` (not a bool), else
    ConfigError: more worker processes than CPUs only slow each other down."""
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ConfigError(f"the number of audit processes must be at least 1, got "
                          f"{processes!r}")
    cpus = usable_cpus()
    if processes > cpus:
        raise ConfigError(f"{processes} audit processes are more than the {cpus} CPUs this "
                          f"process may use")
    return processes


class StateSource(Protocol):
    """What a worker reads from the trainer: S_t and L_t's bytes, unchecked (`replay_interval`
    checks them against the trainer's leaves), and `close` when the worker is done. `state`
    raises PeerError when the trainer does not serve S_t."""

    def state(self, step: int) -> dict[str, torch.Tensor]: ...

    def log_bytes(self, step: int) -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class IntervalTask:
    """One interval to replay: the trainer's leaves start..last, verified by the parent under
    the trainer's signed root, the segment folder the worker writes into, and `own_start`:
    the auditor's own S_start as a safetensors file the parent wrote (the first interval of a
    parallel replay), or None to take the trainer's."""

    interval: Interval
    trainer_leaves: tuple[Leaf, ...]
    segment: Path
    own_start: Path | None = None


@dataclass(frozen=True)
class IntervalResult:
    """An interval as replayed: the auditor's leaves from `first` on (ending at the first
    divergent step, included when it was replayed: a rejected log is not), and that step and
    its reason (None: every leaf matched the trainer's). `unstarted`: why the interval could
    not start — the trainer did not serve S_start, served one that is not its h_start, or one
    that hashes to it but does not load or run its first step (`replay_interval`) — with no
    leaves (None: it started)."""

    interval: Interval
    leaves: tuple[Leaf, ...]
    divergent_step: int | None
    reason: str | None
    segment: Path
    unstarted: str | None = None


def make_task(store: JobStore, source: ClaimSource, interval: Interval,
              own_start: Path | None = None) -> IntervalTask:
    """The task of `interval`, with the trainer's leaves from `source` (which verifies them)."""
    return IntervalTask(interval, tuple(source.leaf(t) for t in range(interval.start,
                                                                      interval.last + 1)),
                        store.dir / SEGMENTS / f"{interval.first:09d}-{interval.last:09d}",
                        own_start)


def replay_interval(spec: JobSpec, task: IntervalTask, source: StateSource, ex: Executor,
                    hooks: StepHooks | None = None, held: bytes | None = None
                    ) -> IntervalResult:
    """Replay `task`'s interval on `ex` from the trainer's S_start, writing its segment.

    `held` is the hash of the state `ex` already holds (None: unknown); when it is the
    trainer's h_start (S_0: the job's h_0), the trainer is not asked for S_start again. Each
    step is `protocol.job.run.replay_step`'s: the trainer's log checked against its leaf, then
    replayed; the interval stops at the first step whose log is rejected or whose state hash
    differs from the trainer's.

    An S_start the trainer does not serve (PeerError from `source`) or that does not hash to
    h_start is no failure but an `unstarted` result: the caller replays the interval from its
    own state instead, which finds the divergence. So is one that hashes to h_start but is no
    state of the program at step `start`, a made-up state a cheat signed: the trainer's
    S_start is untrusted until the interval's first step has run from it, and any Exception
    raised by loading it (ConfigError from `Executor.load_state`) or by that step (a bare
    KeyError from torch's optimizer for a state that lacks a buffer) makes the interval
    unstarted. Raises what the auditor's own start state (`held`, `task.own_start`) and the
    steps after the first raise, and what `source.log_bytes` and the filesystem raise."""
    iv, trainer = task.interval, {leaf.step: leaf for leaf in task.trainer_leaves}
    expected = spec.h0 if iv.start == 0 else trainer[iv.start].state_hash
    # the trainer's S_start, loaded with the interval's first step (None: `ex` holds the
    # auditor's own, or the first step has run)
    untrusted: dict[str, torch.Tensor] | None = None
    if held != expected:
        try:
            state = source.state(iv.start) if task.own_start is None else \
                _segment_state(task.own_start.parent, task.own_start.name)
        except PeerError as err:
            return IntervalResult(iv, (), None, None, task.segment, unstarted=str(err))
        if state_digest(state) != expected:
            return IntervalResult(iv, (), None, None, task.segment, unstarted=(
                f"the trainer's S_{iv.start} does not hash to h_{iv.start} of its own signed "
                f"leaf {iv.start}"))
        if task.own_start is None:
            untrusted = state
        else:
            ex.load_state(state, step=iv.start)
    shutil.rmtree(task.segment, ignore_errors=True)  # a crashed audit's stale files
    task.segment.mkdir(parents=True)
    leaves: list[Leaf] = []
    for t in iv.steps:
        log = source.log_bytes(t)
        try:
            if untrusted is not None:
                ex.load_state(untrusted, step=iv.start)
            replayed = replay_step(spec, ex, t, trainer[t], log, hooks)
        except Exception as err:
            if untrusted is None:
                raise
            shutil.rmtree(task.segment, ignore_errors=True)
            return IntervalResult(iv, (), None, None, task.segment, unstarted=(
                f"the trainer's S_{iv.start} hashes to h_{iv.start} but is no state of this "
                f"job's program at step {iv.start}: {type(err).__name__}: {err}"))
        untrusted = None  # the first step ran from it: what follows is the auditor's own
        if isinstance(replayed, str):
            return IntervalResult(iv, tuple(leaves), t, replayed, task.segment)
        (task.segment / _log_name(t)).write_bytes(replayed.log)
        if checkpoint_due(spec, t):
            (task.segment / _STATE_FILE).write_bytes(safetensors.torch.save(
                {k: v.contiguous() for k, v in replayed.state.items()}))
        leaves.append(replayed.leaf)
        if replayed.differs is not None:
            return IntervalResult(iv, tuple(leaves), t, replayed.differs, task.segment)
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


def _segment_state(segment: Path, name: str = _STATE_FILE) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors((segment / name).read_bytes())
    except (OSError, StateFormatError) as err:
        raise StoreError(f"the state in {segment} is missing or damaged: {err}") from None


def replay_in_intervals(store: JobStore, source: ClaimSource, key: KeyPair,
                        runner: IntervalRunner, *, upto: int | None = None,
                        known: Mapping[Interval, IntervalResult] | None = None,
                        progress: Progress | None = None) -> AuditOutcome:
    """`replay_job` with the remaining steps cut into intervals (`replay_intervals`), and
    signed as `replay_job` signs (`finish_replay`): the same leaves, root and outcome."""
    trainer, divergent, reason = replay_intervals(store, source, runner, upto=upto,
                                                  known=known, progress=progress)
    return finish_replay(store, key, trainer, divergent, reason)


def replay_intervals(store: JobStore, source: ClaimSource, runner: IntervalRunner, *,
                     upto: int | None = None,
                     known: Mapping[Interval, IntervalResult] | None = None,
                     progress: Progress | None = None
                     ) -> tuple[SignedCommitment, int | None, str | None]:
    """Replay the steps after the auditor's store into it, cut into intervals
    (`plan_intervals`) and stitched in step order; signs nothing.

    Resumes as `replay_job` does (`begin_replay`). With one process the parent replays every
    interval from its own state; with more, the runner's workers replay them all, the first
    from the auditor's own state (a file), the others from the trainer's S_c, until one
    cannot start (see the module docstring), after which the parent replays the rest from
    its own state. `upto` ends the
    replay early, at an interval end (a sampled audit's escalation); `known` holds intervals
    already replayed whose segments are still in place (that audit's sample), which are
    stitched without replaying them again. Returns the trainer's verified commitment and the
    first divergent step with its reason ((None, None): every replayed leaf matched). Raises
    what `begin_replay`, `make_task`, the runner, the replay and `stitch` raise, and whatever
    `progress` raises (the replay then resumes from the store on the next call)."""
    spec, known = store.spec, known or {}
    trainer, last, divergent, reason = begin_replay(store, source)
    if divergent is not None:
        return trainer, divergent, reason
    plan = plan_intervals(spec, after=last, upto=upto)
    delegated = {iv for iv in plan if iv not in known} if runner.processes > 1 else set()
    own = _OwnReplay(store, source, runner, progress)
    own_start = None
    if plan and plan[0] in delegated:  # it starts from the auditor's own state, not the trainer's
        own_start = store.dir / SEGMENTS / _OWN_START_FILE
        own_start.parent.mkdir(parents=True, exist_ok=True)
        own_start.write_bytes(safetensors.torch.save(
            {k: v.contiguous() for k, v in own.state(last).items()}))
    results = runner(spec, [make_task(store, source, iv, own_start if i == 0 else None)
                            for i, iv in enumerate(plan) if iv in delegated])
    try:
        for iv in plan:
            result = known.get(iv)
            if result is None and iv in delegated:
                result = next(results)
                if result.unstarted is not None:  # every earlier interval is stitched
                    results.close()
                    delegated.clear()
                    result = None
            if result is None:
                divergent, reason = own.replay(iv.last)
            else:
                stitch(store, result, progress)
                shutil.rmtree(result.segment, ignore_errors=True)
                divergent, reason = result.divergent_step, result.reason
            if divergent is not None:
                break
    finally:
        results.close()  # stops the workers still replaying later intervals
        shutil.rmtree(store.dir / SEGMENTS, ignore_errors=True)
    return trainer, divergent, reason


class _OwnReplay:
    """The parent's replay from the auditor's own state, step by step (`replay_steps`), on
    one executor built on first use and moved to the store's last state (`state_at`: its own
    checkpoint and logs) only when it does not hold that state already."""

    def __init__(self, store: JobStore, source: ClaimSource, runner: IntervalRunner,
                 progress: Progress | None) -> None:
        self.store, self.source, self.runner, self.progress = store, source, runner, progress
        self._ex: Executor | None = None
        self._at = -1  # the step whose state `_ex` holds (-1: none known)

    def state(self, step: int) -> dict[str, torch.Tensor]:
        """The auditor's own S_step (a step it has stored), from its checkpoint and logs."""
        return self._executor_at(step).state()

    def _executor_at(self, step: int) -> Executor:
        if self._ex is None:
            self._ex = job_executor(self.store.spec, self.runner.profile, self.runner.data_dir)
        if self._at != step:
            self.store.state_at(step, self._ex)
            self._at = step
        return self._ex

    def replay(self, upto: int) -> tuple[int | None, str | None]:
        ex = self._executor_at(self.store.last_step())
        self._at = -1
        divergent, reason = replay_steps(self.store, self.source, ex, upto,
                                         hooks=self.runner.hooks, progress=self.progress)
        if divergent is None:
            self._at = upto
        return divergent, reason


StateSources = Callable[[JobSpec], StateSource]
StopCheck = Callable[[], None]


class Results(Protocol):
    """Interval results in task order, computed lazily; `close` stops the work under way
    (results not yet taken are dropped)."""

    def __iter__(self) -> Iterator[IntervalResult]: ...

    def __next__(self) -> IntervalResult: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class _Setup:
    """What every interval of one runner shares, sent once to each worker process."""

    spec_bytes: bytes
    sources: StateSources
    profile: Profile
    hooks: StepHooks | None
    data_dir: Path | None


class _Replayer:
    """Replays tasks in one process with one executor, built on first use; `check_stop`
    (None: never stop) is asked before each state and log is fetched, so a stopped audit ends
    between two steps. An interval that ends where the next one starts leaves its state in
    the executor, and the next does not fetch it again."""

    def __init__(self, setup: _Setup, check_stop: StopCheck | None = None) -> None:
        self.setup, self.spec = setup, JobSpec.from_bytes(setup.spec_bytes)
        self.check_stop = check_stop
        self._ex: Executor | None = None
        self._held: bytes | None = None  # the hash of the state `_ex` holds, when known

    def replay(self, task: IntervalTask) -> IntervalResult:
        if self._ex is None:
            self._ex = job_executor(self.spec, self.setup.profile, self.setup.data_dir)
        held, self._held = self._held, None
        source = self.setup.sources(self.spec)
        try:
            result = replay_interval(
                self.spec, task, source if self.check_stop is None else
                _Stoppable(source, self.check_stop), self._ex, self.setup.hooks, held)
        finally:
            source.close()
        if result.unstarted is None and result.divergent_step is None and result.leaves:
            self._held = result.leaves[-1].state_hash
        return result


class _Stopped(Exception):
    """A worker's task ended early: the runner was closed (nobody reads its result)."""


class _Stoppable:
    """A StateSource that calls `check_stop` (which raises to stop) before every answer."""

    def __init__(self, source: StateSource, check_stop: StopCheck) -> None:
        self.source, self.check_stop = source, check_stop

    def state(self, step: int) -> dict[str, torch.Tensor]:
        self.check_stop()
        return self.source.state(step)

    def log_bytes(self, step: int) -> bytes:  # asked once per step, before the step runs
        self.check_stop()
        return self.source.log_bytes(step)

    def close(self) -> None:
        self.source.close()


_worker: _Replayer | None = None  # a worker process's replayer (`_start_worker`)


def _start_worker(setup: _Setup, stop: Event) -> None:
    global _worker

    def check_stop() -> None:
        if stop.is_set():
            raise _Stopped("the audit was stopped")

    _worker = _Replayer(setup, check_stop)


def _replay_in_worker(task: IntervalTask) -> IntervalResult:
    assert _worker is not None  # the pool's initializer made it
    return _worker.replay(task)


class IntervalRunner:
    """Replays interval tasks in `processes` processes, yielding their results in task order.

    `sources(spec)` opens a worker's `StateSource`; like `hooks` (FAULT INJECTION only, see
    `StepHooks`) it must pickle, since each worker process (started with "spawn": a fresh
    interpreter, no state inherited) gets its own. One process replays in this one, on
    `profile` as it is. With P > 1, each worker runs `profile` on max(1, cores // P) threads,
    cores being `usable_cpus()`, so P workers do not oversubscribe the machine: the thread
    count changes no replayed bit (a profile's accumulation orders are what the job fixes,
    SPEC §3.2), which the tests check by hash equality with a sequential replay. `check_stop`
    (the daemon's `JobQueue.check_stop`; None: never stop) is called between steps and, with
    P > 1, every POLL_S seconds while the parent waits for a worker; what it raises ends the
    replay.
    """

    def __init__(self, processes: int, sources: StateSources, profile: Profile, *,
                 hooks: StepHooks | None = None, data_dir: Path | None = None,
                 check_stop: StopCheck | None = None) -> None:
        """Raises ConfigError for fewer than one process or more than `usable_cpus()`."""
        self.processes = require_processes(processes)
        self.sources, self.profile = sources, profile
        self.hooks, self.data_dir, self.check_stop = hooks, data_dir, check_stop

    @property
    def threads(self) -> int:
        """Each worker's torch thread count when several run."""
        return max(1, usable_cpus() // self.processes)

    def __call__(self, spec: JobSpec, tasks: Sequence[IntervalTask]) -> Results:
        """The results of `tasks`, in order (see `Results`). Raises what a task's replay
        raises, WorkerError for a worker process that died, and what `check_stop` raises."""
        if self.processes == 1 or not tasks:
            return self._inline(spec, tasks)
        setup = _Setup(spec.to_bytes(), self.sources,
                       dataclasses.replace(self.profile, threads=self.threads), self.hooks,
                       self.data_dir)
        return _Pooled(setup, tasks, self.processes, self.check_stop)

    def _inline(self, spec: JobSpec, tasks: Sequence[IntervalTask]) -> Results:
        replayer = _Replayer(_Setup(spec.to_bytes(), self.sources, self.profile, self.hooks,
                                    self.data_dir), self.check_stop)
        for task in tasks:
            yield replayer.replay(task)


class _Pooled:
    """`Results` from a pool of worker processes, started at once: at most `processes` tasks
    are submitted and unfinished at a time (the others wait here, so closing cancels them
    without a worker ever seeing them), and every wait polls `check_stop`."""

    def __init__(self, setup: _Setup, tasks: Sequence[IntervalTask], processes: int,
                 check_stop: StopCheck | None) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._pool = ProcessPoolExecutor(min(processes, len(tasks)), mp_context=context,
                                         initializer=_start_worker,
                                         initargs=(setup, self._stop))
        self._processes, self._check_stop = processes, check_stop
        self._waiting = deque(tasks)
        self._futures: deque[Future[IntervalResult]] = deque()
        self._closed = False
        self._top_up()

    def _top_up(self) -> None:
        busy = sum(not future.done() for future in self._futures)
        while self._waiting and busy < self._processes:
            self._futures.append(self._pool.submit(_replay_in_worker, self._waiting.popleft()))
            busy += 1

    def __iter__(self) -> Iterator[IntervalResult]:
        return self

    def __next__(self) -> IntervalResult:
        if self._closed or not self._futures:
            raise StopIteration
        head = self._futures[0]
        try:
            while not head.done():
                wait([f for f in self._futures if not f.done()], POLL_S, FIRST_COMPLETED)
                self._top_up()
                if self._check_stop is not None:
                    self._check_stop()
            result = head.result()
        except BrokenProcessPool:
            self.close()
            raise WorkerError("an audit worker process died before answering (out of memory? "
                              "try fewer processes)") from None
        except BaseException:
            self.close()
            raise
        self._futures.popleft()
        self._top_up()
        return result

    def close(self) -> None:
        """Stop the workers: tasks not started are cancelled, each busy worker ends after its
        current step, and those still running after GRACE_S are terminated."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        workers = list((self._pool._processes or {}).values())
        self._pool.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + GRACE_S
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in workers:
            if worker.is_alive():
                worker.terminate()
                worker.join(GRACE_S)
            if worker.is_alive():
                worker.kill()
                worker.join()
