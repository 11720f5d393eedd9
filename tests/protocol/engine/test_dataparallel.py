"""Data-parallel steps (SPEC §3.5, issue 14): a job's micro-batches computed by W processes give
the same log and state bits as one process, and replay bit-exactly at any other world size,
under any profile including the bound adversary; a worker killed mid-step changes nothing.

Every worker is a real process on this machine (gloo over 127.0.0.1); every test stops the
workers it started, by pid, and bounds its time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from protocol.codec.roundinglog import RoundingLog, SiteLog, decode_log
from protocol.codec.state import state_digest
from protocol.engine.dataparallel import Recipe, WorkerGroup
from protocol.engine.executor import Executor
from protocol.engine.replaycheck import SideSpec, run_side, worker_executor
from protocol.errors import ConfigError, LogMismatchError, LogViolationError, ProgramError

MICRO = {"char-transformer": 2, "image-cnn": 4}  # image-cnn: BatchNorm, buffers joined
STEPS = 3
LONG_STEPS = 30


def _side(role: str, program: str, profile: str, workers: int, run_dir: Path, steps: int,
          micro: int | None = None) -> SideSpec:
    return SideSpec(role=role, program=program, preset="test", config={}, seed=0, init_seed=1,
                    steps=steps, policy="float64->float32", profile=profile, mode="ovt",
                    probe_steps=(), run_dir=str(run_dir), micro_batches=micro or MICRO[program],
                    workers=workers)


def _logs(run_dir: Path, steps: int) -> list[bytes]:
    return [(run_dir / "trainer" / "logs" / f"{t:07d}.ovtl").read_bytes()
            for t in range(1, steps + 1)]


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Per program: the trainer run on 1 and on 2 processes (cpu-1t: one thread each)."""
    out = {}
    for program in MICRO:
        for workers in (1, 2):
            run_dir = tmp_path_factory.mktemp(f"{program}-w{workers}")
            result = run_side(_side("trainer", program, "cpu-1t", workers, run_dir, STEPS))
            assert result.error is None, result.error
            out[program, workers] = (run_dir, result)
    return out


@pytest.mark.parametrize("program", sorted(MICRO))
def test_two_processes_record_the_same_logs_and_states_as_one(traces, program):
    one_dir, one = traces[program, 1]
    two_dir, two = traces[program, 2]
    assert one.hashes == two.hashes and len(one.hashes) == STEPS + 1
    assert _logs(one_dir, STEPS) == _logs(two_dir, STEPS)
    assert (one_dir / "trainer" / "final.ovts").read_bytes() == \
        (two_dir / "trainer" / "final.ovts").read_bytes()
    log = decode_log(_logs(two_dir, STEPS)[0])
    assert len(log.parts) == MICRO[program] and sum(log.parts) < len(log.sites)


@pytest.mark.parametrize("program", sorted(MICRO))
@pytest.mark.parametrize("trained, replayed, profile", [
    (2, 1, "emulated-gpu"), (2, 1, "adversary"), (1, 2, "adversary-gpu")])
def test_a_replay_at_another_world_size_is_bit_exact(traces, program, trained, replayed,
                                                     profile):
    run_dir, trainer = traces[program, trained]
    audit = run_side(_side("auditor", program, profile, replayed, run_dir, STEPS))
    assert audit.error is None, audit.error
    assert audit.hashes == trainer.hashes


def test_a_log_whose_parts_are_moved_does_not_replay(traces, tmp_path):
    """The parts are part of the log (ℓ_t): a log with one site moved from micro-batch 0 to 1
    is refused precisely, on one process and on two."""
    run_dir, _ = traces["char-transformer", 1]
    log = decode_log(_logs(run_dir, 1)[0])
    moved = RoundingLog(log.sites, (log.parts[0] - 1, log.parts[1] + 1))
    for workers in (1, 2):
        ex = _executor("char-transformer", tmp_path)
        group = _group("char-transformer", tmp_path) if workers == 2 else None
        try:
            ex.use_workers(group)
            with pytest.raises(LogMismatchError, match="micro-batch 0"):
                ex.step(moved)
        finally:
            if group is not None:
                group.close()


def test_a_log_without_parts_does_not_replay_a_micro_batched_step(traces, tmp_path):
    run_dir, _ = traces["char-transformer", 1]
    log = decode_log(_logs(run_dir, 1)[0])
    ex = _executor("char-transformer", tmp_path)
    with pytest.raises(LogMismatchError, match="micro-batch 0 ended but the rounding log has 0"):
        ex.step(RoundingLog(log.sites))


def _recipe(program: str, run_dir: Path) -> dict:
    """A side's JSON values, as `run_side` gives its workers' recipe."""
    return asdict(_side("trainer", program, "cpu-1t", 1, run_dir, STEPS))


def _group(program: str, run_dir: Path, world: int = 2) -> WorkerGroup:
    group = WorkerGroup(world, Recipe("protocol.engine.replaycheck:worker_executor",
                                      _recipe(program, run_dir)), timeout_s=120)
    group.start()
    return group


