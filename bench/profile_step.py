"""Where an ovt record or replay step spends its time, by function (cProfile, exclusive time).

Runs a few warm-up steps, then profiles `--steps` steps of one mode and prints the functions
with the most exclusive time per step. Torch ops called from Python show up as their method
names (`to`, `nonzero`, `bitwise_and`...), so the cost of each pass of the rounding engine is
visible next to the Python overhead of the interceptor. cProfile inflates Python-heavy code, so
read shares, not absolute times; `bench/bench_step.py` measures un-instrumented step times.

    python bench/profile_step.py --program char-transformer --mode record
    python bench/profile_step.py --device cuda --mode replay   # on a CUDA device

On CUDA a step's waits for the device land in whichever call synchronizes first (`nonzero`,
`item`, a copy to the host), not in the op that queued the work.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

import torch

from protocol.engine.allocator import keep_freed_memory
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import plain_profile
from protocol.engine.programs.registry import BUILTIN, load_program
from protocol.errors import OvtError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", choices=sorted(BUILTIN), default="char-transformer")
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--mode", choices=("record", "replay"), default="record")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: profile threads=<threads>; cuda: profile cuda")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    keep_freed_memory()  # as ovt's processes do (protocol/engine/allocator.py)
    torch.set_num_threads(args.threads)
    profile = plain_profile(args.device, args.threads)
    try:
        profile.check_runnable()
    except OvtError as err:
        parser.error(str(err))

    def executor() -> Executor:
        return Executor(load_program(args.program, preset=args.preset), seed=0,
                        policy=PrecisionPolicy(), profile=profile)

    trainer = executor()
    trainer.init_state(1)
    auditor = executor()
    auditor.load_state(trainer.state())
    for _ in range(2):  # warm-up
        auditor.step(trainer.step().log)
    logs = [trainer.step().log for _ in range(args.steps)] if args.mode == "replay" else []

    profiler = cProfile.Profile()
    profiler.enable()
    if args.mode == "record":
        seconds = [trainer.step().seconds for _ in range(args.steps)]
    else:
        seconds = [auditor.step(log).seconds for log in logs]
    profiler.disable()

    per_step = 1e3 / args.steps
    print(f"{args.program} ({args.preset}), {args.mode}: median step under cProfile "
          f"{1e3 * sorted(seconds)[len(seconds) // 2]:.1f} ms; exclusive ms per step:")
    stats = pstats.Stats(profiler)
    # Stats.stats, the raw table (get_stats_profile keys by bare name, merging same-named
    # functions of different files), is undocumented and missing from typeshed's stubs.
    table = stats.stats  # type: ignore[attr-defined]
    rows = sorted(table.items(), key=lambda kv: -kv[1][2])[:args.top]
    for (filename, line, name), (_, calls, tottime, _, _) in rows:
        where = filename.rsplit("/", 1)[-1] if filename != "~" else "torch"
        print(f"  {tottime * per_step:8.2f}  {calls / args.steps:8.0f} calls  "
              f"{where}:{name}" + (f":{line}" if line else ""))


if __name__ == "__main__":
    main()
