"""The README's "Bring your own model" example: it checks clean and replays bit-exactly."""

from __future__ import annotations

from pathlib import Path

from protocol.cli.main import main

EXAMPLE = f"{Path(__file__).parents[2] / 'examples' / 'mixer.py'}:build"


def test_the_mixer_example_checks_bit_exact(capsys):
    assert main(["program", "check", EXAMPLE]) == 0
    out = capsys.readouterr().out
    assert "result: BIT-EXACT replay" in out
    assert "aten.convolution.default" in out and "aten.bmm.default" in out


def test_the_mixer_example_replays_against_the_adversary(capsys, tmp_path):
    rc = main(["replay-check", "--program", EXAMPLE, "--steps", "3", "--probe-steps", "none",
               "--auditor-profile", "adversary", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "result: BIT-EXACT — all 3 state hashes equal" in out
