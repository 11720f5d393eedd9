"""A party's durable record of one job (SPEC §4): leaves, rounding logs, checkpoints, commitments.

Layout under `<root>/<job id hex>/`:

    spec.ovtjob                 the canonical JobSpec bytes (its hash is the directory name)
    leaves.sqlite               one row per step t: (t, h_t, ℓ_t, leaf hash); signed commitments
    logs/<t>.ovtl.z             L_t, canonical bytes, zlib-compressed
    checkpoints/<t>.safetensors S_t every checkpoint interval (and S_0, S_n)

Durability: every file is written to a temporary name, fsynced and renamed into place, and a
step's leaf row is committed only after its log (and checkpoint) are durable, so a crash never
leaves a leaf whose data is missing, and a half-written file never carries a trusted name.
Trust: every read is checked against the hash in the leaf; a checkpoint that fails its check is
treated as missing, and `state_at` regenerates S_t from the nearest good earlier checkpoint by
replaying the party's own logs, checking each replayed state against its own leaf.
Nothing is ever unpickled: tensors are safetensors, everything else canonical bytes.
"""

from __future__ import annotations

import sqlite3
import threading
import zlib
from pathlib import Path

import safetensors.torch
import torch

from protocol.codec.roundinglog import EMPTY_LOG_DIGEST, decode_log, log_digest
from protocol.codec.state import load_safetensors, state_digest
from protocol.commit.commitments import SignedCommitment
from protocol.commit.hashing import HASH_SIZE
from protocol.commit.leaf import Leaf
from protocol.commit.merkle import MerkleTree
from protocol.engine.executor import Executor
from protocol.errors import StateFormatError, StoreError
from protocol.files import atomic_move, atomic_write
from protocol.job.spec import JobSpec

SPEC_FILE = "spec.ovtjob"  # a job's store exists once its directory holds this file
_SCHEMA = """
CREATE TABLE IF NOT EXISTS leaves (
    step INTEGER PRIMARY KEY, state_hash BLOB NOT NULL, log_hash BLOB NOT NULL,
    leaf_hash BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS commitments (
    n INTEGER PRIMARY KEY, signed BLOB NOT NULL);
"""


def checkpoint_due(spec: JobSpec, step: int) -> bool:
    """Whether a party stores S_t in full at step t: every checkpoint interval, and S_n (SPEC
    §4)."""
    return step % spec.checkpoint_interval == 0 or step == spec.steps


def _checked_leaf(step: int, state_hash: bytes, log_hash: bytes, leaf_hash: bytes) -> Leaf:
    """A leaves row as a Leaf, refusing a damaged row (a damaged database may hold anything in
    a BLOB column): all three hashes must be HASH_SIZE bytes and the stored leaf hash the one
    the others give, so a corrupted row is never served or signed. Raises StoreError."""
    if not all(type(h) is bytes and len(h) == HASH_SIZE
               for h in (state_hash, log_hash, leaf_hash)):
        raise StoreError(f"the stored leaf of step {step} is damaged (a field of the wrong size)")
    leaf = Leaf(step, state_hash, log_hash)
    if leaf.hash != leaf_hash:
        raise StoreError(f"the stored leaf of step {step} is damaged (its hash does not match)")
    return leaf


