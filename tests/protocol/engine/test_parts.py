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
from protocol.codec.roundinglog import RoundingLog, SiteLog
from protocol.codec.state import state_digest
from protocol.engine import divergence, fused, interceptor, rounding
from protocol.engine.executor import Executor
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program
from protocol.engine.rounding import BoundAdversary, SiteRecorder, SiteReplayer
from protocol.errors import LogMismatchError, LogViolationError

POLICY = PrecisionPolicy()
BF16 = PrecisionPolicy(torch.float32, torch.bfloat16)
SIZES = (3001, 2048, 0, 700)  # part boundaries inside, on and past each tensor's end
# (policy, unit roundoff): band entries as directions, or as values (16e >= ULP)
WIDENED = {"directions": (POLICY, 2.0**-33), "values": (POLICY, 2.0**-27),
           "bf16-directions": (BF16, 2.0**-17), "bf16-values": (BF16, 2.0**-13)}


def _operands(seed: int, policy: PrecisionPolicy = POLICY) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(n, generator=g) * 4 + 0.25).to(policy.target) for n in SIZES]


# (name, call): each a site of the float32 tensors `xs` (in place: on clones of them)
OPS = [
    ("exp", lambda xs: xs[0].exp()),
    ("rsqrt", lambda xs: xs[0].rsqrt()),
    ("erf", lambda xs: xs[0].erf()),
    ("pow.Tensor_Tensor", lambda xs: xs[0] ** xs[0].flip(0)),
    ("pow.Tensor_Scalar", lambda xs: xs[0] ** 1.7),
    ("_foreach_exp", lambda xs: torch._foreach_exp(xs)),
    ("_foreach_pow_.ScalarList", lambda xs: torch._foreach_pow_(xs, [1.3, 2.7, 0.5, 3.3])),
    ("_foreach_pow.List", lambda xs: torch._foreach_pow(xs, [x.flip(0) for x in xs])),
    ("pow_.Scalar", lambda xs: xs[0].pow_(0.7)),
    ("_foreach_pow_ aliased", lambda xs: torch._foreach_pow_([xs[0], xs[0]], [1.3, 2.7])),
]
# correctly rounded (e = 0): under the float64 -> float32 policy the fused pointwise pass takes
# them first, under float32 -> bfloat16 the parts path
EXACT_OPS = [
    ("sqrt", lambda xs: xs[0].sqrt()),
    ("sqrt_", lambda xs: xs[0].sqrt_()),
    ("_foreach_sqrt", lambda xs: torch._foreach_sqrt(xs)),
    ("div.Tensor", lambda xs: xs[0] / xs[0].flip(0)),
    ("div.Scalar", lambda xs: xs[0] / 3.1),
    ("_foreach_div_.ScalarList", lambda xs: torch._foreach_div_(xs, [1.3, 2.7, 0.5, 3.3])),
    ("_foreach_div.List", lambda xs: torch._foreach_div(xs, [x.flip(0) for x in xs])),
    ("div_.Scalar", lambda xs: xs[0].div_(0.7)),
    ("mul.Tensor", lambda xs: xs[0] * xs[0].flip(0)),
    ("mul_.Scalar", lambda xs: xs[0].mul_(1.1)),
    ("_foreach_mul_.Scalar", lambda xs: torch._foreach_mul_(xs, 0.9)),
    ("_foreach_add.List", lambda xs: torch._foreach_add(xs, [x.flip(0) for x in xs])),
    ("mul complex scalar", lambda xs: xs[0] * 1j),
]
# the parts path passes these by (aliased in-place writes; a complex scalar)
WHOLE = {"_foreach_pow_ aliased", "mul complex scalar"}


