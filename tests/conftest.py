"""Fixtures shared by the end-to-end tests (real daemons on 127.0.0.1, ephemeral ports)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from protocol.cli import commands
from protocol.commit.keys import KeyPair
from protocol.job import queue
from tests.auditor_node.daemon import AuditorDaemon, Auditors


@pytest.fixture(autouse=True)
def _test_process_malloc_untouched(monkeypatch):
    """A command run in this process (`main(argv)`), or a job queue, leaves its malloc and
    environment as they are: `allocator.keep_freed_memory` is process-wide and cannot be
    undone, so it is tested in processes of its own (tests/protocol/engine/test_allocator.py).
    Daemons started as processes call it as they would anywhere."""
    monkeypatch.setattr(commands, "keep_freed_memory", lambda: None)
    monkeypatch.setattr(queue, "release_freed_memory", lambda: None)


@pytest.fixture
def launched(tmp_path):
    """Start processes; kill whichever are still running at the end."""
    procs: list[subprocess.Popen] = []
    auditors = Auditors(tmp_path, tmp_path / "auditor.key")
    KeyPair.generate().save(auditors.key)
    KeyPair.generate().save(tmp_path / "trainer.key")

    def trainer(*options: str) -> AuditorDaemon:  # the same port-file handshake as the auditor's
        port_file, log = tmp_path / "trainer-port", tmp_path / "trainer.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainer_node.cli", "serve", "--listen", "127.0.0.1:0",
                 "--store", str(tmp_path / "trainer-store"), "--key",
                 str(tmp_path / "trainer.key"), "--profile", "cpu-2t", "--port-file",
                 str(port_file), *options], stdout=out, stderr=subprocess.STDOUT)
        procs.append(proc)
        return AuditorDaemon(proc, port_file, log)

    try:
        yield trainer, auditors
    finally:
        auditors.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
