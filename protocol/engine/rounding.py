"""Rounding one site: record mode, replay mode and the bound adversary (SPEC §3.2, §3.3).

A site is one floating-point op execution; its elements are the concatenation, in order, of all
the floating tensors the op produced (outputs, then arguments it mutated), each in logical
row-major order whatever its memory layout. Each comes with its certified error bound `e`
(`protocol.engine.bounds`). `SiteRecorder` rounds to nearest-even and logs the elements with
`δ ≤ 2e`; `SiteReplayer` applies a recorded log and checks its validity (`δ' ≤ 4e'`);
`BoundAdversary` moves every result by its proven bound toward the nearest rounding boundary
before either sees it, the worst any conforming machine could do.

A logged element is a *direction* entry (index, rounded up or not) when its bound is small
against the target ULP, and a *value* entry (index, the target value) when it is not. Two
honest results of one element are within `2e` of each other even against the adversary; a
direction names the same target value on both machines only if both lie between the same two
target neighbours, which holds for an in-band element when `e < gap / 8`, the gap being at
least half its ULP. So elements with `16e ≥ ulp` — heavy cancellation, where the compute
dtype's own error spans target ULPs — log the value itself. They are rare.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from protocol.codec.roundinglog import RoundingLog, SiteLog
from protocol.engine import fused
from protocol.engine.bandpass import apply_entries, bounds_at, nearest, round_band, to_target
from protocol.engine.bounds import (
    SAFETY,
    Bound,
    BoundContext,
    conforming_bounds,
    conforming_error,
)
from protocol.engine.precision import (
    PrecisionPolicy,
    boundary_distance,
    rounded_up,
    step_toward,
    target_ulp,
    toward_boundary,
)
from protocol.errors import LogMismatchError, LogViolationError

_EMPTY_INDEX = np.zeros(0, dtype=np.int64)
_EMPTY_UP = np.zeros(0, dtype=bool)

# An in-band element with WIDE * e >= its target ULP gets a value entry (module docstring).
WIDE = 16


# A band candidate's decision (`entry_kinds`): no entry, a direction toward zero or away from
# it, a value entry (csrc/fused.cpp `decide`).
_NONE, _DOWN, _UP, _VALUE = 0, 1, 2, 3


def entry_kinds(y: torch.Tensor, e: torch.Tensor, policy: PrecisionPolicy) -> np.ndarray:
    """Each band candidate's decision (SPEC §3.2), uint8: `_NONE` where it is no entry (δ > 2e;
    a NaN or infinite y is no choice, one near the overflow threshold is), `_VALUE` where
    `WIDE`·e reaches the ULP of its rounding (module docstring), else `_UP` where the rounding
    went away from zero, `_DOWN` where not. `y` holds the candidates' compute-dtype values and
    `e` their bounds (float64), 1-D CPU tensors. Under the float64 -> float32 policy, where the
    library is loaded, one C++ call (`torch.ops.ovt.decide`) with the same tests as these
    torch ops, whose dozen passes of fixed cost took 0.37 of the 1.09 ms that deciding a
    transformer step's log took."""
    if fused.ENABLED and y.dtype == torch.float64 and \
            (policy.compute, policy.target) == (torch.float64, torch.float32):
        return torch.ops.ovt.decide(y.contiguous(), e.contiguous(), policy.overflow,
                                    float(WIDE)).numpy()
    r = y.to(policy.target)
    keep = torch.isfinite(y) & (boundary_distance(y, r, policy) <= 2 * e)
    kind = torch.where(WIDE * e >= target_ulp(r, policy), _VALUE,
                       torch.where(rounded_up(y, r), _UP, _DOWN))
    return torch.where(keep, kind, _NONE).to(torch.uint8).numpy()


def _value_bits(r: torch.Tensor, policy: PrecisionPolicy) -> np.ndarray:
    """Target values as unsigned bit patterns (uint32), what a value entry stores."""
    bits = r.view(policy.fmt["target_int"]).to(torch.int64)
    return (bits & ((1 << (8 * r.element_size())) - 1)).cpu().numpy().astype(np.uint32)