def _results(out, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What a call left: its results, and the operands it wrote in place."""
    if out is None:
        return list(xs)
    return list(out) if isinstance(out, (list, tuple)) else [out, *xs]


def _run(call, xs, rounder, parts: bool, u: float, monkeypatch, policy=POLICY,
         used: bool | None = None) -> list[torch.Tensor]:
    """`call` on copies of `xs` under a mode over `rounder`, the parts path on or off; asserts
    it ran where on (or as `used` says)."""
    monkeypatch.setattr(interceptor, "PARTS_FROM", 1024 if parts else 1 << 62)
    monkeypatch.setattr(interceptor, "PART", 512)
    mode = RoundingMode(policy, rounder)
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
    assert bool(calls) == (parts if used is None else used), "the parts path ran where asked"
    return [t.clone() for t in _results(out, operands)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
        for x, y in zip(a, b, strict=True))


def _both_ways(name, call, policy, u, monkeypatch, used=None):
    """Record in parts and whole: the same results and log; replay that log in parts and
    whole: the recorded results, each way. Returns the log."""
    xs = _operands(len(name), policy)
    recorders = {parts: SiteRecorder(policy) for parts in (False, True)}
    results = {parts: _run(call, xs, recorders[parts], parts, u, monkeypatch, policy,
                           used=used if parts else None)
               for parts in (False, True)}
    logs = {parts: recorders[parts].log() for parts in (False, True)}
    assert _same(results[True], results[False])
    assert logs[True] == logs[False]
    for parts in (False, True):
        replayer = SiteReplayer(policy, logs[True])
        got = _run(call, xs, replayer, parts, u, monkeypatch, policy,
                   used=used if parts else None)
        assert _same(got, results[True])
        replayer.finish()
    return logs[True]


@pytest.mark.parametrize(("name", "call"), OPS, ids=[name for name, _ in OPS])
@pytest.mark.parametrize("widened", list(WIDENED))
def test_a_site_in_parts_logs_and_replays_as_the_whole(name, call, widened, monkeypatch):
    """Both policies, entries as directions and as values in many parts (`_both_ways`)."""
    policy, u = WIDENED[widened]
    log = _both_ways(name, call, policy, u, monkeypatch, used=name not in WHOLE)
    logged = np.concatenate([s.indices for s in log.sites] + [s.value_indices
                                                             for s in log.sites])
    assert len({int(i) // 512 for i in logged}) >= 4, "entries in several parts"
    assert sum((s.value_indices if "values" in widened else s.indices).size
               for s in log.sites) > 20


@pytest.mark.parametrize(("name", "call"), EXACT_OPS, ids=[name for name, _ in EXACT_OPS])
def test_correctly_rounded_sites_in_parts_are_the_whole(name, call, monkeypatch):
    """Ops with e = 0 under float32 -> bfloat16, where the parts path takes them: the same
    results, logs and replays (`_both_ways`)."""
    _both_ways(name, call, BF16, 2.0**-24, monkeypatch, used=name not in WHOLE)


@pytest.mark.parametrize("policy", [POLICY, BF16], ids=["float32", "bfloat16"])
def test_tiny_quotients_keep_their_band_in_parts_and_whole(policy, monkeypatch):
    """Quotients in the target's subnormal range keep the relative rule (`bounds._quotient`):
    halves of subnormals, ties among them, are logged alike in parts and whole, and the fused
    pass does not take their site."""
    scale = 2.0**-148 if policy is POLICY else 2.0**-131
    log = _both_ways("tiny", lambda xs: (xs[0] * scale) / 2.0, policy, policy.unit_roundoff,
                     monkeypatch)
    assert sum(s.indices.size + s.value_indices.size for s in log.sites) > 20


def _tampered(log: RoundingLog, kinds: str) -> RoundingLog:
    """The log with invalid entries added: for each of `kinds` ("direction" or "value", in
    order), one in the first part after the last one's: a direction at an element far from any
    boundary, or a value entry whose value (1 + 2 ULPs) is far from the element's."""
    (site,) = log.sites
    taken = set(site.indices.tolist()) | set(site.value_indices.tolist())
    index = 0
    for kind in kinds.split(","):
        index = next(i for i in range(index + 512, site.numel) if i not in taken and i % 512 > 5)
        if kind == "direction":
            at = np.searchsorted(site.indices, index)
            site = dataclasses.replace(site, indices=np.insert(site.indices, at, index),
                                       up=np.insert(site.up, at, True))
        else:
            at = np.searchsorted(site.value_indices, index)
            site = dataclasses.replace(
                site, value_indices=np.insert(site.value_indices, at, index),
                values=np.insert(site.values, at, np.uint32(0x3F800002)))
    return RoundingLog((site,), log.parts)


@pytest.mark.parametrize("kinds", ["direction", "value", "value,direction", "value,value",
                                   "direction,value"])
@pytest.mark.parametrize("name", ["exp", "_foreach_exp", "_foreach_pow_.ScalarList"])
def test_violations_in_parts_are_reported_as_in_the_whole(name, kinds, monkeypatch):
    """Invalid entries in later parts: the same LogViolationError (site, op, index, text) in
    parts as whole — the whole path checks a result's directions before its values, so an
    invalid value entry in an early part loses to an invalid direction in a later one."""
    call = dict(OPS)[name]
    xs = _operands(7)
    recorder = SiteRecorder(POLICY)
    _run(call, xs, recorder, False, 2.0**-33, monkeypatch)
    log = _tampered(recorder.log(), kinds)
    raised = {}
    for parts in (False, True):
        with pytest.raises(LogViolationError) as caught:
            _run(call, xs, SiteReplayer(POLICY, log), parts, 2.0**-33, monkeypatch)
        raised[parts] = (str(caught.value), caught.value.site, caught.value.op)
    assert raised[True] == raised[False]
    if kinds == "value,direction" and name == "exp":  # (one result: the direction wins)
        assert "its logged value" not in raised[True][0]


@pytest.mark.parametrize("bad", [
    SiteLog(10, np.array([5, 3], dtype=np.int64), np.array([True, False])),
    SiteLog(10, np.array([4, 4], dtype=np.int64), np.array([True, False])),
    SiteLog(10, np.array([1], dtype=np.int64), np.array([True]), np.array([7, 2, 9]),
            np.array([1, 2, 3], dtype=np.uint32)),
], ids=["directions", "repeated", "values"])
def test_entries_out_of_order_are_refused(bad):
    """Entry indices must be strictly increasing (decode_log builds no other log; one made in
    memory may not be): the replayer refuses the site, when it reaches it, rather than read
    part of it. The order is checked for all sites at once (`_unordered_sites`): one site's
    last index above the next site's first is no disorder."""
    ordered = SiteLog(10, np.array([2, 9], dtype=np.int64), np.array([True, False]),
                      np.array([8]), np.array([0x3F80], dtype=np.uint32))
    empty = SiteLog(10, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool))
    replayer = SiteReplayer(POLICY, RoundingLog((empty, ordered, ordered, bad, ordered)))
    zeros = [torch.zeros(10, dtype=torch.float64)]
    replayer.round_site("op", zeros, [None])
    for _ in range(2):  # the ordered sites' entries are read (and invalid at e = 0)
        with pytest.raises(LogViolationError):
            replayer.round_site("op", zeros, [None])
    with pytest.raises(LogMismatchError, match="site 3 .*not strictly increasing"):
        replayer.round_site("op", zeros, [None])


