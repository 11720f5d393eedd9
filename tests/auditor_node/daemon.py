"""Starting `ovt-auditor serve` as a real process on 127.0.0.1 (ephemeral port), and talking to
it: every wait is bounded, and `Auditors.close` kills whatever is still running."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from proto import ovt_pb2, ovt_pb2_grpc

START_TIMEOUT_S = 60.0
AUDIT_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
TERMINAL = ("matched", "diverged", "sampled", "failed")


@dataclass
class AuditorDaemon:
    proc: subprocess.Popen
    port_file: Path
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{int(self.port_file.read_text())}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_serving(self) -> AuditorDaemon:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"auditor did not start (rc {self.proc.poll()}):\n"
                                     f"{self.log_text()}")
            time.sleep(0.05)
        return self

    def terminate(self) -> int:
        """SIGTERM, and the exit code (bounded wait)."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)


class Auditors:
    """Launches `ovt-auditor serve` processes (without waiting, so several start together)."""

    def __init__(self, tmp_path: Path, key: Path) -> None:
        self.tmp_path, self.key, self.procs = tmp_path, key, []

    def launch(self, store: Path, *extra: str) -> AuditorDaemon:
        n = len(self.procs) + 1
        port_file, log = self.tmp_path / f"auditor-port-{n}", self.tmp_path / f"auditor-{n}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "auditor_node.cli", "serve", "--listen", "127.0.0.1:0",
                 "--store", str(store), "--key", str(self.key), "--port-file", str(port_file),
                 *extra], stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return AuditorDaemon(proc, port_file, log)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)


def watch_audit(channel: grpc.Channel, job_id: bytes,
                timeout: float = AUDIT_TIMEOUT_S) -> list[ovt_pb2.AuditReport]:
    """Every report WatchAudit streams until the audit ends (bounded by `timeout`)."""
    stream = ovt_pb2_grpc.AuditorStub(channel).WatchAudit(ovt_pb2.JobRef(job_id=job_id),
                                                          timeout=timeout)
    reports = []
    try:
        for report in stream:
            reports.append(report)
            if report.state in TERMINAL:
                return reports
    finally:
        stream.cancel()
    raise AssertionError(f"WatchAudit ended before a verdict: {reports}")
