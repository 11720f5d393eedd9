"""The trainer's job queue: one worker thread trains one job at a time (SPEC §4).

Jobs live in the `JobStore`s under one root (`StoreDirectory`); the queue itself is not stored.
On `start` the runner scans the root and queues every job whose store lacks the commitment over
all its steps, so a restarted daemon resumes each unfinished job from its last stored leaf
(`run_job` resumes without changing any leaf). `stop` makes the running job leave after the
step it is on has been stored; the job stays resumable.

Status changes wake watchers through one `threading.Condition` (`wait_for_change`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, replace

from proto.claims import StoreDirectory
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import OvtError, ResourceLimitError
from protocol.job.run import StepHooks, run_job
from protocol.job.store import JobStore

QUEUED, RUNNING, DONE, FAILED = "queued", "running", "done", "failed"
MAX_QUEUED = 64  # jobs waiting to train; Submit beyond it is RESOURCE_EXHAUSTED

log = logging.getLogger("ovt.trainer")


@dataclass(frozen=True)
class JobStatus:
    """Where one job stands: state is queued | running | done | failed."""

    job_id: bytes
    state: str
    step: int
    steps: int
    error: str = ""

    @property
    def finished(self) -> bool:
        return self.state in (DONE, FAILED)


class _StopRequested(Exception):
    """Raised from run_job's progress callback to leave it after a stored step."""


class JobRunner:
    """A queue of jobs and the one thread that trains them. Thread-safe."""

    def __init__(self, stores: StoreDirectory, key: KeyPair, profile: Profile, *,
                 hooks: StepHooks | None = None) -> None:
        """`hooks`: FAULT INJECTION only (`trainer_node.faults`), passed to every `run_job`;
        None trains honestly."""
        self.stores, self.key, self.profile, self.hooks = stores, key, profile, hooks
        self._changed = threading.Condition()
        self._status: dict[bytes, JobStatus] = {}
        self._queue: deque[bytes] = deque()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="ovt-trainer-runner",
                                        daemon=True)

    # -- control --------------------------------------------------------------------------------

    def start(self) -> None:
        """Queue every unfinished job found under the store root, then start training."""
        for job_id in self.stores.job_ids():
            try:
                store = self.stores.get(job_id)
            except OvtError as err:  # a damaged store must not keep the others from running
                log.error("skipping store %s: %s", job_id.hex(), err)
                continue
            if store is not None:
                with self._changed:
                    self._track(store)
        self._thread.start()

    def stop(self, timeout: float) -> bool:
        """Stop after the current step; True if the worker ended within `timeout` seconds."""
        with self._changed:
            self._stopping.set()
            self._changed.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def accepts(self, job_id: bytes) -> bool:
        """Whether `submit` would take this job now: one it already holds (not failed) always,
        a new or failed one while fewer than MAX_QUEUED jobs wait."""
        with self._changed:
            current = self._status.get(job_id)
            return (current is not None and current.state != FAILED) or \
                len(self._queue) < MAX_QUEUED

    def submit(self, store: JobStore) -> JobStatus:
        """Queue a job (idempotent: a queued, running or done job keeps its status; a failed
        one is queued again). Raises ResourceLimitError when MAX_QUEUED jobs wait already."""
        with self._changed:
            if not self.accepts(store.spec.job_id):
                raise ResourceLimitError(f"{MAX_QUEUED} jobs are already waiting to train")
            self.stores.add(store)
            current = self._status.get(store.spec.job_id)
            if current is not None and current.state != FAILED:
                return current
            return self._track(store)

    # -- queries --------------------------------------------------------------------------------

    def status(self, job_id: bytes) -> JobStatus | None:
        with self._changed:
            return self._status.get(job_id)

    def wait_for_change(self, job_id: bytes, seen: JobStatus | None,
                        timeout: float) -> JobStatus | None:
        """The job's status once it differs from `seen`, or after `timeout` seconds, or as soon
        as the runner is stopping."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._status.get(job_id) != seen or self._stopping.is_set(), timeout)
            return self._status.get(job_id)

    # -- the worker -----------------------------------------------------------------------------

    def _track(self, store: JobStore) -> JobStatus:
        """Record a job's status from its store and queue it if unfinished (lock held)."""
        spec = store.spec
        if store.commitment(spec.steps) is not None:
            status = JobStatus(spec.job_id, DONE, spec.steps, spec.steps)
        elif store.last_step() < 0:
            status = JobStatus(spec.job_id, FAILED, 0, spec.steps,
                               "the store holds no initial state; submit the job again")
        else:
            status = JobStatus(spec.job_id, QUEUED, store.last_step(), spec.steps)
            self._queue.append(spec.job_id)
        self._set(status)
        return status

    def _set(self, status: JobStatus) -> None:
        self._status[status.job_id] = status
        self._changed.notify_all()

    def _update(self, job_id: bytes, **changes) -> None:
        with self._changed:
            self._set(replace(self._status[job_id], **changes))

    def _work(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._stopping.is_set())
                if self._stopping.is_set():
                    return
                job_id = self._queue.popleft()
            self._run(job_id)

    def _run(self, job_id: bytes) -> None:
        store = self.stores.get(job_id)
        steps = store.spec.steps
        log.info("job %s: training from step %d of %d", job_id.hex(), store.last_step(), steps)
        self._update(job_id, state=RUNNING, step=store.last_step())
        try:
            signed = run_job(store, self.key, profile=self.profile, hooks=self.hooks,
                             progress=lambda step, _: self._progress(job_id, step))
        except _StopRequested:
            self._update(job_id, state=QUEUED)
            log.info("job %s: stopped at step %d; it resumes on restart", job_id.hex(),
                     store.last_step())
            return
        except OvtError as err:
            self._update(job_id, state=FAILED, error=str(err))
            log.error("job %s failed: %s", job_id.hex(), err)
            return
        except Exception as err:  # a bug: the daemon keeps serving; the trace goes to its log
            log.exception("job %s: internal error", job_id.hex())
            self._update(job_id, state=FAILED, error=f"internal error: {type(err).__name__}")
            return
        self._update(job_id, state=DONE, step=steps)
        log.info("job %s: done, root %s", job_id.hex(), signed.commitment.root.hex())

    def _progress(self, job_id: bytes, step: int) -> None:
        self._update(job_id, step=step)
        if self._stopping.is_set():
            raise _StopRequested
