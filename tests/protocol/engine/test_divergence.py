"""The divergence probe (`protocol.engine.divergence`): a site with bound 0 is unsound only where
two machines' results round to different target values."""

from __future__ import annotations

import numpy as np
import torch

from protocol.engine.divergence import CapturingRecorder, ComparingReplayer, DivergenceReport
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy

POLICY = PrecisionPolicy()


def _near_midpoints() -> torch.Tensor:
    """float32 values whose roots lie nearest to float32 rounding midpoints (4 − 2^−22 the
    nearest of all: 4 float64 ULPs, `bounds.SQRT_MARGIN_ULPS`)."""
    k = np.arange(2**24 - 512, 2**24)
    return torch.from_numpy((((2 * k + 1) * 2.0**-24) ** 2).astype(np.float32))


def _root_off_by(ulps: int):
    """A compute function whose square roots are `ulps` float64 ULPs above the native ones."""
    def compute(func, args, kwargs):
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ == "sqrt":
            return (out.view(torch.int64) + ulps).view(torch.float64)
        return out
    return compute


def _probe(tmp_path, ulps: int) -> DivergenceReport:
    x = _near_midpoints()
    recorder = CapturingRecorder(POLICY, tmp_path, 1)
    with RoundingMode(POLICY, recorder):
        torch.sqrt(x)
    recorder.close()
    report = DivergenceReport()
    with RoundingMode(POLICY, ComparingReplayer(POLICY, recorder.log(), tmp_path, 1, report),
                      compute=_root_off_by(ulps)):
        torch.sqrt(x)
    (divergence,) = report.ops.values()
    assert divergence.elements == x.numel() and divergence.differing == x.numel()
    return report


def test_roots_that_differ_within_their_margin_are_not_unsound(tmp_path):
    """A machine whose roots are 2 float64 ULPs off (the most the relative rule let one err by)
    differs in every compute-dtype value and in no rounding: not reported."""
    (divergence,) = _probe(tmp_path, 2).ops.values()
    assert divergence.zero_bound_rounded_apart == 0


def test_roots_that_round_apart_are_reported(tmp_path):
    """A machine off by 8 ULPs, past the margin, rounds some of these roots to another value:
    counted as bound-0 elements rounded apart."""
    (divergence,) = _probe(tmp_path, 8).ops.values()
    assert divergence.zero_bound_rounded_apart > 0
