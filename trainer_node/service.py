"""The Trainer gRPC service: job submission, status and a progress stream (issue 4).

This is the trainer's edge: everything a client sends is validated here and every failure
becomes a gRPC status with a one-line message (never a traceback):

    malformed spec, S_0 not safetensors, S_0 not hashing to h_0   INVALID_ARGUMENT
    job id not 32 bytes                                            INVALID_ARGUMENT
    program not allowed here, missing, or its source hash differs  FAILED_PRECONDITION
    a data file not in the trainer's --data-dir (or none is given) FAILED_PRECONDITION
    a config the program rejects                                   FAILED_PRECONDITION
    the store holds another job under the same id (damaged)       FAILED_PRECONDITION
    a built-in model of more than `max_params` parameters          RESOURCE_EXHAUSTED
    unknown job                                                    NOT_FOUND
    MAX_QUEUED jobs already waiting (a new job refused unwritten)  RESOURCE_EXHAUSTED
    S_0 beyond the in-flight budget, or no disk space for it       RESOURCE_EXHAUSTED
    SubmitStream: no spec first, a broken or oversized S_0 stream  INVALID_ARGUMENT
    daemon shutting down                                           UNAVAILABLE

Submitting is idempotent: the job id is the spec's hash, and submitting a known job returns the
same id without touching its store. A job whose examples (a data file's, or a built-in program's
own dataset) are not the ones its spec commits to is taken, and fails when it starts training,
saying so: the examples are hashed then, not here.

What a peer can make the trainer hold is bounded before the work is done. The spec is checked
first, without building anything: a built-in program's size comes from its config alone
(`parameter_count`), refused above `max_params`. SubmitStream writes S_0 to a temporary file in
the store root as it streams (one chunk in memory), checking its announced size against
`max_state_bytes` and, before the first byte is written, reserving it from the in-flight
budget (`max_inflight_bytes`: the S_0 bytes of all submissions in flight together, Submit's
included), so concurrent submissions never hold more on disk together; the file is removed
however the call ends. S_0 is then hashed where it lies (`safetensors_file_digest`, one chunk
in memory at a time), checked against h_0 and moved into the job's store as its checkpoint 0:
it is never loaded or held in memory whole, so what submissions hold in memory is the chunk
each stream has in flight (at most one gRPC message, `--max-message-mb`, per stream slot).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import receive_chunks
from proto.status import job_id_of, rpc_errors
from protocol.codec.state import safetensors_file_digest
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
    StateFormatError,
    StoreError,
    UnavailableError,
)
from protocol.files import temporary_file
from protocol.job.create import (
    DEFAULT_MAX_PARAMS,
    check_program_source,
    load_job_program,
    locate_data_file,
    require_model_size,
)
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

from .runner import MAX_QUEUED, JobRunner, JobStatus

WATCH_POLL_S = 1.0  # how often a Watch checks that its client is still there
DEFAULT_MAX_STATE_BYTES = 8 << 30  # the largest S_0 SubmitStream takes
DEFAULT_MAX_INFLIGHT_BYTES = 8 << 30  # S_0 bytes of all submissions in flight together


class ByteBudget:
    """Bytes that all calls in flight may hold together: each call claims what it needs before
    it takes it, and gives it back when it ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()

    @contextmanager
    def claim(self) -> Iterator[Callable[[int], None]]:
        """A block during which `reserve(n)` takes n more bytes from the budget, raising
        ResourceLimitError (and taking nothing) when fewer are left; all it took is given back
        when the block ends."""
        taken = 0

        def reserve(n: int) -> None:
            nonlocal taken
            with self._lock:
                if self._used + n > self.limit:
                    raise ResourceLimitError(
                        f"the trainer holds {self._used} bytes of submissions in flight; {n} "
                        f"more would pass its budget of {self.limit}: submit again later")
                self._used += n
                taken += n

        try:
            yield reserve
        finally:
            with self._lock:
                self._used -= taken


