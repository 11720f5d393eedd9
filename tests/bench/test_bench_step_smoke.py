"""Smoke test of the step benchmark: it runs, measures both programs, and replays bit-exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RATIOS = ("record_over_plain32", "record_over_plain64", "replay_over_plain32",
          "replay_over_record", "nearest_over_plain64")


def test_bench_step_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "bench/bench_step.py", "--preset", "test", "--steps", "3", "--warmup",
         "1", "--repeats", "2", "--programs", "image-cnn", "char-transformer", "--quiet",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["programs"]) == {"image-cnn", "char-transformer"}
    for name, prog in data["programs"].items():
        for key in RATIOS:
            assert prog[key] > 0, (name, key)
        assert prog["replay_hash_equal_all_steps"] is True, name
        assert prog["replay_hash_checked_steps"] == 4
        assert prog["record_repeats_identical"] is True, name
        assert prog["elements_per_step"] > 0
        assert 0 <= prog["log_ratio_to_dense"] < 1
        assert prog["bytes_per_element"] == prog["log_bytes_per_step"] / prog["elements_per_step"]
        assert {t["metric"] for t in prog["targets"]} >= {"log_ratio_to_dense"}
    assert "replay hash == record hash" in proc.stdout