def test_small_broadcast_and_probed_sites_stay_whole(monkeypatch):
    """The parts path passes by: a site under `PARTS_FROM`, an operand broadcast to the result,
    an out= form, a probe recorder (it must see each site whole) and a wrapper forwarding
    attributes to a recorder (the bound adversary: its move would be skipped)."""
    x = torch.rand(4096) + 0.5
    row = torch.rand(1) + 0.5
    cases = [
        (SiteRecorder(POLICY), lambda: x[:1000].exp()),
        (SiteRecorder(POLICY), lambda: x / row),
        (SiteRecorder(POLICY), lambda: torch.exp(x, out=torch.empty_like(x))),
        (BoundAdversary(SiteRecorder(POLICY), POLICY), lambda: x.exp()),
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


def test_a_rounder_that_overrides_round_site_alone_gets_every_site_whole():
    """A subclass of the recorder or replayer that overrides `round_site` (to see the values)
    but not `round_site_in_parts` (`round_result_in_place`) would miss the sites rounded in
    parts (in place): it gets `rounds_in_parts` (`rounds_in_place`) False, unless it says
    otherwise."""
    class Seeing(SiteReplayer):
        def round_site(self, op, ys, bounds):
            return super().round_site(op, ys, bounds)

    class Both(SiteRecorder):
        def round_site(self, op, ys, bounds):
            return super().round_site(op, ys, bounds)

        def round_site_in_parts(self, op, numel, results):
            return super().round_site_in_parts(op, numel, results)

        def round_result_in_place(self, op, y, bound):
            return super().round_result_in_place(op, y, bound)

    class Told(Seeing):
        rounds_in_parts = True
        rounds_in_place = True

    for flag in ("rounds_in_parts", "rounds_in_place"):
        assert not getattr(Seeing, flag) and getattr(Both, flag) and getattr(Told, flag), flag
        assert getattr(SiteRecorder, flag) and getattr(SiteReplayer, flag), flag
        assert not getattr(divergence.CapturingRecorder, flag), flag
        assert not getattr(divergence.ComparingReplayer, flag), flag
        assert getattr(program_cli._TallyingRecorder, flag), flag


def test_the_program_check_tally_counts_sites_rounded_in_parts(monkeypatch):
    """`ovt program check`'s recorder names the op of a site rounded in parts too (its tally
    zips the ops with the sites)."""
    monkeypatch.setattr(interceptor, "PARTS_FROM", 1024)
    monkeypatch.setattr(interceptor, "PART", 512)
    recorder = program_cli._TallyingRecorder(POLICY)
    big, small = torch.rand(3000) + 0.5, torch.rand(10) + 0.5
    with RoundingMode(POLICY, recorder):
        big.exp()
        small.sqrt()
    sites, elements, _ = recorder.tally()
    assert sites == {"aten.exp.default": 1, "aten.sqrt.default": 1}
    assert elements["aten.exp.default"] == 3000


@pytest.mark.parametrize("program", ["char-transformer", "token-lm"])  # (both AdamW)
def test_whole_steps_with_the_optimizer_in_parts(program, monkeypatch):
    """A program's steps with every elementwise site from 2048 elements in parts (the
    optimizer's square roots and divisions among them, the fused passes being off, which would
    take them): the same logs and states as whole, and each log replays to the recorded state
    the other way."""
    monkeypatch.setattr(fused, "ENABLED", False)

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


def test_each_part_reads_only_its_own_entries(monkeypatch):
    """A log cannot make every part (or every result of a foreach site) read all the site's
    entries — parts × entries work for an honest replayer: each check is handed the entries in
    its own range only."""
    xs = _operands(3)
    call = dict(OPS)["_foreach_exp"]  # results and parts
    recorder = SiteRecorder(POLICY)
    _run(call, xs, recorder, False, 2.0**-33, monkeypatch)
    log = recorder.log()
    handed = []
    real = rounding.apply_entries

    def spy(flat, y, bound, r, offset, entries, policy, wide):
        indices, _, value_indices, _ = entries
        handed.append(all(offset <= int(i) < offset + flat.numel()
                          for i in [*indices.tolist(), *value_indices.tolist()]))
        return real(flat, y, bound, r, offset, entries, policy, wide)

    for parts in (False, True):
        monkeypatch.setattr(rounding, "apply_entries", spy)
        _run(call, xs, SiteReplayer(POLICY, log), parts, 2.0**-33, monkeypatch)
    assert len(handed) > 8 and all(handed)
