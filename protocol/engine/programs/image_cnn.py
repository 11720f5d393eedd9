"""Built-in program "image-cnn": a small residual CNN with BatchNorm on synthetic stripe images.

Each class is a stripe pattern, ((x*a + y*b + phase) // period) % 2, with a class-dependent
orientation (a, b) and period; each example has its own phase, a random colour and uniform
noise. Everything is integer arithmetic or single IEEE float32 operations on `protocol.engine.rng`
output, so the dataset has the same bits on every machine. The mean colour of an image carries no
class information: the network has to learn spatial filters.

    >>> program = build(PRESETS["test"])
    >>> program.dataset.example(0)["image"].shape
    torch.Size([3, 16, 16])
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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

NAME = "image-cnn"
DEFAULT_LR = {"sgd": 0.05, "adam": 1e-3}
SGD_MOMENTUM = 0.9
NOISE = 0.5  # half-width of the uniform pixel noise
MAX_CLASSES = 32
# Stripe directions (a, b); class k uses ORIENTATIONS[k % 8] and period 2 + k // 8.
ORIENTATIONS = ((1, 0), (0, 1), (1, 1), (1, -1), (1, 2), (2, 1), (1, -2), (2, -1))

PRESETS: dict[str, dict[str, Any]] = {
    "test": {"image_size": 16, "channels": 16, "batch_size": 32, "dataset_size": 2048},
    # W2 of the reference: small CNN with BatchNorm, batch 64, SGD with momentum.
    "bench": {"image_size": 32, "channels": 16, "batch_size": 64, "dataset_size": 4096},
}


@dataclass(frozen=True)
class ImageCNNConfig:
    """Config of "image-cnn"; the defaults are the "test" preset."""

    image_size: int = 16
    channels: int = 16
    classes: int = 10
    dataset_size: int = 2048
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = DEFAULT_LR["sgd"]
    weight_decay: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        require(4 <= self.image_size <= 512, NAME, "image_size must be in [4, 512]")
        require(1 <= self.channels <= 1024, NAME, "channels must be in [1, 1024]")
        require(2 <= self.classes <= MAX_CLASSES, NAME, f"classes must be in [2, {MAX_CLASSES}]")
        require(self.batch_size >= 1, NAME, "batch_size must be >= 1")
        require(self.dataset_size >= self.batch_size, NAME, "dataset_size must be >= batch_size")
        require(self.optimizer in DEFAULT_LR, NAME,
                f"optimizer must be one of {', '.join(DEFAULT_LR)}, got {self.optimizer!r}")
        require(self.lr > 0, NAME, "lr must be > 0")
        require(self.weight_decay >= 0, NAME, "weight_decay must be >= 0")
        require(0 <= self.seed < 2**63, NAME, "seed must be in [0, 2**63)")
        pixels = self.image_size * self.image_size
        require_tensor_size(self.dataset_size * 3 * pixels, NAME,
                            "the dataset (dataset_size × 3 × image_size²)")
        require_tensor_size(self.batch_size * max(self.channels, 3) * pixels, NAME,
                            "an activation (batch_size × channels × image_size²)")


class ResidualBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input, then ReLU; keeps the shape (B, C, H, W)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))  # (B, C, H, W)
        y = self.bn2(self.conv2(y))  # (B, C, H, W)
        return F.relu(y + x)


class ImageCNN(nn.Module):
    """stem conv -> residual block -> stride-2 conv -> global average pool -> linear."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(channels)
        self.block = ResidualBlock(channels)
        self.down = nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1, bias=False)
        self.down_bn = nn.BatchNorm2d(2 * channels)
        self.head = nn.Linear(2 * channels, classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem_bn(self.stem(image)))  # (B, C, H, W)
        x = self.block(x)  # (B, C, H, W)
        x = F.relu(self.down_bn(self.down(x)))  # (B, 2C, H/2, W/2)
        x = x.mean(dim=(2, 3))  # (B, 2C)
        return self.head(x)  # (B, classes)


