"""Rounding one site: record mode and replay mode (SPEC §3.2, §3.3).

A site is one floating-point op execution; its elements are the concatenation, in order, of all
the floating tensors the op produced (outputs, then arguments it mutated), each in logical
row-major order whatever its memory layout. `SiteRecorder` rounds to nearest-even and notes the
elements inside the band; `SiteReplayer` applies a recorded log and checks its validity.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import LogMismatchError, LogViolationError
from .logcodec import RoundingLog, SiteLog
from .precision import (
    PrecisionPolicy,
    distance_to_boundary,
    near_boundary_mask,
    rounded_up,
    step_toward,
)

_EMPTY_INDEX = np.zeros(0, dtype=np.int64)
_EMPTY_UP = np.zeros(0, dtype=bool)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` flattened in logical row-major order (a view when `t` is contiguous)."""
    return t.reshape(-1)


def _record_tensor(y: torch.Tensor, policy: PrecisionPolicy, tau: float):
    """RNE-round one tensor; return (rounded, flat indices in band, their directions)."""
    r = y.to(policy.target)
    if tau == 0.0:  # nothing is closer than 0 to a boundary: no band to search
        return r, _EMPTY_INDEX, _EMPTY_UP
    cand = _flat(near_boundary_mask(y, policy, tau)).nonzero().squeeze(1)
    # Values whose target is subnormal need the subnormal ULP (SPEC §3.2): the dense test above
    # measured their distance against a normal ULP, so re-test every tiny nonzero value exactly.
    tiny = _flat(torch.frexp(y)[1] <= policy.fmt["min_normal_exp"]).nonzero().squeeze(1)
    if tiny.numel():
        cand = torch.cat([cand, tiny]).unique()
    if cand.numel() == 0:
        return r, _EMPTY_INDEX, _EMPTY_UP
    yv, rv = _flat(y)[cand], _flat(r)[cand]
    keep = (distance_to_boundary(yv, policy) < tau) & torch.isfinite(rv)
    cand, yv, rv = cand[keep], yv[keep], rv[keep]
    return r, cand.cpu().numpy(), rounded_up(yv, rv).cpu().numpy()


class SiteRecorder:
    """Record mode: round every site to nearest-even and log the in-band decisions."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        self.policy = policy
        self.sites: list[SiteLog] = []
        self.in_band = 0

    def round_site(self, op: str, ys: list[torch.Tensor], ieee: bool = False) -> list[torch.Tensor]:
        tau = self.policy.tau_for(ieee)
        rounded, indices, ups, offset = [], [], [], 0
        for y in ys:
            r, idx, up = _record_tensor(y, self.policy, tau)
            rounded.append(r)
            if idx.size:
                indices.append(idx + offset)
                ups.append(up)
            offset += y.numel()
        if indices:
            site = SiteLog(offset, np.concatenate(indices), np.concatenate(ups))
            self.in_band += site.indices.size
        else:
            site = SiteLog(offset, _EMPTY_INDEX, _EMPTY_UP)
        self.sites.append(site)
        return rounded

    def log(self) -> RoundingLog:
        return RoundingLog(tuple(self.sites))


class SiteReplayer:
    """Replay mode: round to nearest-even except where the log says otherwise (SPEC §3.2).

    Checks, per site, that the log has a site here with the same element count (SPEC §3.3),
    and that every logged element is really near a boundary (d < 2*tau), else the log is
    invalid and `LogViolationError` names the site, op and element.
    """

    def __init__(self, policy: PrecisionPolicy, log: RoundingLog, step: int | None = None) -> None:
        self.policy, self.log, self.step = policy, log, step
        self.position = 0

    def round_site(self, op: str, ys: list[torch.Tensor], ieee: bool = False) -> list[torch.Tensor]:
        site = self._next_site(op, ys)
        tau = self.policy.tau_for(ieee)
        rounded, offset = [], 0
        for y in ys:
            r = y.to(self.policy.target)
            lo = int(np.searchsorted(site.indices, offset))
            hi = int(np.searchsorted(site.indices, offset + y.numel()))
            if hi > lo:
                r = self._apply(op, y, r, site.indices[lo:hi] - offset, site.up[lo:hi], offset,
                                tau)
            rounded.append(r)
            offset += y.numel()
        return rounded

    def finish(self) -> None:
        """Raise if the log has sites the replay never reached."""
        if self.position != len(self.log.sites):
            raise LogMismatchError(
                f"{self._where()}rounding log has {len(self.log.sites)} sites but the replayed "
                f"step executed {self.position}: the log is padded or belongs to another step")

    def _next_site(self, op: str, ys: list[torch.Tensor]) -> SiteLog:
        numel = sum(y.numel() for y in ys)
        if self.position >= len(self.log.sites):
            raise LogMismatchError(
                f"{self._where()}replay reached site {self.position} ({op}, {numel} elements) "
                f"but the rounding log has only {len(self.log.sites)} sites: the log is cut "
                f"short or belongs to another program")
        site = self.log.sites[self.position]
        if site.numel != numel:
            raise LogMismatchError(
                f"{self._where()}site {self.position} ({op}) produced {numel} elements but the "
                f"rounding log records {site.numel}: wrong program, config or step")
        self.position += 1
        return site

    def _apply(self, op, y, r, idx_np, up_np, offset, tau) -> torch.Tensor:
        idx = torch.from_numpy(idx_np).to(y.device)
        up = torch.from_numpy(up_np).to(y.device)
        yv = _flat(y)[idx]
        d = distance_to_boundary(yv, self.policy)
        bad = (d >= 2 * tau).nonzero()
        if bad.numel():
            k = int(bad[0, 0])
            raise LogViolationError(self.step, self.position - 1, op, offset + int(idx_np[k]),
                                    float(d[k]), tau)
        fixed = step_toward(_flat(r)[idx], yv, up, self.policy)
        if r.is_contiguous():
            r.view(-1)[idx] = fixed
            return r
        flat = r.contiguous()  # logical order; copy back keeps r's own strides
        flat.view(-1)[idx] = fixed
        r.copy_(flat)
        return r

    def _where(self) -> str:
        return f"step {self.step}: " if self.step is not None else ""
