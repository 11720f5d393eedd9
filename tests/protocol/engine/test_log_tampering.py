"""Tampered rounding logs (SPEC §3.2 validity, §3.3 site structure, §6 threats).

A trainer records three steps of image-cnn; the auditor replays them with doctored logs:
- an invented direction entry at an element far from any boundary (δ' > 4e'), or at a correctly
  rounded op (e' = 0), is a log violation naming step, site, op and element; so is another
  step's log, at its first site with entries;
- a value entry moved by many ULPs is a violation, and so is one invented far from a boundary
  or at a narrow element (direction entries rewritten as values); value entries rewritten as
  the directions that name them replay the same state on the trainer's profile;
- flipped directions make the replay diverge at exactly that step; so does a log with its
  entries dropped, replayed by the bound adversary;
- a log cut short, padded, or with a wrong site size is rejected as a mismatch;
- a log for another config, and a state for another program, are rejected clearly.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from protocol.codec.roundinglog import RoundingLog, SiteLog, decode_log, encode_log
from protocol.codec.state import state_digest
from protocol.engine.bandpass import dense_bounds
from protocol.engine.executor import Executor
from protocol.engine.precision import (
    PrecisionPolicy,
    boundary_distance,
    rounded_up,
    step_toward,
    target_ulp,
)
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program
from protocol.engine.rounding import SiteRecorder, site_values
from protocol.errors import ConfigError, LogFormatError, LogMismatchError, LogViolationError

POLICY = PrecisionPolicy()
TAMPERED_STEP = 2
EMPTY_INDEX, EMPTY_UP = np.zeros(0, np.int64), np.zeros(0, bool)


def _executor(program="image-cnn", profile="cpu-2t", **config) -> Executor:
    return Executor(load_program(program, config or None), seed=0, policy=POLICY,
                    profile=Profile.parse(profile))


class Capture(SiteRecorder):
    """Record mode that also keeps every site's op, compute-dtype values and bounds."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        super().__init__(policy)
        self.ops: list[str] = []
        self.values: list[torch.Tensor] = []
        self.bounds: list[torch.Tensor | None] = []

    def round_site(self, op, ys, bounds):
        self.ops.append(op)
        self.values.append(site_values(ys).detach().clone())
        e = dense_bounds(ys, bounds)
        self.bounds.append(None if e is None else e.detach().clone())
        return super().round_site(op, ys, bounds)

    def claim_exact_site(self, op: str, numel: int) -> bool:
        return False  # every site's values are kept, so every site is widened


@pytest.fixture(scope="module")
def recording():
    """S_0, the logs of steps 1..3, the hashes h_1..h_3 and step 2's sites (ops, values,
    bounds) as the trainer computed them; and S_1, from which a tampered step 2 is replayed."""
    ex = _executor()
    ex.init_state(1)
    states = [ex.state()]
    logs, hashes, captured = [], [], None
    for t in (1, 2, 3):
        rounder = Capture(POLICY) if t == TAMPERED_STEP else None
        logs.append(ex.step(rounder=rounder).log)
        hashes.append(state_digest(ex.state()))
        states.append(ex.state())
        if rounder is not None:
            captured = rounder
    assert captured is not None and len(captured.ops) == len(logs[TAMPERED_STEP - 1].sites)
    return states, logs, hashes, captured


def _replay(state, logs, profile="cpu-2t"):
    """Replay the logs from `state`; return the hashes reached (stops at the first exception)."""
    ex = _executor(profile=profile)
    ex.load_state(state)
    reached = []
    for log in logs:
        ex.step(log)
        reached.append(state_digest(ex.state()))
    return reached


def _replay_tampered(recording, logs, profile="cpu-2t"):
    """Replay the tampered step alone, from the honest state before it (the steps before it are
    the untampered replays); return the hash it reaches."""
    states = recording[0]
    (reached,) = _replay(states[TAMPERED_STEP - 1], [logs[TAMPERED_STEP - 1]], profile)
    return reached


def _with_site(logs: list[RoundingLog], k: int, site: SiteLog) -> list[RoundingLog]:
    """The logs with site k of the tampered step replaced."""
    log = logs[TAMPERED_STEP - 1]
    sites = list(log.sites)
    sites[k] = site
    out = list(logs)
    out[TAMPERED_STEP - 1] = RoundingLog(tuple(sites))
    return out


def _insert(indices: np.ndarray, other: np.ndarray, i: int, v) -> tuple[np.ndarray, np.ndarray]:
    """`indices` (sorted) with index i added, and `other` (aligned) with v at the same place."""
    at = int(np.searchsorted(indices, i))
    return np.insert(indices, at, i), np.insert(other, at, v)


