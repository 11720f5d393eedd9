"""protocol.engine.executor: portable dropout, state round trips, replay on another policy/profile.

The built-in programs run with reduced configs (a few thousand parameters) so that the whole file
stays within a few seconds; the full-size replay checks live in test_replay_exact.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protocol.codec.state import state_digest, states_equal
from protocol.engine.executor import Executor, pinned_backends
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import PRESETS
from protocol.engine.programs.registry import load_program
from protocol.engine.random_ops import PortableRandomFunctions, StepRandomness
from protocol.errors import ConfigError

SMALL = {
    "image-cnn": {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64},
    "char-transformer": {"d_model": 16, "n_heads": 2, "n_layers": 1, "seq_len": 8,
                         "batch_size": 4, "corpus_chars": 2000},
}
F64_F32 = PrecisionPolicy()
F32_BF16 = PrecisionPolicy(torch.float32, torch.bfloat16)


def executor(name: str, profile: str = "cpu-2t", policy: PrecisionPolicy = F64_F32,
             mode: str = "ovt", seed: int = 0) -> Executor:
    return Executor(load_program(name, SMALL[name]), seed=seed, policy=policy,
                    profile=PRESETS[profile], mode=mode)


# -- portable dropout ---------------------------------------------------------------------------


def _masks(seed: int, step: int, threads: int, calls: int = 2) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        drop = nn.Dropout(0.25)
        with PortableRandomFunctions(StepRandomness(seed, step)):
            return [drop(torch.ones(64, 33)) for _ in range(calls)]
    finally:
        torch.set_num_threads(before)


def test_dropout_masks_are_portable():
    one = _masks(3, 2, threads=1)
    two = _masks(3, 2, threads=2)
    again = _masks(3, 2, threads=1)
    for a, b, c in zip(one, two, again, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(one[0], one[1])  # each call draws its own mask
    assert not torch.equal(one[0], _masks(3, 3, threads=1)[0])  # another step
    assert not torch.equal(one[0], _masks(4, 2, threads=1)[0])  # another seed
    kept = one[0] != 0
    assert 0.65 < kept.float().mean().item() < 0.85
    assert torch.equal(one[0][kept], torch.full((int(kept.sum()),), 1.0) * (1.0 / 0.75))


def test_dropout_edge_cases():
    x = torch.randn(10, 10)
    with PortableRandomFunctions(StepRandomness(0, 1)):
        assert F.dropout(x, 0.5, training=False) is x
        assert F.dropout(x, 0.0) is x
        assert torch.equal(F.dropout(x, 1.0), torch.zeros_like(x))
        y = x.clone()
        out = F.dropout(y, 0.5, inplace=True)
        assert out is y and (y == 0).any() and not torch.equal(y, x)
        with pytest.raises(ConfigError, match="dropout probability"):
            F.dropout(x, 1.5)


# -- state round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SMALL))
def test_state_round_trip_includes_optimizer_state(name):
    a = executor(name)
    a.init_state(1)
    for _ in range(2):
        a.step()
    state = a.state()
    assert int(state["step"]) == 2
    optim_keys = {k.rpartition(".")[2] for k in state if k.startswith("optim.")}
    assert optim_keys == ({"momentum_buffer"} if name == "image-cnn" else
                          {"exp_avg", "exp_avg_sq", "step"})

    b = executor(name)
    b.load_state(state)
    assert state_digest(b.state()) == state_digest(state)
    assert states_equal(b.state(), state)
    # the next step from the loaded state is the same step
    la, lb = a.step(), b.step()
    assert la.loss == lb.loss
    assert state_digest(a.state()) == state_digest(b.state())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SMALL))
def test_state_round_trip_with_the_default_config(name):
    """The same round trip at the programs' default ("test" preset) sizes."""
    a = Executor(load_program(name), seed=0, policy=F64_F32, profile=PRESETS["cpu-2t"])
    a.init_state(1)
    for _ in range(2):
        a.step()
    state = a.state()
    assert any(k.startswith("optim.") for k in state)
    b = Executor(load_program(name), seed=0, policy=F64_F32, profile=PRESETS["cpu-2t"])
    b.load_state(state)
    assert state_digest(b.state()) == state_digest(state)
    assert states_equal(b.state(), state)


def test_state_is_a_detached_copy():
    ex = executor("image-cnn")
    ex.init_state(1)
    state = ex.state()
    digest = state_digest(state)
    ex.step()
    assert state_digest(state) == digest != state_digest(ex.state())


def test_load_state_of_another_program():
    cnn, lm = executor("image-cnn"), executor("char-transformer")
    lm.init_state(1)
    with pytest.raises(ConfigError, match="does not fit the program's model"):
        cnn.load_state(lm.state())


