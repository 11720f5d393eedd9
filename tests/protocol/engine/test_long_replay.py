"""The README's default job for 400 steps, replayed against the bound adversary (SPEC §3.2).

Under the superseded fixed band this job stopped at step 321 with a log violation (a sum whose
result cancelled far below its terms): the honest trainer would have lost its dispute. With
certified bands the adversary — every result moved by its proven bound toward the nearest
rounding boundary, with split-K accumulation on top — must still replay every step bit-exactly.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from protocol.engine.replaycheck import SideSpec, replay_check

DEFAULT_JOB = Path(__file__).resolve().parents[3] / "jobs" / "default.toml"
STEPS = 400


@pytest.mark.slow
@pytest.mark.parametrize("trainer, auditor", [("cpu-2t", "adversary-gpu"),
                                              ("adversary", "emulated-gpu")])
def test_default_job_replays_400_steps_against_the_adversary(tmp_path, trainer, auditor):
    job = tomllib.loads(DEFAULT_JOB.read_text())
    common = dict(program=job["program"], preset=job["preset"], config={}, seed=job["seed"],
                  init_seed=job["init_seed"], steps=STEPS, policy="float64->float32",
                  mode="ovt", probe_steps=(), run_dir=str(tmp_path))
    result = replay_check(SideSpec(role="trainer", profile=trainer, **common),
                          SideSpec(role="auditor", profile=auditor, **common))
    assert result.trainer.error is None and result.auditor.error is None, \
        (result.trainer.error, result.auditor.error)
    assert result.compared == STEPS
    assert result.trainer.hashes == result.auditor.hashes  # every h_t, bit for bit
    assert result.bit_exact
