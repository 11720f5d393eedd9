"""A complete user program: a small convolution + attention mixer on token sequences.

This is the file the README's "Bring your own model" section walks through. Check it, then make a
job of it:

    ovt program check examples/mixer.py:build
    ovt replay-check --program examples/mixer.py:build --steps 20
    ovt job create examples/mixer.toml

A program is one function, config mapping -> `TrainingProgram`: an ordinary `nn.Module`, a
`torch.optim` optimizer factory, a loss, a dataset of examples (named CPU tensors), the batch
size, and how S_0 is initialised. Optional: a learning-rate schedule and gradient clipping.
Nothing here knows about rounding, logs or hardware: the executor does all of that.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim import lr_scheduler

from protocol.engine.initialization import portable_init
from protocol.engine.programs.base import TrainingProgram
from protocol.engine.rng import RandomStream

VOCAB = 32
SEQ_LEN = 24


class Mixer(nn.Module):
    """Embedding, a depthwise causal convolution, one causal self-attention, a projection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, width)
        self.conv = nn.Conv1d(width, width, kernel_size=3, padding=2, groups=width)
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (B, T, C)
        t = x.shape[1]
        x = x + self.conv(x.transpose(1, 2))[..., :t].transpose(1, 2)  # causal: drop the tail
        b, _, c = x.shape
        q, k, v = self.qkv(self.norm(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        # dropout inside attention, as HuggingFace models do: served by ovt's portable generator
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=0.1 if self.training else 0.0)
        x = x + self.drop(a.transpose(1, 2).reshape(b, t, c))
        return self.out(x)


class Sequences:
    """A fixed dataset of token sequences from the portable generator: each next token is the
    previous one plus a small random step, so there is something to learn."""

    def __init__(self, count: int, seed: int) -> None:
        steps = RandomStream(seed, "mixer-data").words(count * (SEQ_LEN + 1)) % 3
        walk = torch.from_numpy(steps.astype("int64")).view(count, SEQ_LEN + 1).cumsum(1)
        self.tokens = walk % VOCAB

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def example(self, index: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.tokens[index].clone()}


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def build(config: Mapping[str, Any] | None = None) -> TrainingProgram:
    """The program for `config` (keys: width, heads, batch_size, lr, steps; all optional)."""
    cfg = {"width": 32, "heads": 4, "batch_size": 8, "lr": 3e-3, "steps": 100,
           **(config or {})}
    lr, steps = float(cfg["lr"]), int(cfg["steps"])
    return TrainingProgram(
        name="mixer",
        model=Mixer(int(cfg["width"]), int(cfg["heads"])),
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
        loss=loss,
        dataset=Sequences(256, seed=0),
        batch_size=int(cfg["batch_size"]),
        init=portable_init,
        config=cfg,
        # one-cycle: warm up to lr, then anneal (cosine) over the job's steps
        make_scheduler=lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps + 1),
        clip_grad_norm=1.0,
    )
