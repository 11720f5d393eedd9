"""Rounding one site: record mode and replay mode (SPEC §3.2, §3.3).

A site is one floating-point op execution; its elements are the concatenation, in order, of all
the floating tensors the op produced (outputs, then arguments it mutated), each in logical
row-major order whatever its memory layout. `SiteRecorder` rounds to nearest-even and notes the
elements inside the band; `SiteReplayer` applies a recorded log and checks its validity.
"""

from __future__ import annotations

import numpy as np
import torch

from protocol.codec.roundinglog import RoundingLog, SiteLog
from protocol.engine.precision import (
    PrecisionPolicy,
    band_candidates,
    distance_to_boundary,
    rounded_up,
    step_toward,
)
from protocol.errors import LogMismatchError, LogViolationError

_EMPTY_INDEX = np.zeros(0, dtype=np.int64)
_EMPTY_UP = np.zeros(0, dtype=bool)


def _site_values(ys: list[torch.Tensor]) -> torch.Tensor:
    """All of a site's values as one 1-D tensor in site order (a view for one contiguous y).

    One flat tensor per site turns a foreach op over many small parameters into one band test
    instead of one per parameter, and makes site indices plain positions in it.
    """
    if len(ys) == 1:
        return ys[0].reshape(-1)
    return torch.cat([y.reshape(-1) for y in ys])


def _split(r_flat: torch.Tensor, ys: list[torch.Tensor]) -> list[torch.Tensor]:
    """Cut a site's rounded values back into tensors shaped — and laid out — like `ys`."""
    out, offset = [], 0
    for y in ys:
        part = r_flat[offset:offset + y.numel()].view(y.shape)
        if not y.is_contiguous():  # keep the op's memory layout (e.g. channels_last)
            part = torch.empty_like(y, dtype=r_flat.dtype).copy_(part)
        out.append(part)
        offset += y.numel()
    return out


class SiteRecorder:
    """Record mode: round every site to nearest-even and log the in-band decisions."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        self.policy = policy
        self.sites: list[SiteLog] = []
        self.in_band = 0

    def round_site(self, op: str, ys: list[torch.Tensor], ieee: bool = False) -> list[torch.Tensor]:
        flat = _site_values(ys)
        r = flat.to(self.policy.target)
        tau = self.policy.tau_for(ieee)
        indices, up = _EMPTY_INDEX, _EMPTY_UP
        if tau > 0.0:  # with tau 0 nothing is closer than tau to a boundary
            cand = band_candidates(flat, self.policy, tau)
            if cand.numel():
                rv = r[cand]
                keep = torch.isfinite(rv)  # NaN, inf and overflow are not rounding sites
                cand, rv = cand[keep], rv[keep]
                indices = cand.cpu().numpy()
                up = rounded_up(flat[cand], rv).cpu().numpy()
        self.sites.append(SiteLog(flat.numel(), indices, up))
        self.in_band += indices.size
        return _split(r, ys)

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
        flat = _site_values(ys)
        r = flat.to(self.policy.target)
        if site.indices.size:
            self._apply(op, flat, r, site, self.policy.tau_for(ieee))
        return _split(r, ys)

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

    def _apply(self, op: str, flat: torch.Tensor, r: torch.Tensor, site: SiteLog,
               tau: float) -> None:
        """Set the logged elements of `r` to the logged neighbours, after checking validity."""
        idx = torch.from_numpy(site.indices).to(flat.device)
        yv = flat[idx]
        d = distance_to_boundary(yv, self.policy)
        bad = (d >= 2 * tau).nonzero()
        if bad.numel():
            k = int(bad[0, 0])
            raise LogViolationError(self.step, self.position - 1, op, int(site.indices[k]),
                                    float(d[k]), tau)
        up = torch.from_numpy(site.up).to(flat.device)
        r[idx] = step_toward(r[idx], yv, up, self.policy)

    def _where(self) -> str:
        return f"step {self.step}: " if self.step is not None else ""
