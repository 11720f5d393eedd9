"""Built-in program "token-lm": a GPT-2-style token language model, for runs at scale.

The model is GPT-2's shape: learned token and position embeddings, pre-LayerNorm blocks (causal
multi-head self-attention, then a 4x MLP with exact GELU), a final LayerNorm and an *untied*
linear head without bias (tying would make the head start at the embedding's N(0, 1) init,
logits of standard deviation ~sqrt(d_model); untied, every parameter keeps `portable_init`'s
distribution like the other built-ins). No dropout by default. Attention is spelled out as
matmul, masked softmax, matmul: the blocks are "char-transformer"'s own, so CPU and CUDA run the
same op sequence (the executor also pins SDPA to its math kernel, which decomposes the same way).

The data is a synthetic token corpus from `protocol.engine.rng` (no downloads, no tokenizer), the
same tokens on every machine: documents of `DOC_LEN` tokens, each a random walk on a sparse
successor graph over the vocabulary (every token has `BRANCH` successors; with probability
`JUMP_IN_8 / 8` the walk jumps to a fresh token instead). Start tokens, successors and jumps are
Zipf-distributed (weight ∝ 1/(rank + 1), low ids frequent, like a BPE vocabulary). Everything is
integer arithmetic, so the corpus cannot depend on a machine's floating point. Examples are
non-overlapping windows of seq_len + 1 tokens; the model predicts each next token.

    >>> program = build(PRESETS["test"])
    >>> program.dataset.example(0)["tokens"].shape
    torch.Size([17])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from protocol.engine.initialization import portable_init
from protocol.engine.programs.base import TrainingProgram
from protocol.engine.programs.char_transformer import Block, loss, require_transformer_config
from protocol.engine.programs.validation import config_from_mapping, require
from protocol.engine.rng import RandomStream

NAME = "token-lm"
OPTIMIZERS = ("adamw", "sgd")
SGD_MOMENTUM = 0.9
GPT2_VOCAB = 50_257

_GPT2_SMALL = {"vocab_size": GPT2_VOCAB, "d_model": 768, "n_heads": 12, "seq_len": 64,
               "batch_size": 8, "lr": 3e-4, "corpus_tokens": 1 << 19}
PRESETS: dict[str, dict[str, Any]] = {
    "test": {"vocab_size": 512, "d_model": 32, "n_heads": 2, "n_layers": 1, "seq_len": 16,
             "batch_size": 4},
    # char-transformer's "bench" size (the reference's W3: 2 layers, d 128, seq 64, batch 8,
    # AdamW) with a token vocabulary; what bench/bench_step.py runs by default.
    "bench": {"vocab_size": 8192, "d_model": 128, "n_heads": 4, "n_layers": 2, "seq_len": 64,
              "batch_size": 8, "lr": 1e-3, "corpus_tokens": 1 << 17},
    # GPT-2 small's width (vocabulary 50,257, d 768, 12 heads) with 2 or all 12 of its layers;
    # 91.4 M and 162.3 M parameters (the untied head adds 38.6 M to GPT-2's count).
    "gpt2-small-2l": {**_GPT2_SMALL, "n_layers": 2},
    "gpt2-small": {**_GPT2_SMALL, "n_layers": 12},
}

# The corpus generator's constants: part of the program's source, so of the job's commitment.
DOC_LEN = 256
BRANCH = 4
JUMP_IN_8 = 1
_ZIPF_SCALE = 1 << 40  # integer weights 2**40 // (rank + 1); their sum stays below 2**45


@dataclass(frozen=True)
class TokenLMConfig:
    """Config of "token-lm"; the defaults are the "test" preset."""

    vocab_size: int = 512
    d_model: int = 32
    n_heads: int = 2
    n_layers: int = 1
    seq_len: int = 16
    batch_size: int = 4
    dropout: float = 0.0
    optimizer: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    corpus_tokens: int = 1 << 14
    seed: int = 0

    def __post_init__(self) -> None:
        require(2 <= self.vocab_size <= 1 << 20, NAME, "vocab_size must be in [2, 2**20]")
        require_transformer_config(self, NAME, self.vocab_size, "corpus_tokens", "tokens")


# --- the corpus --------------------------------------------------------------------------------

def _zipf(stream: RandomStream, n: int, cumulative: np.ndarray) -> np.ndarray:
    """n Zipf-distributed token ids: 64-bit draws (two words each) mod the total weight, located
    in the cumulative integer weights. Exact integer arithmetic throughout."""
    words = stream.words(2 * n).astype(np.uint64).reshape(n, 2)
    draws = ((words[:, 0] << np.uint64(32)) | words[:, 1]) % np.uint64(cumulative[-1])
    return np.searchsorted(cumulative, draws.astype(np.int64), side="right").astype(np.int64)


def generate_corpus(tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    """Exactly `tokens` token ids (int64) in [0, vocab_size): documents of DOC_LEN tokens, each a
    walk on the successor graph (see the module docstring), concatenated and cut to length.

    The documents are generated side by side (one vectorised draw per position), so the cost is
    DOC_LEN draws whatever the corpus size. Document i reads word i of every stream, so a
    shorter corpus is a prefix of a longer one.
    """
    weights = _ZIPF_SCALE // np.arange(1, vocab_size + 1, dtype=np.int64)
    cumulative = np.cumsum(weights)
    successors = _zipf(RandomStream(seed, "data", NAME, "successors"), vocab_size * BRANCH,
                       cumulative).reshape(vocab_size, BRANCH)
    docs = -(-tokens // DOC_LEN)
    out = np.empty((docs, DOC_LEN), dtype=np.int64)
    out[:, 0] = _zipf(RandomStream(seed, "data", NAME, "start"), docs, cumulative)
    for pos in range(1, DOC_LEN):
        choice = RandomStream(seed, "data", NAME, "walk", pos).words(docs).astype(np.int64)
        jump = _zipf(RandomStream(seed, "data", NAME, "jump", pos), docs, cumulative)
        follow = successors[out[:, pos - 1], choice % BRANCH]
        out[:, pos] = np.where((choice >> 3) % 8 < JUMP_IN_8, jump, follow)
    return out.reshape(-1)[:tokens]


class TokenWindows:
    """Non-overlapping windows {"tokens": (seq_len + 1,) int64} over the generated corpus."""

    def __init__(self, config: TokenLMConfig) -> None:
        self.config = config

    def __len__(self) -> int:
        return (self.config.corpus_tokens - 1) // self.config.seq_len

    def example(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} out of range [0, {len(self)})")
        start = index * self.config.seq_len
        return {"tokens": self._tokens[start:start + self.config.seq_len + 1].clone()}

    @functools.cached_property
    def _tokens(self) -> torch.Tensor:
        cfg = self.config
        return torch.from_numpy(generate_corpus(cfg.corpus_tokens, cfg.vocab_size, cfg.seed))


# --- the model ---------------------------------------------------------------------------------

class TokenLM(nn.Module):
    """Token + learned position embeddings, pre-LN blocks, final LayerNorm, untied linear head
    without bias (GPT-2's head has none)."""

    def __init__(self, cfg: TokenLMConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            Block(cfg.d_model, cfg.n_heads, cfg.dropout) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        pos = torch.arange(t, device=tokens.device)  # (T,)
        x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, vocab)


# --- the program -------------------------------------------------------------------------------

def parse_config(config: Mapping[str, Any] | None) -> TokenLMConfig:
    """`config` checked and completed with the defaults. Raises ConfigError for an unknown key
    or a bad value."""
    return config_from_mapping(TokenLMConfig, config, NAME)


def parameter_count(config: Mapping[str, Any] | None) -> int:
    """How many parameters `build(config)` makes, from the config alone (nothing is built), so
    a node can refuse a model too large for it first. Raises ConfigError as `parse_config`."""
    cfg = parse_config(config)
    d, vocab = cfg.d_model, cfg.vocab_size
    # per block: 2 LayerNorms (4d), qkv (3d² + 3d), proj (d² + d), fc (4d² + 4d), out (4d² + d)
    block = 12 * d * d + 13 * d
    # token and position embeddings, blocks, final LayerNorm, head (no bias)
    return vocab * d + cfg.seq_len * d + cfg.n_layers * block + 2 * d + d * vocab


def build(config: Mapping[str, Any] | None = None) -> TrainingProgram:
    """The "token-lm" program for `config` (missing keys take the defaults).

    Raises ConfigError for an unknown key or a bad value.
    """
    cfg = parse_config(config)
    return TrainingProgram(
        name=NAME,
        model=TokenLM(cfg),
        make_optimizer=functools.partial(make_optimizer, cfg),
        loss=loss,
        dataset=TokenWindows(cfg),
        batch_size=cfg.batch_size,
        init=portable_init,
        config=dataclasses.asdict(cfg),
        vocab_size=cfg.vocab_size,
    )


def make_optimizer(cfg: TokenLMConfig,
                   params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW or SGD (momentum 0.9); the executor pins their foreach implementation."""
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=SGD_MOMENTUM,
                           weight_decay=cfg.weight_decay)
