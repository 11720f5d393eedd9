"""FAULT INJECTION, for tests and demos only: the vocabulary of faults both daemons share.

A fault is `KIND:STEP`. The trainer's kinds are made real by `trainer_node.faults` (training
faults through `protocol.job.run.StepHooks`, serving faults in the Claims service), the lying
auditor's by `auditor_node.faults`; each kind is described there. An honest party never parses
a fault.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch

from protocol.errors import ConfigError

TRAINING_KINDS = ("relabel", "swap-examples", "skip-step", "lr", "skip-warmup",
                  "swap-checkpoint", "log-flip", "log-invent", "log-drop")
SERVING_KINDS = ("forge-leaf", "stall")
KINDS = TRAINING_KINDS + SERVING_KINDS  # a trainer's faults
AUDITOR_KINDS = ("false-challenge",)  # a lying auditor's (auditor_node.faults)
ALL_KINDS = KINDS + AUDITOR_KINDS


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault: `kind` at step `step` (>= 1; a serving fault may name leaf 0)."""

    kind: str
    step: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.step}"


def parse_fault(text: str, kinds: Iterable[str] = ALL_KINDS) -> Fault:
    """Parse "KIND:STEP" (e.g. "relabel:5") with KIND one of `kinds` (default: any trainer or
    auditor fault). Raises ConfigError naming the allowed kinds."""
    kinds = tuple(kinds)
    kind, sep, step = text.strip().partition(":")
    if not sep or kind not in kinds:
        raise ConfigError(f"bad fault {text!r}: expected KIND:STEP with KIND one of "
                          f"{', '.join(kinds)}")
    try:
        value = int(step)
    except ValueError:
        value = 0
    minimum = 0 if kind in SERVING_KINDS else 1  # leaf 0 is a bisection query too
    if value < minimum or not step.isdigit():
        raise ConfigError(f"bad fault {text!r}: STEP must be a step number >= {minimum}")
    return Fault(kind, value)


def one_ulp_off(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of `state` with element 0 of its first floating model tensor moved one ULP up.

    The smallest change a state can have: its hash differs, nothing else visibly does.
    """
    out = dict(state)
    name = next((k for k, v in state.items() if k.startswith("model.") and
                 v.is_floating_point() and v.numel()), None)
    if name is None:
        raise ConfigError("the state has no floating model tensor to perturb")
    flat = state[name].reshape(-1).clone()
    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))
    out[name] = flat.reshape(state[name].shape)
    return out
