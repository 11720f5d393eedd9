"""The one job queue both daemons run: a bounded FIFO of job ids, one worker thread, a status
per job that watchers can wait on (SPEC §4: a daemon resumes its unfinished jobs after a crash).

The trainer queues jobs to train, the auditor jobs to audit; each hands the queue a `work`
function and keeps its own status type (a frozen dataclass). Every status change goes through
`set` or `update`, which wake the watchers blocked in `wait_for` on one
`threading.Condition`. `stop` makes the running job leave after the step it is on: its `work`
calls `check_stop` from its progress callback, which raises `Stopped` once the queue is
stopping, and the job stays resumable. The queue itself is not stored: each daemon rebuilds it
from its store on start.

    queue = JobQueue("ovt-trainer-runner", work=train, max_waiting=64, noun="jobs")
    queue.enqueue(job_id, status)   # ResourceLimitError when 64 wait already
    queue.start()
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from protocol.engine.allocator import release_freed_memory
from protocol.errors import ResourceLimitError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

S = TypeVar("S", bound="DataclassInstance")  # a frozen dataclass: `update` replaces fields


class Stopped(Exception):
    """Raised inside a job's work by `JobQueue.check_stop` when the queue is stopping."""


class JobQueue(Generic[S]):
    """Job ids waiting for one worker thread, and a status per job. Thread-safe.

    `lock` (a re-entrant condition) may be held by a caller to make a check and an `enqueue`
    or `set` one step, as both daemons' `submit` do.
    """

    def __init__(self, name: str, work: Callable[[bytes], None], *, max_waiting: int,
                 noun: str) -> None:
        """`work(job_id)` runs one job on the worker thread; `max_waiting` bounds the jobs
        that wait (the running one not counted); `noun` names them in the refusal."""
        self.lock = threading.Condition()  # its lock is an RLock: `enqueue` nests in callers
        self.max_waiting, self.noun = max_waiting, noun
        self._work = work
        self._statuses: dict[bytes, S] = {}
        self._waiting: deque[bytes] = deque()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None) -> bool:
        """Stop after the current job's step; True if the worker ended within `timeout` s."""
        with self.lock:
            self._stopping.set()
            self.lock.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def check_stop(self) -> None:
        """Raises Stopped once the queue is stopping (call it between a job's steps)."""
        if self._stopping.is_set():
            raise Stopped

    # -- statuses ------------------------------------------------------------------------------

    def has_room(self) -> bool:
        """Whether one more job may wait now."""
        with self.lock:
            return len(self._waiting) < self.max_waiting

    def require_room(self) -> None:
        """Raises ResourceLimitError when `max_waiting` jobs wait already."""
        if not self.has_room():
            raise ResourceLimitError(f"{self.max_waiting} {self.noun} are already waiting; "
                                     f"try again later")

    def enqueue(self, job_id: bytes, status: S, *, resumed: bool = False) -> S:
        """Record `status` and queue the job. Raises ResourceLimitError, recording nothing, when
        `max_waiting` jobs wait already, unless the job is `resumed`: found unfinished on start,
        it was admitted under the bound before."""
        with self.lock:
            if not resumed:
                self.require_room()
            self._waiting.append(job_id)
            return self.set(job_id, status)

    def set(self, job_id: bytes, status: S) -> S:
        """Record a job's new status and wake the watchers."""
        with self.lock:
            self._statuses[job_id] = status
            self.lock.notify_all()
            return status

    def update(self, job_id: bytes, **changes: Any) -> S:
        """Record the job's status with `changes` applied (`dataclasses.replace`)."""
        with self.lock:
            return self.set(job_id, dataclasses.replace(self._statuses[job_id], **changes))

    def get(self, job_id: bytes) -> S | None:
        with self.lock:
            return self._statuses.get(job_id)

    def forget(self, job_id: bytes) -> None:
        """Drop the status of a job that is not waiting (a finished one): `get` answers None
        for it from now on. Raises ValueError for a waiting job, which the worker will run."""
        with self.lock:
            if job_id in self._waiting:
                raise ValueError(f"job {job_id.hex()} is waiting; its status is needed")
            self._statuses.pop(job_id, None)
            self.lock.notify_all()

    def wait_for(self, job_id: bytes, ready: Callable[[S | None], bool],
                 timeout: float | None) -> S | None:
        """The job's status once `ready(status)` holds (None: no status yet), or as it is after
        `timeout` seconds or as soon as the queue is stopping."""
        with self.lock:
            self.lock.wait_for(lambda: ready(self._statuses.get(job_id)) or self.stopping,
                               timeout)
            return self._statuses.get(job_id)

    # -- the worker ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.lock:
                self.lock.wait_for(lambda: self._waiting or self.stopping)
                if self.stopping:
                    return
                job_id = self._waiting.popleft()
            self._work(job_id)
            release_freed_memory()  # (an idle daemon does not hold its last job's peak)
