"""Smoke test of the gRPC streaming benchmark: it runs on loopback and reports both rates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.network
def test_bench_grpc_smoke(tmp_path):
    out = tmp_path / "grpc.json"
    proc = subprocess.run([sys.executable, "bench/bench_grpc.py", "--mib", "4", "--repeats", "1",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["mib_per_s"]) == {"ovt_chunks", "plain_stream"}
    assert all(rate > 0 for rate in data["mib_per_s"].values())
    assert "ovt / plain" in proc.stdout
