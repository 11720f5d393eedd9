"""The central claim (SPEC §3): ovt replay is bit-exact across hardware profiles, while plain
float32 training under the very same pair of profiles diverges — so the harness really perturbs.

For each built-in program and every unordered pair of distinct profiles available here, the
trainer records 50 steps under one profile and the auditor replays them under the other. One
trainer run per (program, profile) serves every auditor. The isa-default profile runs in a
subprocess (ATEN_CPU_CAPABILITY is fixed at process start), so it is always the auditor side.
"""

from __future__ import annotations

import json
from itertools import combinations
from pathlib import Path

import pytest
import torch

from protocol.codec.state import decode_state
from protocol.engine.profiles import available_profiles
from protocol.engine.replaycheck import SideSpec, run_side_anywhere

STEPS = 50
PROGRAMS = {"char-transformer": False, "image-cnn": True}  # name -> has 4-D activations


def _profiles(has_conv: bool) -> list[str]:
    names = [p.name for p in available_profiles(has_conv) if p.name != "cuda"]
    return sorted(names, key=lambda n: n == "isa-default")  # subprocess profile last


CASES = [(program, a, b) for program, conv in PROGRAMS.items()
         for a, b in combinations(_profiles(conv), 2)]


def _spec(role, program, profile, mode, run_dir) -> SideSpec:
    return SideSpec(role=role, program=program, preset="test", config={}, seed=0, init_seed=1,
                    steps=STEPS, policy="float64->float32", tau=None, profile=profile, mode=mode,
                    probe_steps=(), run_dir=str(run_dir))


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    runs: dict[tuple, Path] = {}

    def get(program: str, profile: str, mode: str) -> Path:
        key = (program, profile, mode)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp(f"{program}-{profile}-{mode}")
            result = run_side_anywhere(_spec("trainer", program, profile, mode, run_dir))
            assert result.error is None, result.error
            assert len(result.hashes) == STEPS + 1
            runs[key] = run_dir
        return runs[key]

    return get


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return t.view(ints[t.dtype]) if t.dtype in ints else t


@pytest.mark.slow
@pytest.mark.parametrize("program,trainer_profile,auditor_profile", CASES)
def test_ovt_replay_is_bit_exact(trainer_run, program, trainer_profile, auditor_profile):
    run_dir = trainer_run(program, trainer_profile, "ovt")
    auditor = run_side_anywhere(_spec("auditor", program, auditor_profile, "ovt", run_dir))
    assert auditor.error is None, auditor.error
    trainer_hashes = json.loads((run_dir / "trainer" / "result.json").read_text())["hashes"]
    assert len(auditor.hashes) == STEPS + 1
    assert auditor.hashes == trainer_hashes
    final_t = decode_state((run_dir / "trainer" / "final.ovts").read_bytes())
    final_a = decode_state((run_dir / "auditor" / "final.ovts").read_bytes())
    assert final_t.keys() == final_a.keys()
    assert int(final_a["step"]) == STEPS
    for name in final_t:
        assert torch.equal(_bits(final_t[name]), _bits(final_a[name])), name


@pytest.mark.slow
@pytest.mark.parametrize("program,trainer_profile,auditor_profile", CASES)
def test_plain_float32_diverges_under_the_same_profiles(trainer_run, program, trainer_profile,
                                                        auditor_profile):
    run_dir = trainer_run(program, trainer_profile, "plain")
    auditor = run_side_anywhere(_spec("auditor", program, auditor_profile, "plain", run_dir))
    trainer_hashes = json.loads((run_dir / "trainer" / "result.json").read_text())["hashes"]
    assert auditor.hashes[0] == trainer_hashes[0]  # same S_0
    assert auditor.hashes != trainer_hashes[:len(auditor.hashes)]


def test_every_program_has_at_least_three_profiles_here():
    for conv in PROGRAMS.values():
        assert len(_profiles(conv)) >= 4
