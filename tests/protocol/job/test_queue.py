"""protocol.job.queue.JobQueue: the bound, resumed jobs, the worker, watchers and stopping."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from protocol.errors import ResourceLimitError
from protocol.job.queue import JobQueue, Stopped

TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Status:
    state: str
    step: int = 0


def _ids(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(n)]


def test_the_bound_refuses_a_new_job_and_records_nothing():
    queue: JobQueue[Status] = JobQueue("t", lambda job_id: None, max_waiting=2, noun="jobs")
    a, b, c = _ids(3)
    queue.enqueue(a, Status("queued"))
    queue.enqueue(b, Status("queued"))
    assert not queue.has_room()
    with pytest.raises(ResourceLimitError, match="2 jobs are already waiting"):
        queue.enqueue(c, Status("queued"))
    assert queue.get(c) is None


def test_a_resumed_job_is_queued_beyond_the_bound():
    queue: JobQueue[Status] = JobQueue("t", lambda job_id: None, max_waiting=1, noun="jobs")
    a, b = _ids(2)
    queue.enqueue(a, Status("queued"), resumed=True)
    queue.enqueue(b, Status("queued"), resumed=True)  # admitted before a restart
    assert queue.get(b) == Status("queued")


def test_the_worker_runs_jobs_in_order_and_watchers_see_each_change():
    done: list[bytes] = []

    def work(job_id: bytes) -> None:  # calls back into the queue it belongs to
        queue.update(job_id, state="running")
        done.append(job_id)
        queue.update(job_id, state="done", step=1)

    queue: JobQueue[Status] = JobQueue("t", work, max_waiting=4, noun="jobs")
    a, b = _ids(2)
    queue.enqueue(a, Status("queued"))
    queue.enqueue(b, Status("queued"))
    queue.start()
    try:
        status = queue.wait_for(b, lambda s: s is not None and s.state == "done", TIMEOUT_S)
        assert status == Status("done", 1)
        assert done == [a, b]
    finally:
        assert queue.stop(TIMEOUT_S)


def test_stop_ends_a_running_job_between_its_steps():
    started, left = threading.Event(), threading.Event()

    def work(job_id: bytes) -> None:
        started.set()
        try:
            while True:
                queue.check_stop()
                queue.wait_for(job_id, lambda s: False, 0.01)
        except Stopped:
            left.set()

    queue: JobQueue[Status] = JobQueue("t", work, max_waiting=4, noun="jobs")
    queue.enqueue(_ids(1)[0], Status("queued"))
    queue.start()
    assert started.wait(TIMEOUT_S)
    assert queue.stop(TIMEOUT_S)
    assert left.is_set()


def test_a_watcher_wakes_when_the_queue_stops():
    queue: JobQueue[Status] = JobQueue("t", lambda job_id: None, max_waiting=4, noun="jobs")
    queue.start()
    result: list[object] = []
    watcher = threading.Thread(target=lambda: result.append(
        queue.wait_for(_ids(1)[0], lambda s: False, TIMEOUT_S)))
    watcher.start()
    assert queue.stop(TIMEOUT_S)
    watcher.join(TIMEOUT_S)
    assert not watcher.is_alive() and result == [None]


def test_a_finished_jobs_status_can_be_forgotten_but_not_a_waiting_ones():
    queue: JobQueue[Status] = JobQueue("t", lambda job_id: None, max_waiting=2, noun="jobs")
    done, waiting = _ids(2)
    queue.set(done, Status("failed"))
    queue.enqueue(waiting, Status("queued"))
    queue.forget(done)
    assert queue.get(done) is None
    with pytest.raises(ValueError, match="is waiting"):
        queue.forget(waiting)
    assert queue.get(waiting) == Status("queued")
