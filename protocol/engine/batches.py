"""Which examples each step uses (SPEC §2 "Batch", §3.4).

Steps are numbered from 1: step t turns S_{t-1} into S_t using batch B_t. Epochs drop the last
partial batch, so every batch has exactly `batch_size` examples and an epoch is
`dataset_size // batch_size` steps. Each epoch's order is a portable permutation keyed by
(seed, "data-order", epoch), so trainer, auditor and arbiter pick the same examples for any step
without replaying the steps before it.

    >>> batch_indices(seed=0, dataset_size=10, batch_size=4, step=1).shape
    (4,)
"""

from __future__ import annotations

import functools

import numpy as np

from protocol.engine.rng import RandomStream
from protocol.errors import ConfigError

_DATA_ORDER = "data-order"


def _check_int(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise ConfigError(f"{what} must be an int >= {minimum}, got {value!r}")
    return int(value)


@functools.lru_cache(maxsize=2)
def _epoch_permutation(seed: int, dataset_size: int, epoch: int) -> np.ndarray:
    """The data order of one epoch, cached: consecutive steps share it (read-only, so the cached
    array cannot be corrupted by a caller)."""
    order = RandomStream(seed, _DATA_ORDER, epoch).permutation(dataset_size)
    order.setflags(write=False)
    return order


def batch_indices(seed: int, dataset_size: int, batch_size: int, step: int) -> np.ndarray:
    """Dataset indices (int64, length batch_size) of the examples step `step` trains on.

    Raises ConfigError if batch_size < 1, step < 1, seed < 0, or the dataset holds fewer than
    batch_size examples (an epoch would have no batch).
    """
    seed = _check_int(seed, "seed", 0)
    dataset_size = _check_int(dataset_size, "dataset_size", 0)
    batch_size = _check_int(batch_size, "batch_size", 1)
    step = _check_int(step, "step", 1)
    batches_per_epoch = dataset_size // batch_size  # SPEC §2: drop-last epochs
    if batches_per_epoch == 0:
        raise ConfigError(
            f"dataset of {dataset_size} examples has no full batch of {batch_size}"
        )
    epoch, pos = divmod(step - 1, batches_per_epoch)
    order = _epoch_permutation(seed, dataset_size, epoch)
    return order[pos * batch_size:(pos + 1) * batch_size].copy()
