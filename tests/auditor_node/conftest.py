"""Fixtures for the auditor's tests: one tiny trained job, served by an in-process Claims server
on 127.0.0.1 (ephemeral port), so nothing here depends on the trainer daemon; a liar that
falsified one leaf, and a cheater that trained one step on other examples."""

from __future__ import annotations

import contextlib
import shutil
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from proto import ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory
from protocol.commit.commitments import Commitment, SignedCommitment, sign_commitment
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from protocol.job.faults import Fault
from protocol.job.run import run_job
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore
from trainer_node.faults import TrainerFaults

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS = 20
FALSIFIED_STEP = 12
CHEAT_STEP = 8  # in the job's second checkpoint interval, steps 6-10
AUDITOR_PROFILE = Profile.parse("emulated-gpu")  # the trainer trains on cpu-2t


@dataclass(frozen=True)
class Trained:
    spec: JobSpec
    root: Path  # the trainer's store root
    signed: SignedCommitment  # the trainer's commitment over all STEPS


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Trained:
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=STEPS,
                             seed=0, init_seed=1, policy=PrecisionPolicy(),
                             checkpoint_interval=5, commit_interval=10)
    root = tmp_path_factory.mktemp("trainer")
    store = JobStore(root, spec)
    store.put_initial(state0)
    signed = run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-2t"))
    store.close()
    return Trained(spec, root, signed)


@pytest.fixture(scope="session")
def liar_root(trained, tmp_path_factory) -> Path:
    """A copy of the trainer's store whose leaf FALSIFIED_STEP claims another state hash, under
    a validly signed root over its (falsified) leaves: only a replay can catch it."""
    root = tmp_path_factory.mktemp("liar") / "store"
    shutil.copytree(trained.root, root)
    store = JobStore(root, trained.spec)
    leaf = store.leaf(FALSIFIED_STEP)
    store._put_leaf(Leaf(FALSIFIED_STEP, bytes(32), leaf.log_hash))
    key = KeyPair.generate()
    store.save_commitment(sign_commitment(Commitment(
        job_id=trained.spec.job_id, n=STEPS, root=store.tree().root,
        h_n=store.leaf(STEPS).state_hash, public_key=key.public_key, role="trainer", time=0),
        key))
    store.close()
    return root


@pytest.fixture(scope="session")
def cheater_root(trained, tmp_path_factory) -> Path:
    """The same job trained by a cheating trainer (`swap-examples:CHEAT_STEP`,
    trainer_node.faults): its leaves and root are consistent and validly signed; only a replay
    of step CHEAT_STEP from S_{CHEAT_STEP - 1} shows that it did not train on the committed
    batch. (Other examples change the forward pass, so the recorded log does not fit the honest
    step; other labels change only the loss and the backward, where this tiny job's log may
    fit the honest replay and the state is what differs.)"""
    honest = JobStore(trained.root, trained.spec)
    state0 = honest.checkpoint(0)
    honest.close()
    root = tmp_path_factory.mktemp("cheater")
    store = JobStore(root, trained.spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-2t"),
            hooks=TrainerFaults([Fault("swap-examples", CHEAT_STEP)]))
    store.close()
    return root


class Counting(ClaimsServicer):
    """The trainer's Claims, noting every (call, step) the auditor makes (GetLeaves: one per
    leaf streamed); each GetLog waits `log_delay_s` first (a slow trainer, so an audit can be
    interrupted mid-way)."""

    def __init__(self, stores, log_delay_s: float = 0.0):
        super().__init__(stores)
        self.calls: list[tuple[str, int]] = []
        self.log_delay_s = log_delay_s

    def GetLeaf(self, request, context):
        self.calls.append(("GetLeaf", request.step))
        return super().GetLeaf(request, context)

    def GetLeaves(self, request, context):
        for reply in super().GetLeaves(request, context):
            self.calls.append(("GetLeaves", reply.step))
            yield reply

    def GetLog(self, request, context):
        self.calls.append(("GetLog", request.step))
        time.sleep(self.log_delay_s)
        return super().GetLog(request, context)

    def GetCheckpoint(self, request, context):
        self.calls.append(("GetCheckpoint", request.step))
        yield from super().GetCheckpoint(request, context)

    def steps(self, call: str) -> list[int]:
        return [step for name, step in self.calls if name == call]


def wait_finished(runner, job_id: bytes, timeout_s: float = 60.0):
    """The job's status once its audit has finished, each change awaited at most `timeout_s`."""
    status = runner.get(job_id)
    while not status.finished:
        newer = runner.wait(job_id, status.version, timeout_s)
        assert newer.version > status.version, "no progress within the timeout"
        status = newer
    return status


@contextlib.contextmanager
def serve_claims(servicer: ClaimsServicer):
    """Serve `servicer` on 127.0.0.1 (ephemeral port); yields its address. Stopped on exit,
    cancelling calls still running (a stalled GetLeaf)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ovt_pb2_grpc.add_ClaimsServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None).wait(10)


@pytest.fixture(scope="session")
def trainer_address(trained):
    with serve_claims(ClaimsServicer(StoreDirectory(trained.root))) as address:
        yield address


@pytest.fixture(scope="session")
def liar_address(liar_root):
    with serve_claims(ClaimsServicer(StoreDirectory(liar_root))) as address:
        yield address


@pytest.fixture(scope="session")
def cheater_address(cheater_root):
    with serve_claims(ClaimsServicer(StoreDirectory(cheater_root))) as address:
        yield address


@pytest.fixture
def auditor_key(tmp_path) -> Path:
    path = tmp_path / "auditor.key"
    KeyPair.generate().save(path)
    return path
