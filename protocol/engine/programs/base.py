"""What a training program is: the contract between user code and the step executor.

A program turns a config mapping into a `TrainingProgram`: an unmodified `torch.nn.Module`, a
factory for a standard `torch.optim` optimizer, a loss function and a dataset of examples. The
executor owns everything that must be deterministic (rounding, randomness, batch order, state
hashing); the program only says *what* to train.

Rules a program must follow (SPEC §3.4, §3.5):
- randomness inside `loss` only through what the executor serves from the portable generator
  (`protocol.engine.random_ops`): the dropouts, SDPA's dropout_p, torch.rand / randn / randint /
  randperm / bernoulli / normal / uniform_ and their kin; other RNG ops are refused;
- the model's initial parameters come from `init(model, seed)`, which uses `protocol.engine.rng`
  only, never torch's default initialisers (their bits depend on the CPU instruction set);
- examples are CPU tensors; the executor moves batches to the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from protocol.commit.data import ExampleSource
from protocol.engine.schedules import SchedulerFactory


@dataclass(frozen=True)
class TrainingProgram:
    """Everything the executor needs to run `step(S_{t-1}, B_t)` for one program and config.

    model: float32 module on the CPU; the executor moves it and casts it per the policy.
    make_optimizer: builds a torch.optim optimizer from `model.named_parameters()` order.
    loss: `loss(model, batch) -> scalar tensor`; batch maps example field name to a stacked
        tensor of shape (batch_size, ...).
    init: `init(model, seed)` sets every parameter and buffer from the portable generator.
    config: the normalised config (plain JSON-able values) that built this program.
    make_scheduler: optional; builds a `torch.optim.lr_scheduler` scheduler on the optimizer,
        stepped once per step after the update (`protocol.engine.schedules` says which).
    clip_grad_norm: optional; the gradients' global 2-norm is clipped to it between backward
        and update (`torch.nn.utils.clip_grad_norm_`, rounded like every other op).
    vocab_size: optional; for a program whose examples hold token ids ("tokens"), how many
        ids its embedding takes: a token data file with a larger id is refused up front (an id
        out of range would fail inside the step, on CUDA as a device-side assert).
    """

    name: str
    model: torch.nn.Module
    make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    loss: Callable[[torch.nn.Module, dict[str, torch.Tensor]], torch.Tensor]
    dataset: ExampleSource
    batch_size: int
    init: Callable[[torch.nn.Module, int], None]
    config: Mapping[str, Any]
    make_scheduler: SchedulerFactory | None = None
    clip_grad_norm: float | None = None
    vocab_size: int | None = None


ProgramFactory = Callable[[Mapping[str, Any]], TrainingProgram]
