"""FAULT INJECTION: a trainer that cheats on purpose, for tests and demos of the dispute game.

Nothing here runs unless `ovt-trainer serve --inject-fault KIND:STEP` (or a test) asks for it;
an honest trainer never builds a `TrainerFaults`. Each fault is one of the threats of SPEC §6,
made real at one step k so that an auditor's replay, and then the arbiter, must catch it there:

training faults (applied through `protocol.job.run.StepHooks` while the job trains):
    relabel:k          step k trains on B_k with example 0's target changed
    swap-examples:k    step k trains on B_k with example 0 replaced by an example not in B_k
    skip-step:k        step k does not train: S_k is S_{k-1} with its step counter set to k,
                       and L_k is the empty log
    lr:k               from step k on, every parameter group's learning rate is doubled
    skip-warmup:k      from step k on, the learning-rate schedule runs one step ahead (the
                       warm-up cut short); needs a program with a schedule
    swap-checkpoint:k  S_k is stored (and trained on) one ULP off at one model element
    log-flip:k         step k trains honestly, but L_k has one entry's direction flipped (one
                       whose flip changes S_k: most flips are absorbed by later rounding)
    log-invent:k       step k trains honestly, but L_k has an entry at an element the trainer
                       did not log (one far from any rounding boundary, so replay rejects it)
    log-drop:k         step k rounds one logged element the other (legal) way, and L_k omits
                       that entry: the log claims nearest-even rounding where none was applied

serving faults (applied by the Claims service to unary GetLeaf queries, not to GetLeaves):
    forge-leaf:k       GetLeaf(k) answers a leaf whose state hash has one byte flipped, so its
                       proof does not verify under the signed root
    stall:k            GetLeaf(k) never answers (until the caller gives up or the server stops)

The faults apply to every job the daemon trains or serves. Several may be combined.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Iterable

import numpy as np
import torch

from proto import ovt_pb2
from protocol.codec.roundinglog import RoundingLog, SiteLog, decode_log, encode_log
from protocol.codec.state import state_digest
from protocol.engine.batches import batch_indices
from protocol.engine.executor import Executor
from protocol.engine.schedules import advance
from protocol.errors import ConfigError, OvtError
from protocol.job.faults import KINDS, SERVING_KINDS, TRAINING_KINDS, Fault, one_ulp_off
from protocol.job.run import StepHooks

STALL_POLL_S = 0.1


def _flip_entry(log: RoundingLog, which: int, entry: int) -> RoundingLog:
    """`log` with the direction of entry `entry` of site `which` flipped."""
    site = log.sites[which]
    up = site.up.copy()
    up[entry] = not up[entry]
    changed = dataclasses.replace(site, up=up)
    return dataclasses.replace(log, sites=log.sites[:which] + (changed,) + log.sites[which + 1:])


def _effective_flip(ex: Executor, saved: dict[str, torch.Tensor], examples, log: RoundingLog,
                    honest: dict[str, torch.Tensor], tries: int = 64
                    ) -> tuple[RoundingLog, int, int]:
    """A flipped direction that changes S_t: (the flipped log, its site, its entry).

    With certified bands most logged elements are intermediate values (reductions that cancel)
    whose other rounding later ops absorb; such a flip is a legal move that changes nothing, not
    a cheat. So candidates — every direction entry, latest site and entry first, at most
    `tries` of them — are replayed from S_{t-1} until one gives another S_t (a flip that moves a
    later logged element out of its band is skipped too). Leaves `ex` at that S_t.
    """
    candidates = [(which, entry) for which in reversed(range(len(log.sites)))
                  for entry in reversed(range(log.sites[which].indices.size))]
    for which, entry in candidates[:tries]:
        flipped = _flip_entry(log, which, entry)
        ex.load_state(saved)
        try:
            ex.step(flipped, examples=examples)
        except OvtError:
            continue
        if state_digest(ex.state()) != state_digest(honest):
            return flipped, which, entry
    raise ConfigError(f"none of the {min(len(candidates), tries)} direction entries tried of "
                      f"the step's rounding log changes S_t when flipped")


def _drop_entry(log: RoundingLog, which: int, entry: int) -> RoundingLog:
    site = log.sites[which]
    keep = [i for i in range(site.indices.size) if i != entry]
    changed = dataclasses.replace(site, indices=site.indices[keep], up=site.up[keep])
    return dataclasses.replace(log, sites=log.sites[:which] + (changed,) + log.sites[which + 1:])


def _invent_entry(log: RoundingLog) -> RoundingLog:
    """`log` with one entry the trainer never recorded.

    Placed at element 0 of the first site without entries (often a correctly rounded op, bound
    0, where any entry is a violation), else at the first unlogged element of the first site
    that has one; such an element is almost surely far from a boundary (δ > 4e), so a replay
    raises LogViolationError there.
    """
    sites = log.sites
    which = next((i for i, s in enumerate(sites)
                  if s.numel and not s.indices.size and not s.value_indices.size), None)
    if which is not None:
        index = 0
    else:
        gap = next(((i, _first_gap(s)) for i, s in enumerate(sites)
                    if s.indices.size + s.value_indices.size < s.numel), None)
        if gap is None:
            raise ConfigError("every element of the step's rounding log is logged already")
        which, index = gap
    site = sites[which]
    pos = int((site.indices < index).sum())
    indices = site.indices.tolist()
    up = site.up.tolist()
    indices.insert(pos, index)
    up.insert(pos, True)
    changed = dataclasses.replace(site, indices=np.array(indices, dtype=np.int64),
                                  up=np.array(up, dtype=bool))
    return dataclasses.replace(log, sites=sites[:which] + (changed,) + sites[which + 1:])


def _first_gap(site: SiteLog) -> int:
    """The smallest element index of `site` that is not logged."""
    logged = set(site.indices.tolist()) | set(site.value_indices.tolist())
    return next(i for i in range(site.numel) if i not in logged)


def _relabelled(example: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`example` with the last element of each integer tensor changed by one, staying in range.

    That element is the target in both built-in programs: image-cnn's "label", and the last
    token of char-transformer's "tokens" (the next character the last position predicts).
    """
    out = {}
    for name, value in example.items():
        if value.dtype.is_floating_point or value.dtype == torch.bool or not value.numel():
            out[name] = value
            continue
        flat = value.reshape(-1).clone()
        flat[-1] = flat[-1] - 1 if flat[-1] > 0 else flat[-1] + 1
        out[name] = flat.reshape(value.shape)
    if all(out[n] is example[n] for n in example):
        raise ConfigError("relabel: the program's examples have no integer target to change")
    return out