class JobStore:
    """One party's record of one job. Safe to share between threads of one process."""

    def __init__(self, root: Path, spec: JobSpec) -> None:
        self.spec = spec
        self.dir = Path(root) / spec.job_id.hex()
        (self.dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.dir / "checkpoints").mkdir(exist_ok=True)
        spec_file = self.dir / SPEC_FILE
        if spec_file.exists():
            if spec_file.read_bytes() != spec.to_bytes():
                raise StoreError(f"{spec_file} holds another job spec than job "
                                 f"{spec.job_id.hex()}")
        else:
            atomic_write(spec_file, spec.to_bytes())
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.dir / "leaves.sqlite", check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    @classmethod
    def open(cls, root: Path, job_id_hex: str) -> JobStore:
        """Open an existing job's store by its id (checks the spec file against the id)."""
        spec_file = Path(root) / job_id_hex / SPEC_FILE
        try:
            spec = JobSpec.from_bytes(spec_file.read_bytes())
        except OSError:
            raise StoreError(f"no job {job_id_hex} in {root}") from None
        if spec.job_id.hex() != job_id_hex:
            raise StoreError(f"{spec_file} does not hash to job id {job_id_hex}")
        return cls(root, spec)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- writing --------------------------------------------------------------------------------

    def put_initial(self, state0: dict[str, torch.Tensor]) -> None:
        """Store S_0 and leaf 0 = (0, h_0, hash of the empty log), after checking h_0."""
        if state_digest(state0) != self.spec.h0:
            raise StoreError("initial state does not hash to the job's h_0")
        self._write_checkpoint(0, state0)
        self._put_leaf(Leaf(0, self.spec.h0, EMPTY_LOG_DIGEST))

    def put_initial_file(self, path: Path, digest: bytes) -> None:
        """Store the safetensors file at `path` as S_0 (it moves into place: `path` is gone
        afterwards) and leaf 0, as `put_initial` stores a state: an S_0 that is never loaded
        here (a submitted one, hashed where it lies). `digest` is the state's h_t as
        `protocol.codec.state.safetensors_file_digest` gave it, which must be h_0; reading the
        checkpoint checks it again. `path` must be on the store's filesystem. Durable as
        `atomic_write` is: the file is fsynced before it takes the checkpoint's name and the
        folder after, then the leaf row is committed. Raises StoreError for another digest,
        OSError as the filesystem does."""
        if digest != self.spec.h0:
            raise StoreError("initial state does not hash to the job's h_0")
        atomic_move(path, self._checkpoint_path(0))
        self._put_leaf(Leaf(0, self.spec.h0, EMPTY_LOG_DIGEST))

    def append_step(self, step: int, state: dict[str, torch.Tensor], log: bytes) -> Leaf:
        """Record step t: L_t and (when due) S_t made durable first, then the leaf."""
        leaf = Leaf(step, state_digest(state), log_digest(log))
        self._append(leaf, log, state)
        return leaf

    def append_leaf(self, leaf: Leaf, log: bytes,
                    state: dict[str, torch.Tensor] | None = None) -> None:
        """Record step t from a leaf computed elsewhere (an audit interval replayed in another
        process, `protocol.job.intervals`), durable as `append_step` is: `log` must be the
        leaf's L_t, and S_t is needed, and must hash to h_t, only when a checkpoint is due at
        t. Raises StoreError for a log or state that is not the leaf's, a missing state, or a
        step that does not follow the last stored one."""
        if log_digest(log) != leaf.log_hash:
            raise StoreError(f"the rounding log given for step {leaf.step} is not its leaf's")
        if checkpoint_due(self.spec, leaf.step) and (
                state is None or state_digest(state) != leaf.state_hash):
            raise StoreError(f"step {leaf.step} is a checkpoint: it needs the state its leaf "
                             f"hashes")
        self._append(leaf, log, state)

    def _append(self, leaf: Leaf, log: bytes, state: dict[str, torch.Tensor] | None) -> None:
        if leaf.step != self.last_step() + 1:
            raise StoreError(f"step {leaf.step} does not follow the last stored step "
                             f"{self.last_step()}")
        atomic_write(self._log_path(leaf.step), zlib.compress(log, 6))
        if checkpoint_due(self.spec, leaf.step):
            assert state is not None  # both callers supply it when due
            self._write_checkpoint(leaf.step, state)
        self._put_leaf(leaf)

    def truncate(self, after: int) -> None:
        """Forget every step after `after`: its leaves and the commitments over more steps (in
        one transaction, first, so that a crash leaves the store whole or cut), then its logs
        and checkpoints. An auditor replays those steps again: its replay made with another
        commitment's logs (`protocol.job.run.begin_replay`). A file left by a crash between the
        two is never read — a log or checkpoint is read for a stored leaf only, and written
        again before its leaf when its step is appended again. Raises StoreError for `after`
        < 0 (S_0 and leaf 0 are the job's, never cut)."""
        if after < 0:
            raise StoreError(f"cannot cut a store back to step {after}: S_0 stays")
        with self._lock, self._db:
            self._db.execute("DELETE FROM leaves WHERE step > ?", (after,))
            self._db.execute("DELETE FROM commitments WHERE n > ?", (after,))
        for path in [*(self.dir / "logs").glob("*.ovtl.z"),
                     *(self.dir / "checkpoints").glob("*.safetensors")]:
            if int(path.name.split(".")[0]) > after:
                path.unlink(missing_ok=True)

    def save_commitment(self, signed: SignedCommitment) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO commitments VALUES (?, ?)",
                             (signed.commitment.n, signed.to_bytes()))

    def _put_leaf(self, leaf: Leaf) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO leaves VALUES (?, ?, ?, ?)",
                             (leaf.step, leaf.state_hash, leaf.log_hash, leaf.hash))

    def _write_checkpoint(self, step: int, state: dict[str, torch.Tensor]) -> None:
        data = safetensors.torch.save({k: v.contiguous() for k, v in state.items()},
                                      metadata={"job_id": self.spec.job_id.hex(),
                                                "step": str(step)})
        atomic_write(self._checkpoint_path(step), data)

    # -- reading --------------------------------------------------------------------------------

    def last_step(self) -> int:
        """The last step with a leaf (0 once S_0 is stored), -1 for an empty store."""
        with self._lock:
            row = self._db.execute("SELECT MAX(step) FROM leaves").fetchone()
        return -1 if row[0] is None else row[0]

    def leaf(self, step: int) -> Leaf:
        """Leaf t, checked (`_checked_leaf`). Raises StoreError if absent or damaged."""
        with self._lock:
            row = self._db.execute("SELECT step, state_hash, log_hash, leaf_hash FROM leaves "
                                   "WHERE step=?", (step,)).fetchone()
        if row is None:
            raise StoreError(f"no leaf for step {step} (last stored step {self.last_step()})")
        return _checked_leaf(*row)

    def leaves(self) -> list[Leaf]:
        """Every stored leaf in step order, each checked. Raises StoreError if one is damaged."""
        with self._lock:
            rows = self._db.execute("SELECT step, state_hash, log_hash, leaf_hash FROM leaves "
                                    "ORDER BY step").fetchall()
        return [_checked_leaf(*row) for row in rows]

    def tree(self, upto: int | None = None) -> MerkleTree:
        """The Merkle tree over leaves 0..upto (default: all stored)."""
        leaves = self.leaves()
        upto = len(leaves) - 1 if upto is None else upto
        if upto >= len(leaves) or [leaf.step for leaf in leaves[:upto + 1]] != list(
                range(upto + 1)):
            raise StoreError(f"leaves 0..{upto} are not all stored")
        return MerkleTree([leaf.hash for leaf in leaves[:upto + 1]])

    def commitment(self, n: int | None = None) -> SignedCommitment | None:
        """The signed commitment over n steps (default: the latest one), if any."""
        with self._lock:
            row = self._db.execute(
                "SELECT signed FROM commitments ORDER BY n DESC LIMIT 1" if n is None
                else "SELECT signed FROM commitments WHERE n=?", () if n is None else (n,)
            ).fetchone()
        return None if row is None else SignedCommitment.from_bytes(row[0])

    def log_bytes(self, step: int) -> bytes:
        """L_t's canonical bytes, checked against ℓ_t in the leaf."""
        leaf = self.leaf(step)
        if step == 0:
            raise StoreError("step 0 has no rounding log (leaf 0 holds the empty log's hash)")
        try:
            data = zlib.decompress(self._log_path(step).read_bytes())
        except (OSError, zlib.error) as err:
            raise StoreError(f"rounding log of step {step} is missing or unreadable: {err}") \
                from None
        if log_digest(data) != leaf.log_hash:
            raise StoreError(f"rounding log of step {step} does not match its leaf (corrupted)")
        return data

    def checkpoint(self, step: int) -> dict[str, torch.Tensor] | None:
        """S_t from its checkpoint file if present, parsable and matching leaf t, else None.

        Any damage counts as missing, in the header as in the body (`load_safetensors` raises
        only StateFormatError), so `state_at` regenerates around it from an earlier
        checkpoint (SPEC §4)."""
        path = self._checkpoint_path(step)
        try:
            state = load_safetensors(path.read_bytes())
        except (OSError, StateFormatError):
            return None
        return state if state_digest(state) == self.leaf(step).state_hash else None

    def checkpoint_steps(self) -> list[int]:
        return sorted(int(p.name.split(".")[0]) for p in
                      (self.dir / "checkpoints").glob("*.safetensors"))

    def state_at(self, step: int, executor: Executor) -> dict[str, torch.Tensor]:
        """S_t, from the nearest good checkpoint at or before t, replayed forward with this
        party's own logs; every replayed state is checked against its own leaf (SPEC §4).
        Leaves `executor` holding S_t."""
        self.leaf(step)  # raises if t is not stored
        for start in (c for c in reversed(self.checkpoint_steps()) if c <= step):
            state = self.checkpoint(start)
            if state is not None:
                break
        else:
            raise StoreError(f"no intact checkpoint at or before step {step}")
        executor.load_state(state)
        for t in range(start + 1, step + 1):
            executor.step(decode_log(self.log_bytes(t)))
            if state_digest(executor.state()) != self.leaf(t).state_hash:
                raise StoreError(f"regenerating step {t} from checkpoint {start} does not "
                                 f"reproduce the stored leaf")
        return executor.state()

    def _log_path(self, step: int) -> Path:
        return self.dir / "logs" / f"{step:09d}.ovtl.z"

    def _checkpoint_path(self, step: int) -> Path:
        return self.dir / "checkpoints" / f"{step:09d}.safetensors"

