"""A site's band pass: its target-dtype values and its band candidates (SPEC §3.2; issue 13),
and the replayer's counterpart, its logged entries checked and applied.

The recorder needs, for every site, `r = y.to(target)` and the elements that may lie within
`2e` of a rounding boundary (`precision.band_candidates`, a superset it then checks exactly).
Done with torch ops, that is a dozen passes over the site: evaluating the bounds, the bit
tricks of the prefilter, the `nonzero`. `round_band` does it in one read of `y` through the
C++ operator `torch.ops.ovt.round_band` (`csrc/fused.cpp`, `fused`), which also
evaluates each element's bound (`bounds.Affine`: the relative rules need only `|y|`, the
matmul family row and column norms) on the way. Both ways give the same bits
(tests/protocol/engine/test_bandpass.py). In replay, `apply_entries` checks and applies the
log's entries of a result in one C++ call (`torch.ops.ovt.apply_entries`) instead of the
replayer's few dozen small torch ops per result.

The fused passes serve the float64 -> float32 policy on the CPU, and on CUDA devices where the
library holds their kernels (`csrc/fused_cuda.cu`: one kernel per site where the torch ops
launch a dozen and wait in `nonzero`; the candidates come back to the host, sorted, as from the
CPU pass). Everything else — the float32 -> bfloat16 policy; an install without the extension
or its CUDA kernels (`fused`) — runs the torch ops.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from protocol.engine import fused
from protocol.engine.bounds import Affine, Bound
from protocol.engine.precision import PrecisionPolicy, band_candidates

_RELATIVE, _ROWS, _OUTER, _PLUS = 0, 1, 2, 3  # csrc/fused.cpp `Mode`
_FUSED_PAIR = (torch.float64, torch.float32)


@dataclass(frozen=True)
class _FlatBound:
    """One result's bound over its flat values, as `csrc/fused.cpp` reads it: element i's base is
    |y_i| (relative), m[i // inner] (+ weight·|y_i| where weight is not 0) (rows),
    m[i // inner]·col[(i // (rows·inner))·inner + i % inner] (+ add[i % inner] or add[i])
    (outer), or |y_i| + weight·|add[i]| (plus); e = base·scale + floor."""

    mode: int
    scale: float
    floor: float
    m: torch.Tensor | None = None
    col: torch.Tensor | None = None
    add: torch.Tensor | None = None
    inner: int = 1
    rows: int = 1
    weight: float = 0.0

    def at(self, flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """e at the flat indices `idx`, NaN as +inf (as `dense_bounds`)."""
        if self.mode == _RELATIVE:
            base = flat[idx].abs()
        elif self.mode == _PLUS:
            assert self.add is not None
            base = self.add[idx].abs().mul_(self.weight).add_(flat[idx].abs())
        else:
            assert self.m is not None
            row = idx // self.inner
            base = self.m[row]
            if self.mode == _ROWS and self.weight:
                base = flat[idx].abs().mul_(self.weight).add_(base)
            if self.mode == _OUTER:
                assert self.col is not None
                j = idx % self.inner
                base = base * self.col[(row // self.rows) * self.inner + j]
                if self.add is not None:
                    base = base + self.add[j if self.add.numel() == self.inner else idx]
        return torch.nan_to_num(base * self.scale + self.floor, nan=math.inf, posinf=math.inf)


def dense_bounds(ys: list[torch.Tensor], bounds: Sequence[Bound]) -> torch.Tensor | None:
    """The bounds of a site as one 1-D tensor aligned with its flat values (NaN and +inf as
    +inf: a bound that overflowed certifies nothing), or None if all are 0.

    A rule may give an `Affine`, a tensor broadcastable to its result (a per-row bound), a
    number for the whole result, or None for zero.
    """
    if all(b is None for b in bounds):
        return None
    parts = []
    for y, b in zip(ys, bounds, strict=True):
        if isinstance(b, Affine):
            b = b.dense(y)
        if isinstance(b, torch.Tensor):
            parts.append(b.to(y.dtype).expand(y.shape).reshape(-1))
        else:
            parts.append(torch.full((y.numel(),), 0.0 if b is None else float(b), dtype=y.dtype,
                                    device=y.device))
    e = parts[0] if len(parts) == 1 else torch.cat(parts)
    return torch.nan_to_num(e, nan=math.inf, posinf=math.inf)  # (bounds are never negative)


def round_band(flat: torch.Tensor, y: torch.Tensor, bound: Bound, policy: PrecisionPolicy,
               out: torch.Tensor | None = None, widen_back: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                          torch.Tensor | None, bool]:
    """(r, candidates, e at them, values at them, widened) of one result `y` of a site, `flat`
    its values in logical order (`y.reshape(-1)`): `flat` rounded to nearest-even in the target
    dtype — written to `out` where it is given (a 1-D target-dtype tensor of `flat`'s elements:
    a part's destination, which saves a copy), else a new tensor — the sorted indices into
    `flat` that may lie in the band (`precision.band_candidates`), their bounds (float64) and
    `flat` there. The middle three are None where there is no candidate; they are CPU tensors
    where the fused pass ran (on a CUDA device too: the recorder decides entries on the CPU).

    `widen_back`: the caller owns `flat`'s memory and asks for it to be overwritten with `r`
    widened, which the fused pass does in the same read (`widened` True; not where a bound
    factor lies in that memory, nor on the torch-ops path, where it would be a pass of its
    own): then `flat` holds exactly `r.to(flat.dtype)`, the compute-dtype copy of the result
    that a later op would otherwise make afresh (`interceptor.WidenCache.note`)."""
    if bound is None or not flat.numel():
        r, widened = nearest(flat, policy, out, widen_back)
        return r, None, None, None, widened
    if _fused_serves(flat, policy) and (out is None or out.is_contiguous()):
        spec = _flat_bound(y, bound)
        r = out if out is not None else torch.empty(flat.numel(), dtype=policy.target,
                                                    device=flat.device)
        widen_back = widen_back and flat.is_contiguous()  # (else `contiguous` copies it)
        cand, ev, yv, widened = torch.ops.ovt.round_band(
            flat.contiguous(), r, spec.mode, spec.m, spec.col, spec.add, spec.inner, spec.rows,
            spec.scale, spec.floor, spec.weight, widen_back)
        if not cand.numel():
            return r, None, None, None, widened
        return r, cand, ev, yv, widened
    e = dense_bounds([y], [bound])
    assert e is not None
    cand = band_candidates(flat, e, policy)
    if not cand.numel():
        return nearest(flat, policy, out)[0], None, None, None, False
    return nearest(flat, policy, out)[0], cand, e[cand].to(torch.float64), flat[cand], False


def nearest(flat: torch.Tensor, policy: PrecisionPolicy, out: torch.Tensor | None = None,
            widen_back: bool = False) -> tuple[torch.Tensor, bool]:
    """(`flat` rounded to nearest-even in the target dtype, widened): the rounding written to
    `out` where it is given (`to_target`); `widen_back` as in `round_band`, done by the fused
    pass (`torch.ops.ovt.nearest`) where it serves."""
    if widen_back and flat.is_contiguous() and _fused_serves(flat, policy) and \
            (out is None or out.is_contiguous()):
        r = out if out is not None else torch.empty(flat.numel(), dtype=policy.target,
                                                    device=flat.device)
        torch.ops.ovt.nearest(flat, r, True)
        return r, True
    return to_target(flat, policy, out), False


# The one NaN of each dtype a step computes in (`canonical_nans`): quiet, sign clear, no
# payload — what Python's float("nan") becomes in each; the fused passes write the float32 one
# (csrc/band.h `narrow`).
CANONICAL_NAN = {torch.float64: 0x7FF8000000000000, torch.float32: 0x7FC00000,
                 torch.bfloat16: 0x7FC0}
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}


def to_target(values: torch.Tensor, policy: PrecisionPolicy, out: torch.Tensor | None = None
              ) -> torch.Tensor:
    """`values` rounded to nearest-even in the target dtype by torch's cast, written to `out`
    where it is given (`copy_` rounds as `to` does), every NaN as the target's
    `CANONICAL_NAN`. A NaN is no rounding site that a log entry could settle (SPEC §3.2), and
    its bits are the machine's: the compute dtype's kernels make NaNs of other signs and
    payloads by code path (a vectorised float64 log1p or sum against the scalar one, a GPU's
    0x7FFFFFFF), a float32 cast keeps them, and torch's casts into bfloat16 write 0xFFFF for
    a float32 NaN from the vectorised kernels (AVX2, AVX-512) and 0x7FC0 from the scalar one
    (a 0-d or strided tensor, or `ATEN_CPU_CAPABILITY=default`). States are compared by their
    hashes (SPEC §2), so honest parties on two machines or layouts would otherwise differ in a
    NaN's bits. One pass where the fused passes serve a contiguous `values` (`nearest`'s,
    without its write-back: csrc/band.h `narrow`), else torch's cast and `canonical_nans`."""
    if values.is_contiguous() and _fused_serves(values, policy) and (out is None or (
            out.is_contiguous() and out.shape == values.shape and out.device == values.device)):
        r = out if out is not None else torch.empty(values.shape, dtype=policy.target,
                                                    device=values.device)
        torch.ops.ovt.nearest(values.view(-1), r.view(-1), False)
        return r
    r = values.to(policy.target) if out is None else out.copy_(values)
    canonical_nans(r)
    return r


def canonical_nans(t: torch.Tensor) -> None:
    """Overwrite every NaN of `t` (float64, float32 or bfloat16, any layout) with its dtype's
    `CANONICAL_NAN`, in place. On the CPU a sum tells first whether there is any NaN to
    overwrite (one NaN makes it NaN in any order of the sum; infinities of both signs too, and
    then the pass finds none): the common case costs a read, 37 µs on 1 M float32 elements,
    where the mask and the masked write cost 745 µs. (On a GPU the check would wait for the
    device.)"""
    if t.is_cpu and not bool(t.sum().isnan()):
        return
    t.view(_BITS[t.dtype]).masked_fill_(t.isnan(), CANONICAL_NAN[t.dtype])


def apply_entries(flat: torch.Tensor, y: torch.Tensor, bound: Bound, r: torch.Tensor,
                  offset: int, entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor],
                  policy: PrecisionPolicy, wide: float, widen_back: bool = False) -> bool:
    """Check and apply, in one pass, the logged entries of a site that fall in its result `y`
    (`flat` its values, at site positions from `offset`; `r` = RNE(flat), written in place):
    `entries` = (direction indices, their directions, value indices, value bits), int64, bool,
    int64, int64 CPU tensors over the whole site; `wide` is `rounding.WIDE`. The same checks
    and writes as `SiteReplayer._apply_directions` and `_apply_values` (csrc/fused.cpp
    `apply_entries`). True where it applied them all; False, with `r` untouched, where the pass
    does not serve here (the bfloat16 policy, no extension or kernel for the device, a result
    with e = 0) or an entry is invalid: the caller's torch ops then apply them, or report the
    violation.

    `widen_back`: `r` is not yet RNE(flat) but a buffer of its size, and the caller owns the
    contiguous `flat`; the pass writes the rounding with the entries applied into `r`, and
    into `flat` widened (`round_band`'s `widen_back`), in the one read that would otherwise
    be a cast and a copy back. False, with nothing written, where it does not serve."""
    if not flat.numel():
        return True  # (no entry can fall in it)
    if bound is None or not _fused_serves(flat, policy) or \
            (widen_back and not flat.is_contiguous()):
        return False
    spec = _flat_bound(y, bound)
    return torch.ops.ovt.apply_entries(flat.contiguous(), r, offset, *entries, spec.mode,
                                       spec.m, spec.col, spec.add, spec.inner, spec.rows,
                                       spec.scale, spec.floor, spec.weight, policy.overflow,
                                       float(wide), widen_back)


def _fused_serves(flat: torch.Tensor, policy: PrecisionPolicy) -> bool:
    """Whether the fused passes run on a site's values `flat` (module docstring)."""
    return fused.band_pass_serves(flat) and flat.dtype == torch.float64 and \
        (policy.compute, policy.target) == _FUSED_PAIR


def bounds_at(flat: torch.Tensor, y: torch.Tensor, bound: Bound, idx: torch.Tensor
              ) -> torch.Tensor:
    """The bounds of one result `y` (`flat` its values) at the indices `idx` into `flat`
    (float64, zeros for e = 0): the same values as `dense_bounds([y], [bound])[idx]`, without
    evaluating the rest (replay)."""
    if bound is None:
        return torch.zeros(idx.shape, dtype=torch.float64, device=flat.device)
    if flat.dtype == torch.float64:
        return _flat_bound(y, bound).at(flat, idx)
    e = dense_bounds([y], [bound])
    assert e is not None
    return e[idx].to(torch.float64)


def _flat_bound(y: torch.Tensor, b: Affine | torch.Tensor | float) -> _FlatBound:
    """The bound of `y` in the form `csrc/fused.cpp` reads."""
    if isinstance(b, Affine):
        return _of_affine(y, b)
    if isinstance(b, torch.Tensor):
        return _rows(y, b, 1.0, 0.0)
    # one number for the whole result
    return _FlatBound(_ROWS, 1.0, 0.0, torch.full((1,), float(b), dtype=torch.float64,
                                                  device=y.device), inner=y.numel())


def _of_affine(y: torch.Tensor, b: Affine) -> _FlatBound:
    if b.m is None:
        if b.other is None:
            return _FlatBound(_RELATIVE, b.scale, b.floor)
        return _FlatBound(_PLUS, b.scale, b.floor, add=_float64(b.other.expand(y.shape), y),
                          weight=b.weight)
    if b.col is None:
        return _rows(y, b.m, b.scale, b.floor, b.weight)
    rows, inner = b.m.shape[-1], b.col.shape[-1]  # y viewed as (..., rows, inner)
    add = b.add
    if add is not None:
        add = add.to(device=y.device, dtype=torch.float64)
        if not (add.numel() == inner and add.shape[-1:] == (inner,)):
            add = add.expand(y.shape)  # a full matrix (or broadcast otherwise): one per element
        add = add.reshape(-1).contiguous()
    return _FlatBound(_OUTER, b.scale, b.floor, _float64(b.m, y), _float64(b.col, y), add, inner,
                      rows)


def _rows(y: torch.Tensor, m: torch.Tensor, scale: float, floor: float, weight: float = 0.0
          ) -> _FlatBound:
    """A base tensor broadcast to `y` (plus weight·|y| where `weight` is not 0): one value per
    run of trailing elements where its shape is y's leading dimensions followed by ones, else
    expanded to one value per element."""
    inner = _run(y.shape, m.shape)
    if inner is not None:
        return _FlatBound(_ROWS, scale, floor, _float64(m, y), inner=inner, weight=weight)
    return _FlatBound(_ROWS, scale, floor, _float64(m.expand(y.shape), y), weight=weight)


@lru_cache(maxsize=4096)
def _run(shape: torch.Size, base: torch.Size) -> int | None:
    """The elements of `shape` sharing one value of a tensor of shape `base` broadcast to it,
    where `base` is `shape`'s leading dimensions followed by ones (`_rows`); else None."""
    padded = (1,) * (len(shape) - len(base)) + tuple(base)
    lead = len(padded)
    while lead and padded[lead - 1] == 1:
        lead -= 1
    if padded[:lead] == tuple(shape[:lead]):
        return math.prod(shape[lead:])
    return None


def _float64(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A bound factor of `y` flat, in float64, on `y`'s device (where the fused pass reads it:
    a rule may give a CPU scalar tensor for a CUDA result, which torch ops broadcast): a view
    of `t` where it is one already (most: norms and sums are made so), else a copy."""
    if t.dtype == torch.float64 and t.is_contiguous() and t.device == y.device:
        return t.view(-1)
    return t.to(device=y.device, dtype=torch.float64).reshape(-1).contiguous()