@rpc_errors
class TrainerServicer(ovt_pb2_grpc.TrainerServicer):
    """Submit / Status / Watch over a `JobRunner` whose stores live under `root`.

    `allowed_programs` are the user programs (beyond the built-ins) a client may name: loading
    a program imports code on this machine, so a peer may never choose an arbitrary one.
    `max_state_bytes` bounds one S_0, `max_inflight_bytes` the S_0 bytes of all submissions in
    flight together, `max_params` the parameters of a built-in model a spec may ask for.
    `data_dir` is the folder the operator offers data files in (None: a job with one is
    refused).
    """

    def __init__(self, root: Path, runner: JobRunner, allowed_programs: Collection[str] = (),
                 max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
                 max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
                 max_params: int = DEFAULT_MAX_PARAMS, data_dir: Path | None = None) -> None:
        self.root, self.runner, self.data_dir = Path(root), runner, data_dir
        self.max_state_bytes, self.max_params = max_state_bytes, max_params
        self.allowed_programs = frozenset(allowed_programs)
        self._inflight = ByteBudget(max_inflight_bytes)
        self._storing = threading.Lock()  # one store creation per job, however many submit it

    def Submit(self, request, context):
        """Submit with S_0 in the request (bounded by the gRPC message size): checked and
        stored as SubmitStream's is."""
        self._require_running()
        spec = self._spec(request.spec)
        if len(request.initial_state) > self.max_state_bytes:
            raise RequestError(f"initial_state: peer sent {len(request.initial_state)} bytes, "
                               f"more than the {self.max_state_bytes} allowed")
        self._require_room(spec)  # cheap first: a user program is built to check its config
        self._check_program(spec)
        with self._state_file() as (reserve, out, path):
            reserve(len(request.initial_state))
            out.write(request.initial_state)
            return self._submit(spec, out, path)

    def SubmitStream(self, request_iterator, context):
        """Submit with S_0 streamed in chunks. The spec (first part) is checked, program
        included, before a byte of S_0 is accepted; S_0 may be at most `max_state_bytes`, and
        goes to a temporary file in the store root as it arrives, within the in-flight budget."""
        self._require_running()
        parts = iter(request_iterator)
        first = next(parts, None)
        if first is None or not first.spec:
            raise RequestError("the first part of SubmitStream must carry the job spec")
        spec = self._spec(first.spec)
        self._require_room(spec)  # cheap first: a user program is built to check its config
        self._check_program(spec)

        def state_chunks():
            if first.HasField("initial_state"):
                yield first.initial_state
            for part in parts:
                if part.spec:
                    raise RequestError("only the first part of SubmitStream may carry a spec")
                yield part.initial_state

        with self._state_file() as (reserve, out, path):
            try:
                receive_chunks(state_chunks(), self.max_state_bytes, out, admit=reserve)
            except PeerError as err:
                raise RequestError(f"initial_state: {err}") from None
            return self._submit(spec, out, path)

    @contextmanager
    def _state_file(self) -> Iterator[tuple[Callable[[int], None], BinaryIO, Path]]:
        """(`reserve`, file, its path) for one submission's S_0: a temporary file in the store
        root, removed when the block ends however it ends (unless the job's store took it),
        and `reserve(n)`, which takes n bytes of the in-flight budget until then (raising
        ResourceLimitError, as `ByteBudget.claim`, when they are not left). Raises
        ResourceLimitError when the disk has no room for S_0 (or for storing it)."""
        try:
            with self._inflight.claim() as reserve, \
                    temporary_file(self.root, "submitted-s0") as (out, path):
                yield reserve, out, path
        except OSError as err:
            raise ResourceLimitError(f"the trainer cannot hold the initial state: "
                                     f"{err.strerror or err}") from None

    def _submit(self, spec: JobSpec, out: BinaryIO, path: Path) -> ovt_pb2.SubmitReply:
        """Check the S_0 written to `path` (through `out`) against h_0 where it lies, then
        store it (the file moves into the job's store) and queue the job. Raises RequestError
        for an S_0 that is not a safetensors state or does not hash to h_0, RefusedError when
        the store holds another job under this id, ResourceLimitError when the queue is full.
        """
        out.flush()
        try:
            digest = safetensors_file_digest(path)
        except StateFormatError as err:
            raise RequestError(f"initial_state is not safetensors: {_one_line(err)}") from None
        if digest != spec.h0:
            raise RequestError("initial_state does not hash to the job's h_0")
        with self._storing:
            self._require_room(spec)  # again: the queue may have filled while S_0 streamed
            try:
                store = self.runner.stores.get(spec.job_id) or JobStore(self.root, spec)
                if store.last_step() < 0:
                    store.put_initial_file(path, digest)
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
            if latest is not None and latest != status:  # (None: no status, nothing to send)
                status = latest
                yield _to_message(status)

    # -- validation ----------------------------------------------------------------------------

    def _require_running(self) -> None:
        if self.runner.stopping:
            raise UnavailableError("the trainer is shutting down")

    def _require_room(self, spec: JobSpec) -> None:
        """Refuse a new job while MAX_QUEUED wait (ResourceLimitError), before its S_0 is taken
        and before anything is written to disk."""
        if not self.runner.accepts(spec.job_id):
            raise ResourceLimitError(f"{MAX_QUEUED} jobs are already waiting; submit again later")

    @staticmethod
    def _spec(data: bytes) -> JobSpec:
        try:
            return JobSpec.from_bytes(data)
        except OvtError as err:
            raise RequestError(f"bad job spec: {err}") from None

    def _check_program(self, spec: JobSpec) -> None:
        """Refuse a program this trainer may not load, whose source is not the committed one, or
        whose config it rejects; a built-in model of more than `max_params` parameters
        (ResourceLimitError); and a data file that is not in this trainer's data folder (or
        leaves it, or there is none): all from the spec alone, before anything is built or
        read. A user program (one the operator allowed) is built to check its config: only its
        code can tell (and its dataset's size against the data commitment's count). The job's
        examples, a data file's or a built-in's own, are checked against its data commitment
        when the job starts training (`require_committed_data` in `load_job_program`: a
        mismatch fails the job, saying so): hashing every example is a job's work, which the
        queue bounds, not a Submit's, which a peer may send at will (SPEC §2.1)."""
        try:
            require_allowed(spec.program, self.allowed_programs, "trainer")
            locate_data_file(spec, self.data_dir)
            if require_model_size(spec, self.max_params) is None:
                # a user program: checks the source, then builds (the data file unread)
                load_job_program(spec, examples=False)
            else:
                check_program_source(spec)
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
