"""Audits from a queue, one at a time on one thread, with a status per job for watchers.

`AuditRunner.submit` starts an audit, or joins the one already queued, running or decided for
that job at the same trainer (a failed audit is started again, and so is a sampled one when this
runner audits in full: "sampled, not verified" is no verdict a full audit may join); a request
naming another trainer is refused, unless the job's audit failed before its store was made
(see `submit`). Each status change bumps the status's `version`, so `wait` can block until
there is something new; the queue, its worker thread and the wake-ups are the daemons' shared
`protocol.job.queue.JobQueue`.

The runner keeps two files per job in the auditor's store, both canonical bytes:
`audit-request.ovt` (the trainer's address, written when the audit is queued) and `audit.ovt`
(the `AuditRecord`, written when it ends). On start, `recover` re-queues every requested audit
without a record — those interrupted by a crash or a shutdown, which resume from the store — and
loads the others' records, so GetAudit answers across restarts. An audit that fails before the
job's store exists (its spec never fetched and verified) leaves no directory: the failure is
kept in memory only, so requests for jobs the trainer does not have cost no disk, and only the
latest MAX_UNSTORED_FAILURES of them are kept, so they cost bounded memory too (an older one is
forgotten: GetAudit answers NOT_FOUND for it, and Audit starts it afresh). `stop` interrupts a
running audit after its current step, also while worker processes replay it (`check_stop`).
"""

from __future__ import annotations

import shutil
import sys
import traceback
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from protocol.codec.canonical import decode_object, encode
from protocol.codec.fields import require_fields
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, EncodingError, OvtError, RefusedError
from protocol.files import atomic_write
from protocol.job.create import DEFAULT_MAX_PARAMS
from protocol.job.queue import JobQueue, Stopped
from protocol.job.run import StepHooks
from protocol.job.store import SPEC_FILE

from .audit import (
    DEFAULT_MAX_STEPS,
    DIVERGED,
    FAILED,
    MATCHED,
    SAMPLED,
    AuditRecord,
    run_audit,
)

QUEUED, RUNNING = "queued", "running"
TERMINAL = (MATCHED, DIVERGED, SAMPLED, FAILED)
REQUEST_FILE, RECORD_FILE = "audit-request.ovt", "audit.ovt"
MAX_PENDING = 64
MAX_UNSTORED_FAILURES = 256  # failed audits that left no store, remembered in memory


@dataclass(frozen=True)
class AuditStatus:
    """What the runner knows about one job's audit. `record` is set once it has ended."""

    job_id: bytes
    trainer: str
    state: str  # queued | running | matched | diverged | sampled | failed
    step: int = 0  # running: the last step done; ended: the record's `replayed` (a count)
    steps: int = 0
    record: AuditRecord | None = None
    version: int = 0

    @property
    def finished(self) -> bool:
        return self.state in TERMINAL


