"""The band passes' CUDA kernels (csrc/fused_cuda.cu) against the CPU pass and the torch ops on
the device, bit for bit (issue 13): the hard sites of test_bandpass on a CUDA device give the
same rounding, candidates, bounds and values as on the CPU; replayed entries get the torch ops'
verdicts and bits; whole steps log and land the same with the kernels and without, and their
logs replay on the CPU. Skipped where no CUDA device is present, or where the kernels' module
(`_fused_cuda`) is not loaded (not built: no nvcc at install; CUDA sites then take the torch
ops, which test_bandpass's torch-path tests and test_cuda_replay cover).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from protocol.engine import fused
from protocol.engine.bandpass import nearest, round_band
from protocol.engine.bounds import Affine, Bound
from tests.protocol.engine.test_bandpass import (
    F64,
    POLICY,
    assert_same_pass,
    entry_verdicts,
    hard_values,
    record_steps,
    replayed,
    sites,
    written_back_verdicts,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(not fused.CUDA_KERNELS,
                       reason="the band passes' CUDA kernels are not loaded here (not built, "
                              "or refused: fused.py warns why)"),
]


def on(value, device):
    """A site's values or bound moved to `device` (an `Affine`'s tensors too)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, Affine):
        moved = {f: getattr(value, f).to(device) for f in ("m", "col", "add", "other")
                 if getattr(value, f) is not None}
        return dataclasses.replace(value, **moved)
    return value


def cuda_sites(seed: int) -> list[tuple[str, torch.Tensor, Bound]]:
    return [(name, on(y, "cuda"), on(b, "cuda")) for name, y, b in sites(seed)]


def host(result):
    """A band pass's (r, candidates, e, values) on the CPU."""
    return tuple(t if t is None else t.cpu() for t in result[:4])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cuda_pass_gives_the_bits_of_the_cpu_pass_and_the_torch_ops(seed, monkeypatch):
    for (name, y, bound), (_, yc, bc) in zip(sites(seed), cuda_sites(seed), strict=True):
        monkeypatch.setattr(fused, "ENABLED", True)
        assert fused.band_pass_serves(yc)
        cpu = round_band(y.reshape(-1), y, bound, POLICY)
        kernel = round_band(yc.reshape(-1), yc, bc, POLICY)
        monkeypatch.setattr(fused, "ENABLED", False)
        torch_ops = round_band(yc.reshape(-1), yc, bc, POLICY)
        assert_same_pass(host(kernel), host(cpu), name)
        assert_same_pass(host(torch_ops), host(cpu), name)


def test_widening_back_on_the_device_changes_nothing_but_the_values_given(monkeypatch):
    """As on the CPU (test_bandpass): `widen_back` gives what the pass gives without it, read
    before the values are overwritten with their rounding, widened; `nearest` likewise."""
    monkeypatch.setattr(fused, "ENABLED", True)
    for name, y, bound in cuda_sites(1):
        r, cand, e, values, widened = round_band(y.reshape(-1), y, bound, POLICY)
        assert not widened, name
        mine = y.contiguous().clone()
        widening = round_band(mine.view(-1), mine, bound, POLICY, widen_back=True)
        assert widening[4], name
        assert_same_pass(host(widening), host((r, cand, e, values)), name)
        assert torch.equal(mine.view(torch.int64), r.to(F64).view(y.shape).view(torch.int64)), \
            name
        mine = y.contiguous().clone()
        r2, widened = nearest(mine.view(-1), POLICY, widen_back=True)
        assert widened, name
        assert torch.equal(r2.view(torch.int32), r.view(torch.int32)), name
        assert torch.equal(mine.view(torch.int64), r.to(F64).view(y.shape).view(torch.int64)), \
            name


def test_a_site_with_more_candidates_than_the_first_room_gives_them_all(monkeypatch):
    """The kernel's first slots hold a few candidates per hundred elements; a bound wide
    against the ULP makes nearly every element one, and the pass runs again with room for all
    (the values untouched until then, then widened back where asked)."""
    monkeypatch.setattr(fused, "ENABLED", True)
    rng = np.random.default_rng(4)
    y = hard_values(rng, (300, 700))
    bound = Affine(2.0**-20, 0.0)
    cpu = round_band(y.reshape(-1), y, bound, POLICY)
    assert cpu[1] is not None and cpu[1].numel() > y.numel() // 2
    yc = y.cuda()
    assert_same_pass(host(round_band(yc.view(-1), yc, bound, POLICY)), cpu, "wide")
    mine = yc.clone()
    widening = round_band(mine.view(-1), mine, bound, POLICY, widen_back=True)
    assert widening[4]
    assert_same_pass(host(widening), cpu, "wide, widened back")
    assert torch.equal(mine.cpu().view(torch.int64),
                       cpu[0].to(F64).view(y.shape).view(torch.int64))


def test_replayed_entries_on_the_device_get_the_verdicts_and_bits_of_the_torch_ops(monkeypatch):
    """Entry by entry on every hard site, and all the valid ones of a site at once, as on the
    CPU (`entry_verdicts`): the kernel's verdict and bits are the torch ops' on the device."""
    verdicts = entry_verdicts(cuda_sites(0), np.random.default_rng(0), 25, monkeypatch)
    assert verdicts["ok"] > 50 and verdicts["violation"] > 50, verdicts


def test_replayed_entries_written_back_on_the_device_as_by_the_torch_ops(monkeypatch):
    """`round_result_in_place` with entries (`apply_entries`'s `widen_back`) on the device, as
    on the CPU (`written_back_verdicts`): the same verdict as the torch ops (the result left as
    it was on a violation), or the same bits with the result then holding them widened, written
    by the kernels."""
    verdicts = written_back_verdicts(cuda_sites(3), np.random.default_rng(3), 8, 3, monkeypatch)
    assert verdicts["ok"] > 20 and verdicts["violation"] > 20, verdicts


@pytest.mark.parametrize("program", ["char-transformer", "image-cnn"])
def test_whole_steps_on_the_device_log_and_land_the_same_with_the_kernels(program, monkeypatch):
    """Record on CUDA with the kernels and with the torch ops: the same logs and states; those
    logs replayed on the CPU and on CUDA with the kernels: the recorded state each time."""
    served = []  # the CUDA tensors the kernels took
    real = fused.band_pass_serves

    def spy(t):
        serves = real(t)
        if serves and t.is_cuda:
            served.append(t.numel())
        return serves
    monkeypatch.setattr(fused, "band_pass_serves", spy)
    logs, states = {}, {}
    for name in ("kernels", "torch"):
        monkeypatch.setattr(fused, "ENABLED", name == "kernels")
        start, records, logs[name], states[name] = record_steps(program, "cuda")
        if name == "kernels":
            assert len(served) > 20  # the record's sites went through the kernels
            for profile in ("cuda", "threads=2"):
                assert replayed(program, profile, start, records) == states[name], profile
    assert logs["kernels"] == logs["torch"]
    assert states["kernels"] == states["torch"]
