"""The divergence probe (`protocol.engine.divergence`): a site with bound 0 is unsound only where
two machines' results round to different target values."""

from __future__ import annotations

import numpy as np
import torch

from protocol.engine.divergence import CapturingRecorder, ComparingReplayer, DivergenceReport
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy
from tests.protocol.engine.worst_cases import midpoint_squares

POLICY = PrecisionPolicy()


def _near_midpoints() -> torch.Tensor:
    """float32 values whose roots lie nearest to float32 rounding midpoints (the margin is 4
    float64 ULPs, `bounds.SQRT_MARGIN_ULPS`)."""
    return torch.from_numpy(midpoint_squares(np.arange(2**24 - 512, 2**24)))


def _off_by(op: str, ulps: int):
    """A compute function whose results of `op` (an op packet's name) are `ulps` float64 ULPs
    above the native ones (in magnitude)."""
    def compute(func, args, kwargs):
        out = func(*args, **kwargs)
        if func.overloadpacket.__name__ == op:
            return (out.view(torch.int64) + ulps).view(torch.float64)
        return out
    return compute


def _probe(tmp_path, ulps: int, op: str = "sqrt", run=lambda: torch.sqrt(_near_midpoints())
           ) -> DivergenceReport:
    recorder = CapturingRecorder(POLICY, tmp_path, 1)
    with RoundingMode(POLICY, recorder):
        x = run()
    recorder.close()
    report = DivergenceReport()
    with RoundingMode(POLICY, ComparingReplayer(POLICY, recorder.log(), tmp_path, 1, report),
                      compute=_off_by(op, ulps)):
        run()
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


def test_quotients_beside_small_ones_are_measured_against_their_documented_error(tmp_path):
    """A division site with a quotient below 2^-125 bounds it by the relative rule and the
    others by a floor of a few subnormals; a machine whose quotients are 1 float64 ULP off (a
    reciprocal and a product) diverges by a fraction of their documented error
    (`bounds.conforming_error`), not by 10^300 floors, and rounds none apart."""
    x = torch.tensor([1.0, 3.0, 1e-30, 7.0, 2.5])
    y = torch.tensor([3.0, 7.0, 1e10, 11.0, 9.0])
    (divergence,) = _probe(tmp_path, 1, "div", lambda: torch.div(x, y)).ops.values()
    assert 0.1 < divergence.max_fraction_of_bound <= 1
    assert divergence.zero_bound_rounded_apart == 0
