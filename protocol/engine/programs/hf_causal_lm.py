"""Built-in program "hf-causal-lm": a HuggingFace transformers causal language model, unmodified.

Needs the optional `hf` extra (`pip install -e '.[hf]'`, transformers pinned); transformers is
imported only when this program is built or sized, so the rest of ovt works without it.

`model` is the transformers config as a plain dict, as `PretrainedConfig.to_dict()` or a
`config.json` holds it, with its `model_type` ("gpt2" or "llama", `MODEL_TYPES`): the model is
`AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **rest))`, float32, in train
mode, with the attention implementation and dropout transformers gives it (GPT-2: SDPA, dropout
0.1 on embeddings, attention weights and residuals; the executor serves SDPA's dropout from the
portable generator and pins its math kernel). Nothing is downloaded and no path is read (a
spec's config comes from a peer): no remote code (`auto_map` is refused), no quantization, no
kernels from the hub. A key the config class does not know is refused (transformers would
silently keep it as an attribute: "n_layers" for GPT-2's "n_layer" would train 12 layers).

The program's source hash covers this file, not transformers' code, so the normalised config
records `transformers_version`, and building under another installed version is a ConfigError.

The data is "token-lm"'s synthetic corpus over the model's vocabulary (`token_lm.TokenWindows`),
examples {"tokens": (seq_len + 1,) int64}, so a token file can replace it. The loss is the
model's own: `model(input_ids=tokens, labels=tokens).loss`, transformers shifting the labels
(position i predicts token i + 1; the last position's label is padding, ignored): the mean
next-token cross-entropy over seq_len predictions per window. The model sees seq_len + 1
positions, so seq_len < max_position_embeddings.

`init` mirrors transformers' `_init_weights` for GPT-2 and Llama from `protocol.engine.rng`
(torch's initialisers, which HF's use, give bits that depend on the CPU instruction set):
Linear, Conv1D and Embedding weights N(0, initializer_range) (Irwin–Hall, as `portable_init`),
biases 0, GPT-2's attention and MLP output projections N(0, initializer_range / sqrt(2 n_layer)),
LayerNorm and RMSNorm weight 1 and bias 0, and Llama's rotary frequencies 1 / theta^(2i / dim)
(non-persistent buffers) computed with `decimal`, not the C library's pow.

    >>> program = build(PRESETS["test"])
    >>> program.dataset.example(0)["tokens"].shape
    torch.Size([17])
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import importlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from protocol.engine.programs import token_lm
from protocol.engine.programs.base import TrainingProgram
from protocol.engine.programs.validation import (
    config_from_mapping,
    require,
    require_tensor_size,
)
from protocol.engine.rng import RandomStream
from protocol.engine.schedules import warmup_cosine
from protocol.errors import ConfigError, ProgramError

NAME = "hf-causal-lm"
MODEL_TYPES = ("gpt2", "llama")  # the types whose modules `init` knows and whose ops are tested
ATTENTION = ("sdpa", "eager")  # attn_implementation values accepted (others load kernels)
INSTALL_HINT = "install the hf extra: pip install -e '.[hf]'"
# config keys that would make transformers run or fetch code other than its own modelling code
REFUSED_KEYS = {"auto_map": "remote code", "quantization_config": "quantization",
                "_attn_implementation": "an attention kernel (use attn_implementation)",
                "_attn_implementation_internal": "an attention kernel"}
MAX_SEQ_LEN = 4096
MAX_LAYERS = 256  # sizing builds the model on the meta device: its cost is the module count

_GPT2_TEST = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64,
              "n_positions": 32, "bos_token_id": 63, "eos_token_id": 63}
_LLAMA_TEST = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 64, "max_position_embeddings": 32}
PRESETS: dict[str, dict[str, Any]] = {
    # tiny GPT-2 (tied head, learned positions, LayerNorm, gelu_new, SDPA with dropout 0.1)
    "test": {"model": _GPT2_TEST, "seq_len": 16, "batch_size": 8},
    # tiny Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention: 4 heads over 2 KV heads)
    "llama-test": {"model": _LLAMA_TEST, "seq_len": 16, "batch_size": 8},
    # "token-lm"'s bench size as a GPT-2 (what bench/bench_step.py runs with --preset bench)
    "bench": {"model": {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4,
                        "vocab_size": 8192, "n_positions": 128, "bos_token_id": 0,
                        "eos_token_id": 0},
              "seq_len": 64, "batch_size": 8, "corpus_tokens": 1 << 17},
}


@dataclass(frozen=True)
class HFCausalLMConfig:
    """Config of "hf-causal-lm"; the defaults are the "test" preset. `transformers_version`
    empty means the installed one, which `parse_config` writes in."""

    model: dict[str, Any] = field(default_factory=lambda: dict(_GPT2_TEST))
    transformers_version: str = ""
    seq_len: int = 16
    batch_size: int = 8
    corpus_tokens: int = 1 << 14
    seed: int = 0
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_steps: int = 0  # learning-rate schedule: linear warm-up, then cosine decay to min_lr
    decay_steps: int = 0
    min_lr: float = 0.0
    clip_grad_norm: float = 0.0  # the gradients' global 2-norm is clipped to this (0: off)

    def __post_init__(self) -> None:
        model_type = self.model.get("model_type")
        require(model_type in MODEL_TYPES, NAME,
                f"model.model_type must be one of {', '.join(MODEL_TYPES)}, got {model_type!r}")
        for key, what in REFUSED_KEYS.items():
            require(key not in self.model, NAME, f"model.{key} is refused: it selects {what}")
        attention = self.model.get("attn_implementation", "sdpa")
        require(attention in ATTENTION, NAME, f"model.attn_implementation must be one of "
                                              f"{', '.join(ATTENTION)}, got {attention!r}")
        require(1 <= self.seq_len <= MAX_SEQ_LEN, NAME, f"seq_len must be in [1, {MAX_SEQ_LEN}]")
        require(self.batch_size >= 1, NAME, "batch_size must be >= 1")
        require(self.corpus_tokens <= 10**8, NAME, "corpus_tokens must be <= 1e8")
        require((self.corpus_tokens - 1) // self.seq_len >= self.batch_size, NAME,
                "corpus_tokens must give at least batch_size windows of seq_len + 1 tokens")
        require(0 <= self.seed < 2**63, NAME, "seed must be in [0, 2**63)")
        require(self.lr > 0, NAME, "lr must be > 0")
        require(self.weight_decay >= 0, NAME, "weight_decay must be >= 0")
        require(self.warmup_steps >= 0 and self.decay_steps >= 0, NAME,
                "warmup_steps and decay_steps must be >= 0")
        require(0 <= self.min_lr <= self.lr, NAME, "min_lr must be in [0, lr]")
        require(self.clip_grad_norm >= 0, NAME, "clip_grad_norm must be >= 0 (0: no clipping)")


# --- transformers, imported lazily --------------------------------------------------------------

def _transformers() -> ModuleType:
    """The transformers package. Raises ProgramError naming the extra when it is absent."""
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise ProgramError(f"program {NAME!r} needs HuggingFace transformers, which is not "
                           f"installed ({exc}); {INSTALL_HINT}") from None


def model_config(cfg: HFCausalLMConfig) -> Any:
    """The transformers config `cfg.model` describes (a `PretrainedConfig`). Raises ConfigError
    for a key its class does not know or a value it rejects; ProgramError without the extra."""
    transformers = _transformers()
    rest = {k: v for k, v in cfg.model.items() if k != "model_type"}
    try:
        hf = transformers.AutoConfig.for_model(cfg.model["model_type"], **rest)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ConfigError(f"{NAME}: transformers rejects model: {type(exc).__name__}: {exc}") \
            from None
    stray = sorted(set(hf.to_dict()) - set(type(hf)().to_dict()))
    require(not stray, NAME, f"model has key(s) {', '.join(stray)} that a "
                             f"{cfg.model['model_type']} config does not know")
    require(isinstance(hf.vocab_size, int) and 2 <= hf.vocab_size <= 1 << 20, NAME,
            "model.vocab_size must be in [2, 2**20]")
    require(isinstance(hf.num_hidden_layers, int) and 1 <= hf.num_hidden_layers <= MAX_LAYERS,
            NAME, f"the model's number of layers must be in [1, {MAX_LAYERS}]")
    require(cfg.seq_len < hf.max_position_embeddings, NAME,
            f"seq_len + 1 positions must fit the model's {hf.max_position_embeddings} "
            f"(max_position_embeddings)")
    widths = (hf.vocab_size, hf.hidden_size, getattr(hf, "intermediate_size", None) or 0,
              getattr(hf, "n_inner", None) or 4 * hf.hidden_size)
    require(all(isinstance(w, int) for w in widths) and isinstance(hf.num_attention_heads, int),
            NAME, "the model's sizes must be integers")
    positions = cfg.batch_size * (cfg.seq_len + 1)
    require_tensor_size(positions * max(widths), NAME,
                        "an activation (batch_size × (seq_len + 1) × the widest layer)")
    require_tensor_size(positions * hf.num_attention_heads * (cfg.seq_len + 1), NAME,
                        "the attention weights (batch_size × heads × (seq_len + 1)²)")
    return hf


def _json_keys(value: Any) -> Any:
    """`value` with int map keys written as strings, as config.json holds them (to_dict() gives
    id2label int keys; transformers turns them back into ints)."""
    if isinstance(value, Mapping):
        return {str(k) if isinstance(k, int) and not isinstance(k, bool) else k: _json_keys(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_keys(v) for v in value]
    return value


# --- the program -------------------------------------------------------------------------------

def parse_config(config: Mapping[str, Any] | None) -> HFCausalLMConfig:
    """`config` checked and completed: the defaults, the installed transformers version, and
    `model` without its own `transformers_version` (to_dict() writes one; it must match too).

    Raises ConfigError for an unknown key, a bad value, a model config transformers rejects or
    another transformers version than the installed one; ProgramError without the hf extra.
    """
    if isinstance(config, Mapping) and isinstance(config.get("model"), Mapping):
        config = {**config, "model": _json_keys(config["model"])}
    cfg = config_from_mapping(HFCausalLMConfig, config, NAME)
    installed = _transformers().__version__
    model = dict(cfg.model)
    for where, version in (("transformers_version", cfg.transformers_version),
                           ("model.transformers_version", model.pop("transformers_version", ""))):
        if version not in ("", installed):
            raise ConfigError(f"{NAME}: the config was made with transformers {version} "
                              f"({where}) but {installed} is installed here; the program's "
                              f"source hash does not cover transformers' code, so the version "
                              f"must be the same")
    cfg = dataclasses.replace(cfg, model=model, transformers_version=installed)
    model_config(cfg)
    return cfg


def parameter_count(config: Mapping[str, Any] | None) -> int:
    """How many parameters `build(config)` makes (tied ones once), from a model built on the
    meta device: nothing is allocated. Raises as `parse_config`."""
    cfg = parse_config(config)
    with torch.device("meta"):
        model = _model(model_config(cfg))
    return sum(p.numel() for p in model.parameters())


def build(config: Mapping[str, Any] | None = None) -> TrainingProgram:
    """The "hf-causal-lm" program for `config` (missing keys take the defaults).

    Raises as `parse_config`.
    """
    cfg = parse_config(config)
    hf = model_config(cfg)
    model = _model(hf)
    data = token_lm.TokenLMConfig(vocab_size=hf.vocab_size, seq_len=cfg.seq_len,
                                  batch_size=cfg.batch_size, corpus_tokens=cfg.corpus_tokens,
                                  seed=cfg.seed)
    return TrainingProgram(
        name=NAME,
        model=model,
        make_optimizer=functools.partial(make_optimizer, cfg),
        loss=loss,
        dataset=token_lm.TokenWindows(data),
        batch_size=cfg.batch_size,
        init=init,
        config=dataclasses.asdict(cfg),
        make_scheduler=warmup_cosine(cfg.warmup_steps, cfg.decay_steps, cfg.min_lr),
        clip_grad_norm=cfg.clip_grad_norm or None,
        vocab_size=hf.vocab_size,
    )


def _model(hf: Any) -> nn.Module:
    """The float32 model of transformers config `hf`, in train mode, on the current default
    device. Raises ConfigError for a config transformers cannot build a model from."""
    transformers = _transformers()
    try:
        model = transformers.AutoModelForCausalLM.from_config(hf, trust_remote_code=False,
                                                              dtype=torch.float32)
    except (TypeError, ValueError, KeyError, AttributeError, RuntimeError,
            AssertionError) as exc:  # transformers asserts on some configs (pad id ≥ vocab)
        raise ConfigError(f"{NAME}: transformers cannot build model: {type(exc).__name__}: "
                          f"{exc}") from None
    return model.train()


def make_optimizer(cfg: HFCausalLMConfig,
                   params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW; the executor pins its foreach implementation."""
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's causal-LM loss: mean next-token cross-entropy over every window's seq_len
    predictions (transformers shifts `labels` by one and ignores the last position)."""
    tokens = batch["tokens"]  # (B, T + 1)
    return model(input_ids=tokens, labels=tokens, use_cache=False).loss


# --- the portable init --------------------------------------------------------------------------

def init(model: nn.Module, seed: int) -> None:
    """Set every parameter and floating buffer of a GPT-2 or Llama model from the portable
    generator, in place (the distributions of the module docstring), each tensor from
    `RandomStream(seed, "init", <qualified name>)`; a tensor shared by several modules (the
    tied head) is set once, under its first name.

    Raises ProgramError naming the first floating parameter or buffer of a module type it
    does not know, or rotary embeddings of a rope_type other than "default".
    """
    kinds = _module_kinds()
    config: Any = model.config  # a transformers PretrainedConfig
    std = float(config.initializer_range)
    # GPT-2's residual projections (the c_proj of every attention and MLP block): std / sqrt(2L)
    scaled = {id(m.get_submodule("c_proj").weight) for m in model.modules()
              if isinstance(m, kinds["residual"])}
    residual_std = std / math.sqrt(2 * config.num_hidden_layers)
    seen: set[int] = set()
    with torch.no_grad():
        for prefix, module in model.named_modules():
            own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
            for name, tensor in own:
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                qualified = f"{prefix}.{name}" if prefix else name
                _init_tensor(kinds, module, name, tensor, qualified, seed,
                             residual_std if id(tensor) in scaled else std)


def _module_kinds() -> dict[str, tuple[type, ...]]:
    """The module classes `init` knows, by how they are initialised."""
    _transformers()
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
    from transformers.pytorch_utils import Conv1D
    return {"normal": (nn.Linear, Conv1D, nn.Embedding), "norm": (nn.LayerNorm, LlamaRMSNorm),
            "rotary": (LlamaRotaryEmbedding,), "residual": (GPT2Attention, GPT2MLP)}


def _init_tensor(kinds: dict[str, tuple[type, ...]], module: nn.Module, name: str,
                 tensor: torch.Tensor, qualified: str, seed: int, std: float) -> None:
    if isinstance(module, kinds["normal"]) and name == "weight":
        tensor.copy_(RandomStream(seed, "init", qualified).normal(tuple(tensor.shape), 0.0, std))
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            tensor[module.padding_idx].zero_()
    elif isinstance(module, kinds["normal"] + kinds["norm"]) and name == "bias":
        tensor.zero_()
    elif isinstance(module, kinds["norm"]) and name == "weight":
        tensor.fill_(1)
    elif isinstance(module, kinds["rotary"]) and name in ("inv_freq", "original_inv_freq"):
        tensor.copy_(_rope_frequencies(module, tuple(tensor.shape), qualified))
    elif tensor.is_floating_point() or tensor.is_complex():
        raise ProgramError(f"{NAME}: init does not know how to initialise {qualified!r} (a "
                           f"{type(module).__name__}); it knows the modules of "
                           f"{', '.join(MODEL_TYPES)} models")


def _rope_frequencies(module: Any, shape: tuple[int, ...], qualified: str) -> torch.Tensor:
    """transformers' default RoPE frequencies 1 / theta ** float32(2i / dim) in float32, the
    power computed in 50-digit decimal arithmetic (libmpdec: integer arithmetic, the same on
    every machine, unlike the C library's pow) and rounded to float32 through float64."""
    if module.rope_type != "default":
        raise ProgramError(f"{NAME}: init computes rotary frequencies of rope_type 'default' "
                           f"only, not {module.rope_type!r} ({qualified}); fine-tune from "
                           f"weights instead")
    config = module.config
    theta = float(np.float32(config.rope_parameters["rope_theta"]))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)  # (dim / 2,)
    context = decimal.Context(prec=50)
    powers = [float(context.power(decimal.Decimal(theta), decimal.Decimal(float(e))))
              for e in exponents]
    frequencies = np.float32(1) / np.asarray(powers, dtype=np.float64).astype(np.float32)
    if frequencies.shape != shape:
        raise ProgramError(f"{NAME}: {qualified} has shape {shape}, not the {frequencies.shape} "
                           f"of rope_type 'default'")
    return torch.from_numpy(frequencies)
