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


def test_nan_bits_agree_across_cpu_and_cuda():
    """A GPU writes its own NaN (0x7FFFFFFF) from float arithmetic, conversions and max/min
    where the CPU keeps an operand's: under the mode every rounding, every max/min and the
    exact ops of `interceptor._MACHINE_BITS` write the one NaN on both devices — the same bits
    for sums, products, roots, relu, floor and maximum of NaN-holding tensors."""
    from protocol.engine.interceptor import RoundingMode
    from protocol.engine.rounding import SiteRecorder

    policy = PrecisionPolicy()
    nans = torch.tensor([0x7FC00001, -0x400000, 0x7FC00000], dtype=torch.int32)
    x = torch.cat([nans.view(torch.float32), torch.tensor([-2.0, 0.5, -0.0, 3.0, 1.0])] * 32)

    def program(t):
        rows = t.view(32, 8)
        return [rows.sum(1), t * 0.75, t.sqrt(), t.relu(), t.floor(), torch.maximum(t, -t),
                rows.amax(0), t.log1p()]

    bits = {}
    for device in ("cpu", "cuda"):
        with RoundingMode(policy, SiteRecorder(policy)):
            outs = program(x.to(device))
        bits[device] = [o.cpu().view(torch.int32) for o in outs]
    for cpu, cuda in zip(bits["cpu"], bits["cuda"], strict=True):
        assert torch.equal(cpu, cuda)
