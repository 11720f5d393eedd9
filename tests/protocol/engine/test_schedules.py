"""Learning-rate schedules, gradient clipping and micro-batches as part of the step (SPEC §3.5).

Exactness is tested as exactness: states compared by their hash, learning rates bit for bit.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import struct

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler

from protocol.codec.state import state_digest
from protocol.engine.executor import SCHEDULE_KEY, Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import PRESETS
from protocol.engine.programs.registry import load_program
from protocol.engine.random_ops import StepRandomness
from protocol.engine.schedules import (
    SCHEDULERS,
    advance,
    learning_rates,
    make_scheduler,
    portable_cos,
    warmup_cosine,
)
from protocol.errors import ConfigError

POLICY = PrecisionPolicy()
STEPS = 6


def bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


# -- portable cos ------------------------------------------------------------------------------

def test_portable_cos_is_within_two_ulps_of_the_c_library():
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.uniform(-60, 60, 20_000),
                         math.pi * rng.integers(0, 10_000, 20_000) / rng.integers(1, 10_000,
                                                                                  20_000)])
    for x in xs.tolist():
        c, ref = portable_cos(x), math.cos(x)
        assert abs(c - ref) <= 2 * math.ulp(max(abs(ref), 2.0**-10)), x


def test_portable_cos_bits_are_pinned():
    """Its bits are a function of IEEE arithmetic only: pinned here, so a change to the
    algorithm (which would change every scheduled job's rates) cannot pass unnoticed."""
    assert portable_cos(0.0) == 1.0 and portable_cos(math.pi) == -1.0
    assert bits(portable_cos(1.0)) == bits(0.5403023058681398)
    assert bits(portable_cos(math.pi / 3)) == bits(0.5000000000000001)
    assert bits(portable_cos(2.5)) == bits(-0.8011436155469337)


def test_portable_cos_refuses_non_finite_values():
    with pytest.raises(Exception, match="non-finite"):
        portable_cos(math.inf)


def test_torch_schedulers_use_no_other_c_library_function():
    """The portable `math` stands in for `cos` only (and refuses `log`, reached only through
    an explicit epoch); a torch release whose schedulers call more must fail here."""
    source = inspect.getsource(lr_scheduler)
    assert set(re.findall(r"math\.(\w+)", source)) <= {"cos", "pi", "floor", "log", "inf"}


# -- which schedulers ---------------------------------------------------------------------------

def program(**changes):
    base = load_program("char-transformer", {"dropout": 0.0}, preset="test")
    return dataclasses.replace(base, **changes)


def executor(prog, profile="cpu-2t", micro_batches=1, mode="ovt"):
    return Executor(prog, seed=0, policy=POLICY, profile=PRESETS[profile],
                    micro_batches=micro_batches, mode=mode)


@pytest.mark.parametrize("factory", [
    lambda o: lr_scheduler.MultiStepLR(o, milestones=[2]),
    lambda o: lr_scheduler.PolynomialLR(o, total_iters=4, power=2.0),
    lambda o: lr_scheduler.SequentialLR(o, [lr_scheduler.LinearLR(o, total_iters=2),
                                            lr_scheduler.MultiStepLR(o, milestones=[2])],
                                        milestones=[2]),
], ids=["multistep", "polynomial", "sequential-with-multistep"])
def test_schedulers_that_need_pow_are_refused(factory):
    with pytest.raises(ConfigError, match="not supported"):
        executor(program(make_scheduler=factory))


def test_every_accepted_scheduler_builds_under_the_portable_math():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    made = make_scheduler(lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=10),
                          opt)
    assert isinstance(made, SCHEDULERS)


# -- record and replay, bit for bit -------------------------------------------------------------

SCHEDULES = {
    "warmup-cosine": warmup_cosine(2, 3, 1e-4),
    "linear+cosine": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=2),
            lr_scheduler.CosineAnnealingLR(o, T_max=3, eta_min=1e-5)], milestones=[2]),
    "one-cycle": lambda o: lr_scheduler.OneCycleLR(o, max_lr=3e-3, total_steps=STEPS + 1),
    "lambda": lambda o: lr_scheduler.LambdaLR(o, lambda t: 1.0 / (1 + t)),
}


