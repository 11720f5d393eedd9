"""Smoke test of the audit benchmark: a short job audited sequentially, in two worker processes
and by a sample, over loopback gRPC; the full audits' signed roots are equal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.network
def test_bench_audit_smoke(tmp_path):
    out = tmp_path / "audit.json"
    proc = subprocess.run([sys.executable, "bench/bench_audit.py", "--program", "image-cnn",
                           "--steps", "8", "--checkpoint-interval", "2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["same_root"] is True
    audits = data["audits"]
    assert [audits[name]["state"] for name in audits] == ["matched"] * 3 + ["sampled"]
    assert audits["parallel"]["replayed"] == 8 and audits["sampled"]["replayed"] == 2
    assert data["sample_reason"].startswith("sampled, not verified")
    assert "byte-identical: True" in proc.stdout
