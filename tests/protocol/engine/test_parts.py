"""Tests of large elementwise sites computed and rounded in parts (`RoundingMode._in_parts`).

Rounding a site in parts must change nothing the protocol sees: the same values, the same log
entries at the same site positions, the same replayed results and the same violations as the
site rounded whole. The part sizes are lowered here (`PARTS_FROM`, `PART`) so that small
tensors go in many parts; `PART` stays a multiple of every vector width, as the real one is.
The relative rules' unit roundoff is raised on the mode's bound context so that elements fall in
the band in every part — as direction entries (u = 2**-33) or value entries (u = 2**-27).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from protocol.cli import program as program_cli
from protocol.codec.roundinglog import RoundingLog
from protocol.codec.state import state_digest
from protocol.engine import divergence, interceptor, rounding
from protocol.engine.executor import Executor
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program
from protocol.engine.rounding import BoundAdversary, SiteRecorder, SiteReplayer
from protocol.errors import LogViolationError

POLICY = PrecisionPolicy()
SIZES = (3001, 2048, 0, 700)  # part boundaries inside, on and past each tensor's end


def _operands(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, generator=g) * 4 + 0.25).float() for n in SIZES]


# (name, call): each a site of the float32 tensors `xs` (in place: on clones of them)
OPS = [
    ("sqrt", lambda xs: xs[0].sqrt()),
    ("exp", lambda xs: xs[0].exp()),
    ("rsqrt", lambda xs: xs[0].rsqrt()),
    ("erf", lambda xs: xs[0].erf()),
    ("div.Tensor", lambda xs: xs[0] / xs[0].flip(0)),
    ("div.Scalar", lambda xs: xs[0] / 3.1),
    ("pow.Tensor_Scalar", lambda xs: xs[0] ** 1.7),
    ("sqrt_", lambda xs: xs[0].sqrt_()),
    ("_foreach_sqrt", lambda xs: torch._foreach_sqrt(xs)),
    ("_foreach_exp", lambda xs: torch._foreach_exp(xs)),
    ("_foreach_div_.ScalarList", lambda xs: torch._foreach_div_(xs, [1.3, 2.7, 0.5, 3.3])),
    ("_foreach_div.List", lambda xs: torch._foreach_div(xs, [x.flip(0) for x in xs])),
]


def _results(out, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a call left: its results, and the operands it wrote in place."""
    if out is None:
        return list(xs)
    return list(out) if isinstance(out, (list, tuple)) else [out, *xs]


def _run(call, xs, rounder, parts: bool, u: float, monkeypatch) -> list[torch.Tensor]:
    monkeypatch.setattr(interceptor, "PARTS_FROM", 1024 if parts else 1 << 62)
    monkeypatch.setattr(interceptor, "PART", 512)
    mode = RoundingMode(POLICY, rounder)
    mode._bounds.u = u  # wide bounds: elements in the band in every part
    calls = []
    real = type(rounder).round_site_in_parts if hasattr(type(rounder), "round_site_in_parts") \
        else None
    if real is not None:
        def counted(self, op, numel, parts_):
            calls.append(op)
            return real(self, op, numel, parts_)
        monkeypatch.setattr(type(rounder), "round_site_in_parts", counted)
    operands = [x.clone() for x in xs]
    with mode:
        out = call(operands)
    monkeypatch.undo()
    assert bool(calls) == parts, "the parts path ran where it was asked for, and only there"
    return [t.clone() for t in _results(out, operands)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.view(torch.int32), y.view(torch.int32))
        for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(("name", "call"), OPS, ids=[name for name, _ in OPS])
