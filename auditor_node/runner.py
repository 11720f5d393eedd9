"""Audits from a queue, one at a time on one thread, with a status per job for watchers.

`AuditRunner.submit` starts an audit, or joins the one already queued, running or decided for
that job (a failed audit is started again). Each status change bumps the status's `version` and
notifies `changed`, a `threading.Condition`, so `wait` can block until there is something new.

The runner keeps two files per job in the auditor's store, both canonical bytes:
`audit-request.ovt` (the trainer's address, written when the audit is queued) and `audit.ovt`
(the `AuditRecord`, written when it ends). On start, `recover` re-queues every requested audit
without a record — those interrupted by a crash or a shutdown, which resume from the store — and
loads the others' records, so GetAudit answers across restarts. `stop` interrupts a running audit
after its current step.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import traceback
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from protocol.codec.canonical import decode, encode
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import EncodingError, OvtError, ResourceLimitError
from protocol.files import atomic_write
from protocol.job.run import StepHooks

from .audit import DIVERGED, FAILED, MATCHED, AuditRecord, run_audit

QUEUED, RUNNING = "queued", "running"
TERMINAL = (MATCHED, DIVERGED, FAILED)
REQUEST_FILE, RECORD_FILE = "audit-request.ovt", "audit.ovt"
MAX_PENDING = 64


class _Stopped(Exception):
    """Raised from the progress callback to interrupt a running audit at shutdown."""


@dataclass(frozen=True)
class AuditStatus:
    """What the runner knows about one job's audit. `record` is set once it has ended."""

    job_id: bytes
    trainer: str
    state: str  # queued | running | matched | diverged | failed
    step: int = 0
    steps: int = 0
    record: AuditRecord | None = None
    version: int = 0

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


