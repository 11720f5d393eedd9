"""The trainer's job queue: one worker thread trains one job at a time (SPEC §4).

Jobs live in the `JobStore`s under one root (`StoreDirectory`); the queue itself is not stored.
On `start` the runner scans the root and queues every job whose store lacks the commitment over
all its steps, so a restarted daemon resumes each unfinished job from its last stored leaf
(`run_job` resumes without changing any leaf). `stop` makes the running job leave after the
step it is on has been stored; the job stays resumable.

The queue, its worker thread and the watchers' wake-ups are the daemons' shared
`protocol.job.queue.JobQueue`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from proto.claims import StoreDirectory
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import OvtError
from protocol.job.queue import JobQueue, Stopped
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


class JobRunner:
    """The trainer's job queue (`protocol.job.queue.JobQueue`) and the training it runs."""

    def __init__(self, stores: StoreDirectory, key: KeyPair, profile: Profile, *,
                 hooks: StepHooks | None = None, data_dir: Path | None = None,
                 workers: int = 1) -> None:
        """`data_dir`: the folder jobs' data files are read in (None: a job with one fails).
        `workers`: processes computing each job's micro-batches, at most the job's count of
        them (SPEC §3.5: the leaves are the same for any count). `hooks`: FAULT INJECTION only
        (`trainer_node.faults`), passed to every `run_job`; None trains honestly."""
        self.stores, self.key, self.profile, self.hooks = stores, key, profile, hooks
        self.data_dir, self.workers = data_dir, workers
        self._queue: JobQueue[JobStatus] = JobQueue("ovt-trainer-runner", self._run,
                                                    max_waiting=MAX_QUEUED, noun="jobs")

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
                self._track(store, resumed=True)
        self._queue.start()

    def stop(self, timeout: float) -> bool:
        """Stop after the current step; True if the worker ended within `timeout` seconds."""
        return self._queue.stop(timeout)

    @property
    def stopping(self) -> bool:
        return self._queue.stopping

    def accepts(self, job_id: bytes) -> bool:
        """Whether `submit` would take this job now: one it already holds (not failed) always,
        a new or failed one while fewer than MAX_QUEUED jobs wait."""
        current = self._queue.get(job_id)
        return (current is not None and current.state != FAILED) or self._queue.has_room()

    def submit(self, store: JobStore) -> JobStatus:
        """Queue a job (idempotent: a queued, running or done job keeps its status; a failed
        one is queued again). Raises ResourceLimitError when MAX_QUEUED jobs wait already."""
        with self._queue.lock:
            current = self._queue.get(store.spec.job_id)
            if current is not None and current.state != FAILED:
                return current
            self._queue.require_room()  # before the store is taken in
            self.stores.add(store)
            return self._track(store)

    # -- queries --------------------------------------------------------------------------------

    def status(self, job_id: bytes) -> JobStatus | None:
        return self._queue.get(job_id)

    def wait_for_change(self, job_id: bytes, seen: JobStatus | None,
                        timeout: float) -> JobStatus | None:
        """The job's status once it differs from `seen`, or after `timeout` seconds, or as soon
        as the runner is stopping."""
        return self._queue.wait_for(job_id, lambda status: status != seen, timeout)

    # -- the work -------------------------------------------------------------------------------

    def _track(self, store: JobStore, *, resumed: bool = False) -> JobStatus:
        """Record a job's status from its store and queue it if unfinished (`resumed`: found
        on start, queued whatever the bound)."""
        spec = store.spec
        if store.commitment(spec.steps) is not None:
            return self._queue.set(spec.job_id, JobStatus(spec.job_id, DONE, spec.steps,
                                                          spec.steps))
        if store.last_step() < 0:
            return self._queue.set(spec.job_id, JobStatus(
                spec.job_id, FAILED, 0, spec.steps,
                "the store holds no initial state; submit the job again"))
        return self._queue.enqueue(spec.job_id, JobStatus(spec.job_id, QUEUED,
                                                          store.last_step(), spec.steps),
                                   resumed=resumed)

    def _run(self, job_id: bytes) -> None:
        store = self.stores.get(job_id)
        if store is None:  # a bug: `_track` queues only jobs whose stores `self.stores` holds
            log.error("job %s: internal error: its store is not open", job_id.hex())
            self._queue.update(job_id, state=FAILED, error="internal error: store not open")
            return
        steps = store.spec.steps
        workers = min(self.workers, store.spec.micro_batches)
        log.info("job %s: training from step %d of %d%s", job_id.hex(), store.last_step(), steps,
                 f" on {workers} processes" if workers > 1 else "")
        self._queue.update(job_id, state=RUNNING, step=store.last_step())
        try:
            signed = run_job(store, self.key, profile=self.profile, hooks=self.hooks,
                             progress=lambda step, _: self._progress(job_id, step),
                             data_dir=self.data_dir, workers=workers)
        except Stopped:
            self._queue.update(job_id, state=QUEUED)
            log.info("job %s: stopped at step %d; it resumes on restart", job_id.hex(),
                     store.last_step())
            return
        except OvtError as err:
            self._queue.update(job_id, state=FAILED, error=str(err))
            log.error("job %s failed: %s", job_id.hex(), err)
            return
        except Exception as err:  # a bug: the daemon keeps serving; the trace goes to its log
            log.exception("job %s: internal error", job_id.hex())
            self._queue.update(job_id, state=FAILED, error=f"internal error: {type(err).__name__}")
            return
        self._queue.update(job_id, state=DONE, step=steps)
        log.info("job %s: done, root %s", job_id.hex(), signed.commitment.root.hex())

    def _progress(self, job_id: bytes, step: int) -> None:
        self._queue.update(job_id, step=step)
        self._queue.check_stop()
