"""Portable initial parameters: PyTorch's default distributions, drawn from `protocol.engine.rng`.

torch's own initialisers (`uniform_`, `normal_`) produce bits that depend on the CPU instruction
set (BACKGROUND: `ATEN_CPU_CAPABILITY=default` vs AVX2), so a job that derives `S_0` from a seed
must not use them (SPEC §3.4). `portable_init` mirrors the default distributions of the common
layers with `RandomStream(seed, "init", <qualified name>)`, one independent stream per tensor:

    >>> import torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    >>> portable_init(model, seed=7)   # same bits on every machine and thread count

A module type not listed here that owns floating parameters or buffers raises `ProgramError`:
the program must then supply its own `init`. A job may instead take `S_0`'s model from a file
(`load_initial_weights`, the job file's `init_from`): a fine-tune from pretrained weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from protocol.codec.state import load_safetensors
from protocol.engine.rng import RandomStream
from protocol.errors import ConfigError, ProgramError, StateFormatError

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


def load_initial_weights(model: nn.Module, path: Path) -> int:
    """Set every tensor of `model.state_dict()` from the safetensors weights at `path`, in
    place: a `.safetensors` file, or a HuggingFace `save_pretrained` folder (its
    `model.safetensors`, or the shards its `model.safetensors.index.json` names). Returns how
    many tensors were read.

    Floating values are converted to the model's dtype (exact from float16/bfloat16/float32;
    float64 rounds to nearest-even); other tensors must have the model's dtype. Names must be
    the model's own state-dict names (a folder saved by the same model class: a hub checkpoint
    of another class, e.g. `GPT2Model` names for a `GPT2LMHeadModel`, is refused, not mapped).
    A state-dict entry the file lacks is allowed only where it is the same tensor as one the
    file has (tied weights, which `save_pretrained` writes once). Read through
    `load_safetensors`, never pickle. Raises ConfigError for a missing or unreadable file, a
    malformed one, an unknown, missing, misshapen or mistyped tensor.
    """
    weights = _read_weights(Path(path))
    expected = model.state_dict()
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise ConfigError(f"init_from {path}: tensors the model does not have: "
                          f"{', '.join(unknown[:5])}{' …' if len(unknown) > 5 else ''}")
    loaded = {expected[name].data_ptr() for name in weights}
    missing = sorted(name for name, t in expected.items()
                     if name not in weights and t.data_ptr() not in loaded)
    if missing:
        raise ConfigError(f"init_from {path}: no weights for {', '.join(missing[:5])}"
                          f"{' …' if len(missing) > 5 else ''}")
    with torch.no_grad():
        for name, value in weights.items():
            target = expected[name]
            if tuple(value.shape) != tuple(target.shape):
                raise ConfigError(f"init_from {path}: {name} has shape {tuple(value.shape)}, "
                                  f"the model's has {tuple(target.shape)}")
            if value.dtype != target.dtype and not (value.is_floating_point()
                                                    and target.is_floating_point()):
                raise ConfigError(f"init_from {path}: {name} is {value.dtype}, the model's is "
                                  f"{target.dtype} (only floating values are converted)")
            target.copy_(value.to(target.dtype))
    return len(weights)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                raise ConfigError(f"init_from {index}: not a safetensors index: {err}") from None
            weights: dict[str, torch.Tensor] = {}
            for shard in shards:
                if Path(shard).name != shard:
                    raise ConfigError(f"init_from {index}: shard {shard!r} is not a file name "
                                      f"in that folder")
                weights.update(_read_file(path / shard))
            return weights
        path = path / "model.safetensors"
    return _read_file(path)


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"init_from {path}: cannot read it: {err.strerror}") from None
    try:
        return load_safetensors(data)
    except StateFormatError as err:
        raise ConfigError(f"init_from {path}: {err}") from None
