"""A bfloat16 program whose results hold NaNs, and its replay in a process of its own
(test_rounding's instruction-set test: `ATEN_CPU_CAPABILITY` is fixed when a process starts).

    python -m tests.protocol.engine.nan_replay LOG_FILE   # prints the replayed bits as JSON
"""

from __future__ import annotations

import json
import sys

import torch

from protocol.codec.roundinglog import decode_log
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.rounding import SiteReplayer

POLICY = PrecisionPolicy(torch.float32, torch.bfloat16)


def nan_program() -> list[torch.Tensor]:
    """A 0-d sum, a product, an exp and an exp of a strided view, each with a NaN."""
    x = torch.tensor([1.0, float("nan"), -2.0, 4.0], dtype=torch.bfloat16)
    return [x.sum(), x * 0.75, x.exp(), x[::2].exp()]


def bits(outs: list[torch.Tensor]) -> list[list[int]]:
    return [(t.view(torch.int16).to(torch.int32) & 0xFFFF).reshape(-1).tolist() for t in outs]


def main(log_file: str) -> None:
    with open(log_file, "rb") as f:
        replayer = SiteReplayer(POLICY, decode_log(f.read()))
    with RoundingMode(POLICY, replayer):
        outs = nan_program()
    replayer.finish()
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                      "bits": bits(outs)}))


if __name__ == "__main__":
    main(sys.argv[1])
