"""The step executor: `step(S_{t-1}, B_t, L_t or record) -> (S_t, L_t)` (SPEC §3.5).

An `Executor` holds one program's model and optimizer on one device under one hardware profile,
and runs training steps in one of three arithmetic modes:

- "ovt": every floating op computed in the policy's compute dtype and rounded to the target
  dtype (record mode when no log is given, replay mode with the trainer's log), SPEC §3.2;
- "plain": ordinary training in the target dtype (what ovt exists to fix: it diverges);
- "plain64": ordinary training with model and state in float64 (a benchmark baseline).

Whatever the mode, a step's randomness comes from `protocol.engine.rng` (SPEC §3.4): dropout is
replaced by the portable generator and device RNG ops are refused. Every backend switch that
changes numbers (cuDNN, TF32, reduced-precision reductions, SDPA kernel choice) is pinned for
the duration of the step and restored afterwards, never flipped globally.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from protocol.codec.roundinglog import RoundingLog
from protocol.engine.batches import batch_indices
from protocol.engine.interceptor import RoundingMode, native_compute
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.base import TrainingProgram
from protocol.engine.rng import RandomStream
from protocol.engine.rounding import BoundAdversary, SiteRecorder, SiteReplayer
from protocol.engine.splitk import ReorderMode
from protocol.errors import ConfigError, DeterminismError

MODES = ("ovt", "plain", "plain64")

# A step pins process-wide switches (backend flags, the intra-op thread count) and restores
# them after; two steps in one process (a daemon regenerating S_t while it trains) must not
# interleave, or one would restore the other's switches mid-step.
_STEP_LOCK = threading.RLock()


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float
    seconds: float
    log: RoundingLog | None  # the recorded log (record mode) or None


class PortableDropout(TorchFunctionMode):
    """Replaces `F.dropout` with a mask from the portable generator (SPEC §3.4).

    The k-th dropout call of step t draws from RandomStream(seed, "dropout", t, k), so the masks
    are the same bits on every device, thread count and torch version.
    """

    def __init__(self, seed: int, step: int) -> None:
        super().__init__()
        self.seed, self.step, self.calls = seed, step, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            return self._dropout(*args, **kwargs)
        if func in _UNSUPPORTED_DROPOUT:
            raise DeterminismError(f"{func.__name__} is not supported inside an ovt step; use "
                                   f"torch.nn.Dropout / F.dropout")
        return func(*args, **kwargs)

    def _dropout(self, input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        if not 0.0 <= p <= 1.0:
            raise ConfigError(f"dropout probability must be in [0, 1], got {p}")
        keep = RandomStream(self.seed, "dropout", self.step, self.calls).keep_mask(
            tuple(input.shape), 1.0 - p).to(input.device)
        self.calls += 1
        out = torch.where(keep, input * (1.0 / (1.0 - p)), 0.0) if p < 1.0 else input * 0.0
        return input.copy_(out) if inplace else out


_UNSUPPORTED_DROPOUT = (
    torch.nn.functional.alpha_dropout, torch.nn.functional.feature_alpha_dropout,
    torch.nn.functional.dropout1d, torch.nn.functional.dropout2d, torch.nn.functional.dropout3d,
    torch.dropout, torch.bernoulli,
)


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
                 profile: Profile, mode: str = "ovt") -> None:
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
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
        self.optimizer = program.make_optimizer(self.model.parameters())
        _use_foreach(self.optimizer)
        self._names = {id(p): n for n, p in self.model.named_parameters()}
        self.step_count = 0
        self._splitk = profile.reorder()

    # -- state ---------------------------------------------------------------------------------

    def init_state(self, init_seed: int) -> None:
        """Set S_0 from the portable generator (done once, by the trainer; SPEC §3.4)."""
        with torch.no_grad():
            self.program.init(self.model, init_seed)
        self.optimizer.state.clear()
        self.step_count = 0

    def state(self) -> dict[str, torch.Tensor]:
        """S_t as named CPU tensors (SPEC §2 "State")."""
        out = {f"model.{k}": v.detach().cpu().clone() for k, v in self.model.state_dict().items()}
        for p, st in self.optimizer.state.items():
            for key, value in st.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim.{self._names[id(p)]}.{key}"] = value.detach().cpu().clone()
        out["step"] = torch.tensor(self.step_count, dtype=torch.int64)
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Make the live model and optimizer hold exactly `state` (bits, not just values)."""
        model_sd = self.model.state_dict()
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
            if value.dim() and value.shape != p.shape:
                raise ConfigError(f"optimizer state {key!r} has shape {tuple(value.shape)}, "
                                  f"parameter has {tuple(p.shape)}")
            if skey == "step" and value.dim() == 0:  # torch.optim keeps step counters on the CPU
                self.optimizer.state[p][skey] = value.clone()
            else:
                self.optimizer.state[p][skey] = torch.empty_like(p).copy_(value)
        self.step_count = int(state["step"])

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
            if t.is_floating_point():
                t = t.to(self.dtype)
                if self.profile.channels_last and t.dim() == 4:
                    t = t.contiguous(memory_format=torch.channels_last)
            batch[name] = t
        return batch

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
        if self.mode == "ovt" and rounder is None:
            rounder = SiteRecorder(self.policy) if log is None else \
                SiteReplayer(self.policy, log, step=t)
        arithmetic = rounder
        if self.profile.adversary and rounder is not None:
            arithmetic = BoundAdversary(rounder, self.policy)
        with _STEP_LOCK:
            start = time.perf_counter()  # the step's own time, not the wait for the lock
            self.optimizer.zero_grad(set_to_none=True)
            with pinned_backends(), self.profile.applied(), self._arithmetic(arithmetic), \
                    PortableDropout(self.seed, t):
                loss = self.program.loss(self.model, batch)
                loss.backward()
                self.optimizer.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - start
        if isinstance(rounder, SiteReplayer):
            rounder.finish()
        self.step_count = t
        recorded = rounder.log() if isinstance(rounder, SiteRecorder) else None
        return StepResult(t, float(loss.detach()), seconds, recorded)

    def _arithmetic(self, rounder):
        if self.mode == "ovt":
            compute = self._splitk or native_compute
            return RoundingMode(self.policy, rounder, compute)
        if self._splitk is not None:
            return ReorderMode(self._splitk)
        return contextlib.nullcontext()


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