def _from_bits(bits: np.ndarray, policy: PrecisionPolicy) -> torch.Tensor:
    """The target values of logged bit patterns (each < 2**bits of the target dtype)."""
    width = torch.finfo(policy.target).bits
    signed = bits.astype(np.int64)
    signed = np.where(signed >= 1 << (width - 1), signed - (1 << width), signed)
    return torch.from_numpy(signed).to(policy.fmt["target_int"]).view(policy.target)


# One part of a site rounded in parts: its values, their bound, where their rounding goes.
Part = tuple[torch.Tensor, Bound, torch.Tensor]


def _unordered_sites(sites: Sequence[SiteLog]) -> frozenset[int]:
    """The positions of the sites whose direction or value indices are not strictly increasing
    (SPEC §2), found in one pass over all of them: a replayer looks them up as it reaches each
    site (`SiteReplayer._next_site`) instead of checking each site's arrays on its own (about 30
    µs a site with entries inside a step)."""
    unordered: set[int] = set()
    for field in ("indices", "value_indices"):
        arrays = [getattr(site, field) for site in sites]
        sizes = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        if sizes.sum() < 2:
            continue
        flat = np.concatenate(arrays).astype(np.int64, copy=False)
        owner = np.repeat(np.arange(len(arrays)), sizes)
        same = owner[1:] == owner[:-1]
        unordered.update(owner[1:][same & (flat[1:] <= flat[:-1])].tolist())
    return frozenset(unordered)


# A tensor's band candidates, as the recorder notes them: (site, site positions, y, e) there.
_Candidates = tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]


def _entry_tensors(site: SiteLog) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor]:
    """A site's entries as `bandpass.apply_entries` reads them: direction indices, directions,
    value indices, value bits."""
    return (torch.from_numpy(site.indices.astype(np.int64)),
            torch.from_numpy(site.up.astype(bool)),
            torch.from_numpy(site.value_indices.astype(np.int64)),
            torch.from_numpy(site.values.astype(np.int64)))


def _entries_in(site: SiteLog, start: int, stop: int) -> SiteLog:
    """The entries of `site` at positions [start, stop), as a SiteLog of the same numel: two
    binary searches, the indices being strictly increasing (`SiteReplayer._next_site` checks
    it); `site` itself where the range is the whole site."""
    if start == 0 and stop >= site.numel:
        return site
    a, b = np.searchsorted(site.indices, [start, stop])
    c, d = np.searchsorted(site.value_indices, [start, stop])
    return SiteLog(site.numel, site.indices[a:b], site.up[a:b], site.value_indices[c:d],
                   site.values[c:d])


def site_values(ys: list[torch.Tensor]) -> torch.Tensor:
    """All of a site's values as one 1-D tensor in site order (a view for one contiguous y):
    site indices are positions in it (the divergence probe compares sites this way)."""
    if len(ys) == 1:
        return ys[0].reshape(-1)
    return torch.cat([y.reshape(-1) for y in ys])


