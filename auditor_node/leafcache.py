"""The trainer's leaves an auditor has verified, kept in its own store across its own crashes.

`CachedClaims` wraps a verified `ClaimSource` (normally `proto.claims.RemoteClaims`, which checks
every leaf against the trainer's signed root before returning it) and appends each leaf it hands
out to `<store>/<job id>/trainer-leaves.ovt`. An auditor restarted after a crash then replays on
without asking the trainer again for a leaf it has already verified. (S_0 and the logs of steps
already replayed are never asked for again either: `replay_job` resumes from the auditor's own
store.)

The file is a sequence of records, each a 4-byte big-endian length and canonical bytes
(`protocol.codec.canonical`). The first record is the trainer's signed commitment the leaves were
verified against; each other one is `leaf_data(t, h_t, ℓ_t)`, the bytes leaf t hashes. The
leaves are valid only under that commitment: when the trainer presents another, the file starts
afresh. (The auditor's own replay is cut back to the last step whose stored leaf, ℓ_t
included, is the new commitment's: `protocol.job.run.begin_replay`.) A torn or unreadable tail
(a crash mid-append) is cut off when the file is opened.
"""

from __future__ import annotations

import struct
import threading
from pathlib import Path

from protocol.codec.canonical import decode
from protocol.commit.commitments import SignedCommitment
from protocol.commit.leaf import Leaf, leaf_data
from protocol.errors import EncodingError
from protocol.files import atomic_write
from protocol.job.run import ClaimSource

CACHE_FILE = "trainer-leaves.ovt"
_LENGTH = struct.Struct(">I")
_MAX_RECORD_BYTES = 4096


def _frame(record: bytes) -> bytes:
    return _LENGTH.pack(len(record)) + record


def _records(data: bytes):
    """Yield (record, end offset) for each whole record; stop at a torn or oversized one."""
    offset = 0
    while offset + _LENGTH.size <= len(data):
        (size,) = _LENGTH.unpack_from(data, offset)
        end = offset + _LENGTH.size + size
        if size > _MAX_RECORD_BYTES or end > len(data):
            return
        yield data[offset + _LENGTH.size:end], end
        offset = end


def _decode_leaf(record: bytes) -> Leaf | None:
    try:
        value = decode(record, max_bytes=_MAX_RECORD_BYTES)
    except EncodingError:
        return None
    if not (isinstance(value, list) and len(value) == 3 and type(value[0]) is int
            and value[0] >= 0 and all(isinstance(v, bytes) and len(v) == 32
                                      for v in value[1:])):
        return None
    return Leaf(*value)


class LeafCache:
    """The verified leaves of one trainer commitment, in memory and appended to `path`."""

    def __init__(self, path: Path, commitment: SignedCommitment) -> None:
        self.path = Path(path)
        self._leaves: dict[int, Leaf] = {}
        self._lock = threading.Lock()
        header = commitment.to_bytes()
        data = self.path.read_bytes() if self.path.exists() else b""
        good = self._load(data, header)
        if good == 0:
            atomic_write(self.path, _frame(header))
        elif good < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good)
        self._file = open(self.path, "ab")  # closed by close()

    def _load(self, data: bytes, header: bytes) -> int:
        """Read the leaves under `header`; the offset after the last good record (0: none)."""
        good = 0
        for i, (record, end) in enumerate(_records(data)):
            if i == 0:
                if record != header:
                    return 0
            else:
                leaf = _decode_leaf(record)
                if leaf is None:
                    break
                self._leaves[leaf.step] = leaf
            good = end
        return good

    def __len__(self) -> int:
        return len(self._leaves)

    def get(self, step: int) -> Leaf | None:
        with self._lock:
            return self._leaves.get(step)

    def add(self, leaf: Leaf) -> None:
        """Remember a verified leaf (flushed to the OS at once: it survives a kill -9)."""
        with self._lock:
            if leaf.step in self._leaves:
                return
            self._leaves[leaf.step] = leaf
            self._file.write(_frame(leaf_data(leaf.step, leaf.state_hash, leaf.log_hash)))
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


class CachedClaims:
    """A `ClaimSource` answering leaves from the auditor's cache, else from `source` (cached).

    `source` must verify what it returns (RemoteClaims does): the cache stores without checking.
    """

    def __init__(self, source: ClaimSource, job_dir: Path) -> None:
        self.source = source
        self.path = Path(job_dir) / CACHE_FILE
        self._cache: LeafCache | None = None

    def _open(self, signed: SignedCommitment) -> LeafCache:
        """The leaf cache, opened under `signed` (the source's commitment) at the first call."""
        if self._cache is None:
            self._cache = LeafCache(self.path, signed)
        return self._cache

    def commitment(self) -> SignedCommitment:
        signed = self.source.commitment()
        self._open(signed)
        return signed

    def leaf(self, step: int) -> Leaf:
        cache = self._open(self.source.commitment())
        leaf = cache.get(step)
        if leaf is None:
            leaf = self.source.leaf(step)
            cache.add(leaf)
        return leaf

    def log_bytes(self, step: int) -> bytes:
        return self.source.log_bytes(step)

    def initial_state(self):
        return self.source.initial_state()

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
