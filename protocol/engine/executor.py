"""The step executor: `step(S_{t-1}, B_t, L_t or record) -> (S_t, L_t)` (SPEC §3.5).

An `Executor` holds one program's model and optimizer on one device under one hardware profile,
and runs training steps in one of three arithmetic modes:

- "ovt": every floating op computed in the policy's compute dtype and rounded to the target
  dtype (record mode when no log is given, replay mode with the trainer's log), SPEC §3.2;
- "plain": ordinary training in the target dtype (what ovt exists to fix: it diverges);
- "plain64": ordinary training with model and state in float64 (a benchmark baseline).

Whatever the mode, a step's randomness comes from `protocol.engine.rng` (SPEC §3.4): dropout,
attention dropout and aten's RNG ops are served by the portable generator, keyed by (seed, step,
micro-batch, call), or refused (`protocol.engine.random_ops`). A program's learning-rate schedule
and gradient clipping are part of the step, and so is the sum over its micro-batches (SPEC §3.5).
Every backend switch that changes numbers (cuDNN, TF32, reduced-precision reductions, SDPA kernel
choice) is pinned for the duration of the step and restored afterwards, never flipped globally.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import _get_scalar_dtype

from protocol.codec.roundinglog import RoundingLog
from protocol.engine.batches import batch_indices
from protocol.engine.dataparallel import PartResult, require_world
from protocol.engine.initialization import load_initial_weights
from protocol.engine.interceptor import RoundingMode, native_compute
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.base import TrainingProgram
from protocol.engine.random_ops import PortableRandomFunctions, PortableRandomOps, StepRandomness
from protocol.engine.rounding import BoundAdversary, SiteRecorder, SiteReplayer
from protocol.engine.schedules import advance, learning_rates, make_scheduler
from protocol.engine.splitk import ReorderMode
from protocol.errors import ConfigError, LogMismatchError, WorkerError

if TYPE_CHECKING:
    from protocol.engine.dataparallel import WorkerGroup

MODES = ("ovt", "plain", "plain64")
WORKER_RESTARTS = 3  # a step whose worker group fails is run again, with new workers, this often
_log = logging.getLogger(__name__)
SCHEDULE_KEY = "schedule.lr"  # S_t's learning rate per parameter group, when there is a schedule

# A step pins process-wide switches (backend flags, the intra-op thread count) and restores
# them after; two steps in one process (a daemon regenerating S_t while it trains) must not
# interleave, or one would restore the other's switches mid-step.
_STEP_LOCK = threading.RLock()


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    seconds: float  # its own wall time: the step, and its log decided (record) or checked done
    log: RoundingLog | None  # the recorded log (record mode) or None


@contextlib.contextmanager
def pinned_backends():
    """Pin every backend switch that changes numbers, for one step, and restore it after."""
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
             matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_tf32 = False
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        # cuDNN off: batch norm then runs the same native op on CUDA as on the CPU, so both
        # execute the same site sequence (SPEC §3.3); the math SDPA kernel likewise.
        with torch.backends.cudnn.flags(enabled=False, benchmark=False, deterministic=True,
                                        allow_tf32=False), sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        (matmul.allow_tf32, matmul.allow_fp16_reduced_precision_reduction,
         matmul.allow_bf16_reduced_precision_reduction) = saved


class Executor:
    """Runs training steps of one program on one device under one profile."""

    def __init__(self, program: TrainingProgram, *, seed: int, policy: PrecisionPolicy,
                 profile: Profile, mode: str = "ovt", micro_batches: int = 1) -> None:
        """Raises ConfigError for an unknown mode, a profile this machine cannot run, or a
        batch that does not split into `micro_batches` equal parts (SPEC §3.5)."""
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if micro_batches < 1 or program.batch_size % micro_batches:
            raise ConfigError(f"a batch of {program.batch_size} examples does not split into "
                              f"{micro_batches} equal micro-batches")
        self.micro_batches = micro_batches
        profile.check_runnable()
        self.program, self.seed, self.policy, self.profile, self.mode = (
            program, seed, policy, profile, mode)
        self.device = torch.device(profile.device)
        self.dtype = torch.float64 if mode == "plain64" else policy.target
        self.model = program.model.to(device=self.device, dtype=self.dtype)
        if profile.channels_last:
            # nn.Module.to accepts memory_format at runtime; torch's overloads for it omit it
            self.model = self.model.to(  # type: ignore[call-overload]
                memory_format=torch.channels_last)
        clip = program.clip_grad_norm
        if clip is not None and not (isinstance(clip, float) and 0 < clip < math.inf):
            raise ConfigError(f"clip_grad_norm must be a positive finite float, got {clip!r}")
        self.optimizer = program.make_optimizer(self.model.parameters())
        _use_foreach(self.optimizer)
        self.scheduler = self._fresh_schedule()
        self._names = {id(p): n for n, p in self.model.named_parameters()}
        self.step_count = 0
        self._splitk = profile.reorder()
        self.workers: WorkerGroup | None = None

    def use_workers(self, workers: WorkerGroup | None) -> None:
        """Compute each step's micro-batches on `workers` from now on (None: all here again).

        Raises ConfigError unless this is an "ovt" executor with at least as many micro-batches
        as the group has processes (SPEC §3.5: the micro-batch is what a worker computes)."""
        if workers is not None:
            if self.mode != "ovt":
                raise ConfigError(f"data-parallel workers run the ovt mode, not {self.mode!r}")
            require_world(workers.world, self.micro_batches, "the worker group's process count")
        self.workers = workers

    # -- state ---------------------------------------------------------------------------------

    def init_state(self, init_seed: int, weights: Path | None = None) -> None:
        """Set S_0, once, by the trainer (SPEC §3.4): the model from the portable generator,
        or from the safetensors `weights` (a fine-tune's pretrained model, `init_from`); no
        optimizer state; the schedule at step 0. Raises ConfigError for weights that do not
        fit the model, ProgramError for a model the portable init does not know."""
        with torch.no_grad():
            if weights is None:
                self.program.init(self.model, init_seed)
            else:
                load_initial_weights(self.model, weights)
        self.optimizer.state.clear()
        self.scheduler = self._fresh_schedule()
        self.step_count = 0

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """The model's part of S_t: its state dict, and its floating buffers that the state
        dict leaves out (non-persistent ones, such as rotary-embedding frequencies, which the
        model computes natively when it is built: their bits may differ between machines, so
        S_0 ships the trainer's)."""
        tensors = self.model.state_dict()
        for name, buffer in self.model.named_buffers():
            if name not in tensors and buffer.is_floating_point():
                tensors[name] = buffer
        return tensors

    def _load_model_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy `tensors` (some of `model_tensors()`, by name) into the live model, bits and
        layout kept as the live tensors have them."""
        live = {**self.model_tensors(), **dict(self.model.named_buffers())}
        with torch.no_grad():
            for name, value in tensors.items():
                live[name].copy_(value)

    def _fresh_schedule(self) -> LRScheduler | None:
        """The program's learning-rate schedule at step 0 (None without one); SPEC §3.5."""
        if self.program.make_scheduler is None:
            return None
        with _STEP_LOCK:  # the schedule's portable math is process-wide while it runs
            return make_scheduler(self.program.make_scheduler, self.optimizer)

    def state(self) -> dict[str, torch.Tensor]:
        """S_t as named CPU tensors (SPEC §2 "State")."""
        out = {f"model.{k}": v.detach().cpu().clone() for k, v in self.model_tensors().items()}
        for p, st in self.optimizer.state.items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{self._names[id(p)]}.{key}"] = value.detach().cpu().clone()
        if self.scheduler is not None:
            out[SCHEDULE_KEY] = learning_rates(self.optimizer)
        out["step"] = torch.tensor(self.step_count, dtype=torch.int64)
        return out

    def load_state(self, state: dict[str, torch.Tensor], step: int | None = None) -> None:
        """Make the live model, optimizer and schedule hold exactly `state` (bits, not just
        values). The schedule is rebuilt and stepped to `state`'s step, and must then give the
        learning rates `state` holds. `step` is the step counter `state` must hold (a peer's
        S_t: checked before the schedule is stepped that far); None takes any.

        A state may be a peer's (made up to hash to a signed h_t), so whatever does not fit is
        one error: raises ConfigError for tensors the program's model, optimizer or schedule
        lacks or holds in another shape or dtype (an optimizer's step counter included), and
        for a step counter that is missing, not one non-negative int64 or not `step`. After a
        ConfigError the executor holds no state that can be trusted: load another before
        stepping. A state may still fail its first step (an optimizer state that lacks a
        buffer): the caller of a peer's state decides what that means
        (`protocol.job.intervals.replay_interval`)."""
        self.step_count = _step_counter(state, step)
        stray = [k for k in state if not k.startswith(("model.", "optim."))
                 and k not in ("step", SCHEDULE_KEY)]
        if stray or (SCHEDULE_KEY in state) != (self.scheduler is not None):
            has = "has" if SCHEDULE_KEY in state else "has no"
            raise ConfigError(f"state does not fit the program: unexpected {stray[:3]}" if stray
                              else f"state {has} learning rates ({SCHEDULE_KEY}) but the "
                                   f"program {'has no' if self.scheduler is None else 'has a'} "
                                   f"schedule")
        model_sd = self.model_tensors()
        expected = set(model_sd)
        given = {k.removeprefix("model.") for k in state if k.startswith("model.")}
        if given != expected:
            raise ConfigError(f"state does not fit the program's model: missing "
                              f"{sorted(expected - given)[:3]}, "
                              f"unexpected {sorted(given - expected)[:3]}")
        for k, v in model_sd.items():
            given_t = state[f"model.{k}"]
            if given_t.shape != v.shape or given_t.dtype != v.dtype:
                raise ConfigError(f"state tensor model.{k} is {given_t.dtype} "
                                  f"{tuple(given_t.shape)} but the program's model has {v.dtype} "
                                  f"{tuple(v.shape)}: wrong program or config")
        with torch.no_grad():
            for k, v in model_sd.items():
                v.copy_(state[f"model.{k}"])
        params = dict(self.model.named_parameters())
        self.optimizer.state.clear()
        for key, value in state.items():
            if not key.startswith("optim."):
                continue
            pname, _, skey = key.removeprefix("optim.").rpartition(".")
            if pname not in params:
                raise ConfigError(f"optimizer state {key!r} names no parameter of the model")
            p = params[pname]
            # torch.optim keeps a parameter's step counter as a CPU scalar of its own dtype
            # (float32 unless torch's default dtype is float64), every other state like p
            counter = skey == "step"
            shape, dtype = (torch.Size(), _get_scalar_dtype()) if counter else (p.shape, p.dtype)
            if value.shape != shape or value.dtype != dtype:
                like = f"a step counter torch.optim keeps as {dtype} ()" if counter else \
                    f"its parameter {p.dtype} {tuple(p.shape)}"
                raise ConfigError(f"optimizer state {key!r} is {value.dtype} "
                                  f"{tuple(value.shape)}, {like}")
            self.optimizer.state[p][skey] = value.clone() if counter else \
                torch.empty_like(p).copy_(value)
        self._load_schedule(state)

    def _load_schedule(self, state: dict[str, torch.Tensor]) -> None:
        """Rebuild the schedule and step it to `step_count` (SPEC §3.5: the rates are a function
        of the step alone); `state`'s committed rates must be exactly those."""
        if self.scheduler is None:
            return
        self.scheduler = self._fresh_schedule()
        assert self.scheduler is not None
        with _STEP_LOCK:
            advance(self.scheduler, self.step_count)
        rates, given = learning_rates(self.optimizer), state[SCHEDULE_KEY]
        if given.dtype != rates.dtype or given.shape != rates.shape:
            raise ConfigError(f"the state's learning rates are {given.dtype} "
                              f"{tuple(given.shape)}, the schedule's {rates.dtype} "
                              f"{tuple(rates.shape)}")
        if not torch.equal(given, rates):
            raise ConfigError(f"the state's learning rates {given.tolist()} are not the "
                              f"schedule's at step {self.step_count} ({rates.tolist()})")

    # -- steps ---------------------------------------------------------------------------------

    def examples(self, step: int) -> list[dict[str, torch.Tensor]]:
        """The examples of B_t from the program's own dataset, in batch order (SPEC §2.1)."""
        ds = self.program.dataset
        idx = batch_indices(self.seed, len(ds), self.program.batch_size, step)
        return [ds.example(int(i)) for i in idx]

    def stack(self, examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """A batch from its examples: stacked, on the device, floats in the state dtype."""
        batch = {}
        for name in examples[0]:
            t = torch.stack([e[name] for e in examples]).to(self.device)
            batch[name] = self._laid_out(t.to(self.dtype) if t.is_floating_point() else t)
        return batch

    def _laid_out(self, t: torch.Tensor) -> torch.Tensor:
        """A batch tensor in the profile's memory layout (a 4-D float: channels_last or not)."""
        if self.profile.channels_last and t.is_floating_point() and t.dim() == 4:
            return t.contiguous(memory_format=torch.channels_last)
        return t

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """B_t, stacked, on the device, floats in the state dtype (SPEC §2 "Batch")."""
        return self.stack(self.examples(step))

    def step(self, log: RoundingLog | None = None, rounder=None,
             examples: list[dict[str, torch.Tensor]] | None = None) -> StepResult:
        """Run step t = step_count + 1: record (no log), replay (log given), or plain.

        `rounder` overrides the record/replay rounder (the divergence probe uses this).
        `examples` are B_t's examples when they come from elsewhere than the program's own
        dataset (the arbiter's, checked against the data commitment: SPEC §5.3).
        """
        t = self.step_count + 1
        batch = self.stack(examples) if examples is not None else self.batch(t)
        if self.workers is not None:
            if rounder is not None:
                raise ConfigError("a probe's rounder sees the whole step; run it without workers")
            return self._parallel_step(t, batch, log)
        if self.mode == "ovt" and rounder is None:
            rounder = SiteRecorder(self.policy) if log is None else \
                SiteReplayer(self.policy, log, step=t)
        arithmetic = rounder
        if self.profile.adversary and rounder is not None:
            arithmetic = BoundAdversary(rounder, self.policy)
        with _STEP_LOCK:
            start = time.perf_counter()  # the step's own time, not the wait for the lock
            with self._inside_step(t, arithmetic) as randomness:
                loss = self._gradients(batch, randomness, rounder)
                self._update()
            self._after_update()
            if isinstance(rounder, SiteReplayer):
                rounder.finish()
            recorded = rounder.log() if isinstance(rounder, SiteRecorder) else None
            seconds = time.perf_counter() - start
        self.step_count = t
        return StepResult(t, loss, seconds, recorded)

    @contextlib.contextmanager
    def _inside_step(self, t: int, arithmetic, micro_batch: int = 0):
        """Run (part of) step t: no gradient held, step t's randomness from micro-batch
        `micro_batch`'s streams on (SPEC §3.4; yielded), the backends pinned, the profile
        applied and `arithmetic` (a rounder, or None for a plain mode) intercepting every op;
        all under the step lock."""
        with _STEP_LOCK:
            self.optimizer.zero_grad(set_to_none=True)
            randomness = StepRandomness(self.seed, t)
            randomness.begin_micro_batch(micro_batch)
            with pinned_backends(), self.profile.applied(), \
                    self._arithmetic(arithmetic, randomness), PortableRandomFunctions(randomness):
                yield randomness

    def _update(self) -> None:
        """The update of a step whose gradients are in place: clipping, then the optimizer."""
        if self.program.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                           self.program.clip_grad_norm, foreach=True)
        self.optimizer.step()

    def _after_update(self) -> None:
        """The schedule's advance after an update (SPEC §3.5), and the device caught up."""
        if self.scheduler is not None:
            advance(self.scheduler)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """B_t cut into the job's k consecutive equal micro-batches, in batch order."""
        size = self.program.batch_size // self.micro_batches
        return [{name: t[i * size:(i + 1) * size] for name, t in batch.items()}
                for i in range(self.micro_batches)]

    def _gradients(self, batch: dict[str, torch.Tensor], randomness: StepRandomness,
                   rounder) -> float:
        """Backward of the program's loss on `batch` into every parameter's `.grad`; returns
        the loss (the mean of the micro-batches' losses).

        With k micro-batches (SPEC §3.5) the batch is cut into k consecutive equal parts in
        batch order. Part i starts from the step's parameters and buffers: its loss, divided
        by k, is back-propagated alone, drawing from part i's own random streams, and the
        part's sites end at `rounder.end_part()` (the log's parts). The parts are then joined
        (`_join`) in sites of their own. Draws after the parts (in the update) are part k's.
        """
        k = self.micro_batches
        if k == 1:
            loss = self.program.loss(self.model, batch)
            loss.backward()
            return float(loss.detach())
        params = [p for p in self.model.parameters() if p.requires_grad]
        start = {name: b.clone() for name, b in self.model.named_buffers()}
        parts = []
        for i, micro in enumerate(self._micro_batches(batch)):
            if i:  # the parts before left their buffers
                self._load_model_tensors(start)
            randomness.begin_micro_batch(i)
            parts.append(self._micro_batch(micro, params))
            if rounder is not None:
                rounder.end_part()
        self._join(parts, params)
        randomness.begin_micro_batch(k)
        return sum(part.loss for part in parts) / k

    def _micro_batch(self, micro: dict[str, torch.Tensor],
                     params: list[torch.nn.Parameter]) -> PartResult:
        """One micro-batch's loss / k back-propagated from the live model (SPEC §3.5): its
        gradients (taken out of `.grad`), the buffers its forward pass left, its loss."""
        loss = self.program.loss(self.model, micro)
        (loss / self.micro_batches).backward()
        grads = [p.grad for p in params]
        self.optimizer.zero_grad(set_to_none=True)
        buffers = {name: b.clone() for name, b in self.model.named_buffers()}
        return PartResult(grads, buffers, float(loss.detach()), None)

    def _join(self, parts: list[PartResult], params: list[torch.nn.Parameter]) -> None:
        """The micro-batches joined into the model (SPEC §3.5): each parameter's gradient is
        the sum of the parts' gradients, taken as one reduction over a stacked dimension — one
        site with a certified band (SPEC §3.2.1), so its bits do not depend on where or in which
        order the parts were computed. Each floating buffer (BatchNorm's running statistics)
        becomes the mean of the parts' buffers the same way, each part's having started from
        the step's; any other buffer (a count) is the last part's. A step's normalisation
        statistics are thus each micro-batch's own, never the whole batch's."""
        for j, p in enumerate(params):
            grads = [part.grads[j] for part in parts]
            if all(g is None for g in grads):
                continue
            p.grad = torch.stack([torch.zeros_like(p) if g is None else g
                                  for g in grads]).sum(dim=0)
        with torch.no_grad():
            for name, buffer in self.model.named_buffers():
                values = [part.buffers[name] for part in parts]
                buffer.copy_(torch.stack(values).mean(dim=0) if buffer.is_floating_point()
                             else values[-1])

    def part(self, t: int, index: int, micro: dict[str, torch.Tensor], log: RoundingLog | None,
             start: dict[str, torch.Tensor], first_site: int = 0) -> PartResult:
        """Micro-batch `index` of step t alone, as a data-parallel worker computes it: `start`
        (model tensors by name: a worker's whole model, rank 0's buffers) is loaded first, then
        the micro-batch runs with a rounder of its own, recording its part of L_t (`log` None)
        or replaying `log`, that part alone, whose first site is the step's `first_site`.

        Raises what a step raises: LogMismatchError, LogViolationError, ...
        """
        self._load_model_tensors(start)
        micro = {name: self._laid_out(v) for name, v in micro.items()}
        rounder = SiteRecorder(self.policy) if log is None else \
            SiteReplayer(self.policy, log, step=t, first_site=first_site, first_part=index)
        arithmetic = BoundAdversary(rounder, self.policy) if self.profile.adversary else rounder
        params = [p for p in self.model.parameters() if p.requires_grad]
        with self._inside_step(t, arithmetic, index):
            result = self._micro_batch(micro, params)
            rounder.end_part()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if isinstance(rounder, SiteReplayer):
            rounder.finish()
        else:
            result.log = rounder.log()
        return result

    def _parallel_step(self, t: int, batch: dict[str, torch.Tensor],
                       log: RoundingLog | None) -> StepResult:
        """Step t with its micro-batches computed by the worker group (`dataparallel`), then
        joined and the update run here, in the tail's sites. A group that fails is started
        again and the step run again from S_{t-1}, at most WORKER_RESTARTS times."""
        assert self.workers is not None
        k = self.micro_batches
        if log is not None and len(log.parts) != k:
            raise LogMismatchError(f"step {t}: the rounding log has {len(log.parts)} "
                                   f"micro-batch parts but the job has {k} micro-batches")
        start = time.perf_counter()
        buffers = {name: b.clone() for name, b in self.model.named_buffers()}  # S_{t-1}'s
        for attempt in range(WORKER_RESTARTS + 1):
            try:
                if attempt:
                    self._load_model_tensors(buffers)  # this rank's parts left theirs
                    self.workers.start()
                parts = self.workers.parts(self, t, self._micro_batches(batch), log, buffers)
                break
            except WorkerError as err:
                if attempt == WORKER_RESTARTS:
                    raise
                _log.warning("%s; starting the workers again", err)
        tail = SiteRecorder(self.policy) if log is None else \
            SiteReplayer(self.policy, log.part(k), step=t, first_site=log.first_site(k))
        arithmetic = BoundAdversary(tail, self.policy) if self.profile.adversary else tail
        params = [p for p in self.model.parameters() if p.requires_grad]
        with _STEP_LOCK:
            with self._inside_step(t, arithmetic, k):
                self._join(parts, params)
                self._update()
            self._after_update()
        recorded = None
        if isinstance(tail, SiteReplayer):
            tail.finish()
        else:  # L_t: the parts' logs in micro-batch order, then the tail's (SPEC §3.5)
            logs = [part.log for part in parts if part.log is not None]
            if len(logs) != k:
                raise AssertionError(f"step {t}: {k - len(logs)} recorded parts have no log")
            sites = tuple(site for part_log in logs for site in part_log.sites)
            recorded = RoundingLog(sites + tail.log().sites,
                                   tuple(len(part_log.sites) for part_log in logs))
        seconds = time.perf_counter() - start
        self.step_count = t
        return StepResult(t, sum(part.loss for part in parts) / k, seconds, recorded)

    def _arithmetic(self, rounder, randomness: StepRandomness):
        if self.mode == "ovt":
            compute = self._splitk or native_compute
            return RoundingMode(self.policy, rounder, compute, randomness)
        return self._plain_arithmetic(randomness)

    @contextlib.contextmanager
    def _plain_arithmetic(self, randomness: StepRandomness):
        """Native arithmetic (re-ordered under an emulated profile) with the step's RNG ops
        served; that mode is innermost, so what a served op computes is re-ordered too."""
        reorder = contextlib.nullcontext() if self._splitk is None else ReorderMode(self._splitk)
        with reorder, PortableRandomOps(randomness):
            yield


def _use_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Run the optimizer through its foreach implementation on every device.

    torch.optim picks single-tensor or foreach code by device; pinning one path gives CPU and
    CUDA the same op sequence (SPEC §3.3), and one foreach op per update term instead of one op
    per parameter keeps the interceptor's per-op cost low.
    """
    for group in optimizer.param_groups:
        if "foreach" in group:
            group["foreach"] = True
        for flag in ("fused", "capturable", "differentiable"):
            if group.get(flag):
                group[flag] = False


def _step_counter(state: dict[str, torch.Tensor], step: int | None) -> int:
    """The step counter `state` holds (SPEC §2 "State": S_t's step counter t, as `state()`
    writes it: one int64), which must be `step` unless that is None. Raises ConfigError for a
    missing counter, one of another dtype or shape, a negative one, or another step."""
    counter = state.get("step")
    if not isinstance(counter, torch.Tensor) or counter.dtype != torch.int64 or counter.dim():
        shown = "none" if counter is None else (
            f"{counter.dtype} {tuple(counter.shape)}" if isinstance(counter, torch.Tensor)
            else type(counter).__name__)
        raise ConfigError(f"state does not fit the program: its step counter 'step' must be "
                          f"one int64, it has {shown}")
    value = int(counter)
    if value < 0 or (step is not None and value != step):
        raise ConfigError(f"state holds step counter {value}, not "
                          f"{'a step' if step is None else step}")
    return value
