"""The Trainer gRPC service: job submission, status and a progress stream (issue 4).

This is the trainer's edge: everything a client sends is validated here and every failure
becomes a gRPC status with a one-line message (never a traceback):

    malformed spec, S_0 not safetensors, S_0 not hashing to h_0   INVALID_ARGUMENT
    job id not 32 bytes                                            INVALID_ARGUMENT
    program not allowed here, missing, or its source hash differs  FAILED_PRECONDITION
    unknown job                                                    NOT_FOUND
    MAX_QUEUED jobs already waiting (a new job refused unwritten)  RESOURCE_EXHAUSTED
    SubmitStream: no spec first, a broken or oversized S_0 stream  INVALID_ARGUMENT
    daemon shutting down                                           UNAVAILABLE

Submitting is idempotent: the job id is the spec's hash, and submitting a known job returns the
same id without touching its store.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from pathlib import Path

import grpc
import safetensors
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import PeerError, join_chunks
from protocol.codec.state import state_digest
from protocol.engine.programs.registry import require_allowed
from protocol.errors import ConfigError, OvtError, ProgramError, StoreError
from protocol.job.create import load_job_program
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

from .runner import MAX_QUEUED, JobRunner, JobStatus, QueueFullError

WATCH_POLL_S = 1.0  # how often a Watch checks that its client is still there
DEFAULT_MAX_STATE_BYTES = 8 << 30  # the largest S_0 SubmitStream takes (it is held in memory)


class TrainerServicer(ovt_pb2_grpc.TrainerServicer):
    """Submit / Status / Watch over a `JobRunner` whose stores live under `root`.

    `allowed_programs` are the user programs (beyond the built-ins) a client may name: loading
    a program imports code on this machine, so a peer may never choose an arbitrary one.
    """

    def __init__(self, root: Path, runner: JobRunner, allowed_programs: Collection[str] = (),
                 max_state_bytes: int = DEFAULT_MAX_STATE_BYTES) -> None:
        self.root, self.runner = Path(root), runner
        self.max_state_bytes = max_state_bytes
        self.allowed_programs = frozenset(allowed_programs)
        self._submit_lock = threading.Lock()

    def Submit(self, request, context):
        self._require_running(context)
        spec = self._spec(request.spec, context)
        state0 = self._initial_state(request.initial_state, spec, context)
        self._check_program(spec, context)
        return self._submit(spec, state0, context)

    def SubmitStream(self, request_iterator, context):
        """Submit with S_0 streamed in chunks. The spec (first part) is checked, program
        included, before a byte of S_0 is accepted; S_0 may be at most `max_state_bytes`."""
        self._require_running(context)
        parts = iter(request_iterator)
        first = next(parts, None)
        if first is None or not first.spec:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "the first part of SubmitStream must carry the job spec")
        spec = self._spec(first.spec, context)
        self._check_program(spec, context)

        def state_chunks():
            if first.HasField("initial_state"):
                yield first.initial_state
            for part in parts:
                if part.spec:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  "only the first part of SubmitStream may carry a spec")
                yield part.initial_state

        try:
            data = join_chunks(state_chunks(), self.max_state_bytes)
        except PeerError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"initial_state: {err}")
        return self._submit(spec, self._initial_state(data, spec, context), context)

    def _submit(self, spec: JobSpec, state0, context) -> ovt_pb2.SubmitReply:
        with self._submit_lock:  # one store creation per job, however many clients submit it
            if not self.runner.accepts(spec.job_id):  # before anything is written to disk
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{MAX_QUEUED} jobs are already waiting; submit again later")
            try:
                store = self.runner.stores.get(spec.job_id) or JobStore(self.root, spec)
                if store.last_step() < 0:
                    store.put_initial(state0)
                self.runner.submit(store)
            except StoreError as err:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
            except QueueFullError as err:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        return ovt_pb2.SubmitReply(job_id=spec.job_id)

    def Status(self, request, context):
        return _to_message(self._status(request.job_id, context))

    def Watch(self, request, context):
        status = self._status(request.job_id, context)
        yield _to_message(status)
        while not status.finished and context.is_active():
            if self.runner.stopping:
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              "the trainer is shutting down; the job resumes when it restarts")
            latest = self.runner.wait_for_change(request.job_id, status, WATCH_POLL_S)
            if latest != status:
                status = latest
                yield _to_message(status)

    # -- validation ----------------------------------------------------------------------------

    def _require_running(self, context) -> None:
        if self.runner.stopping:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the trainer is shutting down")

    @staticmethod
    def _spec(data: bytes, context) -> JobSpec:
        try:
            return JobSpec.from_bytes(data)
        except OvtError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad job spec: {err}")

    @staticmethod
    def _initial_state(data: bytes, spec: JobSpec, context):
        try:
            state = safetensors.torch.load(data)
        except (safetensors.SafetensorError, ValueError, TypeError, RuntimeError) as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"initial_state is not safetensors: {_one_line(err)}")
        if state_digest(state) != spec.h0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "initial_state does not hash to the job's h_0")
        return state

    def _check_program(self, spec: JobSpec, context) -> None:
        try:
            require_allowed(spec.program, self.allowed_programs, "trainer")
            load_job_program(spec)
        except (ProgramError, ConfigError) as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, _one_line(err))

    def _status(self, job_id: bytes, context) -> JobStatus:
        if len(job_id) != 32:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id must be 32 bytes")
        status = self.runner.status(job_id)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown job {job_id.hex()}")
        return status


def _to_message(status: JobStatus) -> ovt_pb2.JobStatus:
    return ovt_pb2.JobStatus(job_id=status.job_id, state=status.state, step=status.step,
                             steps=status.steps, error=status.error)


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:500]
