"""The Auditor gRPC service (ovt.v1.Auditor): the edge between peers and the `AuditRunner`.

Audit starts (or joins) an audit and answers at once; GetAudit reports where it stands;
WatchAudit streams a report on every change until the audit is matched, diverged, sampled
(sampled, not verified: its reason says what it replayed, and `step` counts those steps) or
failed; GetChallenge hands an arbiter the challenge a diverged audit filed (SPEC §5.1).
Requests are validated here and every problem becomes a status code with a one-line message:
a job id that is not 32 bytes or a missing or malformed trainer address is INVALID_ARGUMENT, an
audit this node has never heard of NOT_FOUND, a full queue RESOURCE_EXHAUSTED. No stack trace
ever reaches the peer.
"""

from __future__ import annotations

from proto import ovt_pb2, ovt_pb2_grpc
from proto.serving import split_address
from proto.status import job_id_of, rpc_errors
from protocol.errors import NotFoundError, RequestError, StoreError

from .runner import AuditRunner, AuditStatus

MAX_ADDRESS_CHARS = 512
WATCH_POLL_S = 1.0  # how often a watcher notices a cancelled client or a stopping server


def report(status: AuditStatus) -> ovt_pb2.AuditReport:
    """The wire form of a status (the auditor's signed commitment once it has one, and the
    trainer audited: a node audits a job at one trainer, `AuditRunner.submit`); the reason is
    the record's, then its note (why it replayed more than its sample) if any."""
    record = status.record
    signed = record.auditor_commitment if record else None
    divergent = record.divergent_step if record else None
    reason = "; ".join(filter(None, (record.reason, record.note))) if record else ""
    return ovt_pb2.AuditReport(
        job_id=status.job_id, state=status.state, step=status.step, steps=status.steps,
        divergent_step=divergent or 0, reason=reason,
        commitment=signed.to_bytes() if signed else b"",
        error=(record.error or "") if record else "", trainer=status.trainer)


@rpc_errors
class AuditorServicer(ovt_pb2_grpc.AuditorServicer):
    def __init__(self, runner: AuditRunner) -> None:
        self.runner = runner

    def _status(self, job_id: bytes) -> AuditStatus:
        status = self.runner.get(job_id_of(job_id))
        if status is None:
            raise NotFoundError(f"no audit of job {job_id.hex()}")
        return status

    def Audit(self, request, context):
        job_id = bytes(job_id_of(request.job_id))
        address = request.trainer_address
        if not address:
            raise RequestError("trainer_address is empty")
        if len(address) > MAX_ADDRESS_CHARS:
            raise RequestError(f"trainer_address is longer than {MAX_ADDRESS_CHARS} characters")
        split_address(address)  # ConfigError (INVALID_ARGUMENT) if malformed
        return report(self.runner.submit(job_id, address))

    def GetAudit(self, request, context):
        return report(self._status(request.job_id))

    def WatchAudit(self, request, context):
        status = self._status(request.job_id)
        yield report(status)
        while not status.finished and context.is_active() and not self.runner.stopping:
            newer = self.runner.wait(status.job_id, status.version, WATCH_POLL_S)
            if newer is not None and newer.version != status.version:
                status = newer
                yield report(status)

    def GetChallenge(self, request, context):
        status = self._status(request.job_id)
        record = status.record
        if record is None or record.challenge is None:
            raise NotFoundError(f"no challenge for job {status.job_id.hex()} "
                                f"(audit {status.state})")
        try:
            data = record.challenge.read_bytes()
        except OSError as err:
            raise StoreError(f"the challenge file is unreadable: {err}") from None
        return ovt_pb2.ChallengeReply(challenge=data)
