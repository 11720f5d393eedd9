"""The central claim (SPEC §3): ovt replay is bit-exact across hardware profiles, while plain
float32 training under the very same pair of profiles diverges — so the harness really perturbs.

The default selection is small: a trainer on cpu-2t is replayed by an auditor on every other
preset available here, each preset against one of the built-in programs (both programs are
covered, and every preset is), and the bound adversary as trainer is replayed on emulated-gpu,
for two steps (SGD's momentum update only starts at step 2). The full matrix — every unordered
pair of distinct profiles, 50 steps, in ovt and in plain mode — is marked slow. One trainer run
per (program, profile, mode, steps) serves every auditor. The isa-default profile runs in a
subprocess (ATEN_CPU_CAPABILITY is fixed at process start), so it is always the auditor side.
"""

from __future__ import annotations

import dataclasses
import json
from itertools import combinations
from pathlib import Path

import pytest
import torch

from protocol.codec.state import decode_state
from protocol.engine.profiles import PRESETS, available_profiles
from protocol.engine.replaycheck import SideSpec, run_side_anywhere

STEPS = 50  # the full matrix
FAST_STEPS = 2  # the default selection: the first update, and one with optimizer state
PROGRAMS = {"char-transformer": False, "image-cnn": True}  # name -> has 4-D activations


def _profiles(has_conv: bool) -> list[str]:
    names = [p.name for p in available_profiles(has_conv) if p.name != "cuda"]
    return sorted(names, key=lambda n: n == "isa-default")  # subprocess profile last


# The default selection's auditors, per program: every preset but the trainer's once.
FAST_AUDITORS = {
    "image-cnn": ["channels-last", "emulated-gpu", "pairwise", "adversary", "isa-default"],
    "char-transformer": ["cpu-1t", "splitk-8", "reversed", "adversary-gpu"],
}
FAST_CASES = [(program, "cpu-2t", b) for program, auditors in FAST_AUDITORS.items()
              for b in auditors]
FAST_CASES.append(("char-transformer", "adversary", "emulated-gpu"))
CASES = [(program, a, b) for program, conv in PROGRAMS.items()
         for a, b in combinations(_profiles(conv), 2)]


def _same_in_plain_mode(a: str, b: str) -> bool:
    """Profiles whose plain float32 runs are the same computation: the adversary only acts on
    ovt's rounding, so e.g. adversary and cpu-2t are one machine in plain mode."""
    plain = [dataclasses.replace(PRESETS[n], name="", adversary=False) for n in (a, b)]
    return plain[0] == plain[1]


PLAIN_CASES = [case for case in CASES if not _same_in_plain_mode(case[1], case[2])]


def _spec(role, program, profile, mode, run_dir, steps) -> SideSpec:
    return SideSpec(role=role, program=program, preset="test", config={}, seed=0, init_seed=1,
                    steps=steps, policy="float64->float32", profile=profile, mode=mode,
                    probe_steps=(), run_dir=str(run_dir))


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    runs: dict[tuple, Path] = {}

    def get(program: str, profile: str, mode: str, steps: int) -> Path:
        key = (program, profile, mode, steps)
        if key not in runs:
            run_dir = tmp_path_factory.mktemp(f"{program}-{profile}-{mode}-{steps}")
            result = run_side_anywhere(_spec("trainer", program, profile, mode, run_dir, steps))
            assert result.error is None, result.error
            assert len(result.hashes) == steps + 1
            runs[key] = run_dir
        return runs[key]

    return get


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return t.view(ints[t.dtype]) if t.dtype in ints else t


def _check_bit_exact(trainer_run, program, trainer_profile, auditor_profile, steps):
    run_dir = trainer_run(program, trainer_profile, "ovt", steps)
    auditor = run_side_anywhere(_spec("auditor", program, auditor_profile, "ovt", run_dir,
                                      steps))
    assert auditor.error is None, auditor.error
    trainer = json.loads((run_dir / "trainer" / "result.json").read_text())
    assert len(auditor.hashes) == steps + 1
    assert auditor.hashes == trainer["hashes"]
    assert len(set(trainer["hashes"])) == steps + 1  # every step changed the state
    assert all(n > 0 for n in trainer["entries"])  # the logs did work
    final_t = decode_state((run_dir / "trainer" / "final.ovts").read_bytes())
    final_a = decode_state((run_dir / "auditor" / "final.ovts").read_bytes())
    assert final_t.keys() == final_a.keys()
    assert int(final_a["step"]) == steps
    for name in final_t:
        assert torch.equal(_bits(final_t[name]), _bits(final_a[name])), name


@pytest.mark.parametrize("program,trainer_profile,auditor_profile", FAST_CASES)
def test_ovt_replay_is_bit_exact_against_each_preset(trainer_run, program, trainer_profile,
                                                     auditor_profile):
    _check_bit_exact(trainer_run, program, trainer_profile, auditor_profile, FAST_STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("program,trainer_profile,auditor_profile", CASES)
def test_ovt_replay_is_bit_exact(trainer_run, program, trainer_profile, auditor_profile):
    _check_bit_exact(trainer_run, program, trainer_profile, auditor_profile, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("program,trainer_profile,auditor_profile", PLAIN_CASES)
def test_plain_float32_diverges_under_the_same_profiles(trainer_run, program, trainer_profile,
                                                        auditor_profile):
    run_dir = trainer_run(program, trainer_profile, "plain", STEPS)
    auditor = run_side_anywhere(_spec("auditor", program, auditor_profile, "plain", run_dir,
                                      STEPS))
    trainer_hashes = json.loads((run_dir / "trainer" / "result.json").read_text())["hashes"]
    assert auditor.hashes[0] == trainer_hashes[0]  # same S_0
    assert auditor.hashes != trainer_hashes[:len(auditor.hashes)]


def test_every_preset_but_cuda_runs_here_and_is_in_the_default_selection():
    for conv in PROGRAMS.values():
        names = set(_profiles(conv))
        assert names == set(PRESETS) - {"cuda"} - (set() if conv else {"channels-last"})
    auditors = [b for _, _, b in FAST_CASES[:-1]]
    assert sorted(auditors) == sorted(set(PRESETS) - {"cuda", "cpu-2t"})  # each once
    assert all(b in _profiles(PROGRAMS[program]) for program, _, b in FAST_CASES)
    assert len(CASES) == 36 + 45  # C(9, 2) + C(10, 2)


def test_plain_mode_skips_exactly_the_pairs_that_are_one_machine_there():
    """adversary differs from cpu-2t only in ovt's rounding; every other pair differs in plain
    float32 arithmetic too (threads, memory format, instruction set or accumulation order)."""
    skipped = {(a, b) for _, a, b in CASES if _same_in_plain_mode(a, b)}
    assert skipped == {("cpu-2t", "adversary")}
    assert not _same_in_plain_mode("adversary", "adversary-gpu")