class StripeImages:
    """The synthetic dataset of a config: generated once, on first use, then kept."""

    def __init__(self, config: ImageCNNConfig) -> None:
        self.config = config

    def __len__(self) -> int:
        return self.config.dataset_size

    def example(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} out of range [0, {len(self)})")
        images, labels = self._tensors
        return {"image": images[index].clone(), "label": labels[index].clone()}

    @functools.cached_property
    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return generate_stripes(self.config)


def generate_stripes(config: ImageCNNConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """All images (N, 3, S, S) float32 and labels (N,) int64 of `config`, deterministically."""
    n, s = config.dataset_size, config.image_size

    def stream(purpose: str) -> RandomStream:
        return RandomStream(config.seed, "data", NAME, purpose)

    labels = torch.from_numpy(stream("labels").permutation(n) % config.classes)  # (N,)
    orient = torch.tensor(ORIENTATIONS, dtype=torch.int64)[labels % len(ORIENTATIONS)]  # (N, 2)
    period = (2 + labels // len(ORIENTATIONS)).view(n, 1, 1)  # (N, 1, 1)
    phase = torch.from_numpy(stream("phase").words(n).astype("int64")).view(n, 1, 1)
    grid = torch.arange(s, dtype=torch.int64)
    y, x = grid.view(1, s, 1), grid.view(1, 1, s)
    # offset keeps the numerator non-negative (|a|, |b| <= 2).
    v = x * orient[:, 0].view(n, 1, 1) + y * orient[:, 1].view(n, 1, 1) + 2 * s + phase % period
    sign = ((v // period) % 2 * 2 - 1).to(torch.float32).unsqueeze(1)  # (N, 1, S, S) in {-1, 1}
    colour = stream("colour").uniform((n, 3, 1, 1), 0.5, 1.0)  # (N, 3, 1, 1)
    noise = stream("noise").uniform((n, 3, s, s), -NOISE, NOISE)  # (N, 3, S, S)
    return sign * colour + noise, labels


def parse_config(config: Mapping[str, Any] | None) -> ImageCNNConfig:
    """`config` checked and completed with the defaults; without an explicit lr, lr is the
    default of the chosen optimizer (sgd 0.05, adam 1e-3). Raises ConfigError for an unknown key
    or a bad value."""
    mapping = {} if config is None else config
    optimizer = mapping.get("optimizer") if isinstance(mapping, Mapping) else None
    if isinstance(optimizer, str) and optimizer in DEFAULT_LR and "lr" not in mapping:
        mapping = {**mapping, "lr": DEFAULT_LR[optimizer]}
    return config_from_mapping(ImageCNNConfig, mapping, NAME)


def parameter_count(config: Mapping[str, Any] | None) -> int:
    """How many parameters `build(config)` makes, from the config alone (nothing is built), so
    a node can refuse a model too large for it first. Raises ConfigError as `parse_config`."""
    cfg = parse_config(config)
    c, classes = cfg.channels, cfg.classes
    convs = 3 * c * 9 + 2 * c * c * 9 + c * 2 * c * 9  # stem, the block's two, down (3x3)
    batch_norms = 2 * (c + c + c + 2 * c)  # weight and bias of stem_bn, bn1, bn2, down_bn
    return convs + batch_norms + 2 * c * classes + classes


def build(config: Mapping[str, Any] | None = None) -> TrainingProgram:
    """The "image-cnn" program for `config` (missing keys take the defaults).

    Raises ConfigError for an unknown key or a bad value (see `parse_config`).
    """
    cfg = parse_config(config)
    return TrainingProgram(
        name=NAME,
        model=ImageCNN(cfg.channels, cfg.classes),
        make_optimizer=functools.partial(make_optimizer, cfg),
        loss=loss,
        dataset=StripeImages(cfg),
        batch_size=cfg.batch_size,
        init=portable_init,
        config=dataclasses.asdict(cfg),
    )


def make_optimizer(cfg: ImageCNNConfig,
                   params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD (momentum 0.9) or Adam; the executor pins their foreach implementation."""
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=SGD_MOMENTUM,
                               weight_decay=cfg.weight_decay)
    return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy of the model's logits against the labels."""
    return F.cross_entropy(model(batch["image"]), batch["label"])
