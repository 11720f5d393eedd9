"""CPU ↔ CUDA replay check: record on one device, replay on the other, compare every h_t.

    python bench/cuda_check.py                 # both built-ins and token-lm, 10 steps each way
    python bench/cuda_check.py --steps 30 --programs image-cnn

For each program: record on the CPU (profile cpu-2t) and replay on CUDA, then record on CUDA and
replay on the CPU, and the same with the bound adversary on the CPU side (SPEC §3.2): the
certified bands must make all four bit-exact. Then data-parallel steps (SPEC §3.5, 4
micro-batches): a 2-process CUDA trainer replayed by one CPU process, and a 2-process CPU
trainer replayed by one CUDA process (on CUDA the workers' tensors travel through CPU copies
over gloo). The CUDA side runs with TF32, reduced-precision
reductions and cuDNN pinned off (the executor does this for every step), so its float64 GEMMs
are native IEEE arithmetic, as the reduction rule assumes. Prints one line per direction and
exits 1 if any replay is not bit-exact, 2 if there is no CUDA device.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time

import torch

from protocol.engine.replaycheck import SideSpec, replay_check

PROGRAMS = ("char-transformer", "image-cnn", "token-lm")
DIRECTIONS = (("cpu-2t", "cuda"), ("cuda", "cpu-2t"), ("adversary", "cuda"), ("cuda", "adversary"))
# (trainer, its processes, auditor, its processes), with 4 micro-batches
PARALLEL = (("cuda", 2, "cpu-2t", 1), ("cpu-1t", 2, "cuda", 1))


def check(program: str, preset: str, steps: int, trainer: str, auditor: str,
          workers: tuple[int, int] = (1, 1)) -> bool:
    with tempfile.TemporaryDirectory(prefix="ovt-cuda-check-") as run_dir:
        parallel = workers != (1, 1)
        trainer_side = SideSpec(role="trainer", program=program, preset=preset, config={},
                                seed=0, init_seed=1, steps=steps, policy="float64->float32",
                                profile=trainer, mode="ovt",
                                probe_steps=() if parallel else (1,), run_dir=run_dir,
                                micro_batches=4 if parallel else 1, workers=workers[0])
        auditor_side = dataclasses.replace(trainer_side, role="auditor", profile=auditor,
                                           workers=workers[1])
        started = time.perf_counter()
        result = replay_check(trainer_side, auditor_side)
        wall = time.perf_counter() - started
    s = result.summary()
    worst = max((d["max_fraction_of_bound"] for d in result.auditor.divergence.values()),
                default=float("nan"))
    verdict = "BIT-EXACT" if result.bit_exact else \
        f"NOT bit-exact (first divergent step {s['first_divergent_step']})"
    sides = f"{trainer}x{workers[0]} -> {auditor}x{workers[1]}" if parallel else \
        f"{trainer:>9} -> {auditor:<9}"
    print(f"{program:17} {sides} {verdict}; {s['steps_compared']} steps, "
          f"median step {1e3 * (s['median_trainer_step_s'] or 0):.0f} ms record / "
          f"{1e3 * (s['median_auditor_step_s'] or 0):.0f} ms replay, log entries/step "
          f"{s['median_entries']}, worst divergence {worst:.3g} of e (step 1), {wall:.0f} s",
          flush=True)
    for who, err in (("trainer", result.trainer.error), ("auditor", result.auditor.error)):
        if err:
            print(f"  {who}: {err}", flush=True)
    return result.bit_exact


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="steps per direction (default 10)")
    p.add_argument("--preset", default="test", help="size preset of every program")
    p.add_argument("--programs", nargs="+", default=list(PROGRAMS), choices=PROGRAMS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_check: no CUDA device here; nothing to check", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.steps} steps")
    ok = [check(program, args.preset, args.steps, trainer, auditor)
          for program in args.programs for trainer, auditor in DIRECTIONS]
    ok += [check(program, args.preset, args.steps, trainer, auditor, (tw, aw))
           for program in args.programs for trainer, tw, auditor, aw in PARALLEL]
    print(f"{sum(ok)}/{len(ok)} bit-exact")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
