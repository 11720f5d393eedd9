"""Tests of protocol.engine.batches: drop-last epochs of a portable permutation."""

from __future__ import annotations

import numpy as np
import pytest

from protocol.engine.batches import batch_indices
from protocol.engine.rng import RandomStream
from protocol.errors import ConfigError


def epoch_batches(seed, dataset_size, batch_size, epoch):
    per_epoch = dataset_size // batch_size
    first = epoch * per_epoch + 1
    return [batch_indices(seed, dataset_size, batch_size, step)
            for step in range(first, first + per_epoch)]


def test_one_epoch_is_disjoint_and_covers_full_batches():
    batches = epoch_batches(seed=3, dataset_size=103, batch_size=10, epoch=0)
    assert len(batches) == 10
    assert all(b.shape == (10,) and b.dtype == np.int64 for b in batches)
    joined = np.concatenate(batches)
    assert np.unique(joined).size == 100
    assert joined.min() >= 0 and joined.max() < 103


def test_batches_follow_the_epoch_permutation():
    order = RandomStream(3, "data-order", 1).permutation(103)
    assert np.array_equal(batch_indices(3, 103, 10, 12), order[10:20])


def test_epochs_differ():
    first = np.concatenate(epoch_batches(3, 103, 10, 0))
    second = np.concatenate(epoch_batches(3, 103, 10, 1))
    assert not np.array_equal(first, second)


def test_deterministic_and_seeded():
    assert np.array_equal(batch_indices(9, 50, 7, 5), batch_indices(9, 50, 7, 5))
    assert not np.array_equal(batch_indices(9, 50, 7, 5), batch_indices(10, 50, 7, 5))


def test_returned_batch_is_a_private_copy():
    batch = batch_indices(9, 50, 7, 1)
    batch[:] = -1
    assert (batch_indices(9, 50, 7, 1) >= 0).all()


@pytest.mark.parametrize(("seed", "dataset_size", "batch_size", "step"), [
    (0, 5, 6, 1), (0, 0, 1, 1), (0, 10, 0, 1), (0, 10, 2, 0), (-1, 10, 2, 1),
    (0, -10, 2, 1), (0, 10, 2.0, 1), (0, 10, 2, True),
])
def test_bad_arguments_raise(seed, dataset_size, batch_size, step):
    with pytest.raises(ConfigError):
        batch_indices(seed, dataset_size, batch_size, step)
