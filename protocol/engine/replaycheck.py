"""`ovt replay-check`: train under one hardware profile, replay under another, compare bits.

The trainer side trains `steps` steps (record mode, or plain float training) and writes S_0, its
per-step state hashes h_t and rounding logs L_t into a run directory; the auditor side loads S_0,
replays every step with the trainer's logs under its own profile, and stops at the first step
whose h_t differs or whose log it must reject. A side whose profile needs another instruction
set than this process runs (`ATEN_CPU_CAPABILITY` is fixed at start-up) runs in a subprocess
of this same module, so both sides always execute the same code path.

Everything a side writes is its own output for its own partner; nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from protocol.codec.roundinglog import decode_log, encode_log
from protocol.codec.state import decode_state, encode_state, state_digest
from protocol.engine.dataparallel import Recipe, WorkerGroup
from protocol.engine.divergence import (
    CapturingRecorder,
    ComparingReplayer,
    DivergenceReport,
    probe_paths,
)
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program
from protocol.errors import ConfigError, OvtError


@dataclass(frozen=True)
class SideSpec:
    """Everything one side needs; JSON round-trips it to a subprocess."""

    role: str  # "trainer" | "auditor"
    program: str
    preset: str | None
    config: dict
    seed: int
    init_seed: int
    steps: int
    policy: str
    profile: str
    mode: str  # "ovt" | "plain"
    probe_steps: tuple[int, ...]
    run_dir: str
    micro_batches: int = 1
    workers: int = 1  # processes computing the micro-batches (SPEC §3.5; dataparallel)


@dataclass
class SideResult:
    hashes: list[str] = field(default_factory=list)  # h_0 .. h_k, hex
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    log_bytes: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)
    elements: list[int] = field(default_factory=list)
    divergence: dict = field(default_factory=dict)
    error: str | None = None
    error_step: int | None = None


def _side_dir(spec: SideSpec, role: str) -> Path:
    return Path(spec.run_dir) / role


def _executor(spec: SideSpec) -> Executor:
    program = load_program(spec.program, spec.config, spec.preset)
    policy = PrecisionPolicy.parse(spec.policy)
    return Executor(program, seed=spec.seed, policy=policy, profile=Profile.parse(spec.profile),
                    mode=spec.mode, micro_batches=spec.micro_batches)


def worker_executor(args: dict) -> Executor:
    """A data-parallel worker's executor for the side `args` (a SideSpec as JSON values): the
    `Recipe` builder `run_side` gives its workers."""
    return _executor(SideSpec(**{**args, "probe_steps": tuple(args["probe_steps"])}))


def _workers(spec: SideSpec) -> contextlib.AbstractContextManager[WorkerGroup | None]:
    """The side's worker group, started (a null context for one process; a probed step then
    refuses to run, `Executor.step`: the probe sees the whole step in one process)."""
    if spec.workers == 1:
        return contextlib.nullcontext()
    return WorkerGroup(spec.workers, Recipe("protocol.engine.replaycheck:worker_executor",
                                            asdict(spec)))


def run_side(spec: SideSpec, progress: Callable[[int], None] | None = None) -> SideResult:
    """Run one side in this process, writing its outputs to run_dir/<role>/: result.json, the
    final state (final.ovts) and, for the trainer, S_0 (s0.ovts) and the logs (logs/*.ovtl)."""
    out = _side_dir(spec, spec.role)
    out.mkdir(parents=True, exist_ok=True)
    result = SideResult()
    try:
        ex = _executor(spec)
        with _workers(spec) as workers:
            ex.use_workers(workers)
            if spec.role == "trainer":
                _train(spec, ex, out, result, progress)
            else:
                _audit(spec, ex, result, progress)
        (out / "final.ovts").write_bytes(encode_state(ex.state()))
    except OvtError as err:
        result.error = str(err)
        result.error_step = getattr(err, "step", None) or len(result.hashes)
    (out / "result.json").write_text(json.dumps(asdict(result)))
    return result


def _train(spec, ex, out, result, progress) -> None:
    ex.init_state(spec.init_seed)
    state0 = ex.state()
    (out / "s0.ovts").write_bytes(encode_state(state0))
    result.hashes.append(state_digest(state0).hex())
    (out / "logs").mkdir(exist_ok=True)
    for t in range(1, spec.steps + 1):
        rounder = CapturingRecorder(ex.policy, out, t) \
            if spec.mode == "ovt" and t in spec.probe_steps else None
        step = ex.step(rounder=rounder)
        if rounder is not None:
            rounder.close()
        if spec.mode == "ovt":
            log = step.log
            data = encode_log(log)
            (out / "logs" / f"{t:07d}.ovtl").write_bytes(data)
            result.log_bytes.append(len(data))
            result.entries.append(log.n_entries)
            result.elements.append(log.n_elements)
        _note_step(result, ex, step, progress)


def _audit(spec, ex, result, progress) -> None:
    trainer = _side_dir(spec, "trainer")
    expected = json.loads((trainer / "result.json").read_text())["hashes"]
    ex.load_state(decode_state((trainer / "s0.ovts").read_bytes()))
    result.hashes.append(state_digest(ex.state()).hex())
    report = DivergenceReport()
    for t in range(1, min(spec.steps, len(expected) - 1) + 1):
        log, rounder = None, None
        if spec.mode == "ovt":
            log = decode_log((trainer / "logs" / f"{t:07d}.ovtl").read_bytes())
            if probe_paths(trainer, t)[1].exists():
                rounder = ComparingReplayer(ex.policy, log, trainer, t, report)
        step = ex.step(log, rounder=rounder)
        _note_step(result, ex, step, progress)
        if result.hashes[t] != expected[t]:
            break  # diverged: later steps would only compound it
    result.divergence = report.as_json()


def _note_step(result: SideResult, ex: Executor, step, progress) -> None:
    result.hashes.append(state_digest(ex.state()).hex())
    result.losses.append(step.loss)
    result.seconds.append(step.seconds)
    if progress:
        progress(step.step)


def run_side_anywhere(spec: SideSpec, progress=None) -> SideResult:
    """Run a side here, or in a subprocess when its profile needs another instruction set."""
    profile = Profile.parse(spec.profile)
    if not profile.needs_subprocess:
        return run_side(spec, progress)
    spec_file = Path(spec.run_dir) / f"{spec.role}-spec.json"
    spec_file.parent.mkdir(parents=True, exist_ok=True)
    spec_file.write_text(json.dumps(asdict(spec)))
    env = {**os.environ, **profile.env()}
    proc = subprocess.run([sys.executable, "-m", "protocol.engine.replaycheck", str(spec_file)],
                          env=env, capture_output=True, text=True, timeout=3600)
    result_file = _side_dir(spec, spec.role) / "result.json"
    if proc.returncode != 0 or not result_file.exists():
        raise OvtError(f"{spec.role} subprocess failed (exit {proc.returncode}): "
                       f"{proc.stderr.strip()[-2000:]}")
    return SideResult(**json.loads(result_file.read_text()))


@dataclass
class CheckResult:
    trainer: SideResult
    auditor: SideResult
    steps: int

    @property
    def compared(self) -> int:
        """Number of steps both sides produced a hash for."""
        return min(len(self.trainer.hashes), len(self.auditor.hashes)) - 1

    @property
    def first_divergent_step(self) -> int | None:
        for t, (a, b) in enumerate(zip(self.trainer.hashes, self.auditor.hashes, strict=False)):
            if a != b:
                return t
        if self.auditor.error is not None:
            return self.auditor.error_step
        if len(self.auditor.hashes) < len(self.trainer.hashes):
            return len(self.auditor.hashes)
        return None

    @property
    def bit_exact(self) -> bool:
        return (self.trainer.error is None and self.first_divergent_step is None
                and self.compared == self.steps)

    def summary(self) -> dict:
        t, a = self.trainer, self.auditor
        return {
            "bit_exact": self.bit_exact,
            "first_divergent_step": self.first_divergent_step,
            "steps_compared": self.compared,
            "trainer_error": t.error,
            "auditor_error": a.error,
            "median_trainer_step_s": _median(t.seconds),
            "median_auditor_step_s": _median(a.seconds),
            "median_log_bytes": _median(t.log_bytes),
            "median_entries": _median(t.entries),
            "max_entries": max(t.entries, default=None),
            "elements_per_step": t.elements[0] if t.elements else None,
        }


def _median(values: list) -> float | None:
    return statistics.median(values) if values else None


def replay_check(trainer: SideSpec, auditor: SideSpec, progress=None) -> CheckResult:
    if trainer.run_dir != auditor.run_dir:
        raise ConfigError("trainer and auditor must share one run directory")
    t = run_side_anywhere(trainer, progress and (lambda s: progress("train", s)))
    if t.error is not None:
        return CheckResult(t, SideResult(), trainer.steps)
    a = run_side_anywhere(auditor, progress and (lambda s: progress("replay", s)))
    return CheckResult(t, a, trainer.steps)


def _worker(spec_path: str) -> int:
    spec_data = json.loads(Path(spec_path).read_text())
    spec_data["probe_steps"] = tuple(spec_data["probe_steps"])
    run_side(SideSpec(**spec_data))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1]))