def _executor(program: str, run_dir: Path) -> Executor:
    """A trainer's executor at S_0, on one process."""
    ex = worker_executor(_recipe(program, run_dir))
    ex.init_state(1)
    return ex


def _kill_during_steps(program: str, run_dir: Path, steps: int, kills: int,
                       seed: int, world: int = 2) -> list[str]:
    """Train at least `steps` steps on `world` processes while a thread SIGKILLs the first
    worker `kills` times at random moments; returns the state hashes."""
    ex = _executor(program, run_dir)
    group = _group(program, run_dir, world)
    ex.use_workers(group)
    rng = random.Random(seed)
    done, stepped = threading.Event(), threading.Event()
    killed: list[int] = []

    def killer() -> None:
        """Kill the worker at a random moment, then again once a step has completed since."""
        while len(killed) < kills and not done.wait(rng.uniform(0.1, 2.0)):
            pids = group.pids
            if pids:
                try:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
                except ProcessLookupError:
                    continue
                stepped.clear()
                while not (stepped.wait(0.1) or done.is_set()):
                    pass

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    hashes = [state_digest(ex.state()).hex()]
    try:
        while len(hashes) <= steps or len(killed) < kills:
            ex.step()
            hashes.append(state_digest(ex.state()).hex())
            stepped.set()
    finally:
        done.set()
        thread.join(timeout=10)
        group.close()
    assert len(killed) == kills
    return hashes


def _reference(program: str, run_dir: Path, steps: int) -> list[str]:
    ex = _executor(program, run_dir)
    hashes = [state_digest(ex.state()).hex()]
    for _ in range(steps):
        ex.step()
        hashes.append(state_digest(ex.state()).hex())
    return hashes


@pytest.mark.slow  # (16 s; the three-process variant below runs by default)
def test_a_worker_killed_mid_step_changes_no_state(tmp_path):
    hashes = _kill_during_steps("image-cnn", tmp_path, steps=3, kills=2, seed=1)
    assert hashes == _reference("image-cnn", tmp_path, len(hashes) - 1)


def test_a_worker_that_cannot_build_the_job_fails_the_start_with_its_error(tmp_path):
    group = WorkerGroup(2, Recipe("protocol.engine.replaycheck:worker_executor",
                                  {**_recipe("char-transformer", tmp_path),
                                   "program": "no-such-program"}), timeout_s=60)
    start = time.monotonic()
    with pytest.raises(ProgramError, match="unknown program .no-such-program."):
        group.start()
    assert time.monotonic() - start < 60
    assert group.pids == []  # nothing left running


def test_more_processes_than_micro_batches_are_refused(tmp_path):
    ex = _executor("char-transformer", tmp_path)
    with pytest.raises(ConfigError, match=r"process count must lie in 1..2, the job's micro"):
        ex.use_workers(WorkerGroup(3, Recipe("unused:unused", {})))
    assert ex.workers is None


def test_a_violation_in_a_workers_part_is_raised_as_on_one_process(traces, tmp_path):
    """A log entry no honest machine could have made, in micro-batch 1 (a worker's part at
    W = 2), is refused with the same LogViolationError, word for word, at W = 1 and W = 2."""
    run_dir, _ = traces["char-transformer", 1]
    log = decode_log(_logs(run_dir, 1)[0])
    for site in range(log.first_site(1), log.first_site(2)):
        if log.sites[site].indices.size or not log.sites[site].numel:
            continue
        bad = RoundingLog(log.sites[:site] + (SiteLog(log.sites[site].numel, np.array([0]),
                                                      np.array([True])),)
                          + log.sites[site + 1:], log.parts)
        messages = []
        for workers in (1, 2):
            ex = _executor("char-transformer", tmp_path)
            group = _group("char-transformer", tmp_path) if workers == 2 else None
            ex.use_workers(group)
            try:
                ex.step(bad)
            except LogViolationError as err:
                messages.append(str(err))
            finally:
                if group is not None:
                    group.close()
        if messages:  # element 0 of this site was far from a boundary, as it nearly always is
            assert len(messages) == 2 and messages[0] == messages[1]
            assert f"site {site} " in messages[0]
            return
    pytest.fail("no site of micro-batch 1 refused an invented entry")


def _raising_executor(args: dict) -> Executor:
    """A worker's executor whose program raises a plain exception in every micro-batch."""
    ex = worker_executor(args)

    def loss(model, batch):
        raise ValueError("the program's own bug")

    ex.program = dataclasses.replace(ex.program, loss=loss)
    return ex


def test_a_program_error_in_a_worker_is_raised_once_not_retried(tmp_path):
    ex = _executor("char-transformer", tmp_path)
    group = WorkerGroup(2, Recipe(f"{__name__}:_raising_executor",
                                  _recipe("char-transformer", tmp_path)), timeout_s=120)
    group.start()
    pids = group.pids
    ex.use_workers(group)
    try:
        with pytest.raises(ProgramError, match="worker 1 raised ValueError: the program's own bug"):
            ex.step()
        assert group.pids == pids  # no restart: the same error would only come again
    finally:
        group.close()


