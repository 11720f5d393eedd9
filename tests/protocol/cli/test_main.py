"""The `ovt` command line: help, usage errors (exit 2, one line, no traceback), replay-check.

The CLI runs as `python -m protocol.cli.main` in subprocesses, started together so that their torch
imports overlap; a few more error variants run in-process through `main()`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from protocol.cli.main import main
from protocol.engine.precision import RULES_VERSION
from protocol.engine.profiles import PRESETS

TIMEOUT = 300
TINY_CNN = ["--program", "image-cnn", "--set", "image_size=8", "--set", "channels=4",
            "--set", "batch_size=8", "--set", "dataset_size=64"]
PAIR = ["--trainer-profile", "cpu-2t", "--auditor-profile", "emulated-gpu"]


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "protocol.cli.main", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, out, err


USAGE_ERRORS = {
    "bad-trainer-profile": (["--trainer-profile", "nope"], "unknown profile 'nope'"),
    "zero-steps": (["--steps", "0"], "--steps must be at least 1"),
    "unknown-program": (["--program", "no-such-program", "--steps", "1"],
                        "unknown program 'no-such-program'"),
    "set-unknown-key": (["--program", "image-cnn", "--set", "bogus=1", "--steps", "1"],
                        "unknown config key(s) bogus"),
    "bad-probe-steps": (["--probe-steps", "one"], "--probe-steps must be a comma list"),
}


@pytest.fixture(scope="module")
def usage_runs():
    procs = {name: start("replay-check", *args) for name, (args, _) in USAGE_ERRORS.items()}
    procs["help"] = start("--help")
    procs["rc-help"] = start("replay-check", "--help")
    procs["argparse-steps"] = start("replay-check", "--steps", "abc")
    return {name: finish(proc) for name, proc in procs.items()}


@pytest.mark.slow  # the subprocesses of usage_runs start together: ~7 s in all
def test_help(usage_runs):
    rc, out, err = usage_runs["help"]
    assert rc == 0 and "replay-check" in out and "profile" in out and not err


@pytest.mark.slow  # the subprocesses of usage_runs start together: ~7 s in all
def test_replay_check_help_names_the_profiles(usage_runs):
    rc, out, err = usage_runs["rc-help"]
    assert rc == 0 and not err
    assert f"Profiles (presets): {', '.join(PRESETS)};" in out  # all of them, in order
    for option in ("--trainer-profile", "--auditor-profile", "--mode", "--policy", "--json"):
        assert option in out
    assert "tau" not in out
    assert "certified error bound" in out and "as a fraction of its bound" in out


@pytest.mark.parametrize("name", list(USAGE_ERRORS))
@pytest.mark.slow  # the subprocesses of usage_runs start together: ~7 s in all
def test_usage_error_is_one_line(usage_runs, name):
    rc, out, err = usage_runs[name]
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and lines[0].startswith("ovt: error: "), err
    assert USAGE_ERRORS[name][1] in lines[0]
    assert "Traceback" not in err + out


@pytest.mark.parametrize("name", ["unknown-program", "set-unknown-key"])
@pytest.mark.slow  # the subprocesses of usage_runs start together: ~7 s in all
def test_input_error_prints_no_report(usage_runs, name):
    rc, out, err = usage_runs[name]
    assert rc == 2 and out == ""


@pytest.mark.slow  # the subprocesses of usage_runs start together: ~7 s in all
def test_argparse_error(usage_runs):
    rc, out, err = usage_runs["argparse-steps"]
    assert rc == 2 and "invalid int value: 'abc'" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["replay-check", "--policy", "float16->float32"], "bad precision policy"),
    (["replay-check", "--policy", "float32->float64"], "unsupported precision policy"),
    (["replay-check", "--steps", "-3"], "--steps must be at least 1"),
    (["replay-check", "--trainer-profile", "memory=fast"], "bad value 'fast' for 'memory'"),
    (["replay-check", "--set", "=1"], "--set expects KEY=VALUE"),
    (["replay-check", "--set", "oops"], "--set expects KEY=VALUE, got 'oops'"),
    (["replay-check", "--auditor-profile", "threads=0"], "bad value '0' for 'threads'"),
    (["replay-check", "--steps", "3", "--probe-steps", "5"], "--probe-steps must lie in 1..3"),
    (["replay-check", "--steps", "3", "--probe-steps", "0,2"], "--probe-steps must lie in 1..3"),
    (["replay-check", *TINY_CNN, "--set", "channels=0", "--steps", "1"],
     "channels must be in [1, 1024]"),
    (["replay-check", "--micro-batches", "2", "--trainer-workers", "3"],
     "--trainer-workers must lie in 1..2, the job's micro-batches"),
    (["replay-check", "--auditor-workers", "0"], "--auditor-workers must lie in 1..1"),
    (["replay-check", "--micro-batches", "2", "--auditor-workers", "2", "--probe-steps", "1,2"],
     "the divergence probe runs in one process"),
    (["replay-check", "--micro-batches", "2", "--trainer-workers", "2", "--mode", "plain"],
     "--trainer-workers needs --mode ovt"),
])
def test_more_usage_errors_in_process(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1
    assert captured.err.startswith("ovt: error: ") and message in captured.err


def test_tau_is_gone(capsys):
    """SPEC §3.1: the fixed threshold τ is superseded by certified bands; the option is no more."""
    with pytest.raises(SystemExit) as exit_info:
        main(["replay-check", "--tau", "0.5"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --tau 0.5" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "replay-check" in capsys.readouterr().out


def test_text_report_in_process(capsys, tmp_path):
    rc = main(["replay-check", *TINY_CNN, *PAIR, "--steps", "1", "--probe-steps", "1",
               "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0] == "ovt replay-check: image-cnn (its default config), 1 steps, mode ovt"
    assert lines[1] == f"  policy float64->float32, certified bands (bound rules v{RULES_VERSION})"
    assert lines[2] == ("  trainer profile cpu-2t (cpu threads=2); auditor profile emulated-gpu "
                        "(cpu threads=2 splitk=1 chunks=3 order=permuted)")
    assert "result: BIT-EXACT — all 1 state hashes equal" in out
    (log_line,) = [line for line in lines if line.startswith("log: median ")]
    assert "entries of" in log_line and "the trainer's freedom" in log_line
    assert any(line.startswith("divergence between the profiles, per op (probed steps 1), as a "
                               "fraction of the certified bound e (conforming hardware: at most 1")
               for line in lines)
    (worst,) = [line for line in lines if line.startswith("  worst: ")]
    assert worst.endswith(" of e") and float(worst.split()[1]) <= 1
    assert "UNSOUND" not in out and "tau" not in out and "ulp" not in out
    assert (tmp_path / "trainer" / "s0.ovts").is_file()
    assert (tmp_path / "trainer" / "logs" / "0000001.ovtl").is_file()


def test_a_replay_at_another_world_size_in_process(capsys, tmp_path):
    """Issue 14: the trainer on 2 processes, the auditor on 1, another profile: bit-exact."""
    rc = main(["replay-check", *TINY_CNN, *PAIR, "--steps", "2", "--micro-batches", "2",
               "--trainer-workers", "2", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert out.splitlines()[0].endswith(", 2 micro-batches, 2 trainer / 1 auditor processes")
    assert "result: BIT-EXACT — all 2 state hashes equal" in out


# -- full runs ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def json_runs():
    procs = {
        "ovt": start("replay-check", *TINY_CNN, *PAIR, "--steps", "3", "--json"),
        "plain": start("replay-check", *TINY_CNN, *PAIR, "--steps", "3", "--json", "--mode",
                       "plain"),
        "adversary": start("replay-check", *TINY_CNN, "--trainer-profile", "cpu-2t",
                           "--auditor-profile", "adversary", "--steps", "2", "--json"),
    }
    return {name: finish(proc) for name, proc in procs.items()}


@pytest.mark.slow
def test_replay_check_json_is_bit_exact(json_runs):
    rc, out, err = json_runs["ovt"]
    assert rc == 0, err
    report = json.loads(out)
    assert report["bit_exact"] is True and report["first_divergent_step"] is None
    assert report["steps_compared"] == 3 and report["mode"] == "ovt"
    assert report["trainer_profile"]["name"] == "cpu-2t"
    assert report["auditor_profile"]["describe"] == "cpu threads=2 splitk=1 chunks=3 order=permuted"
    assert report["policy"] == "float64->float32" and report["bound_rules"] == RULES_VERSION
    assert "tau" not in report
    assert [s["step"] for s in report["steps"]] == [1, 2, 3]
    for s in report["steps"]:
        assert s["equal"] is True and s["trainer_hash"] == s["auditor_hash"]
        assert len(s["trainer_hash"]) == 64
        assert s["log_bytes"] > 0 and 0 <= s["log_entries"] < s["rounded_elements"]
    assert sum(s["log_entries"] for s in report["steps"]) > 0  # (a step of this tiny CNN may
    # log nothing: about 1 element in 10^4 lies in a band)
    assert len({s["trainer_hash"] for s in report["steps"]}) == 3
    divergence = report["divergence"]
    assert divergence, "probe step 1 measures per-op divergence"
    assert set(next(iter(divergence.values()))) == {
        "sites", "elements", "differing", "max_fraction_of_bound", "zero_bound_rounded_apart"}
    # conforming hardware stays within its certified bounds, and ops with bound 0 never round
    # apart
    assert all(0 <= d["max_fraction_of_bound"] <= 1 for d in divergence.values())
    assert all(d["zero_bound_rounded_apart"] == 0 for d in divergence.values())
    differing = [op for op, d in divergence.items() if d["differing"] > 0]
    assert differing  # the profiles really differ ...
    assert all(divergence[op]["max_fraction_of_bound"] > 0 for op in differing)  # ... within e
    assert "aten.convolution.default" in differing


@pytest.mark.slow
def test_replay_check_against_the_bound_adversary(json_runs):
    """The adversary moves every result by e/2 toward its boundary: bit-exact all the same, and
    the probe sees that move — half the bound where e spans many compute ULPs (a convolution),
    up to half a compute ULP more where it spans few, never more than e — and no element whose
    bound is zero rounded apart (roots and quotients with e = 0 move within their documented
    error, `bounds.conforming_error`; exact operations do not move)."""
    rc, out, err = json_runs["adversary"]
    assert rc == 0, err
    report = json.loads(out)
    assert report["bit_exact"] is True and report["steps_compared"] == 2
    assert report["auditor_profile"]["describe"] == "cpu threads=2 adversary"
    divergence = report["divergence"]
    assert all(d["zero_bound_rounded_apart"] == 0 for d in divergence.values())
    assert all(d["max_fraction_of_bound"] <= 1 for d in divergence.values())
    conv = divergence["aten.convolution.default"]
    assert conv["differing"] > 0 and abs(conv["max_fraction_of_bound"] - 0.5) < 0.01


@pytest.mark.slow
def test_replay_check_plain_diverges_at_step_one(json_runs):
    rc, out, err = json_runs["plain"]
    assert rc == 1, err
    report = json.loads(out)
    assert report["bit_exact"] is False and report["first_divergent_step"] == 1
    assert report["steps"][0]["equal"] is False
    assert report["steps"][0]["log_bytes"] is None
