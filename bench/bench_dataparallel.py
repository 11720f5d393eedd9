"""Data-parallel steps (issue 14): per-step time and bytes exchanged for W = 1 and W = 2.

For each built-in program this trains the same job (its micro-batches fixed by the job, SPEC
§3.5) three ways, interleaved step by step so that a noisy machine slows all alike:

    w1-1t   one process, one intra-op thread
    w1-2t   one process, two threads (what one process can do with both cores)
    w2-1t   two processes (rank 0 and one worker, gloo over 127.0.0.1), one thread each

and reports the median step time of each, the ratios w2-1t / w1-1t and w2-1t / w1-2t, and the
bytes rank 0 exchanged with its worker per step (S_{t-1}'s model tensors and the worker's
micro-batches out; their gradients, buffers and log parts back). After every step the three
states must hash equal — the figure of a data-parallel run that changed the bits would be
meaningless — and that check is printed too.

    python bench/bench_dataparallel.py                          # test presets, 6 steps
    python bench/bench_dataparallel.py --preset bench --steps 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict

from protocol.codec.state import state_digest
from protocol.engine.allocator import keep_freed_memory
from protocol.engine.dataparallel import Recipe, WorkerGroup
from protocol.engine.replaycheck import SideSpec, worker_executor

RUNS = {"w1-1t": ("cpu-1t", 1), "w1-2t": ("cpu-2t", 1), "w2-1t": ("cpu-1t", 2)}


def _spec(program: str, preset: str | None, profile: str, micro: int, steps: int) -> SideSpec:
    return SideSpec(role="trainer", program=program, preset=preset, config={}, seed=0,
                    init_seed=1, steps=steps, policy="float64->float32", profile=profile,
                    mode="ovt", probe_steps=(), run_dir="", micro_batches=micro)


def bench(program: str, preset: str | None, micro: int, steps: int, warmup: int) -> dict:
    executors, groups = {}, []
    try:
        for name, (profile, workers) in RUNS.items():
            args = asdict(_spec(program, preset, profile, micro, steps))
            ex = worker_executor(args)
            ex.init_state(1)
            if workers > 1:
                group = WorkerGroup(workers, Recipe("protocol.engine.replaycheck:worker_executor",
                                                    args))
                group.start()
                groups.append(group)
                ex.use_workers(group)
            executors[name] = ex
        seconds: dict[str, list[float]] = {name: [] for name in RUNS}
        equal = True
        exchanged = []
        for t in range(1, warmup + steps + 1):
            hashes, step_s = set(), {}
            for name, ex in executors.items():
                before = ex.workers.bytes_exchanged if ex.workers else 0
                step_s[name] = ex.step().seconds
                if t > warmup:
                    seconds[name].append(step_s[name])
                    if ex.workers:
                        exchanged.append(ex.workers.bytes_exchanged - before)
                hashes.add(state_digest(ex.state()))
            equal = equal and len(hashes) == 1
            print(f"  {program} step {t}{' (warm-up)' if t <= warmup else ''}: "
                  + ", ".join(f"{n} {s:.3f} s" for n, s in step_s.items())
                  + f"; states equal: {len(hashes) == 1}", file=sys.stderr)
    finally:
        for group in groups:
            group.close()
    med = {name: statistics.median(values) for name, values in seconds.items()}
    return {"program": program, "median_s": med, "equal": equal,
            "bytes_per_step": statistics.median(exchanged)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", nargs="+", default=["char-transformer", "image-cnn"])
    parser.add_argument("--preset", default="test", help="size preset (default: %(default)s)")
    parser.add_argument("--micro-batches", type=int, default=4,
                        help="the job's micro-batches (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    args = parser.parse_args(argv)
    keep_freed_memory()  # as ovt's processes do, its workers too (protocol/engine/allocator.py)
    rows = [bench(p, args.preset, args.micro_batches, args.steps, args.warmup)
            for p in args.programs]
    print(f"\ndata-parallel steps, preset {args.preset}, {args.micro_batches} micro-batches, "
          f"medians of {args.steps} steps")
    print(f"{'program':18} {'w1-1t s':>8} {'w1-2t s':>8} {'w2-1t s':>8} {'w2/w1-1t':>9} "
          f"{'w2/w1-2t':>9} {'MB/step':>8} {'bits equal':>10}")
    for row in rows:
        m = row["median_s"]
        print(f"{row['program']:18} {m['w1-1t']:8.3f} {m['w1-2t']:8.3f} {m['w2-1t']:8.3f} "
              f"{m['w2-1t'] / m['w1-1t']:9.2f} {m['w2-1t'] / m['w1-2t']:9.2f} "
              f"{row['bytes_per_step'] / 2**20:8.2f} {'yes' if row['equal'] else 'NO':>10}")
    return 0 if all(row["equal"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
