"""The README's fine-tuning example: a save_pretrained folder, then a job starting from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from protocol.job.create import create_job

pytest.importorskip("transformers")
EXAMPLES = Path(__file__).parents[2] / "examples"


def test_the_finetune_job_starts_from_the_pretrained_folder(tmp_path):
    folder = tmp_path / "pretrained-gpt2"
    subprocess.run([sys.executable, str(EXAMPLES / "make_pretrained.py"), str(folder),
                    "--steps", "2"], check=True, capture_output=True, timeout=300)
    job = tmp_path / "finetune.toml"
    job.write_text((EXAMPLES / "finetune.toml").read_text())
    spec, state0 = create_job(job)
    assert spec.micro_batches == 4 and spec.config["warmup_steps"] == 4
    saved = load_file(folder / "model.safetensors")
    for name, value in saved.items():
        assert torch.equal(state0[f"model.{name}"], value), name
