"""Portable initial parameters: PyTorch's default distributions, drawn from `protocol.engine.rng`.

torch's own initialisers (`uniform_`, `normal_`) produce bits that depend on the CPU instruction
set (BACKGROUND: `ATEN_CPU_CAPABILITY=default` vs AVX2), so a job that derives `S_0` from a seed
must not use them (SPEC §3.4). `portable_init` mirrors the default distributions of the common
layers with `RandomStream(seed, "init", <qualified name>)`, one independent stream per tensor:

    >>> import torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    >>> portable_init(model, seed=7)   # same bits on every machine and thread count

A module type not listed here that owns floating parameters or buffers raises `ProgramError`:
the program must then supply its own `init`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from protocol.engine.rng import RandomStream
from protocol.errors import ProgramError

_FAN_IN_UNIFORM = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def portable_init(model: nn.Module, seed: int) -> None:
    """Set every floating parameter and buffer of `model` from the portable generator, in place.

    Linear / Conv{1,2,3}d: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with
    fan_in = weight.shape[1] * prod(kernel size); Embedding: weight ~ N(0, 1) (padding row 0);
    LayerNorm / GroupNorm / RMSNorm / BatchNorm: weight 1, bias 0, running_mean 0,
    running_var 1, num_batches_tracked 0. A tensor shared by several modules is set once, under
    its first qualified name (the order of `model.named_parameters()`).

    Raises ProgramError naming the first floating parameter or buffer owned by any other module
    type (the program must then pass its own init).
    """
    seen: set[int] = set()
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for name, tensor in _own_tensors(module):
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                qualified = f"{prefix}.{name}" if prefix else name
                _init_tensor(module, name, tensor, qualified, seed)


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers `module` owns directly (not those of its children)."""
    params = [(n, p) for n, p in module.named_parameters(recurse=False)]
    buffers = [(n, b) for n, b in module.named_buffers(recurse=False) if b is not None]
    return params + buffers


def _init_tensor(module: nn.Module, name: str, tensor: torch.Tensor, qualified: str,
                 seed: int) -> None:
    stream = RandomStream(seed, "init", qualified)
    if isinstance(module, _FAN_IN_UNIFORM) and name in ("weight", "bias"):
        bound = _fan_in_bound(module.weight)
        tensor.copy_(stream.uniform(tuple(tensor.shape), -bound, bound))
    elif isinstance(module, nn.Embedding) and name == "weight":
        tensor.copy_(stream.normal(tuple(tensor.shape)))
        if module.padding_idx is not None:
            tensor[module.padding_idx].zero_()
    elif isinstance(module, _NORMS) and name in ("weight", "running_var"):
        tensor.fill_(1)
    elif isinstance(module, _NORMS) and name in ("bias", "running_mean", "num_batches_tracked"):
        tensor.zero_()
    elif tensor.is_floating_point() or tensor.is_complex():
        raise ProgramError(
            f"portable_init does not know how to initialise {qualified!r} "
            f"(a {type(module).__name__}); pass an init function with the program"
        )


def _fan_in_bound(weight: torch.Tensor) -> float:
    """1/sqrt(fan_in), torch's bound for kaiming_uniform_(a=sqrt(5)) and the default bias."""
    fan_in = weight.shape[1] * math.prod(weight.shape[2:])
    return 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
