"""Measuring hardware divergence per op class, to set tau from data (SPEC §3.1, §6).

The paper's adaptive thresholding: before trusting a threshold, look at how far two machines'
compute-dtype results actually drift apart. The trainer captures every site's exact (pre-rounding)
values for a step; the auditor replays that step with the trainer's log, so each of its sites
sees bit-identical inputs, and compares its own pre-rounding values element by element. The
difference, in target ULPs, is pure hardware divergence; its maximum per op must stay below tau
(an element farther than tau from a boundary must round the same way on both machines) with a
margin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from protocol.codec.roundinglog import RoundingLog
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.rounding import SiteRecorder, SiteReplayer

_MANTISSA_BITS = {torch.float32: 23, torch.bfloat16: 7}


def target_ulp(y: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """The target-dtype ULP at each value of `y` (compute dtype), subnormal ULP for tiny ones."""
    _, exponent = torch.frexp(y)  # y = m * 2**e, 0.5 <= |m| < 1
    exp = (exponent - (_MANTISSA_BITS[policy.target] + 1)).clamp_min(
        policy.fmt["subnormal_ulp_exp"])
    return torch.ldexp(torch.ones_like(y), exp)


class CapturingRecorder(SiteRecorder):
    """Record mode that also keeps every site's compute-dtype values (for one probed step)."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        super().__init__(policy)
        self.captured: list[torch.Tensor] = []

    def round_site(self, op, ys, ieee=False):
        self.captured.append(_concat(ys))
        return super().round_site(op, ys, ieee)

    def reference(self) -> dict[str, torch.Tensor]:
        """The captured values, named by site number (sortable, for the state codec)."""
        return {f"site{k:07d}": v for k, v in enumerate(self.captured)}


@dataclass
class OpDivergence:
    """What one op class showed: sites, elements, how many differed, the worst, in ULPs."""

    ieee: bool
    sites: int = 0
    elements: int = 0
    differing: int = 0
    max_ulps: float = 0.0


@dataclass
class DivergenceReport:
    ops: dict[str, OpDivergence] = field(default_factory=dict)

    def worst(self, ieee: bool) -> float:
        return max((o.max_ulps for o in self.ops.values() if o.ieee == ieee), default=0.0)

    def as_json(self) -> dict:
        return {op: vars(o) for op, o in sorted(self.ops.items())}


class ComparingReplayer(SiteReplayer):
    """Replay mode that compares each site's compute-dtype values with the trainer's."""

    def __init__(self, policy: PrecisionPolicy, log: RoundingLog, reference: dict, step: int,
                 report: DivergenceReport) -> None:
        super().__init__(policy, log, step)
        self.reference, self.report = reference, report

    def round_site(self, op, ys, ieee=False):
        k = self.position
        mine = _concat(ys)
        theirs = self.reference.get(f"site{k:07d}")
        entry = self.report.ops.setdefault(op, OpDivergence(ieee))
        entry.sites += 1
        if theirs is not None and theirs.shape == mine.shape:
            both = torch.isfinite(mine) & torch.isfinite(theirs)
            diff = torch.where(both, (mine - theirs).abs() / target_ulp(theirs, self.policy), 0.0)
            entry.elements += mine.numel()
            entry.differing += int((diff > 0).sum())
            if diff.numel():
                entry.max_ulps = max(entry.max_ulps, float(diff.max()))
        return super().round_site(op, ys, ieee)


def _concat(ys: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([y.detach().reshape(-1).cpu() for y in ys]) if ys else torch.zeros(0)
