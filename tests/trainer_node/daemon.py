"""The trainer daemon under test: a tiny job on disk, its reference root from an in-process
`run_job`, and a factory starting `ovt-trainer serve` as a real process on 127.0.0.1
(ephemeral port) that kills every process it started."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.serving import make_channel
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from protocol.job.run import run_job
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS = 40
START_TIMEOUT_S = 60.0
WAIT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TinyJob:
    spec: JobSpec
    spec_path: Path  # S_0 beside it, as `ovt job create` writes it
    state0_bytes: bytes
    root: bytes  # of an uninterrupted in-process run_job

    @property
    def job_id(self) -> bytes:
        return self.spec.job_id


def make_job(init_seed: int = 1) -> tuple[JobSpec, dict]:
    return build_job(program="image-cnn", config=TINY, preset=None, steps=STEPS, seed=0,
                     init_seed=init_seed, policy=PrecisionPolicy(), checkpoint_interval=10,
                     commit_interval=10)


@pytest.fixture(scope="session")
def tiny_job(tmp_path_factory) -> TinyJob:
    spec, state0 = make_job()
    out = tmp_path_factory.mktemp("job")
    spec_path = out / "tiny.ovtjob"
    spec_path.write_bytes(spec.to_bytes())
    state0_bytes = safetensors.torch.save(state0)
    (out / "tiny.s0.safetensors").write_bytes(state0_bytes)
    store = JobStore(out / "reference-store", spec)
    store.put_initial(state0)
    signed = run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-2t"))
    return TinyJob(spec, spec_path, state0_bytes, signed.commitment.root)


@dataclass
class Daemon:
    proc: subprocess.Popen
    port: int
    store: Path
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


class Trainers:
    """Starts `ovt-trainer serve` processes; `close` kills whatever is still running."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path, self.procs, self.count = tmp_path, [], 0
        self.key = tmp_path / "trainer.key"
        KeyPair.generate().save(self.key)

    def command(self, store: Path, *extra: str, listen: str = "127.0.0.1:0") -> list[str]:
        return [sys.executable, "-m", "trainer_node.cli", "serve", "--listen", listen,
                "--store", str(store), "--key", str(self.key), "--profile", "cpu-2t", *extra]

    def start(self, store: Path, *extra: str) -> Daemon:
        self.count += 1
        port_file = self.tmp_path / f"port-{self.count}"
        log = self.tmp_path / f"serve-{self.count}.log"
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(self.command(store, "--port-file", str(port_file), *extra),
                                    stdout=log_file, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"trainer did not start (rc {proc.poll()}):\n"
                                     f"{log.read_text(errors='replace')}")
            time.sleep(0.05)
        return Daemon(proc, int(port_file.read_text()), store, log)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.fixture
def trainers(tmp_path):
    started = Trainers(tmp_path)
    try:
        yield started
    finally:
        started.close()


def submit(channel: grpc.Channel, spec_bytes: bytes, state0_bytes: bytes) -> bytes:
    reply = ovt_pb2_grpc.TrainerStub(channel).Submit(
        ovt_pb2.SubmitRequest(spec=spec_bytes, initial_state=state0_bytes), timeout=60)
    return reply.job_id


def watch_until(channel: grpc.Channel, job_id: bytes, done, timeout: float = WAIT_TIMEOUT_S):
    """The first streamed JobStatus for which `done(status)` holds (bounded by a deadline)."""
    stream = ovt_pb2_grpc.TrainerStub(channel).Watch(ovt_pb2.JobRef(job_id=job_id),
                                                     timeout=timeout)
    try:
        for status in stream:
            if done(status):
                return status
        raise AssertionError("the Watch stream ended before the condition held")
    finally:
        stream.cancel()


def channel_to(daemon: Daemon, **kwargs) -> grpc.Channel:
    return make_channel(daemon.address, tls_ca=None, **kwargs)
