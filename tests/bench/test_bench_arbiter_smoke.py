"""Smoke test of the adjudication benchmark: a short job, adjudicated over loopback gRPC."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.network
def test_bench_arbiter_smoke(tmp_path):
    out = tmp_path / "arbiter.json"
    proc = subprocess.run([sys.executable, "bench/bench_arbiter.py", "--steps", "12", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert (data["fault"], data["step"]) == ("trainer", data["fault_step"])
    assert data["rounds"] <= 4  # ceil(log2 12)
    assert data["bytes_moved"]["trainer"] > 0 and data["bytes_moved"]["auditor"] > 0
    assert set(data["timings"]) == {"bisection_s", "evidence_s", "reexecution_s", "total_s"}
    assert "adjudication / full re-execution" in proc.stdout
