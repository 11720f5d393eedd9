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

# The same dtypes under the names a safetensors header gives them. A peer's safetensors file
# naming any other dtype (U16, C64, F8_E8M0...) is refused before torch sees it.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of `dtype` ("float32" for torch.float32)."""
    return str(dtype).removeprefix("torch.")
