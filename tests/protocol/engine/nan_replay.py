"""Programs whose results hold NaNs, one per precision policy, and their replay in a process of
its own (test_rounding's instruction-set test: `ATEN_CPU_CAPABILITY` is fixed when a process
starts).

    python -m tests.protocol.engine.nan_replay POLICY LOG_FILE   # the replayed bits as JSON

POLICY is a policy's name (`PrecisionPolicy.name`: float64->float32, float32->bfloat16).
"""

from __future__ import annotations

import json
import sys

import torch

from protocol.codec.roundinglog import decode_log
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.rounding import SiteReplayer

POLICIES = {p.name: p for p in (PrecisionPolicy(torch.float64, torch.float32),
                                PrecisionPolicy(torch.float32, torch.bfloat16))}
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def nan_program(policy: PrecisionPolicy) -> list[torch.Tensor]:
    """Under bfloat16: a 0-d sum, a product, an exp and an exp of a strided view, each with a
    NaN (torch's vectorised casts into bfloat16 write another NaN than its scalar one), and
    exact ops whose vectorised kernels write 0xFFFF for a NaN (relu, clamp, abs, floor,
    maximum). Under float32: NaNs of several signs and payloads (data may hold any) through a
    log1p and row sums, whose float64 kernels give a NaN's sign and payload by instruction set,
    a sum and a product of strided views, and the exact maximum, amax and minimum, whose
    vectorised kernels write an all-ones NaN."""
    if policy.target == torch.bfloat16:
        x = torch.tensor([1.0, float("nan"), -2.0, 4.0], dtype=torch.bfloat16)
        many = torch.tensor([0x7FC1, -0x3F, 0x7F81, -1, 0x3F80, -0x4080, 0, -0x8000],
                            dtype=torch.int16).view(torch.bfloat16).repeat(16)
        return [x.sum(), x * 0.75, x.exp(), x[::2].exp(), many.relu(), many.clamp(-1.0, 1.0),
                many.abs(), many.floor(), torch.maximum(many, many.flip(0))]
    nans = torch.tensor([0x7FC00001, -0x400000, 0x7FC00000, -0x3FFFFF], dtype=torch.int32)
    x = torch.cat([nans.view(torch.float32), torch.tensor([-2.0, 1.0, 0.5, 3.0])] * 16)
    rows = x.view(16, 8)
    return [x.log1p(), rows.sum(1), rows.t().sum(1), (rows[:, ::2] * 0.75).sum(0),
            torch.maximum(x, torch.ones_like(x)), rows.amax(0), torch.minimum(x, x.flip(0))]


def bits(outs: list[torch.Tensor]) -> list[list[int]]:
    return [t.view(_BITS[t.dtype]).reshape(-1).tolist() for t in outs]


def main(policy_name: str, log_file: str) -> None:
    policy = POLICIES[policy_name]
    with open(log_file, "rb") as f:
        replayer = SiteReplayer(policy, decode_log(f.read()))
    with RoundingMode(policy, replayer):
        outs = nan_program(policy)
    replayer.finish()
    print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                      "bits": bits(outs)}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