class AuditRunner:
    """Runs `run_audit` for queued jobs on the shared job queue's worker (start with `start`)."""

    def __init__(self, store_root: Path, key: KeyPair, profile: Profile, *,
                 tls_ca: Path | None = None, allow_remote_plaintext: bool = False,
                 allowed_programs: Collection[str] = (),
                 max_params: int = DEFAULT_MAX_PARAMS, max_steps: int = DEFAULT_MAX_STEPS,
                 audit: Callable[..., AuditRecord] = run_audit,
                 hooks: StepHooks | None = None, data_dir: Path | None = None,
                 processes: int = 1, sample: float | None = None) -> None:
        """`data_dir`: the folder jobs' data files are read in (None: a job with one fails).
        `hooks`: FAULT INJECTION only (a lying auditor, `auditor_node.faults`), passed to
        every audit; None audits honestly. `processes`, `sample`: how every audit replays
        (`run_audit`'s options: worker processes, and the fraction of intervals a sampled
        audit replays; None audits in full)."""
        self.store_root = Path(store_root)
        self.hooks, self.data_dir = hooks, data_dir
        self.processes, self.sample = processes, sample
        self.key, self.profile, self.tls_ca = key, profile, tls_ca
        self.allow_remote_plaintext = allow_remote_plaintext
        self.allowed_programs = tuple(allowed_programs)
        self.max_params, self.max_steps = max_params, max_steps
        self._audit = audit
        self._queue: JobQueue[AuditStatus] = JobQueue("audit-runner", self._run,
                                                      max_waiting=MAX_PENDING, noun="audits")
        # Failed audits with no store, oldest first (under the queue's lock): the statuses
        # beyond MAX_UNSTORED_FAILURES are forgotten.
        self._unstored_failures: OrderedDict[bytes, None] = OrderedDict()

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Make the store, load its audits and start the worker. Raises ConfigError for a store
        that cannot be made (a bad `--store`, said in one line, not a traceback)."""
        try:
            self.store_root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"cannot make the store {self.store_root}: {err.strerror}") \
                from None
        self.recover()
        self._queue.start()

    def stop(self, timeout: float | None = None) -> bool:
        """Stop after the current step of a running audit (it resumes on the next start);
        True if the worker ended within `timeout` seconds."""
        return self._queue.stop(timeout)

    @property
    def stopping(self) -> bool:
        return self._queue.stopping

    def recover(self) -> None:
        """Load the verdicts in the store; queue the requested audits that have none."""
        for request in sorted(self.store_root.glob(f"*/{REQUEST_FILE}")):
            try:
                job_id = bytes.fromhex(request.parent.name)
                trainer = _read_request(request)
            except (ValueError, EncodingError, OSError) as err:  # one bad file stops no start
                print(f"ovt-auditor: ignoring {request}: {err}", file=sys.stderr)
                continue
            record = _read_record(request.parent / RECORD_FILE)
            if record is None:
                self._queue.enqueue(job_id, AuditStatus(job_id, trainer, QUEUED), resumed=True)
            else:
                self._queue.set(job_id, _finished(job_id, trainer, record, 0))

    # -- queries -------------------------------------------------------------------------------

    def submit(self, job_id: bytes, trainer: str) -> AuditStatus:
        """Queue an audit of `job_id` at `trainer`, or join the one of that trainer already
        under way or decided (a failed one is queued again, and a sampled one when this runner
        audits in full).

        An audit is of a job at one trainer, and the wire names an audit by its job alone
        (GetAudit, WatchAudit, GetChallenge, and the auditor's Claims an arbiter questions), so
        this node audits each job at one trainer and refuses any other: were another's request
        to take the job's place, even after a failed audit, whoever reads the job's audit (the
        client who asked for the first trainer) would be told another trainer's verdict, and
        could take another trainer's challenge to an arbiter, who would rule it bad and blame
        this auditor. The one exception is an audit that failed before the job's store was
        made (no spec fetched: an unreachable trainer, say): it holds nothing, and keeping
        the job for its address would let anyone shut a job out of this node with one request
        to a dead address. Who reads an audit can tell whose it is (the report names its
        trainer, which the arbiter checks). (A trainer's own commitment to the job may change
        between its audits: a replay made with another commitment's logs is replayed again
        unless this auditor signed it, `protocol.job.run.begin_replay`.) Raises RefusedError
        for another trainer, ResourceLimitError when MAX_PENDING are waiting."""
        with self._queue.lock:
            current = self._queue.get(job_id)
            if current is not None and current.trainer != trainer and \
                    job_id not in self._unstored_failures:
                raise RefusedError(
                    f"job {job_id.hex()} is audited here at trainer {current.trainer} "
                    f"({current.state}); this node audits a job at one trainer only (to audit "
                    f"it at another, remove {self.store_root / job_id.hex()} while the "
                    f"auditor is stopped)")
            if current is not None and current.state != FAILED and not (
                    current.state == SAMPLED and self.sample is None):
                return current
            self._queue.require_room()  # before anything is written
            self._unstored_failures.pop(job_id, None)  # queued again: not a failure to drop
            job_dir = self.store_root / job_id.hex()
            job_dir.mkdir(parents=True, exist_ok=True)
            atomic_write(job_dir / REQUEST_FILE, _request_bytes(trainer))
            (job_dir / RECORD_FILE).unlink(missing_ok=True)
            version = current.version + 1 if current else 0
            return self._queue.enqueue(job_id, AuditStatus(job_id, trainer, QUEUED,
                                                           version=version))

    def get(self, job_id: bytes) -> AuditStatus | None:
        return self._queue.get(job_id)

    def wait(self, job_id: bytes, after_version: int, timeout: float) -> AuditStatus | None:
        """The job's status once its version exceeds `after_version`, or as it is after
        `timeout` seconds or when the runner stops."""
        return self._queue.wait_for(
            job_id, lambda status: status is not None and status.version > after_version,
            timeout)

    # -- the work ------------------------------------------------------------------------------

    def _update(self, job_id: bytes, **changes) -> None:
        with self._queue.lock:
            old = self._queue.get(job_id)
            assert old is not None  # a job runs only after its status was recorded
            self._queue.update(job_id, version=old.version + 1, **changes)

    def _run(self, job_id: bytes) -> None:
        status = self.get(job_id)
        assert status is not None  # a job runs only after its status was recorded
        trainer = status.trainer
        self._update(job_id, state=RUNNING)

        def progress(step: int, steps: int) -> None:
            self._update(job_id, step=step, steps=steps)
            self._queue.check_stop()

        try:
            record = self._audit(trainer, job_id, self.store_root, self.key, self.profile,
                                 tls_ca=self.tls_ca, progress=progress,
                                 allow_remote_plaintext=self.allow_remote_plaintext,
                                 allowed_programs=self.allowed_programs,
                                 max_params=self.max_params, max_steps=self.max_steps,
                                 # only when set: an `audit` stand-in need not know of these
                                 **({} if self.hooks is None else {"hooks": self.hooks}),
                                 **({} if self.data_dir is None else
                                    {"data_dir": self.data_dir}),
                                 **({} if self.processes == 1 else
                                    {"processes": self.processes}),
                                 **({} if self.sample is None else {"sample": self.sample}),
                                 **({} if self.processes == 1 and self.sample is None else
                                    {"check_stop": self._queue.check_stop}))
        except Stopped:
            return  # no record: `recover` queues it again on the next start
        except OvtError as err:
            record = AuditRecord.failed(job_id, str(err))
        except Exception as err:  # a bug: keep serving, tell the operator, not the peer
            traceback.print_exc(file=sys.stderr)
            record = AuditRecord.failed(job_id, f"internal error ({type(err).__name__})")
        job_dir = self.store_root / job_id.hex()
        unstored = record.state == FAILED and not (job_dir / SPEC_FILE).exists()
        if unstored:
            # It failed before the job's store was made (no verified spec: an unknown job, an
            # unreachable trainer, a program refused): keep no directory for it, or every
            # request for a random job id would leave one. The failure is known until a restart
            # or until MAX_UNSTORED_FAILURES later ones push it out.
            shutil.rmtree(job_dir, ignore_errors=True)
        else:
            try:
                atomic_write(job_dir / RECORD_FILE, record.to_bytes())
            except OSError as err:
                print(f"ovt-auditor: cannot store the verdict of {job_id.hex()}: {err}",
                      file=sys.stderr)
        with self._queue.lock:
            old = self._queue.get(job_id)
            assert old is not None
            self._queue.set(job_id, _finished(job_id, trainer, record, old.version + 1, old))
            if unstored:
                self._remember_unstored_failure(job_id)

    def _remember_unstored_failure(self, job_id: bytes) -> None:
        """Count `job_id` as the latest failure with no store, and forget the oldest such
        failures beyond MAX_UNSTORED_FAILURES; under the queue's lock."""
        self._unstored_failures[job_id] = None
        self._unstored_failures.move_to_end(job_id)
        while len(self._unstored_failures) > MAX_UNSTORED_FAILURES:
            oldest, _ = self._unstored_failures.popitem(last=False)
            self._queue.forget(oldest)  # failed, and not queued since (`submit` unlists it)


def _finished(job_id: bytes, trainer: str, record: AuditRecord, version: int,
              old: AuditStatus | None = None) -> AuditStatus:
    steps = record.steps or (old.steps if old else 0)
    step = record.replayed if record.state != FAILED else (old.step if old else 0)
    return AuditStatus(job_id, trainer, record.state, step=step, steps=steps, record=record,
                       version=version)


def _request_bytes(trainer: str) -> bytes:
    """The canonical bytes of an audit request: the trainer's address."""
    return encode({"trainer": trainer})


def _read_request(path: Path) -> str:
    """The trainer address a stored request names: a map of exactly that one string,
    re-encoding to the file's bytes (SPEC §2, `decode_object`). Raises EncodingError."""
    return decode_object(path.read_bytes(), _trainer_of, _request_bytes, what="audit request",
                         max_bytes=4096)


def _trainer_of(body: object) -> str:
    trainer = require_fields("an audit request", body, ("trainer",))["trainer"]
    if type(trainer) is not str:
        raise EncodingError("an audit request names its trainer by a string")
    return trainer


def _read_record(path: Path) -> AuditRecord | None:
    try:
        return AuditRecord.from_bytes(path.read_bytes())
    except (OSError, EncodingError):
        return None