class AuditRunner:
    """Runs `run_audit` for queued jobs on one background thread (start with `start`)."""

    def __init__(self, store_root: Path, key: KeyPair, profile: Profile, *,
                 tls_ca: Path | None = None, allow_remote_plaintext: bool = False,
                 allowed_programs: Collection[str] = (),
                 audit: Callable[..., AuditRecord] = run_audit,
                 hooks: StepHooks | None = None) -> None:
        """`hooks`: FAULT INJECTION only (a lying auditor, `auditor_node.faults`), passed to
        every audit; None audits honestly."""
        self.store_root = Path(store_root)
        self.hooks = hooks
        self.key, self.profile, self.tls_ca = key, profile, tls_ca
        self.allow_remote_plaintext = allow_remote_plaintext
        self.allowed_programs = tuple(allowed_programs)
        self._audit = audit
        self._queue: queue.Queue[bytes | None] = queue.Queue()
        self._statuses: dict[bytes, AuditStatus] = {}
        self.changed = threading.Condition()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="audit-runner", daemon=True)

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        self.store_root.mkdir(parents=True, exist_ok=True)
        self.recover()
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the current step of a running audit (it resumes on the next start)."""
        self._stopping.set()
        self._queue.put(None)
        with self.changed:
            self.changed.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def recover(self) -> None:
        """Load the verdicts in the store; queue the requested audits that have none."""
        for request in sorted(self.store_root.glob(f"*/{REQUEST_FILE}")):
            try:
                job_id = bytes.fromhex(request.parent.name)
                trainer = _read_request(request)
            except (ValueError, EncodingError) as err:
                print(f"ovt-auditor: ignoring {request}: {err}", file=sys.stderr)
                continue
            record = _read_record(request.parent / RECORD_FILE)
            with self.changed:
                if record is None:
                    self._statuses[job_id] = AuditStatus(job_id, trainer, QUEUED)
                    self._queue.put(job_id)
                else:
                    self._statuses[job_id] = _finished(job_id, trainer, record, 0)

    # -- queries -------------------------------------------------------------------------------

    def submit(self, job_id: bytes, trainer: str) -> AuditStatus:
        """Queue an audit of `job_id` at `trainer`, or join the one already under way or decided
        (a failed one is queued again). Raises ResourceLimitError when MAX_PENDING are waiting."""
        with self.changed:
            current = self._statuses.get(job_id)
            if current is not None and current.state != FAILED:
                return current
            if self._queue.qsize() >= MAX_PENDING:
                raise ResourceLimitError(f"{MAX_PENDING} audits are already waiting")
            job_dir = self.store_root / job_id.hex()
            job_dir.mkdir(parents=True, exist_ok=True)
            (job_dir / RECORD_FILE).unlink(missing_ok=True)
            atomic_write(job_dir / REQUEST_FILE, encode({"trainer": trainer}))
            version = current.version + 1 if current else 0
            return self._set(AuditStatus(job_id, trainer, QUEUED, version=version),
                             enqueue=True)

    def get(self, job_id: bytes) -> AuditStatus | None:
        with self.changed:
            return self._statuses.get(job_id)

    def wait(self, job_id: bytes, after_version: int, timeout: float) -> AuditStatus | None:
        """The job's status once its version exceeds `after_version`, or as it is after
        `timeout` seconds or when the runner stops."""
        with self.changed:
            self.changed.wait_for(lambda: self._stopping.is_set() or self._version(job_id) >
                                  after_version, timeout)
            return self._statuses.get(job_id)

    def _version(self, job_id: bytes) -> int:
        status = self._statuses.get(job_id)
        return -1 if status is None else status.version

    # -- the worker ----------------------------------------------------------------------------

    def _set(self, status: AuditStatus, *, enqueue: bool = False) -> AuditStatus:
        """Record a new status (caller holds `changed`) and wake the watchers."""
        self._statuses[status.job_id] = status
        if enqueue:
            self._queue.put(status.job_id)
        self.changed.notify_all()
        return status

    def _update(self, job_id: bytes, **changes) -> None:
        with self.changed:
            old = self._statuses[job_id]
            self._set(dataclasses.replace(old, version=old.version + 1, **changes))

    def _loop(self) -> None:
        while not self._stopping.is_set():
            job_id = self._queue.get()
            if job_id is None or self._stopping.is_set():
                return
            self._run(job_id)

    def _run(self, job_id: bytes) -> None:
        trainer = self.get(job_id).trainer
        self._update(job_id, state=RUNNING)

        def progress(step: int, steps: int) -> None:
            self._update(job_id, step=step, steps=steps)
            if self._stopping.is_set():
                raise _Stopped

        try:
            record = self._audit(trainer, job_id, self.store_root, self.key, self.profile,
                                 tls_ca=self.tls_ca, progress=progress,
                                 allow_remote_plaintext=self.allow_remote_plaintext,
                                 allowed_programs=self.allowed_programs,
                                 # only when set: an `audit` stand-in need not know of hooks
                                 **({} if self.hooks is None else {"hooks": self.hooks}))
        except _Stopped:
            return  # no record: `recover` queues it again on the next start
        except OvtError as err:
            record = AuditRecord.failed(job_id, str(err))
        except Exception as err:  # a bug: keep serving, tell the operator, not the peer
            traceback.print_exc(file=sys.stderr)
            record = AuditRecord.failed(job_id, f"internal error ({type(err).__name__})")
        try:
            atomic_write(self.store_root / job_id.hex() / RECORD_FILE, record.to_bytes())
        except OSError as err:
            print(f"ovt-auditor: cannot store the verdict of {job_id.hex()}: {err}",
                  file=sys.stderr)
        with self.changed:
            old = self._statuses[job_id]
            self._set(_finished(job_id, trainer, record, old.version + 1, old))


def _finished(job_id: bytes, trainer: str, record: AuditRecord, version: int,
              old: AuditStatus | None = None) -> AuditStatus:
    steps = record.steps or (old.steps if old else 0)
    step = record.replayed if record.state != FAILED else (old.step if old else 0)
    return AuditStatus(job_id, trainer, record.state, step=step, steps=steps, record=record,
                       version=version)


def _read_request(path: Path) -> str:
    body = decode(path.read_bytes(), max_bytes=4096)
    if not isinstance(body, dict) or not isinstance(body.get("trainer"), str):
        raise EncodingError("not an audit request")
    return body["trainer"]


def _read_record(path: Path) -> AuditRecord | None:
    try:
        return AuditRecord.from_bytes(path.read_bytes())
    except (OSError, EncodingError):
        return None
