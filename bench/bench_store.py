"""What committing to a step costs next to the step itself (issue: commitments and the store).

For each built-in program (bench presets), trains `--steps` ovt record steps into a JobStore and
times, per step: the step; taking S_t off the model (`Executor.state`); hashing it (h_t); the
leaf; and the whole durable append (log compression, checkpoint when due, fsyncs, SQLite).
Prints medians and each as a fraction of the step time.

    python bench/bench_store.py [--steps 10] [--preset bench]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from protocol.codec.roundinglog import encode_log, log_digest
from protocol.codec.state import state_digest
from protocol.commit.hashing import leaf_hash
from protocol.commit.leaf import leaf_data
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import BUILTIN
from protocol.job.create import build_job, load_job_program
from protocol.job.store import JobStore


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def bench_program(name: str, preset: str, steps: int) -> dict[str, float]:
    spec, state0 = build_job(program=name, config={}, preset=preset, steps=steps, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=5,
                             commit_interval=steps)
    times: dict[str, list[float]] = {k: [] for k in ("step", "state", "hash", "leaf", "append")}
    with tempfile.TemporaryDirectory() as root:
        store = JobStore(Path(root), spec)
        store.put_initial(state0)
        ex = Executor(load_job_program(spec), seed=0, policy=spec.policy,
                      profile=Profile.parse("cpu-2t"))
        ex.load_state(state0)
        for t in range(1, steps + 1):
            result = ex.step()
            times["step"].append(result.seconds)
            state, dt = _timed(ex.state)
            times["state"].append(dt)
            h, dt = _timed(lambda state=state: state_digest(state))
            times["hash"].append(dt)
            if result.log is None:  # a record step of an "ovt" executor always records one
                raise AssertionError(f"step {t} recorded no rounding log")
            log = encode_log(result.log)
            _, dt = _timed(lambda t=t, h=h, log=log: leaf_hash(leaf_data(t, h, log_digest(log))))
            times["leaf"].append(dt)
            _, dt = _timed(lambda t=t, state=state, log=log: store.append_step(t, state, log))
            times["append"].append(dt)
        store.close()
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--preset", default="bench")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"commitment cost per step (median of {args.steps}; checkpoint every 5 steps)")
    print(f"  {'program':18} {'step ms':>8} {'S_t ms':>8} {'h_t ms':>8} {'leaf ms':>8} "
          f"{'append ms':>9}  {'h_t+leaf / step':>15} {'all / step':>10}")
    for name in sorted(BUILTIN):
        m = bench_program(name, args.preset, args.steps)
        hashing = (m["hash"] + m["leaf"]) / m["step"]
        total = (m["state"] + m["hash"] + m["leaf"] + m["append"]) / m["step"]
        print(f"  {name:18} {1e3 * m['step']:8.1f} {1e3 * m['state']:8.2f} "
              f"{1e3 * m['hash']:8.2f} {1e3 * m['leaf']:8.3f} {1e3 * m['append']:9.2f}  "
              f"{100 * hashing:14.2f}% {100 * total:9.2f}%")


if __name__ == "__main__":
    main()