@pytest.mark.parametrize("u", [2.0**-33, 2.0**-27], ids=["directions", "values"])
def test_a_site_in_parts_logs_and_replays_as_the_whole(name, call, u, monkeypatch):
    """Record in parts and whole: the same results and log; replay each log in parts and
    whole: the recorded results, each way."""
    xs = _operands(len(name))
    recorders = {parts: SiteRecorder(POLICY) for parts in (False, True)}
    results = {parts: _run(call, xs, recorders[parts], parts, u, monkeypatch)
               for parts in (False, True)}
    logs = {parts: recorders[parts].log() for parts in (False, True)}
    assert _same(results[True], results[False])
    assert logs[True] == logs[False]
    (site,) = logs[True].sites
    logged = np.concatenate([site.indices, site.value_indices])
    assert len({int(i) // 512 for i in logged}) >= 4, "entries in several parts"
    assert (site.value_indices.size if u > 2.0**-30 else site.indices.size) > 20
    for parts in (False, True):
        replayer = SiteReplayer(POLICY, logs[True])
        assert _same(_run(call, xs, replayer, parts, u, monkeypatch), results[True])
        replayer.finish()


def _tampered(log: RoundingLog, kind: str) -> RoundingLog:
    """The log with one invalid entry added in a late part: a direction at an element far from
    any boundary, or a value entry whose value is two ULPs off."""
    (site,) = log.sites
    taken = set(site.indices.tolist()) | set(site.value_indices.tolist())
    index = next(i for i in range(site.numel - 1, 0, -1) if i not in taken and i % 512 > 5)
    if kind == "direction":
        at = np.searchsorted(site.indices, index)
        changed = dataclasses.replace(site, indices=np.insert(site.indices, at, index),
                                      up=np.insert(site.up, at, True))
    else:
        at = np.searchsorted(site.value_indices, index)
        changed = dataclasses.replace(
            site, value_indices=np.insert(site.value_indices, at, index),
            values=np.insert(site.values, at, np.uint32(0x3F800002)))
    return RoundingLog((changed,), log.parts)


@pytest.mark.parametrize("kind", ["direction", "value"])
@pytest.mark.parametrize(("name", "call"), [OPS[0], OPS[8], OPS[10]],
                         ids=[OPS[0][0], OPS[8][0], OPS[10][0]])
def test_a_violation_in_a_late_part_is_reported_as_in_the_whole(name, call, kind, monkeypatch):
    """An invalid entry in a late part: the same LogViolationError (site, op, index, text) in
    parts as whole."""
    xs = _operands(7)
    recorder = SiteRecorder(POLICY)
    _run(call, xs, recorder, False, 2.0**-33, monkeypatch)
    log = _tampered(recorder.log(), kind)
    raised = {}
    for parts in (False, True):
        with pytest.raises(LogViolationError) as caught:
            _run(call, xs, SiteReplayer(POLICY, log), parts, 2.0**-33, monkeypatch)
        raised[parts] = (str(caught.value), caught.value.site, caught.value.op)
    assert raised[True] == raised[False]


def test_small_broadcast_and_probed_sites_stay_whole(monkeypatch):
    """The parts path passes by: a site under `PARTS_FROM`, an operand broadcast to the result,
    an out= form, a probe recorder (it must see each site whole) and a wrapper forwarding
    attributes to a recorder (the bound adversary: its move would be skipped)."""
    x = torch.rand(4096) + 0.5
    row = torch.rand(1) + 0.5
    cases = [
        (SiteRecorder(POLICY), lambda: x[:1000].sqrt()),
        (SiteRecorder(POLICY), lambda: x / row),
        (SiteRecorder(POLICY), lambda: torch.sqrt(x, out=torch.empty_like(x))),
        (BoundAdversary(SiteRecorder(POLICY), POLICY), lambda: x.sqrt()),
    ]
    monkeypatch.setattr(interceptor, "PARTS_FROM", 2048)
    monkeypatch.setattr(interceptor, "PART", 512)
    ran = []
    monkeypatch.setattr(SiteRecorder, "round_site_in_parts",
                        lambda self, op, numel, parts: ran.append(op))
    for rounder, call in cases:
        with RoundingMode(POLICY, rounder):
            call()
    assert ran == []
    for cls in (divergence.CapturingRecorder, divergence.ComparingReplayer):
        assert not cls.rounds_in_parts


def _subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


def test_every_rounder_that_overrides_round_site_says_whether_it_rounds_in_parts():
    """A subclass of the recorder or replayer that overrides `round_site` (to see the values)
    but inherits `round_site_in_parts` would miss the sites rounded in parts: each of ovt's
    must set `rounds_in_parts` itself or override both."""
    assert divergence and program_cli  # (imported: their rounders are among the subclasses)
    checked = []
    for base in (rounding.SiteRecorder, rounding.SiteReplayer):
        for cls in _subclasses(base):
            if "round_site" in vars(cls) and cls.__module__.startswith("protocol."):
                assert "rounds_in_parts" in vars(cls) or "round_site_in_parts" in vars(cls), cls
                checked.append(cls.__name__)
    assert {"CapturingRecorder", "ComparingReplayer", "_TallyingRecorder"} <= set(checked)


def test_the_program_check_tally_counts_sites_rounded_in_parts(monkeypatch):
    """`ovt program check`'s recorder names the op of a site rounded in parts too (its tally
    zips the ops with the sites)."""
    monkeypatch.setattr(interceptor, "PARTS_FROM", 1024)
    monkeypatch.setattr(interceptor, "PART", 512)
    recorder = program_cli._TallyingRecorder(POLICY)
    big, small = torch.rand(3000) + 0.5, torch.rand(10) + 0.5
    with RoundingMode(POLICY, recorder):
        big.sqrt()
        small.exp()
    sites, elements, _ = recorder.tally()
    assert sites == {"aten.sqrt.default": 1, "aten.exp.default": 1}
    assert elements["aten.sqrt.default"] == 3000


@pytest.mark.parametrize("program", ["char-transformer", "token-lm"])  # (both AdamW)
def test_whole_steps_with_the_optimizer_in_parts(program, monkeypatch):
    """A program's steps with every elementwise site from 2048 elements in parts (the
    optimizer's square roots and divisions among them): the same logs and states as whole, and
    each log replays to the recorded state the other way."""
    def executor(threads: int) -> Executor:
        return Executor(load_program(program, preset="test"), seed=5, policy=POLICY,
                        profile=Profile.parse(f"threads={threads}"))

    logs, states, starts = {}, {}, {}
    spied: list[str] = []
    real = SiteRecorder.round_site_in_parts

    def counted(self, op, numel, parts):
        spied.append(op)
        return real(self, op, numel, parts)

    for parts in (False, True):
        monkeypatch.setattr(interceptor, "PARTS_FROM", 2048 if parts else 1 << 62)
        monkeypatch.setattr(interceptor, "PART", 1024)
        monkeypatch.setattr(SiteRecorder, "round_site_in_parts", counted)
        ex = executor(2)
        ex.init_state(1)
        starts[parts] = ex.state()
        logs[parts] = [ex.step().log for _ in range(2)]
        states[parts] = state_digest(ex.state())
    assert spied, "some site went in parts"
    assert logs[True] == logs[False] and states[True] == states[False]
    for parts in (False, True):  # each log replayed the other way
        monkeypatch.setattr(interceptor, "PARTS_FROM", 2048 if parts else 1 << 62)
        auditor = executor(1)
        auditor.load_state(starts[not parts])
        for log in logs[not parts]:
            auditor.step(log)
        assert state_digest(auditor.state()) == states[not parts]
