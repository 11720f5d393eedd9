"""`ovt program check`: the report on a program that works, one that is refused, bad input."""

from __future__ import annotations

import json
import textwrap

from protocol.cli.main import main

TINY_CNN = ["--set", "image_size=8", "--set", "channels=4", "--set", "batch_size=8",
            "--set", "dataset_size=64"]


def test_a_builtin_records_and_replays_bit_exactly(capsys):
    assert main(["program", "check", "image-cnn", *TINY_CNN, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bit_exact"] and report["refused"] is None
    ops = {row["op"]: row for row in report["ops"]}
    assert ops["aten.convolution.default"]["sites"] >= 1
    assert report["sites"] == sum(row["sites"] for row in report["ops"])
    assert report["entries"] == sum(row["entries"] for row in report["ops"])
    assert report["log_bytes"] > 0 and report["parameters"] > 0


REFUSED = '''
    import torch
    from protocol.engine.initialization import portable_init
    from protocol.engine.programs.base import TrainingProgram

    class Ramp:
        def __len__(self):
            return 8

        def example(self, i):
            return {"x": torch.full((4,), float(i) / 8)}

    def loss(model, batch):
        return torch.lgamma(model(batch["x"]).abs() + 1).mean()  # lgamma: no bound rule

    def build(config):
        return TrainingProgram(name="refused", model=torch.nn.Linear(4, 2),
                               make_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss=loss,
                               dataset=Ramp(), batch_size=4, init=portable_init, config={})
'''


def test_an_op_without_a_rule_is_reported_refused_by_name(tmp_path, capsys):
    path = tmp_path / "refused.py"
    path.write_text(textwrap.dedent(REFUSED))
    assert main(["program", "check", f"{path}:build"]) == 1  # no PRESETS needed
    out = capsys.readouterr().out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("REFUSED")]
    assert "lgamma" in line and "no certified error bound" in line
    assert "aten.addmm.default" in out  # the sites before the refusal are listed


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["program", "check", "no-such-program"]) == 2
    assert "unknown program" in capsys.readouterr().err
    assert main(["program", "check", "image-cnn", "--set", "channels=-1"]) == 2
    assert main(["program", "check", "image-cnn", "--micro-batches", "0"]) == 2
    assert "--micro-batches" in capsys.readouterr().err
