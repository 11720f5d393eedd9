"""The one table of dtypes that ovt's canonical objects name (SPEC §2 "State", §3.1).

A state tensor, an example and a precision policy all name their dtype by the string torch
prints without its `torch.` prefix; this module is the only place that maps between the two.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of `dtype` ("float32" for torch.float32)."""
    return str(dtype).removeprefix("torch.")
