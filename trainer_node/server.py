"""Wiring of the trainer daemon: stores, job runner, Claims + Trainer servicers, health, TLS.

    node = TrainerNode(TrainerConfig(listen="127.0.0.1:0", store=Path("store"),
                                     key=KeyPair.load("trainer.key"), profile=Profile("cpu-2t")))
    port = node.start()        # resumes unfinished jobs, then serves
    ...
    node.stop()                # the running job stops after its current step
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from proto import ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory
from proto.limits import ServerLimits
from proto.serving import DEFAULT_MAX_MESSAGE_BYTES, build_server, make_health
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError
from protocol.files import remove_stale_temp_files
from protocol.job.create import DEFAULT_MAX_PARAMS
from protocol.job.faults import Fault

from .faults import TrainerFaults
from .runner import JobRunner
from .service import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_MAX_STATE_BYTES,
    TrainerServicer,
)

SERVICE_NAMES = ("ovt.v1.Claims", "ovt.v1.Trainer")
log = logging.getLogger("ovt.trainer")


@dataclass(frozen=True)
class TrainerConfig:
    listen: str
    store: Path
    key: KeyPair
    profile: Profile
    tls_cert: Path | None = None
    tls_key: Path | None = None
    allow_remote_plaintext: bool = False
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES  # the largest S_0 SubmitStream takes
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES  # S_0 bytes of submissions in flight
    max_params: int = DEFAULT_MAX_PARAMS  # the largest built-in model a spec may ask for
    limits: ServerLimits = ServerLimits()  # worker threads, stream slots, stream idle timeout
    allowed_programs: tuple[str, ...] = field(default=())
    data_dir: Path | None = None  # the folder jobs' data files are read in (None: refused)
    workers: int = 1  # processes computing a job's micro-batches (at most its micro-batches)
    # FAULT INJECTION (tests and demos only): make this trainer cheat, see trainer_node.faults.
    faults: tuple[Fault, ...] = field(default=())


class TrainerNode:
    """The trainer daemon in-process: `start` binds and serves, `stop` shuts down gracefully."""

    def __init__(self, config: TrainerConfig) -> None:
        """Make the store folder and bind the server (`start` serves). Raises ConfigError for
        a store path that cannot be a folder (under a regular file, say), a profile this
        machine cannot run, and what `build_server` raises."""
        config.profile.check_runnable()
        try:
            config.store.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"cannot make the store folder {config.store}: "
                              f"{err.strerror or err}") from None
        self.config = config
        self.stores = StoreDirectory(config.store)
        faults = TrainerFaults(config.faults) if config.faults else None
        if faults is not None:
            log.warning("FAULT INJECTION: this trainer CHEATS on purpose (%s); for tests and "
                        "demos of the dispute game only", ", ".join(map(str, config.faults)))
        self.runner = JobRunner(self.stores, config.key, config.profile,
                                hooks=faults if faults and faults.training else None,
                                data_dir=config.data_dir, workers=config.workers)
        claims = ClaimsServicer(self.stores, data_dir=config.data_dir,
                                leaf_fault=faults.leaf_fault
                                if faults and faults.serving else None)
        trainer = TrainerServicer(config.store, self.runner, config.allowed_programs,
                                  max_state_bytes=config.max_state_bytes,
                                  max_inflight_bytes=config.max_inflight_bytes,
                                  max_params=config.max_params, data_dir=config.data_dir)
        self.health = make_health()
        self.server, self.port = build_server(
            config.listen,
            [lambda s: ovt_pb2_grpc.add_ClaimsServicer_to_server(claims, s),
             lambda s: ovt_pb2_grpc.add_TrainerServicer_to_server(trainer, s)],
            service_names=SERVICE_NAMES, tls_cert=config.tls_cert, tls_key=config.tls_key,
            allow_remote_plaintext=config.allow_remote_plaintext,
            max_message_bytes=config.max_message_bytes, limits=config.limits,
            health=self.health)

    def start(self) -> int:
        """Remove temporary files a kill left in the store, queue unfinished jobs, start
        training and serving; returns the bound port."""
        removed = remove_stale_temp_files(self.config.store)
        if removed:
            log.info("removed %d temporary files left in the store by an earlier run", removed)
        self.runner.start()
        self.server.start()
        log.info("serving on port %d (%s)", self.port,
                 "TLS" if self.config.tls_cert else "plaintext")
        return self.port

    def stop(self, grace_s: float = 5.0, runner_timeout_s: float = 60.0) -> bool:
        """Stop the runner after its current step and the server after `grace_s` seconds;
        True if the runner ended in time."""
        self.health.enter_graceful_shutdown()  # NOT_SERVING, before the port closes
        self.runner.stop(0)  # refuse new work and wake every Watch at once
        self.server.stop(grace=grace_s).wait(grace_s + 1)
        stopped = self.runner.stop(runner_timeout_s)
        if not stopped:
            log.error("the job runner did not stop within %.0f s", runner_timeout_s)
        return stopped