def record(prog, micro_batches=1, profile="cpu-2t"):
    ex = executor(prog, profile, micro_batches)
    ex.init_state(1)
    state0 = ex.state()
    logs, hashes, rates = [], [], []
    for _ in range(STEPS):
        logs.append(ex.step().log)
        hashes.append(state_digest(ex.state()))
        rates.append(ex.state().get(SCHEDULE_KEY))
    return state0, logs, hashes, rates


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_schedule_replays_bit_exactly_and_its_rates_are_in_the_state(name):
    prog = program(make_scheduler=SCHEDULES[name])
    state0, logs, hashes, rates = record(prog)
    assert len({r.numpy().tobytes() for r in rates}) > 1  # the rate did change
    replay = executor(prog, "emulated-gpu")
    replay.load_state(state0)
    for t in range(STEPS):
        replay.step(logs[t])
        assert state_digest(replay.state()) == hashes[t], (name, t + 1)
        assert torch.equal(replay.state()[SCHEDULE_KEY], rates[t])


def test_loading_a_mid_run_state_fast_forwards_the_schedule():
    prog = program(make_scheduler=SCHEDULES["linear+cosine"])
    state0, logs, hashes, _ = record(prog)
    first = executor(prog, "cpu-1t")
    first.load_state(state0)
    for t in range(3):
        first.step(logs[t])
    resumed = executor(prog, "adversary")
    resumed.load_state(first.state())
    for t in range(3, STEPS):
        resumed.step(logs[t])
        assert state_digest(resumed.state()) == hashes[t]


def test_a_state_whose_rates_are_not_the_schedules_is_refused():
    prog = program(make_scheduler=SCHEDULES["warmup-cosine"])
    ex = executor(prog)
    ex.init_state(1)
    ex.step()
    state = ex.state()
    forged = dict(state)
    forged[SCHEDULE_KEY] = state[SCHEDULE_KEY] * 2
    with pytest.raises(ConfigError, match="not the schedule's at step 1"):
        executor(prog).load_state(forged)
    without = {k: v for k, v in state.items() if k != SCHEDULE_KEY}
    with pytest.raises(ConfigError, match="has no learning rates"):
        executor(prog).load_state(without)
    with pytest.raises(ConfigError, match="has learning rates"):
        executor(program()).load_state(state)
    with pytest.raises(ConfigError, match="unexpected"):
        executor(prog).load_state({**state, "extra.thing": torch.zeros(1)})


def test_a_peers_state_is_refused_before_its_schedule_is_stepped_to_it(monkeypatch):
    """A made-up S_c may claim step 2**62: with the step it must be (a replay's c), it is
    refused before the schedule is advanced that many times; rates of another shape are
    refused without printing them."""
    prog = program(make_scheduler=SCHEDULES["warmup-cosine"])
    ex = executor(prog)
    ex.init_state(1)
    ex.step()
    state = ex.state()
    forged = {**state, "step": torch.tensor(2**62)}
    loaded = executor(prog)
    monkeypatch.setattr("protocol.engine.executor.advance", lambda *a: pytest.fail("stepped"))
    with pytest.raises(ConfigError, match=f"holds step counter {2**62}, not 1"):
        loaded.load_state(forged, step=1)
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"rates are torch.float64 \(1000000,\), the "):
        loaded.load_state({**state, SCHEDULE_KEY: torch.zeros(10**6, dtype=torch.float64)})


def test_the_rates_follow_the_documented_warmup_and_cosine():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(warmup_cosine(3, 4, 0.1), opt)
    got = [learning_rates(opt).item()]
    for _ in range(9):
        advance(sched)
        got.append(learning_rates(opt).item())
    assert got[:4] == [0.25, 0.5, 0.75, 1.0]
    assert got[4] == 0.1 + 0.9 * (1 + portable_cos(math.pi / 4)) / 2
    assert got[7:] == [0.1, 0.1, 0.1]


# -- clipping -----------------------------------------------------------------------------------

