"""A user program for the registry tests: image-cnn at a custom, tiny size."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from protocol.engine.programs import image_cnn
from protocol.engine.programs.base import TrainingProgram

PRESETS = {"tiny": {"channels": 2}, "small": {"channels": 4}}


@dataclass(frozen=True)
class Sizes:
    image_size: int = 8
    dataset_size: int = 64
    batch_size: int = 8


def build(config: Mapping[str, Any] | None = None) -> TrainingProgram:
    sizes = Sizes()
    return image_cnn.build({"image_size": sizes.image_size, "dataset_size": sizes.dataset_size,
                            "batch_size": sizes.batch_size, "channels": 4, **(config or {})})


def not_a_program(config: Mapping[str, Any] | None = None) -> dict[str, str]:
    return {"name": "not a TrainingProgram"}


def broken(config: Mapping[str, Any] | None = None) -> TrainingProgram:
    raise RuntimeError("this program is broken")


NOT_CALLABLE = 3
