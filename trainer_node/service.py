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

import safetensors
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import join_chunks
from proto.serving import job_id_of, rpc_errors
from protocol.codec.state import state_digest
from protocol.engine.programs.registry import require_allowed
from protocol.errors import (
    ConfigError,
    NotFoundError,
    OvtError,
    PeerError,
    ProgramError,
    RefusedError,
    RequestError,
    ResourceLimitError,
    StoreError,
    UnavailableError,
)
from protocol.job.create import load_job_program
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

from .runner import MAX_QUEUED, JobRunner, JobStatus

WATCH_POLL_S = 1.0  # how often a Watch checks that its client is still there
DEFAULT_MAX_STATE_BYTES = 8 << 30  # the largest S_0 SubmitStream takes (it is held in memory)


@rpc_errors
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
        self._require_running()
        spec = self._spec(request.spec)
        state0 = self._initial_state(request.initial_state, spec)
        self._check_program(spec)
        return self._submit(spec, state0)

    def SubmitStream(self, request_iterator, context):
        """Submit with S_0 streamed in chunks. The spec (first part) is checked, program
        included, before a byte of S_0 is accepted; S_0 may be at most `max_state_bytes`."""
        self._require_running()
        parts = iter(request_iterator)
        first = next(parts, None)
        if first is None or not first.spec:
            raise RequestError("the first part of SubmitStream must carry the job spec")
        spec = self._spec(first.spec)
        self._check_program(spec)

        def state_chunks():
            if first.HasField("initial_state"):
                yield first.initial_state
            for part in parts:
                if part.spec:
                    raise RequestError("only the first part of SubmitStream may carry a spec")
                yield part.initial_state

        try:
            data = join_chunks(state_chunks(), self.max_state_bytes)
        except PeerError as err:
            raise RequestError(f"initial_state: {err}") from None
        return self._submit(spec, self._initial_state(data, spec))

    def _submit(self, spec: JobSpec, state0) -> ovt_pb2.SubmitReply:
        with self._submit_lock:  # one store creation per job, however many clients submit it
            if not self.runner.accepts(spec.job_id):  # before anything is written to disk
                raise ResourceLimitError(f"{MAX_QUEUED} jobs are already waiting; submit again "
                                         f"later")
            try:
                store = self.runner.stores.get(spec.job_id) or JobStore(self.root, spec)
                if store.last_step() < 0:
                    store.put_initial(state0)
                self.runner.submit(store)
            except StoreError as err:  # the store holds another job under this id
                raise RefusedError(str(err)) from None
        return ovt_pb2.SubmitReply(job_id=spec.job_id)

    def Status(self, request, context):
        return _to_message(self._status(request.job_id))

    def Watch(self, request, context):
        status = self._status(request.job_id)
        yield _to_message(status)
        while not status.finished and context.is_active():
            if self.runner.stopping:
                raise UnavailableError("the trainer is shutting down; the job resumes when it "
                                       "restarts")
            latest = self.runner.wait_for_change(request.job_id, status, WATCH_POLL_S)
            if latest != status:
                status = latest
                yield _to_message(status)

    # -- validation ----------------------------------------------------------------------------

    def _require_running(self) -> None:
        if self.runner.stopping:
            raise UnavailableError("the trainer is shutting down")

    @staticmethod
    def _spec(data: bytes) -> JobSpec:
        try:
            return JobSpec.from_bytes(data)
        except OvtError as err:
            raise RequestError(f"bad job spec: {err}") from None

    @staticmethod
    def _initial_state(data: bytes, spec: JobSpec):
        try:
            state = safetensors.torch.load(data)
        except (safetensors.SafetensorError, ValueError, TypeError, RuntimeError) as err:
            raise RequestError(f"initial_state is not safetensors: {_one_line(err)}") from None
        if state_digest(state) != spec.h0:
            raise RequestError("initial_state does not hash to the job's h_0")
        return state

    def _check_program(self, spec: JobSpec) -> None:
        try:
            require_allowed(spec.program, self.allowed_programs, "trainer")
            load_job_program(spec)
        except (ProgramError, ConfigError) as err:
            raise RefusedError(_one_line(err)) from None

    def _status(self, job_id: bytes) -> JobStatus:
        status = self.runner.status(job_id_of(job_id))
        if status is None:
            raise NotFoundError(f"unknown job {job_id.hex()}")
        return status


def _to_message(status: JobStatus) -> ovt_pb2.JobStatus:
    return ovt_pb2.JobStatus(job_id=status.job_id, state=status.state, step=status.step,
                             steps=status.steps, error=status.error)


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:500]
