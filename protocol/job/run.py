"""Running a job (trainer) and replaying it (auditor) into signed commitments (SPEC §4, §5.1).

`run_job` trains a job step by step into the trainer's `JobStore`, resuming after a crash from
its last stored leaf without changing any leaf, and signs a commitment over the leaves so far
every `commit_interval` steps and at the end. `replay_job` is the auditor: it takes S_0, the
trainer's leaves and logs from a `ClaimSource` (a local store here; the daemons' gRPC client
later), checks each log against the trainer's leaf, replays it on its own hardware profile into
its own store, and signs its own commitment. It stops at the first step whose state hash
differs or whose log it must reject: that step is the challenge of SPEC §5.1. The same replay
cut at the trainer's checkpoints, in worker processes or on a sample of the intervals, is
`protocol.job.intervals` and `protocol.job.sampling`, sharing `begin_replay`, `replay_step`,
`replay_steps` and `finish_replay` with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from protocol.codec.roundinglog import RoundingLog, decode_log, encode_log, log_digest
from protocol.codec.state import state_digest
from protocol.commit.commitments import Commitment, SignedCommitment, sign_commitment
from protocol.commit.data import prove_examples, verify_examples
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.engine.batches import batch_indices
from protocol.engine.datasets import commit_examples
from protocol.engine.executor import Executor, StepResult
from protocol.engine.profiles import Profile
from protocol.errors import (
    ConfigError,
    LogFormatError,
    LogMismatchError,
    LogViolationError,
    ProofError,
    RefusedError,
    StoreError,
)
from protocol.job.create import job_executor, job_workers
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

Progress = Callable[[int, int], None]
STATE_DIFFERS = "state hash differs from the trainer's"  # a challenge's reason (SPEC §5.1)


class StepHooks:
    """Seams around one step of `run_job` / `replay_job`, for fault injection only.

    The base class is honest: it changes nothing, and a job run with it is byte-identical to one
    run without hooks. Nodes pass a subclass only to make a party cheat on purpose (tests and
    demos of the dispute game: `trainer_node.faults`, `auditor_node.faults`). Per step t the
    caller does, in this order: `before(t, ex)`; `ex.step(log, examples=examples(t, B_t))`;
    `after(t, ex, log_bytes)`, and stores what `after` returns. `after` must leave `ex` holding
    the state it returns, since step t + 1 starts from the executor.
    """

    def examples(self, t: int, examples: list[dict[str, torch.Tensor]]
                 ) -> list[dict[str, torch.Tensor]]:
        """The examples step t trains on (given: B_t from the program's own dataset)."""
        return examples

    def before(self, t: int, ex: Executor) -> None:
        """Called before step t runs; `ex` holds S_{t-1}."""

    def after(self, t: int, ex: Executor, log: bytes) -> tuple[dict[str, torch.Tensor], bytes]:
        """Called after step t ran; returns (S_t, L_t's bytes) to store. `ex` holds S_t."""
        return ex.state(), log


def _hooked_step(ex: Executor, hooks: StepHooks, t: int,
                 log: RoundingLog | None) -> StepResult:
    """Run step t on `ex` through `hooks`: `before`, then the step on `examples`' batch."""
    hooks.before(t, ex)
    return ex.step(log, examples=hooks.examples(t, ex.examples(t)))


def _recorded_log(result: StepResult) -> bytes:
    """L_t's bytes: the log a step run without one recorded (record mode, SPEC §3.2)."""
    if result.log is None:  # only a non-"ovt" executor records nothing; job executors are "ovt"
        raise AssertionError(f"step {result.step} recorded no rounding log")
    return encode_log(result.log)


def _commit(store: JobStore, key: KeyPair, role: str, n: int) -> SignedCommitment:
    tree = store.tree(n)
    commitment = Commitment(job_id=store.spec.job_id, n=n, root=tree.root,
                            h_n=store.leaf(n).state_hash, public_key=key.public_key, role=role,
                            time=int(time.time()))
    signed = sign_commitment(commitment, key)
    store.save_commitment(signed)
    return signed


def run_job(store: JobStore, key: KeyPair, *, profile: Profile,
            progress: Progress | None = None, hooks: StepHooks | None = None,
            data_dir: Path | None = None, workers: int = 1) -> SignedCommitment:
    """Train the store's job to its last step (resuming where the store stops) and sign.

    A job with a data file reads it inside `data_dir` (ConfigError without one, or for a file
    that is not the committed one: `protocol.job.create.load_job_program`). With `workers` > 1
    the micro-batches are computed by that many processes (`job_workers`; the leaves are the
    same for any count). `hooks` (fault injection only, see `StepHooks`) may alter each step and
    what is stored.
    """
    spec = store.spec
    last = store.last_step()
    if last < 0:
        raise StoreError("the job store holds no initial state; store S_0 first (put_initial)")
    ex = job_executor(spec, profile, data_dir)
    store.state_at(last, ex)
    with job_workers(spec, profile, workers) as group:
        ex.use_workers(group)
        for t in range(last + 1, spec.steps + 1):
            if hooks is None:
                result = ex.step(examples=committed_batch(spec, ex, t))
                store.append_step(t, ex.state(), _recorded_log(result))
            else:
                result = _hooked_step(ex, hooks, t, None)
                store.append_step(t, *hooks.after(t, ex, _recorded_log(result)))
            if t % spec.commit_interval == 0 and t != spec.steps:
                _commit(store, key, "trainer", t)
            if progress:
                progress(t, spec.steps)
    return store.commitment(spec.steps) or _commit(store, key, "trainer", spec.steps)


def committed_batch(spec: JobSpec, ex: Executor, t: int) -> list[dict[str, torch.Tensor]] | None:
    """B_t's examples of a job that reads a data file, each checked against the job's data
    commitment first (None for a program's own data, which no one can change under a job).

    A file rewritten under a running job would otherwise be trained on, or replayed, though
    the party could not prove it (SPEC §2.1) and would lose its dispute. Raises ConfigError
    naming the first example that is not the committed one.
    """
    if spec.data_file is None:
        return None
    dataset = ex.program.dataset
    indices = batch_indices(spec.seed, spec.data.count, ex.program.batch_size, t)
    _, tree = commit_examples(dataset)
    items = prove_examples(dataset, tree, indices)
    try:
        verify_examples(spec.data, items, indices)
    except ProofError as err:
        raise ConfigError(f"{spec.data_file.describe()} changed under the job: step {t}'s "
                          f"batch is not the committed one ({err})") from None
    return [item.example for item in items]


class ClaimSource(Protocol):
    """What an auditor reads from a trainer (SPEC §2: states, leaves, logs, commitments)."""

    def initial_state(self) -> dict[str, torch.Tensor]: ...

    def leaf(self, step: int) -> Leaf: ...

    def log_bytes(self, step: int) -> bytes: ...

    def commitment(self) -> SignedCommitment: ...


class StoreSource:
    """A ClaimSource over a trainer's local store (tests, and a node reading its own disk)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store

    def initial_state(self):
        state = self.store.checkpoint(0)
        if state is None:
            raise StoreError("the trainer's store has no intact S_0")
        return state

    def leaf(self, step: int) -> Leaf:
        return self.store.leaf(step)

    def log_bytes(self, step: int) -> bytes:
        return self.store.log_bytes(step)

    def commitment(self) -> SignedCommitment:
        signed = self.store.commitment(self.store.spec.steps)
        if signed is None:
            raise StoreError("the trainer has not committed to the whole job yet")
        return signed


@dataclass(frozen=True)
class AuditOutcome:
    """The auditor's verdict on its own replay."""

    commitment: SignedCommitment  # the auditor's, over the leaves it replayed
    trainer_commitment: SignedCommitment
    first_divergent_step: int | None  # None: every leaf matched
    reason: str | None

    @property
    def matches(self) -> bool:
        return self.first_divergent_step is None and \
            self.commitment.commitment.root == self.trainer_commitment.commitment.root


def replay_job(store: JobStore, source: ClaimSource, key: KeyPair, *, profile: Profile,
               progress: Progress | None = None, hooks: StepHooks | None = None,
               data_dir: Path | None = None, workers: int = 1) -> AuditOutcome:
    """Replay the trainer's job on this profile into the auditor's own store, and sign.

    A job with a data file reads it inside `data_dir`, as `run_job` does. With `workers` > 1
    each step's micro-batches are replayed by that many processes (`job_workers`), whatever
    number the trainer used (SPEC §3.5). `hooks` (fault injection only, see `StepHooks`) may
    alter each replayed step and what the auditor stores. The same replay cut into intervals
    and run in several processes is `protocol.job.intervals.replay_in_intervals`; its leaves,
    and so its root, are these.
    """
    spec = store.spec
    trainer, last, divergent, reason = begin_replay(store, source)
    if divergent is None:
        ex = job_executor(spec, profile, data_dir)
        store.state_at(last, ex)
        with job_workers(spec, profile, workers) as group:
            ex.use_workers(group)
            divergent, reason = replay_steps(store, source, ex, spec.steps, hooks=hooks,
                                             progress=progress)
    return finish_replay(store, key, trainer, divergent, reason)


def begin_replay(store: JobStore, source: ClaimSource
                 ) -> tuple[SignedCommitment, int, int | None, str | None]:
    """Start or resume an audit: the trainer's verified commitment over the whole job, the
    last step in the auditor's store (S_0 fetched, checked against h_0 and stored first when the
    store is empty), and the first stored step that disagrees with the trainer (or None) with
    its reason; a stored replay of another commitment's logs is cut back first
    (`_first_mismatch`). Raises SignatureError for a commitment that does not verify,
    StoreError for an S_0 that does not hash to h_0, RefusedError for a replay of another
    commitment that the auditor has signed, and what `source` raises."""
    spec = store.spec
    trainer = source.commitment()
    trainer.verify(job_id=spec.job_id, role="trainer", n=spec.steps)
    if store.last_step() < 0:
        state0 = source.initial_state()
        if state_digest(state0) != spec.h0:
            raise StoreError("the trainer's S_0 does not hash to the job's h_0")
        store.put_initial(state0)
    divergent, reason = _first_mismatch(store, source, store.last_step())
    return trainer, store.last_step(), divergent, reason


def finish_replay(store: JobStore, key: KeyPair, trainer: SignedCommitment,
                  divergent: int | None, reason: str | None) -> AuditOutcome:
    """Sign the auditor's commitment over every leaf in its store (SPEC §5.1: up to the first
    divergent step, or all n; the one already signed over as many is reused)."""
    n = store.last_step()
    signed = store.commitment(n) or _commit(store, key, "auditor", n)
    return AuditOutcome(signed, trainer, divergent, reason)


def _first_mismatch(store: JobStore, source: ClaimSource, upto: int):
    """After a restart: the first already-replayed step whose state disagrees with the
    trainer's, with its reason, or (None, None).

    The whole leaf is compared, the trainer's ℓ_t too: a stored step t replayed L_t, so only
    where ℓ_t is the trainer's is the stored h_t this trainer's step replayed, and a differing
    h_t a challenge of step t (SPEC §5.1). A stored ℓ_t that is not the trainer's came from
    another commitment to the job (one this trainer served before, in an audit that failed):
    a challenge on that replay would name a leaf that the arbiter's re-execution of the
    trainer's own L_t answers for the trainer (SPEC §5.4: a false challenge). So the store is
    cut back to step t - 1 (`JobStore.truncate`) and replays the trainer's L_t onwards —
    unless the auditor has signed a commitment over step t: a challenge built on it must stay
    provable (the arbiter questions the auditor under the commitment it signed), so that
    replay is kept and this audit refused: the trainer has served two commitments to the job
    that differ at step t. Leaf 0 is (0, h_0, the empty log's hash) by rule (SPEC §2), so any
    difference there is the trainer's, a challenge of step 0. Raises RefusedError in the case
    above, and what `source` and the store raise."""
    for leaf in store.leaves()[: upto + 1]:
        claimed = source.leaf(leaf.step)
        if leaf.step == 0 and leaf.log_hash != claimed.log_hash:
            return 0, "the trainer's leaf 0 does not hold the empty log's hash"
        if leaf.log_hash != claimed.log_hash:
            signed = store.commitment()
            if signed is not None and signed.commitment.n >= leaf.step:
                raise RefusedError(
                    f"the trainer's commitment to job {store.spec.job_id.hex()} holds another "
                    f"rounding log at step {leaf.step} than the one this auditor replayed and "
                    f"signed over {signed.commitment.n} steps: it has served two commitments "
                    f"to the job, and the signed replay is kept for the first")
            store.truncate(leaf.step - 1)
            return None, None
        if leaf.state_hash != claimed.state_hash:
            return leaf.step, STATE_DIFFERS
    return None, None


def replay_steps(store: JobStore, source: ClaimSource, ex: Executor, upto: int, *,
                 hooks: StepHooks | None = None, progress: Progress | None = None
                 ) -> tuple[int | None, str | None]:
    """Replay steps last+1..upto into the auditor's store, `last` its last stored step and `ex`
    holding its S_last: `replay_job`'s loop, also run by an interval replay that continues from
    the auditor's own state. Calls `progress(t, n)` after each step t. Returns the first
    divergent step and its reason, or (None, None) when every leaf matched the trainer's.
    Raises what `source`, `replay_step`, the store and `progress` raise."""
    for t in range(store.last_step() + 1, upto + 1):
        replayed = replay_step(store.spec, ex, t, source.leaf(t), source.log_bytes(t), hooks)
        if not isinstance(replayed, str):
            store.append_leaf(replayed.leaf, replayed.log, replayed.state)
        if progress:
            progress(t, store.spec.steps)
        reason = replayed if isinstance(replayed, str) else replayed.differs
        if reason is not None:
            return t, reason
    return None, None


@dataclass(frozen=True)
class ReplayedStep:
    """Step t as the auditor replayed it: its leaf, with S_t and L_t's bytes to store, and
    `differs`: STATE_DIFFERS when the leaf's state hash is not the trainer's, else None."""

    leaf: Leaf
    state: dict[str, torch.Tensor]
    log: bytes
    differs: str | None


def replay_step(spec: JobSpec, ex: Executor, t: int, claimed: Leaf, log: bytes,
                hooks: StepHooks | None = None) -> ReplayedStep | str:
    """Replay step t on `ex` (holding S_{t-1}) with the trainer's log bytes `log`, checked
    against ℓ_t in the trainer's leaf `claimed` first, and compare the replayed leaf with
    `claimed`; or, when the log must be rejected, the reason, which is a challenge of step t
    (SPEC §5.1). The one place a replayed step becomes a leaf, for every replay (sequential,
    interval, sampled). Raises ConfigError for a data file changed under the job
    (`committed_batch`)."""
    if log_digest(log) != claimed.log_hash:
        return "the trainer served a rounding log that does not match its own leaf"
    try:
        if hooks is None:
            ex.step(decode_log(log), examples=committed_batch(spec, ex, t))
        else:
            _hooked_step(ex, hooks, t, decode_log(log))
    except (LogFormatError, LogViolationError, LogMismatchError) as err:
        # An undecodable log is as invalid as a violating one: the arbiter rules invalid-log
        # (SPEC §5.4), so the audit must end in a challenge, not a failure.
        return f"the trainer's rounding log is invalid: {err}"
    state, log = (ex.state(), log) if hooks is None else hooks.after(t, ex, log)
    leaf = Leaf(t, state_digest(state), log_digest(log))
    return ReplayedStep(leaf, state, log,
                        None if leaf.state_hash == claimed.state_hash else STATE_DIFFERS)