def test_clipping_bounds_the_update_and_replays_bit_exactly():
    clipped = program(clip_grad_norm=0.05)
    state0, logs, hashes, _ = _record_plain(clipped)
    unclipped = _record_plain(program())[2]
    assert hashes[0] != unclipped[0]  # the clip did act
    replay = executor(clipped, "splitk-8")
    replay.load_state(state0)
    for t in range(STEPS):
        replay.step(logs[t])
        assert state_digest(replay.state()) == hashes[t]


def _record_plain(prog):
    ex = executor(prog)
    ex.init_state(1)
    state0 = ex.state()
    logs, hashes = [], []
    for _ in range(STEPS):
        logs.append(ex.step().log)
        hashes.append(state_digest(ex.state()))
    return state0, logs, hashes, None


def test_clipped_gradients_have_at_most_the_norm_in_plain64():
    ex = executor(program(clip_grad_norm=0.05), mode="plain64")
    ex.init_state(1)
    ex.optimizer.step = lambda: None  # keep the clipped gradients to look at them
    ex.step()
    norm = torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(p.grad) for p in ex.model.parameters()]))
    assert float(norm) <= 0.05 * (1 + 1e-9)


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, 1])
def test_a_bad_clip_value_is_refused(value):
    with pytest.raises(ConfigError, match="clip_grad_norm"):
        executor(program(clip_grad_norm=value))


# -- micro-batches ------------------------------------------------------------------------------

def test_micro_batch_gradients_are_the_sum_of_the_parts():
    """k = 2 in plain64: each gradient is exactly g(first half)/2 + g(second half)/2."""
    prog = program()
    ex = executor(prog, mode="plain64", micro_batches=2)
    ex.init_state(1)
    ex.optimizer.step = lambda: None
    batch = ex.batch(1)
    ex.step()
    got = [p.grad.clone() for p in ex.model.parameters()]
    halves = []
    for part in (slice(0, 4), slice(4, 8)):
        ex.optimizer.zero_grad(set_to_none=True)
        (prog.loss(ex.model, {k: v[part] for k, v in batch.items()}) / 2).backward()
        halves.append([p.grad.clone() for p in ex.model.parameters()])
    for g, a, b in zip(got, *halves, strict=True):
        assert torch.equal(g, a + b)


@pytest.mark.parametrize("k", [2, 4])
def test_micro_batches_replay_bit_exactly_across_profiles(k):
    prog = program(make_scheduler=SCHEDULES["warmup-cosine"], clip_grad_norm=0.5)
    state0, logs, hashes, _ = record(prog, micro_batches=k)
    for profile in ("emulated-gpu", "adversary"):
        replay = executor(prog, profile, micro_batches=k)
        replay.load_state(state0)
        for t in range(STEPS):
            replay.step(logs[t])
            assert state_digest(replay.state()) == hashes[t], (profile, t + 1)


def test_micro_batches_change_the_step_and_log_little():
    """k = 2 is another step than k = 1 (the gradient is a sum of two parts) and, thanks to
    exact short sums (bound rule `sum`), logs about as few entries."""
    whole = record(program())
    parts = record(program(), micro_batches=2)
    assert whole[2][0] != parts[2][0]
    entries = [sum(log.n_directions + log.n_values for log in run[1]) for run in (whole, parts)]
    assert entries[1] < 3 * entries[0], entries


def test_a_batch_that_does_not_split_is_refused():
    with pytest.raises(ConfigError, match="does not split into 3 equal micro-batches"):
        executor(program(), micro_batches=3)


def test_each_micro_batch_draws_from_its_own_streams():
    """Part i's dropout masks do not depend on the parts before it (SPEC §3.5: the part is the
    unit a trainer may compute anywhere): with dropout on, part 1 of a 2-part step draws the
    masks of micro-batch 1's streams whatever part 0 drew."""
    first, second = StepRandomness(0, 1), StepRandomness(0, 1)
    first.begin_micro_batch(1)
    second.next_stream()  # part 0 drew once more
    second.next_stream()
    second.begin_micro_batch(1)
    assert np.array_equal(first.next_stream().words(8), second.next_stream().words(8))
    other = StepRandomness(0, 1)
    assert not np.array_equal(other.next_stream().words(8), first.next_stream().words(8))
