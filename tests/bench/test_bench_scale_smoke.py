"""Smoke test of the scale benchmark: token-lm's test preset records, replays bit-exactly under
every replay profile it has here, and reports the log, old-band, timing and memory figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_scale_smoke(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, "bench/bench_scale.py", "--preset", "test", "--steps", "2", "--quiet",
         "--replay-profiles", "emulated-gpu,adversary,no-such-profile", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    s = data["summary"]
    assert data["meta"]["params"] == 46_048
    assert s["replays"], "no replay ran"
    assert "emulated-gpu" in s["replays"]
    assert "no-such-profile" in s["skipped_replays"]
    for name, rep in s["replays"].items():
        assert rep["bit_exact"] is True, (name, rep)
        assert rep["steps_checked"] == 2
    assert s["elements_per_step"] > 0
    assert s["bytes_per_element"] == s["log_bytes_per_step"] / s["elements_per_step"]
    assert 0 <= s["entries_per_step"] <= s["elements_per_step"]
    assert 0 < s["old_band_elements_per_step"] <= s["old_band_elements_per_step_any_op"]
    for role in ("record", "plain32", "plain64"):
        assert s["median_step_s"][role] > 0, role
    assert s["record_over_plain32"] > 0 and s["record_over_plain64"] > 0
    assert s["rss_peak_mib"] >= s["rss_setup_mib"] > 0
    assert "bit-exact under emulated-gpu" in proc.stdout
    assert "old fixed band" in proc.stdout