def test_load_state_with_stray_optimizer_entry():
    ex = executor("image-cnn")
    ex.init_state(1)
    state = ex.state()
    state["optim.no.such.param.momentum_buffer"] = torch.zeros(3)
    with pytest.raises(ConfigError, match="names no parameter"):
        ex.load_state(state)


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("step"), "step counter 'step' must be one int64, it has none"),
    (lambda s: s.update(step=torch.tensor([2, 2])), r"one int64, it has torch.int64 \(2,\)"),
    (lambda s: s.update(step=torch.tensor(2.0)), r"one int64, it has torch.float32 \(\)"),
    (lambda s: s.update(step=torch.tensor(-1)), "holds step counter -1, not a step"),
    (lambda s: s.update({k: v.double() for k, v in s.items() if k.endswith("momentum_buffer")}),
     "momentum_buffer' is torch.float64 .*, its parameter torch.float32"),
], ids=["no-step", "step-vector", "step-float", "step-negative", "optim-dtype"])
def test_a_state_that_does_not_fit_is_a_config_error(change, message):
    """A peer's state is whatever it made up to hash to its signed h_t: every way it may not
    fit the program is the one ConfigError (a missing counter was a bare KeyError)."""
    ex = executor("image-cnn")
    ex.init_state(1)
    ex.step()
    state = ex.state()
    change(state)
    with pytest.raises(ConfigError, match=message):
        executor("image-cnn").load_state(state)



def _first(state, suffix: str) -> str:
    return next(k for k in sorted(state) if k.startswith("optim.") and k.endswith(suffix))


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update({_first(s, ".step"): s[_first(s, ".step")].long()}),
     r"\.step' is torch.int64 \(\), a step counter torch.optim keeps as torch.float32 \(\)$"),
    (lambda s: s.update({_first(s, ".step"): s[_first(s, ".step")].double()}),
     r"\.step' is torch.float64 \(\), a step counter torch.optim keeps as torch.float32"),
    (lambda s: s.update({_first(s, ".step"): s[_first(s, ".step")].reshape(1)}),
     r"\.step' is torch.float32 \(1,\), a step counter torch.optim keeps as torch.float32"),
    (lambda s: s.update({_first(s, ".exp_avg"): s[_first(s, ".exp_avg")].flatten()[0]}),
     r"\.exp_avg' is torch.float32 \(\), its parameter torch.float32 \(16,\)$"),
], ids=["step-int64", "step-float64", "step-vector", "buffer-scalar"])
def test_an_adam_state_whose_scalars_do_not_fit_is_a_config_error(change, message):
    """Review 30, finding A: a 0-dim optimizer value was taken unchecked, a step counter of
    any dtype kept as it was and any other broadcast into its parameter's shape (the state
    loaded was not the one hashed). torch.optim keeps the counters as float32 CPU scalars and
    every other value like its parameter."""
    ex = executor("char-transformer")  # AdamW: exp_avg, exp_avg_sq and a step per parameter
    ex.init_state(1)
    ex.step()
    state = ex.state()
    executor("char-transformer").load_state(state)  # as it was made: it fits
    change(state)
    with pytest.raises(ConfigError, match=message):
        executor("char-transformer").load_state(state)

def test_load_state_takes_the_step_counter_it_is_told():
    ex = executor("image-cnn")
    ex.init_state(1)
    ex.step()
    state = ex.state()
    loaded = executor("image-cnn")
    loaded.load_state(state, step=1)
    assert loaded.step_count == 1
    with pytest.raises(ConfigError, match="holds step counter 1, not 2"):
        loaded.load_state(state, step=2)


def test_init_state_resets_the_optimizer():
    ex = executor("image-cnn")
    ex.init_state(1)
    s0 = ex.state()
    ex.step()
    ex.init_state(1)
    assert states_equal(ex.state(), s0)


# -- replay -------------------------------------------------------------------------------------


def test_bf16_replay_between_profiles():
    """float32 -> bfloat16 (SPEC §3.1): trainer on cpu-2t, auditor on emulated-gpu, 5 steps."""
    policy = F32_BF16
    trainer = executor("image-cnn", "cpu-2t", policy)
    trainer.init_state(1)
    auditor = executor("image-cnn", "emulated-gpu", policy)
    auditor.load_state(trainer.state())
    assert all(t.dtype == policy.target for t in trainer.state().values()
               if t.is_floating_point())
    entries = 0
    for t in range(1, 6):
        recorded = trainer.step()
        replayed = auditor.step(recorded.log)
        assert recorded.step == replayed.step == t and replayed.log is None
        assert state_digest(trainer.state()) == state_digest(auditor.state()), f"step {t}"
        entries += recorded.log.n_entries
    assert entries > 0


def test_plain_modes():
    plain = executor("image-cnn", mode="plain")
    plain.init_state(1)
    assert plain.step().log is None
    wide = executor("image-cnn", mode="plain64")
    wide.init_state(1)
    for _ in range(2):
        result = wide.step()
        assert result.log is None and math.isfinite(result.loss)
    floats = [t for t in wide.state().values() if t.is_floating_point()]
    assert floats and all(t.dtype == torch.float64 for t in floats)
    assert int(wide.state()["step"]) == 2


def test_unknown_mode():
    with pytest.raises(ConfigError, match="unknown mode 'fast'"):
        executor("image-cnn", mode="fast")


def test_pinned_backends_restores_the_switches():
    matmul = torch.backends.cuda.matmul
    saved = matmul.allow_tf32
    try:
        matmul.allow_tf32 = True
        with pinned_backends():
            assert matmul.allow_tf32 is False
            assert torch.backends.cudnn.enabled is False
        assert matmul.allow_tf32 is True
        assert torch.backends.cudnn.enabled is True
    finally:
        matmul.allow_tf32 = saved