class TrainerFaults(StepHooks):
    """The faults of one cheating trainer: training faults as step hooks, serving faults as
    `leaf_fault` for `proto.claims.ClaimsServicer`. Used by one training thread at a time."""

    def __init__(self, faults: Iterable[Fault]) -> None:
        self.faults = tuple(faults)
        unknown = [f for f in self.faults if f.kind not in KINDS]
        if unknown:
            raise ConfigError(f"not a trainer fault: {', '.join(map(str, unknown))}")
        self._ex: Executor | None = None
        self._saved: dict[str, torch.Tensor] | None = None
        self._examples: list[dict[str, torch.Tensor]] | None = None
        self._lr_doubled: weakref.WeakSet[Executor] = weakref.WeakSet()

    def _at(self, kind: str, t: int) -> bool:
        return any(f.kind == kind and f.step == t for f in self.faults)

    @property
    def training(self) -> bool:
        return any(f.kind in TRAINING_KINDS for f in self.faults)

    @property
    def serving(self) -> bool:
        return any(f.kind in SERVING_KINDS for f in self.faults)

    # -- training faults (StepHooks) ------------------------------------------------------------

    def before(self, t: int, ex: Executor) -> None:
        self._ex = ex  # `examples` needs the program's dataset (swap-examples)
        self._saved = ex.state() if any(self._at(kind, t) for kind in
                                        ("skip-step", "log-drop", "log-flip")) else None
        for fault in self.faults:  # lr: once per executor, so a resumed job keeps it too
            if fault.kind == "lr" and t >= fault.step and ex not in self._lr_doubled:
                for group in ex.optimizer.param_groups:
                    group["lr"] = group["lr"] * 2
                self._lr_doubled.add(ex)
        if self._at("skip-warmup", t):
            if ex.scheduler is None:
                raise ConfigError("skip-warmup: the program has no learning-rate schedule")
            advance(ex.scheduler)

    def _saved_state(self, t: int) -> dict[str, torch.Tensor]:
        """S_{t-1}, which `before(t, ...)` saved for a fault at step t that replays or undoes it.

        Raises AssertionError if the hooks were called out of `StepHooks`' order.
        """
        if self._saved is None:
            raise AssertionError(f"step {t}: after() without before() saving S_{t - 1}")
        return self._saved

    def examples(self, t, examples):
        examples = list(examples)
        if self._at("swap-examples", t):
            if self._ex is None:
                raise AssertionError(f"step {t}: examples() called before before()")
            ds = self._ex.program.dataset
            batch = set(batch_indices(self._ex.seed, len(ds), len(examples), t).tolist())
            other = next((i for i in range(len(ds)) if i not in batch), None)
            if other is None:
                raise ConfigError("swap-examples: every dataset example is in the batch")
            examples[0] = ds.example(other)
        if self._at("relabel", t):
            examples[0] = _relabelled(examples[0])
        self._examples = examples
        return examples

    def after(self, t, ex, log):
        if self._at("log-flip", t):  # S_t stays honest; the log replays to another state
            honest = ex.state()
            flipped, _, _ = _effective_flip(ex, self._saved_state(t), self._examples,
                                            decode_log(log), honest)
            ex.load_state(honest)
            log = encode_log(flipped)
        if self._at("log-drop", t):
            # Round that element the other (legal, in-band) way, then leave it out of the log.
            flipped, which, entry = _effective_flip(ex, self._saved_state(t), self._examples,
                                                    decode_log(log), ex.state())
            log = encode_log(_drop_entry(flipped, which, entry))
        if self._at("log-invent", t):
            log = encode_log(_invent_entry(decode_log(log)))
        if self._at("skip-step", t):
            ex.load_state({**self._saved_state(t), "step": torch.tensor(t, dtype=torch.int64)})
            log = encode_log(RoundingLog(()))
        if self._at("swap-checkpoint", t):
            ex.load_state(one_ulp_off(ex.state()))
        self._saved = self._examples = None
        return ex.state(), log

    # -- serving faults (proto.claims.ClaimsServicer's leaf_fault) -------------------------------

    def leaf_fault(self, step: int, reply: ovt_pb2.LeafReply, context) -> ovt_pb2.LeafReply:
        """The answer to a unary GetLeaf(step): forged, stalled, or `reply` itself."""
        if self._at("stall", step):
            while context.is_active():
                time.sleep(STALL_POLL_S)
        if self._at("forge-leaf", step):
            forged = bytearray(reply.state_hash)
            forged[0] ^= 0xFF
            reply = ovt_pb2.LeafReply(step=reply.step, state_hash=bytes(forged),
                                      log_hash=reply.log_hash, proof=reply.proof,
                                      tree_size=reply.tree_size)
        return reply