def _shaped(r_flat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`y`'s rounded values (`r_flat`, logical order) shaped — and laid out — like `y`."""
    part = r_flat.view(y.shape)
    if not y.is_contiguous():  # keep the op's memory layout (e.g. channels_last)
        part = torch.empty_like(y, dtype=r_flat.dtype).copy_(part)
    return part


class _RoundingPaths:
    """The interceptor's ways into a rounder besides `round_site`, each with a flag saying the
    rounder takes it: `rounds_in_parts`, large elementwise sites handed in parts
    (`round_site_in_parts`); `rounds_in_place`, a site of one result that the caller owns
    handed to `round_result_in_place`, which may leave its rounding, widened, in that result.
    A subclass that overrides `round_site` (to see every site's values, as a probe does) but
    neither a path's method nor its flag would miss the sites taken that way: it gets False.
    Likewise `bound_positions`, where the rounder reads a site's bounds: such a subclass reads
    them everywhere unless it says otherwise."""

    rounds_in_parts = True
    rounds_in_place = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = vars(cls).keys()
        if "round_site" in own:
            if not {"round_site_in_parts", "rounds_in_parts"} & own:
                cls.rounds_in_parts = False
            if not {"round_result_in_place", "rounds_in_place"} & own:
                cls.rounds_in_place = False
            if "bound_positions" not in own:
                cls.bound_positions = _RoundingPaths.bound_positions  # type: ignore[method-assign]

    def bound_positions(self) -> torch.Tensor | None:
        """The positions of the next site at which this rounder reads its bounds (int64, any
        order: `bounds.bounds_for`'s `read_at`), or None: at all of them."""
        return None


class SiteRecorder(_RoundingPaths):
    """Record mode: round every site to nearest-even and log the in-band decisions.

    Each of a site's tensors gets its own band pass (`bandpass.round_band`), with no copy of
    the site into one buffer: a foreach op's parameters are rounded where they lie. The pass
    returns candidates, a superset of the band; which of them are entries, and of which kind,
    does not change what the step computes, so it is decided for all the sites since the last
    look in one batch (`sites`, `log`), not in a dozen small tensor ops per site.
    """

    def __init__(self, policy: PrecisionPolicy) -> None:
        self.policy = policy
        self._numels: list[int] = []  # per site rounded so far
        self._candidates: list[_Candidates] = []
        self._sites: list[SiteLog] = []  # the first sites, decided
        self._part_ends: list[int] = []  # the site count at each micro-batch's end

    def end_part(self) -> None:
        """End a micro-batch's part of the step (SPEC §3.5): the sites since the previous part
        ended are its segment of the log (`RoundingLog.parts`)."""
        self._part_ends.append(len(self._numels))

    def round_site(self, op: str, ys: list[torch.Tensor], bounds: list[Bound]
                   ) -> list[torch.Tensor]:
        out, offset, site = [], 0, len(self._numels)
        found: list[_Candidates] = []
        for y, b in zip(ys, bounds, strict=True):
            out.append(_shaped(self._round_part(site, offset, y, b, found)[0], y))
            offset += y.numel()
        self._candidates.extend(found)  # (only once the whole site has been rounded)
        self._numels.append(offset)
        return out

    def round_site_in_parts(self, op: str, numel: int,
                            results: Iterable[Iterable[Part]]) -> None:
        """Round one site of `numel` elements given result by result, each as consecutive
        parts `(y, bound, out)`: 1-D compute-dtype values, their bound, and the 1-D
        target-dtype view `out` their rounding is written to. The same log as `round_site` on
        the whole (the site's values are the parts' concatenation, in order), with one part's
        values held at a time (each may be computed when asked: `RoundingMode`'s parts path)."""
        offset, site = 0, len(self._numels)
        found: list[_Candidates] = []
        for parts in results:
            for y, b, out in parts:
                self._round_part(site, offset, y, b, found, out)
                offset += y.numel()
        assert offset == numel, f"{op}: parts of {offset} elements for a site of {numel}"
        self._candidates.extend(found)
        self._numels.append(offset)

    def round_result_in_place(self, op: str, y: torch.Tensor, bound: Bound
                              ) -> tuple[torch.Tensor, bool]:
        """`round_site(op, [y], [bound])`, the one result's rounding and whether `y` — which
        the caller owns: nothing else may read its memory — now holds that rounding widened
        (`bandpass.round_band`'s `widen_back`: where the fused pass serves a contiguous `y`)."""
        found: list[_Candidates] = []
        r, widened = self._round_part(len(self._numels), 0, y, bound, found,
                                      widen_back=y.is_contiguous())
        self._candidates.extend(found)
        self._numels.append(y.numel())
        return _shaped(r, y), widened

    def _round_part(self, site: int, offset: int, y: torch.Tensor, b: Bound,
                    found: list[_Candidates], out: torch.Tensor | None = None,
                    widen_back: bool = False) -> tuple[torch.Tensor, bool]:
        """`y` (the site's elements from `offset`) rounded to nearest-even, flat (written to
        `out` where it is given), and whether `y` was overwritten with it, widened
        (`round_band`); its band candidates noted in `found`."""
        flat = y.reshape(-1)
        r, cand, ev, yv, widened = round_band(flat, y, b, self.policy, out, widen_back)
        if cand is not None and ev is not None and yv is not None:
            found.append((site, cand + offset if offset else cand, yv, ev))
        return r, widened

    def claim_exact_site(self, op: str, numel: int) -> bool:
        """Take the next site as one of `numel` elements with `e = 0` that the caller rounds to
        nearest-even itself (`pointwise`): nothing of it is in the band, so nothing is logged."""
        self._numels.append(numel)
        return True

    @property
    def sites(self) -> list[SiteLog]:
        """The sites rounded so far, each with its entries."""
        if len(self._sites) < len(self._numels):
            self._decide()
        return self._sites

    def log(self) -> RoundingLog:
        starts = [0, *self._part_ends][:len(self._part_ends)]
        return RoundingLog(tuple(self.sites),
                           tuple(b - a for a, b in zip(starts, self._part_ends, strict=True)))

    def _decide(self) -> None:
        """The entries of the undecided sites: the candidates with δ ≤ 2e, as directions or
        values (module docstring), in one batch."""
        pending, self._candidates = self._candidates, []
        first = len(self._sites)
        groups: dict[int, tuple[np.ndarray, ...]] = {}
        if pending:
            # on the CPU: a step's sites may live on several devices (a CPU-made schedule in a
            # CUDA step); the candidates are few, and these ops are exact on any device
            site = np.repeat(np.array([c[0] for c in pending], dtype=np.int64),
                             [c[1].numel() for c in pending])
            pos = torch.cat([c[1].cpu() for c in pending]).numpy()
            yv = torch.cat([c[2].cpu() for c in pending])
            ev = torch.cat([c[3].cpu() for c in pending])
            kind = entry_kinds(yv, ev, self.policy)
            keep = kind != _NONE
            site, pos, kind = site[keep], pos[keep], kind[keep]
            wide = kind == _VALUE
            narrow = ~wide
            directions = (pos[narrow], kind[narrow] == _UP)
            rv = torch.from_numpy(yv.numpy()[keep][wide]).to(self.policy.target)
            values = (pos[wide], _value_bits(rv, self.policy))
            # the candidates came in site order, each site's in increasing position: each
            # site's entries are a slice of these (one split, not a selection per site)
            sites = np.arange(first, len(self._numels) + 1)
            cut_d = np.searchsorted(site[narrow], sites).tolist()
            cut_v = np.searchsorted(site[wide], sites).tolist()
            for k in range(first, len(self._numels)):
                d0, d1 = cut_d[k - first], cut_d[k - first + 1]
                v0, v1 = cut_v[k - first], cut_v[k - first + 1]
                if d0 < d1 or v0 < v1:
                    groups[k] = (directions[0][d0:d1], directions[1][d0:d1],
                                 values[0][v0:v1], values[1][v0:v1])
        for k in range(first, len(self._numels)):
            self._sites.append(SiteLog(self._numels[k], *groups[k]) if k in groups else
                               SiteLog(self._numels[k], _EMPTY_INDEX, _EMPTY_UP))


class SiteReplayer(_RoundingPaths):
    """Replay mode: round to nearest-even except where the log says otherwise (SPEC §3.2).

    Checks, per site, that the log has a site here with the same element count (SPEC §3.3),
    that each micro-batch ends where the log's part does (SPEC §3.5), and that every logged
    element is one where honest machines could disagree: its bound is not zero and its
    replayed value is within `4e'` of a boundary. Otherwise the log is invalid and
    `LogViolationError` names the site, op and element. For a log that is one part of a step
    (a worker replaying micro-batch `first_part` alone), `first_site` is the step's number of
    its first site, so that errors name the step's site and micro-batch.
    """

    def __init__(self, policy: PrecisionPolicy, log: RoundingLog, step: int | None = None,
                 first_site: int = 0, first_part: int = 0) -> None:
        self.policy, self.log, self.step = policy, log, step
        self.first_site, self.first_part = first_site, first_part
        self.position = 0
        self._parts_done = 0
        self._unordered = _unordered_sites(log.sites)

    def _part_end(self) -> int:
        """Where the current micro-batch's part ends (the log's end after the last part)."""
        parts = self.log.parts
        if self._parts_done < len(parts):
            return sum(parts[:self._parts_done + 1])
        return len(self.log.sites)

    def end_part(self) -> None:
        """A micro-batch ended: it must have executed exactly its part's sites."""
        parts = self.log.parts
        if self._parts_done >= len(parts):
            raise LogMismatchError(f"{self._where()}micro-batch "
                                   f"{self.first_part + self._parts_done} ended but the "
                                   f"rounding log has {len(parts)} micro-batch parts: the log "
                                   f"belongs to a job with another micro-batch count")
        if self.position != self._part_end():
            raise LogMismatchError(
                f"{self._where()}micro-batch {self.first_part + self._parts_done} ended before "
                f"site "
                f"{self._site(self.position)} but the rounding log's part ends before site "
                f"{self._site(self._part_end())}: wrong program, config or step")
        self._parts_done += 1

    def round_site(self, op: str, ys: list[torch.Tensor], bounds: list[Bound]
                   ) -> list[torch.Tensor]:
        site = self._next_site(op, sum(y.numel() for y in ys))
        if not (site.indices.size or site.value_indices.size):
            # flat, then laid out as the recorder lays out its roundings (`_shaped`): `y.to`
            # keeps some layouts (an expanded y) that the recorder's results do not
            return [_shaped(to_target(y.reshape(-1), self.policy), y) for y in ys]
        out, offset = [], 0
        for y, b in zip(ys, bounds, strict=True):
            r, bad_value = self._replay_part(op, site, offset, y, b, check_values=True)
            if bad_value is not None:
                raise bad_value
            out.append(_shaped(r, y))
            offset += y.numel()
        return out

    def round_result_in_place(self, op: str, y: torch.Tensor, bound: Bound
                              ) -> tuple[torch.Tensor, bool]:
        """`round_site(op, [y], [bound])`, and whether `y` — which the caller owns — now holds
        its rounding widened (`SiteRecorder.round_result_in_place`): where the site has no
        entries (most) and the fused pass serves a contiguous `y`, and where it has entries and
        `y` is contiguous (written once they are applied, by the fused pass in its one read
        where it serves: the consumers of a large result with entries then widen nothing, as
        after record's band pass)."""
        site = self._next_site(op, y.numel())
        if not (site.indices.size or site.value_indices.size):
            r, widened = nearest(y.reshape(-1), self.policy, widen_back=y.is_contiguous())
            return _shaped(r, y), widened
        if y.is_contiguous():  # the rounding, its entries and the write-back in one pass
            r = torch.empty(y.numel(), dtype=self.policy.target, device=y.device)
            if apply_entries(y.view(-1), y, bound, r, 0, _entry_tensors(site), self.policy, WIDE,
                             widen_back=True):
                return _shaped(r, y), True
        r, bad_value = self._replay_part(op, site, 0, y, bound, check_values=True)
        if bad_value is not None:
            raise bad_value
        if not y.is_contiguous():
            return _shaped(r, y), False
        y.view(-1).copy_(r)
        return _shaped(r, y), True

    def round_site_in_parts(self, op: str, numel: int,
                            results: Iterable[Iterable[Part]]) -> None:
        """Replay one site given in parts (`SiteRecorder.round_site_in_parts`): the same checks,
        results and violations as `round_site` on the whole. That one checks a result's
        direction entries before its value entries, so here a result's first invalid value
        entry is reported only once its later parts have shown no invalid direction. (Where one
        is raised, the parts before it have been written: the step is void either way.)"""
        site = self._next_site(op, numel)
        entries = bool(site.indices.size or site.value_indices.size)
        offset = 0
        for parts in results:
            bad_value: LogViolationError | None = None
            for y, b, out in parts:
                if not entries:
                    to_target(y, self.policy, out)
                else:
                    r, bad = self._replay_part(op, site, offset, y, b,
                                               check_values=bad_value is None)
                    bad_value = bad_value or bad
                    out.copy_(r)
                offset += y.numel()
            if bad_value is not None:
                raise bad_value
        assert offset == numel, f"{op}: parts of {offset} elements for a site of {numel}"

    def _replay_part(self, op: str, site: SiteLog, offset: int, y: torch.Tensor, b: Bound,
                     check_values: bool) -> tuple[torch.Tensor, LogViolationError | None]:
        """`y` (the site's elements from `offset`) rounded, flat, with the site's entries that
        fall in it checked and applied; raises LogViolationError for an invalid direction entry
        and, if `check_values`, returns the violation of the first invalid value entry (values
        then not applied) instead of raising it. Only the
        entries in `y`'s range are read (`_entries_in`): a log cannot make each of a site's
        many parts or results read all its entries."""
        flat = y.reshape(-1)
        r = to_target(flat, self.policy)
        mine = _entries_in(site, offset, offset + flat.numel())
        if not (mine.indices.size or mine.value_indices.size):
            return r, None
        if apply_entries(flat, y, b, r, offset, _entry_tensors(mine), self.policy, WIDE):
            return r, None
        self._apply_directions(op, flat, r, mine, y, b, offset)
        if check_values:
            try:
                self._apply_values(op, flat, r, mine, y, b, offset)
            except LogViolationError as bad:
                return r, bad
        return r, None

    def claim_exact_site(self, op: str, numel: int) -> bool:
        """Take the next site as one of `numel` elements with `e = 0` that the caller rounds to
        nearest-even itself (`pointwise`), if the log's next site is that: inside this
        micro-batch's part, of `numel` elements, without entries. Otherwise claim nothing and
        return False: the caller then rounds the site through `round_site`, which reports what
        is wrong (an entry at a site with `e = 0` is a violation) with the replayed values."""
        if self._parts_done < len(self.log.parts) and self.position >= self._part_end():
            return False
        if self.position >= len(self.log.sites):
            return False
        site = self.log.sites[self.position]
        if site.numel != numel or site.indices.size or site.value_indices.size:
            return False
        self.position += 1
        return True

    def bounds_needed(self) -> bool:
        """Whether the next site has log entries, the only sites whose bounds replay reads
        (`RoundingMode` computes no bounds for the others). Past the log's end: True, so that
        `round_site` reports the overrun."""
        if self.position >= len(self.log.sites):
            return True
        site = self.log.sites[self.position]
        return bool(site.indices.size or site.value_indices.size)

    def bound_positions(self) -> torch.Tensor | None:
        """The next site's entry positions, where alone replay reads its bounds (a rule may
        compute them there alone: `bounds.bounds_for`); None past the log's end (`round_site`
        reports the overrun). Whatever positions a log holds, each is checked where it is
        read, against the bound computed there. The direction entries' then the value
        entries', neither sorted nor made distinct here (a rule takes them in any order)."""
        if self.position >= len(self.log.sites):
            return None
        site = self.log.sites[self.position]
        return torch.from_numpy(np.concatenate((site.indices, site.value_indices))
                                .astype(np.int64, copy=False))

    def finish(self) -> None:
        """Raise if the log has sites or micro-batch parts the replay never reached."""
        if self._parts_done != len(self.log.parts):
            raise LogMismatchError(
                f"{self._where()}rounding log has {len(self.log.parts)} micro-batch parts but "
                f"the replayed step ran {self._parts_done}: the log belongs to a job with another "
                f"micro-batch count")
        if self.position != len(self.log.sites):
            raise LogMismatchError(
                f"{self._where()}rounding log has {len(self.log.sites)} sites but the replayed "
                f"step executed {self.position}: the log is padded or belongs to another step")

    def _next_site(self, op: str, numel: int) -> SiteLog:
        if self._parts_done < len(self.log.parts) and self.position >= self._part_end():
            raise LogMismatchError(
                f"{self._where()}micro-batch {self.first_part + self._parts_done} reached site "
                f"{self._site(self.position)} ({op}) but the rounding log's part ends before it: "
                f"wrong program, config or step")
        if self.position >= len(self.log.sites):
            raise LogMismatchError(
                f"{self._where()}replay reached site {self._site(self.position)} ({op}, {numel} "
                f"elements) but the rounding log has only {self._site(len(self.log.sites))} "
                f"sites: the log is cut short or belongs to another program")
        site = self.log.sites[self.position]
        if site.numel != numel:
            raise LogMismatchError(
                f"{self._where()}site {self._site(self.position)} ({op}) produced {numel} "
                f"elements but the rounding log records {site.numel}: wrong program, config or "
                f"step")
        if self.position in self._unordered:
            raise LogMismatchError(  # (decode_log builds no such log; one made in memory may)
                f"{self._where()}site {self._site(self.position)} ({op}): the rounding log's "
                f"entry indices are not strictly increasing (SPEC §2)")
        self.position += 1
        return site

    @staticmethod
    def _within(indices: np.ndarray, offset: int, numel: int) -> np.ndarray:
        """Which of a site's entry `indices` fall in the tensor at [offset, offset + numel)."""
        return np.flatnonzero((indices >= offset) & (indices < offset + numel))

    def _apply_directions(self, op: str, flat: torch.Tensor, r: torch.Tensor, site: SiteLog,
                          y: torch.Tensor, bound: Bound, offset: int) -> None:
        """Set the direction entries of `r` (one tensor of the site, at `offset`) to the logged
        neighbours, after checking validity."""
        mine = self._within(site.indices, offset, flat.numel())
        if not mine.size:
            return
        idx = torch.from_numpy(site.indices[mine] - offset).to(flat.device)
        yv, rv = flat[idx], r[idx]
        d = boundary_distance(yv, rv, self.policy)
        ev = bounds_at(flat, y, bound, idx)
        valid = (ev > 0) & (d <= 4 * ev) & torch.isfinite(yv)  # (rv: ±inf past the overflow)
        bad = (~valid).nonzero()
        if bad.numel():
            k = int(bad[0, 0])
            raise LogViolationError(self.step, self._site(self.position - 1), op,
                                    int(site.indices[mine[k]]), float(d[k]), float(ev[k]))
        up = torch.from_numpy(site.up[mine]).to(flat.device)
        r[idx] = step_toward(rv, yv, up, self.policy)

    def _apply_values(self, op: str, flat: torch.Tensor, r: torch.Tensor, site: SiteLog,
                      y: torch.Tensor, bound: Bound, offset: int) -> None:
        """Set the value entries of `r` (one tensor of the site, at `offset`) to the logged
        values, after checking validity.

        An honest value entry is the trainer's nearest-even rounding `v` of a result within `2e`
        of this one, at an in-band (`δ ≤ 2e`) and wide (`16e ≥ ulp(v)`) element; so here
        `δ' ≤ 4e'`, `32e' ≥ ulp(v)` and `|v − y'| ≤ ulp(v)/2 + 4e'` (margins of 2 on e'); an
        infinite `v` (the trainer's result overflowed) needs `y'` of its sign within `4e'` of
        the overflow threshold instead. A value entry failing any of these, or where the bound
        is 0, is a violation."""
        mine = self._within(site.value_indices, offset, flat.numel())
        if not mine.size:
            return
        logged = site.value_indices[mine]
        idx = torch.from_numpy(logged - offset).to(flat.device)
        bits = site.values[mine]
        over = np.flatnonzero(bits.astype(np.uint64) >> torch.finfo(self.policy.target).bits)
        if over.size:
            raise LogViolationError(self.step, self._site(self.position - 1), op,
                                    int(logged[over[0]]), float("inf"), 0.0,
                                    note=f"its logged bits do not fit {self.policy.target}")
        v = _from_bits(bits, self.policy).to(flat.device)
        yv = flat[idx]
        distance = (v.to(torch.float64) - yv.to(torch.float64)).abs()
        ev = bounds_at(flat, y, bound, idx)
        ulp = target_ulp(v, self.policy)
        in_band = boundary_distance(yv, yv.to(self.policy.target), self.policy) <= 4 * ev
        near = torch.where(torch.isinf(v),
                           (yv.abs() + 4 * ev >= self.policy.overflow)
                           & (torch.signbit(v) == torch.signbit(yv)),
                           distance <= ulp / 2 + 4 * ev)
        valid = (ev > 0) & in_band & (2 * WIDE * ev >= ulp) & near & ~torch.isnan(v) \
            & torch.isfinite(yv)
        bad = (~valid).nonzero()
        if bad.numel():
            k = int(bad[0, 0])
            raise LogViolationError(
                self.step, self._site(self.position - 1), op, int(logged[k]), float(distance[k]),
                float(ev[k]), note=f"its logged value {float(v[k]):.9g} is not a choice an honest "
                                   f"machine had (it needs δ' <= 4e', 32e' >= ULP and the value "
                                   f"within ULP/2 + 4e')")
        r[idx] = v

    def _site(self, position: int) -> int:
        """The step's site number of this log's site `position`."""
        return self.first_site + position

    def _where(self) -> str:
        return f"step {self.step}: " if self.step is not None else ""


class BoundAdversary:
    """The worst hardware within the rules, as a rounder wrapper (profile `adversary`).

    Every element is moved by its proven bound (`e / SAFETY`) toward its nearest rounding
    boundary — across it where it is closer than that — before the wrapped recorder or replayer
    rounds it. A conforming machine lands within `e / SAFETY` of the exact result; this one
    lands up to twice that from it, always on the side that makes honest rounding hardest. An
    honest log must still replay bit-exactly against it, in either role (SPEC §3.2).

    A square root or a division is moved by its documented error where that is more than its
    bound (`bounds.conforming_bounds`): roots and quotients of target values have e = 0
    because no result within their margin rounds otherwise, not because every machine computes
    the same bits, so this machine takes them wide (it declines `claim_exact_site`, which
    would round them from the target values) and errs as far as it may. An exact operation's
    e = 0 (add, multiply, a fixed formula) leaves its site as it is.
    """

    def __init__(self, inner, policy: PrecisionPolicy) -> None:
        self.inner, self.policy = inner, policy
        self._bounds = BoundContext(policy)

    def claim_exact_site(self, op: str, numel: int) -> bool:
        """The wrapped rounder's answer (`RoundingMode`), except for a root or a quotient,
        which this machine computes wide, with its error: no."""
        claim = getattr(self.inner, "claim_exact_site", None)
        return claim is not None and conforming_error(self._bounds, op) is None and \
            claim(op, numel)

    def round_site(self, op: str, ys: list[torch.Tensor], bounds: list[Bound]
                   ) -> list[torch.Tensor]:
        moved = []
        for y, e in zip(ys, conforming_bounds(self._bounds, op, ys, bounds), strict=True):
            if e is None:
                moved.append(y)
                continue
            r = y.to(self.policy.target)
            shift = toward_boundary(y, r, self.policy) * (e / SAFETY)
            # (to or past the overflow; in y's dtype: a bound may be wider, as float64
            # magnitudes are under a float32 compute dtype)
            pushed = torch.where(torch.isfinite(y), y + shift, y).to(y.dtype)
            moved.append(pushed if y.is_contiguous() else
                         torch.empty_like(y).copy_(pushed))
        return self.inner.round_site(op, moved, bounds)

    def bounds_needed(self) -> bool:
        return True  # it moves every element by its bound

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # log(), finish(), sites... of the wrapped rounder