def _far_element(captured: Capture, k: int, log: RoundingLog) -> int:
    """An element of site k with e > 0, far outside the band (δ > 100e), not logged."""
    y, e = captured.values[k], captured.bounds[k]
    d = boundary_distance(y, y.to(POLICY.target), POLICY)
    far = ((e.to(torch.float64) > 0) & (d > 100 * e.to(torch.float64))).nonzero().squeeze(1)
    logged = set(log.sites[k].indices.tolist()) | set(log.sites[k].value_indices.tolist())
    return next(int(i) for i in far if int(i) not in logged)


def test_untampered_logs_replay_exactly_on_another_profile(recording):
    states, logs, hashes, _ = recording
    assert _replay(states[0], logs, profile="emulated-gpu") == hashes


def test_untampered_logs_replay_exactly_against_the_bound_adversary(recording):
    states, logs, hashes, _ = recording
    assert _replay(states[0], logs, profile="adversary") == hashes


def test_invented_entry_far_from_any_boundary_is_a_violation(recording):
    _, logs, _, captured = recording
    log = logs[TAMPERED_STEP - 1]
    # A convolution (a reduction: e > 0) with an element far from every boundary that the
    # trainer did not log: claiming a rounding choice there is a lie.
    k = next(i for i, op in enumerate(captured.ops)
             if op == "aten.convolution.default" and log.sites[i].numel > 1000)
    far = _far_element(captured, k, log)
    site = log.sites[k]
    indices, up = _insert(site.indices, site.up, far, True)
    forged = SiteLog(site.numel, indices, up, site.value_indices, site.values)
    with pytest.raises(LogViolationError) as err:
        _replay_tampered(recording, _with_site(logs, k, forged))
    v = err.value
    assert (v.step, v.site, v.op, v.index) == (TAMPERED_STEP, k, "aten.convolution.default", far)
    assert v.bound == float(captured.bounds[k][far]) > 0
    assert v.distance > 4 * v.bound
    assert str(v).startswith(f"log violation at step {TAMPERED_STEP}, site {k} "
                             f"(aten.convolution.default), element {far}: ")


def test_invented_entry_at_a_correctly_rounded_op_is_a_violation(recording):
    """At an IEEE multiply (e' = 0) every machine computes the same bits: an entry there, even
    at an element that happens to sit right next to a boundary, is a lie."""
    _, logs, _, captured = recording
    k = next(i for i, (op, e) in enumerate(zip(captured.ops, captured.bounds, strict=True))
             if op == "aten.mul.Tensor" and e is None and captured.values[i].numel() > 100)
    y = captured.values[k]
    nearest = int(boundary_distance(y, y.to(POLICY.target), POLICY).argmin())
    site = logs[TAMPERED_STEP - 1].sites[k]
    assert site.indices.size == site.value_indices.size == 0
    forged = SiteLog(site.numel, np.array([nearest]), np.array([True]))
    with pytest.raises(LogViolationError) as err:
        _replay_tampered(recording, _with_site(logs, k, forged))
    assert (err.value.step, err.value.site, err.value.index) == (TAMPERED_STEP, k, nearest)
    assert err.value.op == "aten.mul.Tensor" and err.value.bound == 0.0
    assert "correctly rounded" in str(err.value)


def test_flipped_directions_diverge_at_exactly_that_step(recording):
    """A flip is a legal choice, so no violation: the state simply is not the one the trainer
    committed to. Flipped at one of the last sites with direction entries (the backward
    pass's convolution gradients), the replay completes the step with another hash. (Not at
    every such site: a 1-ULP change of a few gradient elements can round away in the update;
    and one upstream of later entries can move those out of their bands, a violation.)"""
    _, logs, hashes, _ = recording
    log = logs[TAMPERED_STEP - 1]
    candidates = [i for i, s in enumerate(log.sites) if s.indices.size > 0][-3:]
    diverged = []
    for k in reversed(candidates):
        site = log.sites[k]
        flipped = SiteLog(site.numel, site.indices, ~site.up, site.value_indices, site.values)
        with contextlib.suppress(LogViolationError):
            diverged.append(_replay_tampered(recording, _with_site(logs, k, flipped))
                            != hashes[TAMPERED_STEP - 1])
    assert any(diverged), f"no flip at sites {candidates} changed the state"


def test_dropped_entries_diverge_at_exactly_that_step_against_the_adversary(recording):
    """Missing entries (SPEC §6): replayed by the bound adversary, every in-band element closer
    to its boundary than e/2 rounds the other way, so the state differs at that step."""
    _, logs, hashes, _ = recording
    log = logs[TAMPERED_STEP - 1]
    stripped = list(logs)
    stripped[TAMPERED_STEP - 1] = RoundingLog(tuple(SiteLog(s.numel, EMPTY_INDEX, EMPTY_UP)
                                                    for s in log.sites))
    assert _replay_tampered(recording, stripped, "adversary") != hashes[TAMPERED_STEP - 1]


