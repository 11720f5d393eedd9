"""CPU-recorded training replays bit-exactly on a CUDA device, and vice versa (SPEC §3, §5.3:
the arbiter re-executes on a GPU where one exists). Skipped where no CUDA device is present."""

from __future__ import annotations

import pytest
import torch

from protocol.codec.state import state_digest
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
STEPS = 20


@pytest.mark.parametrize("program", ["image-cnn", "char-transformer"])
@pytest.mark.parametrize("trainer,auditor", [("cpu-2t", "cuda"), ("cuda", "cpu-2t")])
def test_replay_across_cpu_and_cuda_is_bit_exact(program, trainer, auditor):
    policy = PrecisionPolicy()
    rec = Executor(load_program(program), seed=0, policy=policy, profile=Profile.parse(trainer))
    rec.init_state(1)
    rep = Executor(load_program(program), seed=0, policy=policy, profile=Profile.parse(auditor))
    rep.load_state(rec.state())
    for t in range(1, STEPS + 1):
        log = rec.step().log
        rep.step(log)
        assert state_digest(rep.state()) == state_digest(rec.state()), f"diverged at step {t}"


@pytest.mark.parametrize("program", ["image-cnn", "char-transformer"])
def test_plain_float32_diverges_between_cpu_and_cuda(program):
    policy = PrecisionPolicy()
    runs = []
    for profile in ("cpu-2t", "cuda"):
        ex = Executor(load_program(program), seed=0, policy=policy,
                      profile=Profile.parse(profile), mode="plain")
        ex.init_state(1)
        runs.append([state_digest((ex.step(), ex.state())[1]) for _ in range(STEPS)])
    assert runs[0] != runs[1]
