"""Built-in program "char-transformer": a small pre-LN GPT on a generated English-like corpus.

The corpus comes from a tiny probabilistic grammar driven by `protocol.engine.rng` (no downloads),
so it has the same characters on every machine. Examples are non-overlapping windows of seq_len + 1
tokens; the model predicts each next character. Attention is spelled out with matmul and softmax
(no fused kernels) so CPU and CUDA run the same op sequence.

    >>> program = build(PRESETS["test"])
    >>> program.dataset.example(0)["tokens"].shape
    torch.Size([33])
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from protocol.engine.initialization import portable_init
from protocol.engine.programs.base import TrainingProgram
from protocol.engine.programs.validation import (
    config_from_mapping,
    require,
    require_tensor_size,
)
from protocol.engine.rng import RandomStream
from protocol.engine.schedules import warmup_cosine

NAME = "char-transformer"
OPTIMIZERS = ("adamw", "sgd")
SGD_MOMENTUM = 0.9

PRESETS: dict[str, dict[str, Any]] = {
    "test": {"d_model": 64, "n_heads": 4, "n_layers": 2, "seq_len": 32, "batch_size": 8},
    # W3 of the reference: 2-layer transformer LM, d 128, seq 64, batch 8, AdamW.
    "bench": {"d_model": 128, "n_heads": 4, "n_layers": 2, "seq_len": 64, "batch_size": 8,
              "corpus_chars": 100_000},
}


@dataclass(frozen=True)
class CharTransformerConfig:
    """Config of "char-transformer"; the defaults are the "test" preset."""

    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    seq_len: int = 32
    batch_size: int = 8
    dropout: float = 0.1
    optimizer: str = "adamw"
    lr: float = 3e-3
    weight_decay: float = 0.01
    corpus_chars: int = 20_000
    seed: int = 0
    warmup_steps: int = 0  # learning-rate schedule: linear warm-up, then cosine decay to min_lr
    decay_steps: int = 0
    min_lr: float = 0.0
    clip_grad_norm: float = 0.0  # the gradients' global 2-norm is clipped to this (0: off)

    def __post_init__(self) -> None:
        require_transformer_config(self, NAME, len(VOCAB), "corpus_chars", "characters")
        require(self.warmup_steps >= 0 and self.decay_steps >= 0, NAME,
                "warmup_steps and decay_steps must be >= 0")
        require(0 <= self.min_lr <= self.lr, NAME, "min_lr must be in [0, lr]")
        require(self.clip_grad_norm >= 0, NAME, "clip_grad_norm must be >= 0 (0: no clipping)")


def require_transformer_config(cfg: Any, program: str, vocab: int, corpus_field: str,
                               unit: str) -> None:
    """The checks every GPT-shaped built-in's config shares (this one's and token-lm's): the
    shape, the optimizer, a corpus (`corpus_field`, counted in `unit`s) giving a batch of
    windows, and the largest tensors a step makes. Raises ConfigError naming `program`."""
    require(1 <= cfg.n_heads <= cfg.d_model <= 8192, program,
            "need 1 <= n_heads <= d_model <= 8192")
    require(cfg.d_model % cfg.n_heads == 0, program, "d_model must be divisible by n_heads")
    require(1 <= cfg.n_layers <= 64, program, "n_layers must be in [1, 64]")
    require(1 <= cfg.seq_len <= 4096, program, "seq_len must be in [1, 4096]")
    require(cfg.batch_size >= 1, program, "batch_size must be >= 1")
    require(0.0 <= cfg.dropout < 1.0, program, "dropout must be in [0, 1)")
    require(cfg.optimizer in OPTIMIZERS, program,
            f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")
    require(cfg.lr > 0, program, "lr must be > 0")
    require(cfg.weight_decay >= 0, program, "weight_decay must be >= 0")
    corpus = getattr(cfg, corpus_field)
    require(corpus <= 10**8, program, f"{corpus_field} must be <= 1e8")
    require((corpus - 1) // cfg.seq_len >= cfg.batch_size, program,
            f"{corpus_field} must give at least batch_size windows of seq_len + 1 {unit}")
    require(0 <= cfg.seed < 2**63, program, "seed must be in [0, 2**63)")
    tokens = cfg.batch_size * cfg.seq_len
    require_tensor_size(tokens * max(4 * cfg.d_model, vocab), program,
                        "an activation (batch_size × seq_len × max(4 d_model, vocabulary))")
    require_tensor_size(tokens * cfg.n_heads * cfg.seq_len, program,
                        "the attention weights (batch_size × n_heads × seq_len²)")


# --- the corpus --------------------------------------------------------------------------------

NAMES = ("Alice", "Bob", "the king", "the queen", "a farmer", "my sister", "the old man")
NOUNS = ("cat", "dog", "bird", "horse", "child", "sailor", "baker", "river", "garden", "house",
         "letter", "song", "apple", "lamp", "ship", "road")
ADJECTIVES = ("small", "quiet", "red", "green", "happy", "tired", "bright", "cold", "old",
              "young", "strange", "gentle")
VERBS = ("sees", "finds", "loves", "follows", "paints", "carries", "hears", "keeps", "builds",
         "remembers", "watches", "wants")
ADVERBS = ("slowly", "today", "again", "at night", "in the rain", "near the river", "with care")
DETERMINERS = ("the", "a", "every", "one", "that")
CONNECTIVES = ("and", "but", "because", "while", "so")
ENDINGS = (".", ".", ".", "!", "?")
WORD_LISTS = (NAMES, NOUNS, ADJECTIVES, VERBS, ADVERBS, DETERMINERS, CONNECTIVES, ENDINGS)
VOCAB = sorted({c for words in WORD_LISTS for w in words for c in w + w.capitalize()} | {" ", ","})


def _draws(seed: int) -> Iterator[int]:
    """An endless sequence of uint32 draws from the corpus streams, 4096 at a time."""
    chunk = 0
    while True:
        yield from RandomStream(seed, "data", NAME, "corpus", chunk).words(4096).tolist()
        chunk += 1


def _noun_phrase(draw: Iterator[int]) -> str:
    if next(draw) % 3 == 0:
        return NAMES[next(draw) % len(NAMES)]
    words = [DETERMINERS[next(draw) % len(DETERMINERS)]]
    if next(draw) % 2 == 0:
        words.append(ADJECTIVES[next(draw) % len(ADJECTIVES)])
    words.append(NOUNS[next(draw) % len(NOUNS)])
    return " ".join(words)


def _clause(draw: Iterator[int]) -> str:
    words = [_noun_phrase(draw), VERBS[next(draw) % len(VERBS)], _noun_phrase(draw)]
    if next(draw) % 3 == 0:
        words.append(ADVERBS[next(draw) % len(ADVERBS)])
    return " ".join(words)


def _sentence(draw: Iterator[int]) -> str:
    text = _clause(draw)
    if next(draw) % 4 == 0:
        text += ", " + CONNECTIVES[next(draw) % len(CONNECTIVES)] + " " + _clause(draw)
    text += ENDINGS[next(draw) % len(ENDINGS)]
    return text[0].upper() + text[1:]


def generate_corpus(chars: int, seed: int) -> str:
    """Exactly `chars` characters of sentences from the grammar, separated by spaces."""
    draw, pieces, length = _draws(seed), [], 0
    while length < chars:
        pieces.append(_sentence(draw))
        length += len(pieces[-1]) + 1
    return " ".join(pieces)[:chars]


class CorpusWindows:
    """Non-overlapping windows {"tokens": (seq_len + 1,) int64} over the encoded corpus."""

    def __init__(self, config: CharTransformerConfig) -> None:
        self.config = config

    def __len__(self) -> int:
        return (self.config.corpus_chars - 1) // self.config.seq_len

    def example(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} out of range [0, {len(self)})")
        start = index * self.config.seq_len
        return {"tokens": self._tokens[start:start + self.config.seq_len + 1].clone()}

    @functools.cached_property
    def _tokens(self) -> torch.Tensor:
        text = generate_corpus(self.config.corpus_chars, self.config.seed)
        table = np.zeros(128, dtype=np.int64)
        table[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))
        codes = np.frombuffer(text.encode("ascii"), dtype=np.uint8)
        return torch.from_numpy(table[codes])  # (corpus_chars,)


# --- the model ---------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written as matmul, masked softmax, matmul."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        hd = c // self.n_heads
        q, k, v = self.qkv(x).split(c, dim=2)  # 3 x (B, T, C)
        q = q.view(b, t, self.n_heads, hd).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(b, t, self.n_heads, hd).transpose(1, 2)  # (B, H, T, hd)
        v = v.view(b, t, self.n_heads, hd).transpose(1, 2)  # (B, H, T, hd)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))  # (B, H, T, T)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # (T, T)
        att = att.masked_fill(~causal, float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))  # (B, H, T, T)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU(approximate="none")
        self.out = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(self.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # (B, T, C)
        return x + self.mlp(self.ln2(x))  # (B, T, C)


class CharTransformer(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, linear head."""

    def __init__(self, vocab: int, cfg: CharTransformerConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg.d_model, cfg.n_heads, cfg.dropout) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)  # (T,)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


