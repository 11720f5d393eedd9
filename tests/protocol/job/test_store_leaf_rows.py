"""Issue 10, finding 9: a corrupted leaf row in a party's own SQLite database went unnoticed:
`JobStore.leaf` and `leaves` now check every row (field sizes, and the stored leaf hash against
the one the row's fields give) and raise StoreError, which a daemon answers DATA_LOSS."""

from __future__ import annotations

import sqlite3

import pytest

from protocol.engine.precision import PrecisionPolicy
from protocol.errors import StoreError
from protocol.job.create import build_job
from protocol.job.store import JobStore

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}


@pytest.fixture
def store(tmp_path):
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=2, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=1,
                             commit_interval=2)
    store = JobStore(tmp_path, spec)
    store.put_initial(state0)
    yield store
    store.close()


def _damage(store: JobStore, column: str, value: bytes) -> None:
    """Change one field of leaf 0 behind the store's back (a disk or another process)."""
    with sqlite3.connect(store.dir / "leaves.sqlite") as db:
        db.execute(f"UPDATE leaves SET {column}=? WHERE step=0", (value,))


@pytest.mark.parametrize("column, value", [
    ("state_hash", b"\x01" * 32),  # another h_0: the stored leaf hash no longer fits
    ("log_hash", b"\x02" * 32),
    ("leaf_hash", b"\x03" * 32),
    ("state_hash", b"\x01" * 31),  # a field of the wrong size
    ("leaf_hash", b""),
])
def test_finding_9_a_corrupted_leaf_row_is_a_store_error(store, column, value):
    assert store.leaf(0).state_hash == store.spec.h0  # intact first
    _damage(store, column, value)
    with pytest.raises(StoreError, match="leaf of step 0 is damaged"):
        store.leaf(0)
    with pytest.raises(StoreError, match="leaf of step 0 is damaged"):
        store.leaves()
    with pytest.raises(StoreError, match="leaf of step 0 is damaged"):
        store.tree()
