"""Smoke test of the submission memory benchmark: a real daemon takes two concurrent streams and
its peak memory is reported under the in-flight budget."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.network
def test_bench_submit_memory_smoke(tmp_path):
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, "bench/submit_memory.py", "--mib", "8", "--streams",
                           "2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["streams"] == 2 and row["under_budget"]
    assert row["peak_vmhwm_mib"] >= row["baseline_vmhwm_mib"] > 0
    assert "peak VmHWM" in proc.stdout
