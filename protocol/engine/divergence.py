"""Measuring hardware divergence per op against its certified bound (SPEC §3.2, §6).

Before trusting the bound rules on a machine, look at how far two machines' compute-dtype results
actually drift apart. The trainer captures every site's exact (pre-rounding) values for a step,
streaming them to a file so that a step of any size fits in memory; the auditor replays that
step with the trainer's log, so each of its sites sees bit-identical inputs, and compares its
own pre-rounding values element by element. The difference is pure hardware divergence; as a
fraction of the element's bound `e` it must stay at most 1 on conforming hardware (each side is
within `e / 2` of the exact result), and the band absorbs anything up to 2. An element with
bound 0 must round to the same target value on both: add, subtract and multiply give the same
compute-dtype bits, a square root or a quotient of target values may differ in its last
compute-dtype bits but never in its rounding (`bounds.SQRT_MARGIN_ULPS`,
`bounds.QUOTIENT_MARGIN_ULPS`). Their divergence is measured against their documented error
where that is more than their bound (`bounds.conforming_bounds`): e = 0, or a floor beside a
small quotient, says nothing of how far two machines' roots and quotients may drift.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from protocol.codec.dtypes import DTYPES, dtype_name
from protocol.codec.roundinglog import RoundingLog
from protocol.engine.bandpass import dense_bounds
from protocol.engine.bounds import Bound, BoundContext, conforming_bounds
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.rounding import SiteRecorder, SiteReplayer, site_values
from protocol.errors import ConfigError


def probe_paths(directory: Path, step: int) -> tuple[Path, Path]:
    """The probe of one step: raw values (site after site) and their index (JSON)."""
    return directory / f"probe-{step:07d}.bin", directory / f"probe-{step:07d}.json"


class CapturingRecorder(SiteRecorder):
    """Record mode that also streams every site's compute-dtype values to a probe file."""

    def __init__(self, policy: PrecisionPolicy, directory: Path, step: int) -> None:
        super().__init__(policy)
        self._values_path, self._index_path = probe_paths(directory, step)
        self._file = self._values_path.open("wb")
        self._probe_sites: list[tuple[int, int]] = []
        self._offset = 0

    def claim_exact_site(self, op: str, numel: int) -> bool:
        return False  # every site's values go to the probe, so every site is widened

    def round_site(self, op, ys, bounds):
        values = site_values(ys).detach().cpu().contiguous().numpy()
        self._file.write(values.tobytes())
        self._probe_sites.append((self._offset, values.size))
        self._offset += values.size
        return super().round_site(op, ys, bounds)

    def close(self) -> None:
        """Finish the probe: flush the values and write their index."""
        self._file.close()
        self._index_path.write_text(json.dumps(
            {"dtype": dtype_name(self.policy.compute), "sites": self._probe_sites}))


@dataclass
class OpDivergence:
    """What one op showed: sites, elements, how many differed, and the worst as a fraction of
    the bound; `zero_bound_rounded_apart` counts elements with bound 0 whose target roundings
    differed (must be 0)."""

    sites: int = 0
    elements: int = 0
    differing: int = 0
    max_fraction_of_bound: float = 0.0
    zero_bound_rounded_apart: int = 0


@dataclass
class DivergenceReport:
    ops: dict[str, OpDivergence] = field(default_factory=dict)

    def worst(self) -> float:
        return max((o.max_fraction_of_bound for o in self.ops.values()), default=0.0)

    def as_json(self) -> dict:
        return {op: vars(o) for op, o in sorted(self.ops.items())}


class ComparingReplayer(SiteReplayer):
    """Replay mode that compares each site's compute-dtype values with the trainer's probe."""

    def __init__(self, policy: PrecisionPolicy, log: RoundingLog, directory: Path, step: int,
                 report: DivergenceReport) -> None:
        super().__init__(policy, log, step)
        values_path, index_path = probe_paths(directory, step)
        index = json.loads(index_path.read_text())
        if DTYPES.get(index.get("dtype")) is not policy.compute:
            raise ConfigError(f"probe {index_path} holds {index.get('dtype')} values, the "
                              f"policy computes in {dtype_name(policy.compute)}")
        self._sites = index["sites"]
        self._values = np.memmap(values_path, dtype=np.dtype(index["dtype"]), mode="r") \
            if values_path.stat().st_size else np.zeros(0)
        self.report = report
        self._bounds = BoundContext(policy)

    def bounds_needed(self) -> bool:
        return True  # every site's divergence is measured against its bounds

    def claim_exact_site(self, op: str, numel: int) -> bool:
        return False  # (the same: every site's values are compared)

    def round_site(self, op, ys, bounds: list[Bound]):
        k = self.position
        entry = self.report.ops.setdefault(op, OpDivergence())
        entry.sites += 1
        if k < len(self._sites):
            offset, numel = self._sites[k]
            mine = site_values(ys).detach().cpu()
            if numel == mine.numel():
                theirs = torch.from_numpy(np.array(self._values[offset:offset + numel]))
                self._compare(entry, mine, theirs, dense_bounds(ys, bounds),
                              dense_bounds(ys, conforming_bounds(self._bounds, op, ys, bounds)),
                              self.policy.target)
        return super().round_site(op, ys, bounds)

    @staticmethod
    def _compare(entry: OpDivergence, mine: torch.Tensor, theirs: torch.Tensor,
                 e: torch.Tensor | None, scale: torch.Tensor | None, target: torch.dtype) -> None:
        """Adds one site's comparison to `entry`: elements, those that differ, the worst
        difference as a fraction of `scale` (`bounds.conforming_bounds`: the bound, or what a
        root or quotient may err by), and the elements with bound `e` 0 whose roundings
        differ."""
        both = torch.isfinite(mine) & torch.isfinite(theirs)
        # one side finite and the other not is a divergence without bound (both NaN, or equal
        # infinities, are not)
        same_special = ~both & ((mine == theirs) | (mine.isnan() & theirs.isnan()))
        diff = torch.where(both, (mine - theirs).abs(),
                           torch.where(same_special, 0.0, torch.inf))
        entry.elements += mine.numel()
        entry.differing += int((diff > 0).sum())
        bound = torch.zeros_like(diff) if e is None else e.detach().cpu().to(diff.dtype)
        ours, others = mine.to(target), theirs.to(target)  # (their bits: +0 and −0 differ)
        bits = torch.int32 if target.itemsize == 4 else torch.int16
        apart = (ours.view(bits) != others.view(bits)) & ~(ours.isnan() & others.isnan())
        entry.zero_bound_rounded_apart += int(((bound == 0) & apart).sum())
        measure = bound if scale is None else scale.detach().cpu().to(diff.dtype)
        positive = measure > 0
        if bool(positive.any()):
            worst = float(torch.nan_to_num(diff[positive] / measure[positive], nan=0.0).max())
            entry.max_fraction_of_bound = max(entry.max_fraction_of_bound, worst)
