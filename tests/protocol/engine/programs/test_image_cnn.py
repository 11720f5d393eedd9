"""image-cnn specifics: the stripe data, the model's shapes, optimizer defaults."""

from __future__ import annotations

import pytest
import torch

from protocol.engine.programs import image_cnn
from protocol.errors import ConfigError


def test_labels_are_balanced_and_images_bounded():
    cfg = image_cnn.ImageCNNConfig(dataset_size=200, classes=10)
    images, labels = image_cnn.generate_stripes(cfg)
    assert images.shape == (200, 3, 16, 16) and images.dtype == torch.float32
    assert labels.dtype == torch.int64
    assert torch.equal(torch.bincount(labels, minlength=10), torch.full((10,), 20))
    assert images.abs().max() <= 1.5


def test_class_patterns_differ():
    cfg = image_cnn.ImageCNNConfig(dataset_size=64, classes=16)
    images, labels = image_cnn.generate_stripes(cfg)
    signs = {int(k): (images[labels == k][0].sum(0) > 0) for k in labels.unique()}
    # a class's stripe pattern is not a shifted copy of another's: compare autocorrelation shape
    patterns = {k: (s[:, :-1] == s[:, 1:]).sum().item() * 1000 + (s[:-1] == s[1:]).sum().item()
                for k, s in signs.items()}
    assert len(set(patterns.values())) > len(patterns) // 2


def test_model_shapes():
    program = image_cnn.build({"image_size": 8, "channels": 4, "classes": 3, "dataset_size": 8,
                               "batch_size": 4})
    logits = program.model(torch.zeros(2, 3, 8, 8))
    assert logits.shape == (2, 3)


def test_optimizer_default_lr_follows_the_optimizer():
    assert image_cnn.build({}).config["lr"] == 0.05
    assert image_cnn.build({"optimizer": "adam"}).config["lr"] == 1e-3
    assert image_cnn.build({"optimizer": "adam", "lr": 0.01}).config["lr"] == 0.01


@pytest.mark.parametrize("bad", [{"classes": 1}, {"classes": 33}, {"dataset_size": 16},
                                 {"image_size": 2}, {"channels": 0}])
def test_out_of_range_sizes(bad):
    with pytest.raises(ConfigError, match="image-cnn"):
        image_cnn.build(bad)