# -- value entries ------------------------------------------------------------------------------


def test_value_entry_moved_many_ulps_is_a_violation(recording):
    _, logs, _, captured = recording
    log = logs[TAMPERED_STEP - 1]
    k = next(i for i, s in enumerate(log.sites) if s.value_indices.size > 0)
    site = log.sites[k]
    i = int(site.value_indices[0])
    y, e = captured.values[k][i:i + 1], float(captured.bounds[k][i])
    ulp = float(target_ulp(y.to(POLICY.target), POLICY)[0])
    sign = 1.0 if float(y[0]) >= 0 else -1.0
    moved = (y + sign * (8 * ulp + 8 * e)).to(POLICY.target)
    distance = abs(float(moved[0]) - float(y[0]))
    assert distance > float(target_ulp(moved, POLICY)[0]) + 4 * e  # beyond any honest value
    values = site.values.copy()
    values[0] = int(moved.view(torch.int32)[0]) & 0xFFFF_FFFF
    forged = SiteLog(site.numel, site.indices, site.up, site.value_indices, values)
    with pytest.raises(LogViolationError) as err:
        _replay_tampered(recording, _with_site(logs, k, forged))
    v = err.value
    assert (v.step, v.site, v.op, v.index) == (TAMPERED_STEP, k, captured.ops[k], i)
    assert v.distance == pytest.approx(distance, rel=1e-12) and v.bound == e
    assert f"site {k} ({captured.ops[k]}), element {i}" in str(v)
    assert "logged value" in str(v)


def _directions_as_values(log: RoundingLog, captured: Capture) -> RoundingLog:
    """Every direction entry rewritten as a value entry holding the very value it named."""
    sites = []
    for k, site in enumerate(log.sites):
        if not site.indices.size:
            sites.append(site)
            continue
        idx = torch.from_numpy(site.indices)
        y = captured.values[k][idx]
        named = step_toward(y.to(POLICY.target), y, torch.from_numpy(site.up), POLICY)
        bits = named.view(torch.int32).numpy().astype(np.int64) & 0xFFFF_FFFF
        indices = np.concatenate([site.indices, site.value_indices])
        values = np.concatenate([bits, site.values.astype(np.int64)])
        order = np.argsort(indices)
        sites.append(SiteLog(site.numel, EMPTY_INDEX, EMPTY_UP, indices[order],
                             values[order].astype(np.uint32)))
    return RoundingLog(tuple(sites))


def _values_as_directions(log: RoundingLog, captured: Capture) -> RoundingLog:
    """Every value entry rewritten as the direction that leads to its value from y."""
    sites = []
    for k, site in enumerate(log.sites):
        if not site.value_indices.size:
            sites.append(site)
            continue
        idx = torch.from_numpy(site.value_indices)
        y = captured.values[k][idx]
        v = torch.from_numpy(site.values.astype(np.int64)).to(torch.int32).view(torch.float32)
        assert torch.equal(v, y.to(POLICY.target))  # the trainer logs its RNE result
        up = rounded_up(y, v).numpy()
        indices = np.concatenate([site.indices, site.value_indices])
        ups = np.concatenate([site.up, up])
        order = np.argsort(indices)
        sites.append(SiteLog(site.numel, indices[order], ups[order]))
    return RoundingLog(tuple(sites))


@pytest.mark.parametrize("profile", ["cpu-2t", "emulated-gpu"])
def test_direction_entries_rewritten_as_values_are_violations(recording, profile):
    """A value entry is legal only where the element's bound is wide (32e' >= its ULP): the
    trainer's direction entries, all narrow, rewritten as their values claim a choice of value
    that no honest machine had, and the replay rejects the step (on any profile)."""
    _, logs, hashes, captured = recording
    log = logs[TAMPERED_STEP - 1]
    rewritten = _directions_as_values(log, captured)
    assert rewritten.n_directions == 0 and rewritten.n_values == log.n_entries
    assert encode_log(rewritten) != encode_log(log)
    tampered = list(logs)
    tampered[TAMPERED_STEP - 1] = rewritten
    with pytest.raises(LogViolationError) as info:
        _replay_tampered(recording, tampered, profile)
    assert "not a choice an honest machine had" in str(info.value)


def test_value_entries_rewritten_as_directions_replay_the_same_state_on_that_profile(recording):
    """On the trainer's own profile y' = y, so the direction towards a logged value names that
    value (and the element is in the band: δ <= 2e <= 4e', a valid direction entry)."""
    _, logs, hashes, captured = recording
    log = logs[TAMPERED_STEP - 1]
    assert log.n_values > 0
    rewritten = _values_as_directions(log, captured)
    assert rewritten.n_values == 0 and rewritten.n_directions == log.n_entries
    tampered = list(logs)
    tampered[TAMPERED_STEP - 1] = rewritten
    assert _replay_tampered(recording, tampered) == hashes[TAMPERED_STEP - 1]