def test_a_failure_on_rank_0_leaves_no_worker_blocking_the_close(tmp_path, monkeypatch):
    """Rank 0's own part raising while a worker is sending its reply: closing the group does
    not wait on that worker (it is killed, by pid)."""
    ex = _executor("image-cnn", tmp_path)
    group = _group("image-cnn", tmp_path)
    ex.use_workers(group)
    pids = group.pids
    monkeypatch.setattr(ex, "part", lambda *a, **k: (_ for _ in ()).throw(MemoryError("oom")))
    try:
        with pytest.raises(MemoryError):
            ex.step()
    finally:
        start = time.monotonic()
        group.close()
        assert time.monotonic() - start < 15
    assert not any(_alive(pid) for pid in pids)


def test_a_worker_killed_mid_step_at_three_processes_changes_no_state(tmp_path):
    """W = 3: the retry kills the surviving worker too (no stop message that could block on
    it) and the step runs again, promptly."""
    start = time.monotonic()
    hashes = _kill_during_steps("image-cnn", tmp_path, steps=2, kills=1, seed=3, world=3)
    assert time.monotonic() - start < 120
    assert hashes == _reference("image-cnn", tmp_path, len(hashes) - 1)


_RANK0 = """
import json, sys, time
from protocol.engine.dataparallel import Recipe, WorkerGroup
spec = json.loads(sys.argv[1])
group = WorkerGroup(2, Recipe("protocol.engine.replaycheck:worker_executor", spec), timeout_s=60)
group.start()
print(group.pids[0], flush=True)
time.sleep(120)
"""


def test_workers_exit_when_rank_0_is_killed(tmp_path):
    rank0 = subprocess.Popen([sys.executable, "-c", _RANK0,
                              json.dumps(_recipe("char-transformer", tmp_path))],
                             stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        line = rank0.stdout.readline() if rank0.stdout else ""
        worker = int(line)
        rank0.kill()
        rank0.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(worker):
            time.sleep(0.1)
        assert not _alive(worker), "the worker outlived its rank 0"
    finally:
        rank0.kill()
        rank0.wait(timeout=10)
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, which only waits for its parent to reap it, does not)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return status != "Z"


def test_the_wire_keeps_every_dtype_and_shape():
    from protocol.engine.dataparallel import _recv, _send

    tensors = {"f": torch.randn(3, 5), "d": torch.randn(2, dtype=torch.float64),
               "b": torch.tensor([True, False, True]), "h": torch.randn(7).to(torch.bfloat16),
               "i": torch.arange(5), "s": torch.tensor(2.5), "e": torch.zeros(0, 4)}

    class Loop:  # a one-process stand-in for a gloo pair: what is sent comes back
        def __init__(self) -> None:
            self.queue: list[torch.Tensor] = []

        def send(self, ts, peer, tag):
            self.queue.append(ts[0].clone())
            return self

        def recv(self, ts, peer, tag):
            ts[0].copy_(self.queue.pop(0))
            return self

        def wait(self, timeout):
            return True

    loop = Loop()
    sent = _send(loop, 1, {"k": 1}, tensors, 10)
    header, back, received = _recv(loop, 1, 10)
    assert header == {"k": 1} and sent == received
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t)


@pytest.mark.slow  # ~4 min on 2 cores
@pytest.mark.parametrize("program", sorted(MICRO))
def test_thirty_steps_on_two_processes_equal_one_and_replay_everywhere(tmp_path, program):
    """Issue 14's bar: 30 steps, W=2 and W=1 identical; W=2 <-> W'=1 replays bit-exact under
    emulated-gpu and the adversary, in both directions."""
    results = {}
    for workers in (1, 2):
        run_dir = tmp_path / f"w{workers}"
        results[workers] = run_side(_side("trainer", program, "cpu-1t", workers, run_dir,
                                          LONG_STEPS))
        assert results[workers].error is None
    assert results[1].hashes == results[2].hashes
    assert _logs(tmp_path / "w1", LONG_STEPS) == _logs(tmp_path / "w2", LONG_STEPS)
    for trained, replayed in ((2, 1), (1, 2)):
        for profile in ("emulated-gpu", "adversary"):
            audit = run_side(_side("auditor", program, profile, replayed,
                                   tmp_path / f"w{trained}", LONG_STEPS))
            assert audit.error is None and audit.hashes == results[trained].hashes


@pytest.mark.slow  # ~2 min on 2 cores: 4 processes on 2 cores
def test_four_processes_equal_one(tmp_path):
    results = [run_side(_side("trainer", "image-cnn", "cpu-1t", w, tmp_path / f"w{w}", 10))
               for w in (1, 4)]
    assert results[0].error is None and results[1].error is None
    assert results[0].hashes == results[1].hashes
    assert _logs(tmp_path / "w1", 10) == _logs(tmp_path / "w4", 10)


@pytest.mark.slow  # ~2 min on 2 cores: ten restarts of the worker
def test_ten_kills_at_random_moments_change_no_state(tmp_path):
    hashes = _kill_during_steps("char-transformer", tmp_path, steps=12, kills=10, seed=7)
    assert hashes == _reference("char-transformer", tmp_path, len(hashes) - 1)
