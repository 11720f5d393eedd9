"""The auditor daemon: its own Claims (for the arbiter), the Auditor service and health, one port.

The Claims service answers from the auditor's own store — the same directory its audits replay
into — so an arbiter asks the auditor for its signed commitment (role "auditor"), its leaves with
proofs, its checkpoints and the logs it replayed, exactly as it asks the trainer.

    node = AuditorNode(store_root, key, profile, listen="127.0.0.1:0")
    port = node.start()
    ...
    node.stop()
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path

from proto import ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory
from proto.limits import ServerLimits
from proto.serving import build_server, make_health
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.files import remove_stale_temp_files
from protocol.job.create import DEFAULT_MAX_PARAMS
from protocol.job.faults import Fault

from .audit import DEFAULT_MAX_STEPS
from .faults import AuditorFaults
from .runner import AuditRunner
from .service import AuditorServicer

SERVICE_NAMES = ("ovt.v1.Claims", "ovt.v1.Auditor")
log = logging.getLogger("ovt.auditor")


class AuditorNode:
    """An audit runner and a gRPC server over one store directory."""

    def __init__(self, store_root: Path, key: KeyPair, profile: Profile, *, listen: str,
                 tls_cert: Path | None = None, tls_key: Path | None = None,
                 tls_ca: Path | None = None, allow_remote_plaintext: bool = False,
                 allowed_programs: Collection[str] = (), limits: ServerLimits | None = None,
                 max_params: int = DEFAULT_MAX_PARAMS, max_steps: int = DEFAULT_MAX_STEPS,
                 data_dir: Path | None = None,
                 processes: int = 1, sample: float | None = None,
                 faults: Collection[Fault] = ()) -> None:
        """`limits`: the server's worker threads, stream slots and stream idle timeout
        (default `ServerLimits()`). `max_params`: the largest built-in model a trainer's spec
        may make this auditor build; `max_steps`: the most steps of a job it audits.
        `data_dir`: the folder jobs' data files are read in (None: a job with one fails its
        audit, saying so). `processes`, `sample`: how every audit replays (see
        `auditor_node.audit.run_audit`). `faults`: FAULT INJECTION only (tests and demos): make
        this auditor lie, see `auditor_node.faults`. Raises ConfigError for a bad address, TLS
        files or plaintext off loopback."""
        profile.check_runnable()
        if faults:
            log.warning("FAULT INJECTION: this auditor LIES on purpose (%s); for tests and "
                        "demos of the dispute game only", ", ".join(map(str, faults)))
        self.runner = AuditRunner(store_root, key, profile, tls_ca=tls_ca,
                                  allow_remote_plaintext=allow_remote_plaintext,
                                  allowed_programs=allowed_programs, max_params=max_params,
                                  max_steps=max_steps,
                                  data_dir=data_dir, processes=processes, sample=sample,
                                  hooks=AuditorFaults(faults) if faults else None)
        claims = ClaimsServicer(StoreDirectory(Path(store_root)), data_dir=data_dir)
        auditor = AuditorServicer(self.runner)
        self.health = make_health()
        self.server, self.port = build_server(
            listen,
            [lambda s: ovt_pb2_grpc.add_ClaimsServicer_to_server(claims, s),
             lambda s: ovt_pb2_grpc.add_AuditorServicer_to_server(auditor, s)],
            service_names=SERVICE_NAMES, tls_cert=tls_cert, tls_key=tls_key,
            allow_remote_plaintext=allow_remote_plaintext, limits=limits, health=self.health)

    def start(self) -> int:
        """Remove temporary files a kill left in the store, start auditing (resuming
        interrupted audits) and serving; returns the bound port."""
        removed = remove_stale_temp_files(self.runner.store_root)
        if removed:
            log.info("removed %d temporary files left in the store by an earlier run", removed)
        self.runner.start()
        self.server.start()
        return self.port

    def stop(self, grace_s: float = 5.0) -> None:
        """Report NOT_SERVING, stop taking requests, end the streams, and stop the running audit
        after its step."""
        self.health.enter_graceful_shutdown()
        self.runner.stop(timeout=0)
        self.server.stop(grace_s).wait(grace_s + 1)
        self.runner.stop(timeout=grace_s + 60)