def test_invented_value_entry_far_from_any_boundary_is_a_violation(recording):
    """The threat of SPEC §6 'invented entries', as a value entry: at the parameter update
    (SGD's p += -lr·buf, an axpy with e > 0) a far-from-boundary element is given its other
    neighbour. No honest machine could round it so; the replay must reject the log."""
    _, logs, _, captured = recording
    log = logs[TAMPERED_STEP - 1]
    k = len(log.sites) - 1
    assert captured.ops[k] == "aten._foreach_add_.List" and captured.bounds[k] is not None
    i = _far_element(captured, k, log)
    y = captured.values[k][i:i + 1]
    r = y.to(POLICY.target)
    other = step_toward(r, y, ~rounded_up(y, r), POLICY)
    site = log.sites[k]
    v_idx, values = _insert(site.value_indices, site.values.astype(np.int64), i,
                            int(other.view(torch.int32)[0]) & 0xFFFF_FFFF)
    forged = SiteLog(site.numel, site.indices, site.up, v_idx, values.astype(np.uint32))
    # (an earlier replayer accepted it: that parameter moved by the one ULP the trainer chose,
    # and the doctored state replayed as if it were honest)
    with pytest.raises(LogViolationError) as err:
        _replay_tampered(recording, _with_site(logs, k, forged))
    assert (err.value.step, err.value.site, err.value.index) == (TAMPERED_STEP, k, i)


# -- structure ----------------------------------------------------------------------------------


def test_log_cut_short_is_rejected(recording):
    states, logs, _, _ = recording
    s0 = states[0]
    log = logs[0]
    with pytest.raises(LogMismatchError, match="cut short"):
        _replay(s0, [RoundingLog(log.sites[:-1])])


def test_padded_log_is_rejected(recording):
    states, logs, _, _ = recording
    s0 = states[0]
    log = logs[0]
    extra = SiteLog(4, EMPTY_INDEX, EMPTY_UP)
    with pytest.raises(LogMismatchError, match="padded"):
        _replay(s0, [RoundingLog((*log.sites, extra))])


def test_wrong_site_size_is_rejected(recording):
    states, logs, _, _ = recording
    s0 = states[0]
    log = logs[0]
    site = log.sites[3]
    wrong = SiteLog(site.numel + 1, site.indices, site.up, site.value_indices, site.values)
    with pytest.raises(LogMismatchError, match=r"^step 1: site 3 \(.*\) produced .* elements"):
        _replay(s0, [RoundingLog((*log.sites[:3], wrong, *log.sites[4:]))])


def test_another_steps_log_is_a_violation_at_its_first_logged_site(recording):
    states, logs, _, _ = recording
    s0 = states[0]
    # Step 2's log fits step 1's site structure, but its entries sit near a boundary in step
    # 2's values, not in step 1's: there their distances are spread over [0, ulp/2] while 4e'
    # is a small fraction of a ULP. So the validity check rejects the log at the first site
    # that has entries, before any state is reached (an entry lands in its band there with a
    # chance of about 8e'/ulp, far below 1%).
    other = logs[1]
    k = next(i for i, s in enumerate(other.sites) if s.indices.size + s.value_indices.size)
    with pytest.raises(LogViolationError) as err:
        _replay(s0, [other])
    assert (err.value.step, err.value.site) == (1, k)
    assert err.value.index in set(other.sites[k].indices.tolist())
    assert err.value.distance > 4 * err.value.bound > 0


def test_malformed_log_bytes_are_rejected(recording):
    _, logs, _, _ = recording
    data = encode_log(logs[0])
    with pytest.raises(LogFormatError):
        decode_log(data[: len(data) // 2])
    with pytest.raises(LogFormatError):
        decode_log(b"XXXX" + data[4:])


def test_log_of_another_config_is_rejected(recording):
    states, logs, _, _ = recording
    s0 = states[0]
    ex = _executor(batch_size=16)  # same parameters, other batch size: other site sizes
    ex.load_state(s0)
    with pytest.raises(LogMismatchError, match="site 0 .*elements"):
        ex.step(logs[0])


def test_state_of_another_program_is_rejected(recording):
    s0 = recording[0][0]
    with pytest.raises(ConfigError, match="does not fit"):
        _executor("char-transformer").load_state(s0)


def test_state_of_another_model_size_is_rejected(recording):
    s0 = recording[0][0]
    with pytest.raises(ConfigError, match="wrong program or config"):
        _executor(channels=8).load_state(s0)
