"""Tampered rounding logs (SPEC §3.2 validity, §3.3 site structure, §6 threats).

A trainer records three steps of image-cnn; the auditor replays them with doctored logs:
- an invented entry at an element far from any boundary is a log violation naming step, site
  and element; so is another step's log, at its first site with entries;
- a flipped direction makes the replay diverge at exactly that step;
- a log cut short, padded, or with a wrong site size is rejected as a mismatch;
- a log for another config, and a state for another program, are rejected clearly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.codec.roundinglog import RoundingLog, SiteLog, decode_log, encode_log
from protocol.codec.state import state_digest
from protocol.engine.divergence import CapturingRecorder
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy, distance_to_boundary
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program
from protocol.errors import ConfigError, LogFormatError, LogMismatchError, LogViolationError

POLICY = PrecisionPolicy()
TAMPERED_STEP = 2


def _executor(program="image-cnn", profile="cpu-2t", **config) -> Executor:
    return Executor(load_program(program, config or None), seed=0, policy=POLICY,
                    profile=Profile.parse(profile))


@pytest.fixture(scope="module")
def recording():
    """S_0, the logs of steps 1..3, the hashes h_1..h_3 and step 2's pre-rounding values."""
    ex = _executor()
    ex.init_state(1)
    s0 = ex.state()
    logs, hashes, captured = [], [], None
    for t in (1, 2, 3):
        rounder = CapturingRecorder(POLICY) if t == TAMPERED_STEP else None
        logs.append(ex.step(rounder=rounder).log)
        hashes.append(state_digest(ex.state()))
        if rounder is not None:
            captured = rounder.captured
    return s0, logs, hashes, captured


def _replay(s0, logs, profile="cpu-2t"):
    """Replay the logs; return the hashes reached (stops at the first exception)."""
    ex = _executor(profile=profile)
    ex.load_state(s0)
    reached = []
    for log in logs:
        ex.step(log)
        reached.append(state_digest(ex.state()))
    return reached


def _with_site(log: RoundingLog, k: int, site: SiteLog) -> RoundingLog:
    sites = list(log.sites)
    sites[k] = site
    return RoundingLog(tuple(sites))


def test_untampered_logs_replay_exactly_on_another_profile(recording):
    s0, logs, hashes, _ = recording
    assert _replay(s0, logs, profile="emulated-gpu") == hashes


def test_invented_entry_far_from_any_boundary_is_a_violation(recording):
    s0, logs, _, captured = recording
    log = logs[TAMPERED_STEP - 1]
    # A general-op site (conv) with an element far from every boundary that the trainer did
    # not log: claiming a rounding choice there is a lie.
    k = next(i for i, s in enumerate(log.sites) if s.numel > 1000 and s.indices.size > 0)
    d = distance_to_boundary(captured[k], POLICY)
    far = int(torch.nonzero(d > 0.4)[0, 0])
    assert far not in set(log.sites[k].indices.tolist())
    site = log.sites[k]
    order = np.argsort(np.append(site.indices, far))
    forged = SiteLog(site.numel, np.append(site.indices, far)[order],
                     np.append(site.up, True)[order])
    tampered = list(logs)
    tampered[TAMPERED_STEP - 1] = _with_site(log, k, forged)
    with pytest.raises(LogViolationError) as err:
        _replay(s0, tampered)
    assert (err.value.step, err.value.site, err.value.index) == (TAMPERED_STEP, k, far)
    assert err.value.distance > 2 * POLICY.tau
    assert f"step {TAMPERED_STEP}" in str(err.value) and f"element {far}" in str(err.value)


def test_flipped_direction_diverges_at_exactly_that_step(recording):
    s0, logs, hashes, _ = recording
    log = logs[TAMPERED_STEP - 1]
    # The last site with entries is the optimizer's parameter update: a flipped direction
    # there changes a parameter's bits directly.
    k = max(i for i, s in enumerate(log.sites) if s.indices.size > 0)
    site = log.sites[k]
    up = site.up.copy()
    up[0] = not up[0]
    tampered = list(logs)
    tampered[TAMPERED_STEP - 1] = _with_site(log, k, SiteLog(site.numel, site.indices, up))
    reached = _replay(s0, tampered[:TAMPERED_STEP])
    assert reached[:TAMPERED_STEP - 1] == hashes[:TAMPERED_STEP - 1]
    assert reached[TAMPERED_STEP - 1] != hashes[TAMPERED_STEP - 1]


def test_log_cut_short_is_rejected(recording):
    s0, logs, _, _ = recording
    log = logs[0]
    with pytest.raises(LogMismatchError, match="cut short"):
        _replay(s0, [RoundingLog(log.sites[:-1])])


def test_padded_log_is_rejected(recording):
    s0, logs, _, _ = recording
    log = logs[0]
    extra = SiteLog(4, np.zeros(0, np.int64), np.zeros(0, bool))
    with pytest.raises(LogMismatchError, match="padded"):
        _replay(s0, [RoundingLog((*log.sites, extra))])


def test_wrong_site_size_is_rejected(recording):
    s0, logs, _, _ = recording
    log = logs[0]
    site = log.sites[3]
    wrong = SiteLog(site.numel + 1, site.indices, site.up)
    with pytest.raises(LogMismatchError, match="site 3 .*elements"):
        _replay(s0, [_with_site(log, 3, wrong)])


def test_another_steps_log_is_a_violation_at_its_first_logged_site(recording):
    s0, logs, _, _ = recording
    # Step 2's log fits step 1's site structure, but its ~1000 entries per site sit near a
    # boundary in step 2's values, not in step 1's: at step 1 their distances are spread over
    # [0, 0.5], and each is below 2*tau (2^-7) with chance 2^-6 only. So the replayer's validity
    # check rejects the log at the first site that has entries, before any state is reached.
    other = logs[1]
    k = next(i for i, s in enumerate(other.sites) if s.indices.size > 0)
    assert other.sites[k].indices.size > 100
    with pytest.raises(LogViolationError) as err:
        _replay(s0, [other])
    assert (err.value.step, err.value.site) == (1, k)
    assert err.value.index in set(other.sites[k].indices.tolist())
    assert err.value.distance >= 2 * POLICY.tau


def test_malformed_log_bytes_are_rejected(recording):
    _, logs, _, _ = recording
    data = encode_log(logs[0])
    with pytest.raises(LogFormatError):
        decode_log(data[: len(data) // 2])
    with pytest.raises(LogFormatError):
        decode_log(b"XXXX" + data[4:])


def test_log_of_another_config_is_rejected(recording):
    s0, logs, _, _ = recording
    ex = _executor(batch_size=16)  # same parameters, other batch size: other site sizes
    ex.load_state(s0)
    with pytest.raises(LogMismatchError, match="site 0 .*elements"):
        ex.step(logs[0])


def test_state_of_another_program_is_rejected(recording):
    s0, _, _, _ = recording
    with pytest.raises(ConfigError, match="does not fit"):
        _executor("char-transformer").load_state(s0)


def test_state_of_another_model_size_is_rejected(recording):
    s0, _, _, _ = recording
    with pytest.raises(ConfigError, match="wrong program or config"):
        _executor(channels=8).load_state(s0)