# --- the program -------------------------------------------------------------------------------

def parse_config(config: Mapping[str, Any] | None) -> CharTransformerConfig:
    """`config` checked and completed with the defaults. Raises ConfigError for an unknown key
    or a bad value."""
    return config_from_mapping(CharTransformerConfig, config, NAME)


def parameter_count(config: Mapping[str, Any] | None) -> int:
    """How many parameters `build(config)` makes, from the config alone (nothing is built), so
    a node can refuse a model too large for it first. Raises ConfigError as `parse_config`."""
    cfg = parse_config(config)
    d, vocab = cfg.d_model, len(VOCAB)
    # per block: 2 LayerNorms (4d), qkv (3d² + 3d), proj (d² + d), fc (4d² + 4d), out (4d² + d)
    block = 12 * d * d + 13 * d
    return vocab * d + cfg.seq_len * d + cfg.n_layers * block + 2 * d + d * vocab + vocab


def build(config: Mapping[str, Any] | None = None) -> TrainingProgram:
    """The "char-transformer" program for `config` (missing keys take the defaults).

    Raises ConfigError for an unknown key or a bad value.
    """
    cfg = parse_config(config)
    return TrainingProgram(
        name=NAME,
        model=CharTransformer(len(VOCAB), cfg),
        make_optimizer=functools.partial(make_optimizer, cfg),
        loss=loss,
        dataset=CorpusWindows(cfg),
        batch_size=cfg.batch_size,
        init=portable_init,
        config=dataclasses.asdict(cfg),
        make_scheduler=warmup_cosine(cfg.warmup_steps, cfg.decay_steps, cfg.min_lr),
        clip_grad_norm=cfg.clip_grad_norm or None,
        vocab_size=len(VOCAB),
    )


def make_optimizer(cfg: CharTransformerConfig,
                   params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW or SGD (momentum 0.9); the executor pins their foreach implementation."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=SGD_MOMENTUM,
                           weight_decay=cfg.weight_decay)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean next-character cross-entropy over every position of every window."""
    tokens = batch["tokens"]  # (B, T + 1)
    logits = model(tokens[:, :-1])  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
