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

from protocol.codec.roundinglog import SiteLog, encode_log
from protocol.codec.state import state_digest
from protocol.engine import bandpass, fused
from protocol.engine.bandpass import nearest, round_band
from protocol.engine.bounds import Affine, Bound
from protocol.engine.executor import Executor
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program
from tests.protocol.engine.test_bandpass import (
    F64,
    POLICY,
    assert_same_pass,
    hard_values,
    replay_in_place,
    same_replay,
    sites,
    value_choices,
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
    """Entry by entry on every hard site (a direction either way, value entries of every kind),
    each a one-entry log: the kernel's verdict and bits are the torch ops' on the device; then
    all the valid ones of a site at once, directions and values."""
    rng = np.random.default_rng(0)
    verdicts = {"ok": 0, "violation": 0}
    for name, y, bound in cuda_sites(0):
        flat = y.reshape(-1)
        if not flat.numel():
            continue
        r = flat.to(torch.float32).cpu()
        picks = sorted(int(p) for p in rng.choice(flat.numel(), size=min(25, flat.numel()),
                                                  replace=False))
        dirs: dict[int, bool] = {}
        values: dict[int, int] = {}
        for i in picks:
            index = np.array([i], dtype=np.int64)
            for up in (False, True):
                site = SiteLog(flat.numel(), index, np.array([up]))
                verdict, applied = same_replay([y], [bound], site, monkeypatch)
                verdicts[verdict] += 1
                if verdict == "ok":
                    assert applied == [True] or bound is None, name
                    dirs[i] = up
            for bits in value_choices(r[i]):
                site = SiteLog(flat.numel(), np.zeros(0, dtype=np.int64), np.zeros(0, bool),
                               index, np.array([bits], dtype=np.int64))
                verdict, applied = same_replay([y], [bound], site, monkeypatch)
                verdicts[verdict] += 1
                if verdict == "ok":
                    assert applied == [True], name
                    values.setdefault(i, bits)
        values = {i: b for i, b in values.items() if i not in dirs}
        site = SiteLog(flat.numel(), np.array(sorted(dirs), dtype=np.int64),
                       np.array([dirs[i] for i in sorted(dirs)], dtype=bool),
                       np.array(sorted(values), dtype=np.int64),
                       np.array([values[i] for i in sorted(values)], dtype=np.int64))
        assert same_replay([y], [bound], site, monkeypatch)[0] == "ok", name
    assert verdicts["ok"] > 50 and verdicts["violation"] > 50, verdicts


def test_replayed_entries_written_back_on_the_device_as_by_the_torch_ops(monkeypatch):
    """`round_result_in_place` with entries (`apply_entries`'s `widen_back`) on the device: the
    same verdict as the torch ops (the result left as it was on a violation), or the same bits
    with the result then holding them widened, by the kernels."""
    from protocol.engine import rounding
    done: list[bool] = []  # what the fused pass returned, asked to write back
    real = bandpass.apply_entries

    def spy(*args, widen_back=False):
        applied = real(*args, widen_back=widen_back)
        if widen_back and fused.ENABLED:
            done.append(applied)
        return applied
    monkeypatch.setattr(rounding, "apply_entries", spy)
    rng = np.random.default_rng(3)
    verdicts = {"ok": 0, "violation": 0}
    for name, y, bound in cuda_sites(3):
        flat = y.reshape(-1)
        if not flat.numel() or not y.is_contiguous() or bound is None:
            continue
        r = flat.to(torch.float32).cpu()
        picks = sorted(int(p) for p in rng.choice(flat.numel(), size=8, replace=False))
        logs = [SiteLog(flat.numel(), np.array([i], dtype=np.int64), np.array([up]))
                for i in picks for up in (False, True)]
        logs += [SiteLog(flat.numel(), np.zeros(0, dtype=np.int64), np.zeros(0, bool),
                         np.array([i], dtype=np.int64), np.array([bits], dtype=np.int64))
                 for i in picks[:3] for bits in value_choices(r[i])]
        for site in logs:
            done.clear()
            got = replay_in_place(y, bound, site, monkeypatch, True)
            want = replay_in_place(y, bound, site, monkeypatch, False)
            assert got[0] == want[0], (name, got[:2], want[:2])
            verdicts[got[0]] += 1
            if got[0] == "violation":
                assert got[1] == want[1], name
                assert torch.equal(got[2], y.view(torch.int64)), name
                continue
            assert done == [True], name  # the kernels did it
            assert torch.equal(got[1], want[1]) and got[2], name
            widened = got[1].view(torch.float32).double().view(torch.int64).view(y.shape)
            assert torch.equal(got[3], widened), name
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
        ex = Executor(load_program(program, preset="test"), seed=3, policy=POLICY,
                      profile=Profile.parse("cuda"))
        ex.init_state(1)
        start = ex.state()
        records = [ex.step().log for _ in range(2)]
        logs[name] = [encode_log(log) for log in records]
        states[name] = state_digest(ex.state())
        if name != "kernels":
            continue
        assert len(served) > 20  # the record's sites went through the kernels
        for profile in ("cuda", "threads=2"):
            auditor = Executor(load_program(program, preset="test"), seed=3, policy=POLICY,
                               profile=Profile.parse(profile))
            auditor.load_state(start)
            for log in records:
                auditor.step(log)
            assert state_digest(auditor.state()) == states[name], profile
    assert logs["kernels"] == logs["torch"]
    assert states["kernels"] == states["torch"]
