"""Tests of protocol.engine.hugepages: large widened copies on huge pages, the same as `to`."""

from __future__ import annotations

import mmap

import pytest
import torch

from protocol.codec.state import state_digest
from protocol.engine import hugepages
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program

needs_advice = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"),
                                  reason="no MADV_HUGEPAGE here: torch's buffers serve")


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    base = torch.randn(6, 70, 33, generator=g) * torch.exp2(
        torch.randint(-140, 120, (6, 70, 33), generator=g).float())
    base[0, 0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    return [base, base.transpose(1, 2), base.permute(2, 0, 1), base[:, ::3],  # (not dense)
            base[:, :1], base.double() * (1 + 2.0**-30), base.reshape(-1)[:0]]


@needs_advice
@pytest.mark.parametrize("case", range(7))
def test_a_copy_on_huge_pages_is_to(case, monkeypatch):
    """From any size (the threshold lowered to 0): the same bits and strides as `to`, both ways
    (float32 to float64 exactly, float64 to float32 rounded), on memory that is not torch's
    (its storage cannot be resized)."""
    monkeypatch.setattr(hugepages, "HUGE_FROM", 0)
    t = _cases()[case]
    dtype = torch.float32 if t.dtype == torch.float64 else torch.float64
    got, expected = hugepages.copy_to(t, dtype), t.to(dtype)
    assert got.dtype == dtype and got.shape == expected.shape
    if t.numel():
        assert got.stride() == expected.stride()
        assert not got.untyped_storage().resizable()
    bits = torch.int64 if dtype == torch.float64 else torch.int32
    assert torch.equal(got.contiguous().view(bits), expected.contiguous().view(bits))


def test_small_and_same_dtype_copies_are_torchs():
    t = torch.randn(100)
    assert hugepages.copy_to(t, torch.float64).untyped_storage().resizable()
    assert hugepages.copy_to(t, torch.float32) is t  # (to: no copy)


@needs_advice
def test_whole_steps_widen_onto_huge_pages_as_onto_torchs(monkeypatch):
    """A transformer's steps with every widened input on huge pages: the same logs and state."""
    results = {}
    for huge in (False, True):
        monkeypatch.setattr(hugepages, "HUGE_FROM", 0 if huge else 1 << 62)
        ex = Executor(load_program("char-transformer", preset="test"), seed=4,
                      policy=PrecisionPolicy(), profile=Profile.parse("threads=2"))
        ex.init_state(1)
        logs = [ex.step().log for _ in range(2)]
        results[huge] = (logs, state_digest(ex.state()))
    assert results[True] == results[False]
