"""`init_from`: S_0's model from pretrained safetensors weights (a fine-tune), SPEC §3.4."""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program
from protocol.errors import ConfigError
from protocol.job.create import create_job

JOB = """\
program = "char-transformer"
steps = 4
init_from = "{weights}"
"""


def _pretrained() -> dict[str, torch.Tensor]:
    """A trained-looking model: the portable init of another seed, one step away."""
    ex = Executor(load_program("char-transformer"), seed=0, policy=PrecisionPolicy(),
                  profile=Profile("create"))
    ex.init_state(7)
    ex.step()
    return {k.removeprefix("model."): v for k, v in ex.state().items()
            if k.startswith("model.")}


def test_a_job_starts_from_a_safetensors_file_bit_for_bit(tmp_path):
    weights = _pretrained()
    safetensors.torch.save_file(weights, tmp_path / "w.safetensors")
    (tmp_path / "job.toml").write_text(JOB.format(weights="w.safetensors"))
    spec, state0 = create_job(tmp_path / "job.toml")
    for name, value in weights.items():
        assert torch.equal(state0[f"model.{name}"], value), name
    assert not any(k.startswith("optim.") for k in state0) and int(state0["step"]) == 0


def test_a_sharded_save_pretrained_folder(tmp_path):
    weights = _pretrained()
    names = sorted(weights)
    folder = tmp_path / "pretrained"
    folder.mkdir()
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for shard, part in halves.items():
        safetensors.torch.save_file({n: weights[n] for n in part}, folder / shard)
    index = {"weight_map": {n: shard for shard, part in halves.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "job.toml").write_text(JOB.format(weights="pretrained"))
    _, state0 = create_job(tmp_path / "job.toml")
    assert all(torch.equal(state0[f"model.{n}"], weights[n]) for n in names)


@pytest.mark.parametrize("change, message", [
    (lambda w: w.pop("head.weight"), "no weights for head.weight"),
    (lambda w: w.update({"extra": torch.zeros(2)}), "tensors the model does not have: extra"),
    (lambda w: w.update({"head.bias": torch.zeros(3)}), r"head.bias has shape \(3,\)"),
])
def test_weights_that_do_not_fit_are_a_clear_error(tmp_path, change, message):
    weights = _pretrained()
    change(weights)
    safetensors.torch.save_file(weights, tmp_path / "w.safetensors")
    (tmp_path / "job.toml").write_text(JOB.format(weights="w.safetensors"))
    with pytest.raises(ConfigError, match=message):
        create_job(tmp_path / "job.toml")


def test_a_missing_or_broken_file_is_a_clear_error(tmp_path):
    (tmp_path / "job.toml").write_text(JOB.format(weights="nowhere.safetensors"))
    with pytest.raises(ConfigError, match="cannot read it"):
        create_job(tmp_path / "job.toml")
    (tmp_path / "broken.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    (tmp_path / "job.toml").write_text(JOB.format(weights="broken.safetensors"))
    with pytest.raises(ConfigError, match="init_from"):
        create_job(tmp_path / "job.toml")
