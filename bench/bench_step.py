"""Per-step cost of ovt against plain training, and the size of its rounding logs.

For each built-in program this builds six executors from one initial state S_0:

    plain32  ordinary float32 training            (mode "plain")
    plain64  ordinary float64 training            (mode "plain64")
    record   ovt, trainer side: records L_t       (mode "ovt", no log)
    replay   ovt, auditor side: replays L_t       (mode "ovt", the log just recorded)
    record-torch  record with torch ops (`OVT_FUSED=0`) instead of the fused C++ passes:
             its log and state must equal record's (checked every step)
    nearest  ovt's interceptor with every site rounded to nearest-even and no bound computed:
             not a conforming execution (nothing certifies its rounding), but what widening,
             computing and rounding cost alone — the floor of this design, against which
             record's bounds and band work are measured (its state drifts from record's)

and runs them interleaved, one step of each per step index, so that a noisy shared machine
slows all six alike. Warm-up steps are discarded; the table reports medians of the step's own
wall time (`StepResult.seconds`: forward, backward and optimizer update, and for record
and replay the log decided or checked done; not batch assembly) and
the ratios record/plain32, record/plain64, replay/plain32, replay/record, nearest/plain64,
plus the log figures (bytes per step, rounded elements, entries, bytes per rounded element,
ratio to the dense ternary encoding at 1.6 bits per element). Each timed step runs
`--repeats` times (default 3) from the same state, restored between repeats outside the timing,
and counts its fastest repeat: on a shared machine other load only ever adds time. After every
step the replay's state hash must equal the record's: a benchmark of a wrong replay would be
meaningless, so the check is printed too.

    python bench/bench_step.py                       # bench presets (reference W2, W3)
    python bench/bench_step.py --preset test --steps 4 --warmup 1   # quick smoke run
    python bench/bench_step.py --device cuda         # every role on a CUDA device

On CUDA every role runs under the `cuda` profile, whose steps pin TF32, reduced-precision
reductions and cuDNN off (plain32 included: IEEE float32 arithmetic); record and replay use the
band passes' CUDA kernels where they are built (`fused.CUDA_KERNELS`), record-torch the torch
ops, and the header says which ran.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from protocol.codec.roundinglog import RoundingLog, encode_log, size_report
from protocol.codec.state import state_digest
from protocol.engine import allocator, fused
from protocol.engine.executor import Executor, StepResult
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile, plain_profile
from protocol.engine.programs.registry import BUILTIN, load_program
from protocol.engine.rounding import SiteRecorder
from protocol.errors import OvtError

ROLES = ("plain32", "plain64", "record", "replay", "record-torch", "nearest")
MODE_OF = {"plain32": "plain", "plain64": "plain64", "record": "ovt", "replay": "ovt",
           "record-torch": "ovt", "nearest": "ovt"}

# The reference implementation's figures (BACKGROUND.md; CPU, 2 threads): W2 small CNN with
# BatchNorm, batch 64, SGD momentum <-> image-cnn; W3 2-layer transformer d128 seq64 batch 8,
# AdamW <-> char-transformer.
REFERENCE = {
    "image-cnn": {"workload": "W2", "record_over_plain32": 17.7, "record_over_plain64": 7.0,
                  "replay_over_plain32": 36.9, "bytes_per_element": 0.200,
                  "log_bytes_per_step": 3.8e6},
    "char-transformer": {"workload": "W3", "record_over_plain32": 9.3, "record_over_plain64": 4.3,
                         "replay_over_plain32": 19.5, "bytes_per_element": 0.200,
                         "log_bytes_per_step": 762e3},
}
DENSE_BITS_PER_ELEMENT = 1.6

# The issues' targets: (metric, bound, programs it applies to; None = every program). The log
# size is certified bands' (issue 11); the times are the performance issue's (13).
TARGETS = (
    ("record_over_plain64", 1.3, None),
    ("record_over_plain32", 2.5, ("char-transformer",)),
    ("replay_over_record", 1.0, None),
    ("log_ratio_to_dense", 0.005, None),
)


@dataclass
class ProgramRun:
    program: str
    seconds: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in ROLES})
    log_bytes: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)
    elements: list[int] = field(default_factory=list)
    dense_bytes: list[int] = field(default_factory=list)
    hash_equal: list[bool] = field(default_factory=list)
    repeat_logs_equal: bool = True  # a re-run record step logged the same bytes
    band_passes_equal: bool = True  # record-torch logged the same bytes, reached the same state
    losses: dict[str, list[float]] = field(default_factory=lambda: {r: [] for r in ROLES})


def state_in(state: dict, dtype: torch.dtype) -> dict:
    """`state` with its floating tensors in `dtype` (exact widening of S_0 for plain64)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _with_torch_ops(step):
    """Run `step()` with torch ops instead of the fused C++ passes."""
    saved, fused.ENABLED = fused.ENABLED, False
    try:
        return step()
    finally:
        fused.ENABLED = saved


class NearestRounder(SiteRecorder):
    """The nearest role's rounder: a recorder whose sites need no bounds (`RoundingMode` then
    passes e = 0), so it rounds every element to nearest-even and logs nothing."""

    def bounds_needed(self) -> bool:
        return False


def fused_in_use(device: str) -> str:
    """Whether the record and replay columns ran the fused passes, for the table's header."""
    if not fused.ENABLED:
        return f"no, torch ops ({fused.MISSING or 'OVT_FUSED=0'})"
    if device == "cuda" and not fused.CUDA_KERNELS:
        return "no, torch ops (no CUDA kernels: _fused_cuda not built or refused)"
    return "yes" + (" (CUDA kernels)" if device == "cuda" else "")


def _recorded_log(result: StepResult) -> RoundingLog:
    """The rounding log of a record step (an "ovt" executor's step always records one)."""
    if result.log is None:
        raise RuntimeError("a record step returned no rounding log")
    return result.log


def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def run_program(name: str, preset: str, steps: int, warmup: int, seed: int, init_seed: int,
                policy: PrecisionPolicy, profile: Profile, replay_profile: Profile,
                repeats: int = 1, progress=None) -> ProgramRun:
    execs = {}
    for role in ROLES:
        prof = replay_profile if role == "replay" else profile
        execs[role] = Executor(load_program(name, preset=preset), seed=seed, policy=policy,
                               profile=prof, mode=MODE_OF[role])
    execs["record"].init_state(init_seed)
    s0 = execs["record"].state()
    for role in ("plain32", "plain64", "replay"):
        execs[role].load_state(state_in(s0, execs[role].dtype))
    if state_digest(execs["replay"].state()) != state_digest(s0):
        raise RuntimeError(f"{name}: replay executor does not hold S_0 after load_state")

    execs["record-torch"].load_state(s0)
    execs["nearest"].load_state(s0)
    run = ProgramRun(name)
    for t in range(1, warmup + steps + 1):
        keep = t > warmup
        # Timed steps run `repeats` times from the same S_{t-1} (restored between repeats, outside
        # the timing), interleaved across the executors; a step's time is its fastest repeat.
        n = repeats if keep else 1
        before = {role: execs[role].state() for role in ROLES} if n > 1 else {}
        res: dict[str, StepResult] = {}
        best: dict[str, float] = {}
        for r in range(n):
            for role in ROLES:
                if r:
                    execs[role].load_state(before[role])
                if role == "replay":
                    out = execs[role].step(_recorded_log(res["record"]))
                elif role == "record-torch":
                    out = _with_torch_ops(execs[role].step)
                elif role == "nearest":
                    out = execs[role].step(rounder=NearestRounder(policy))
                else:
                    out = execs[role].step()
                res.setdefault(role, out)  # the first repeat's result (and log)
                if r and role == "record" and \
                        encode_log(_recorded_log(out)) != encode_log(_recorded_log(res[role])):
                    run.repeat_logs_equal = False
                best[role] = min(best.get(role, float("inf")), out.seconds)
        log = _recorded_log(res["record"])
        rep = size_report(log)
        recorded = state_digest(execs["record"].state())
        same = recorded == state_digest(execs["replay"].state())
        run.hash_equal.append(same)  # every step, warm-up included
        run.band_passes_equal &= recorded == state_digest(execs["record-torch"].state()) and \
            encode_log(_recorded_log(res["record-torch"])) == encode_log(log)
        if keep:
            for role in ROLES:
                run.seconds[role].append(best[role])
                run.losses[role].append(res[role].loss)
            run.log_bytes.append(rep.encoded_bytes)
            run.entries.append(rep.entries)
            run.elements.append(rep.elements)
            run.dense_bytes.append(rep.dense_ternary_bytes)
        if progress:
            progress(name, t, warmup + steps, best, same)
    return run


def summarize(run: ProgramRun) -> dict:
    med = {r: _median(run.seconds[r]) for r in ROLES}
    mn = {r: min(run.seconds[r]) for r in ROLES}
    log_bytes, elements = _median(run.log_bytes), _median(run.elements)
    dense = _median(run.dense_bytes)
    out = {
        "program": run.program,
        "steps_timed": len(run.seconds["record"]),
        "median_step_s": med,
        "record_over_plain32": med["record"] / med["plain32"],
        "record_over_plain64": med["record"] / med["plain64"],
        "replay_over_plain32": med["replay"] / med["plain32"],
        "replay_over_plain64": med["replay"] / med["plain64"],
        "replay_over_record": med["replay"] / med["record"],
        "record_torch_over_record": med["record-torch"] / med["record"],
        "nearest_over_plain64": med["nearest"] / med["plain64"],
        "plain64_over_plain32": med["plain64"] / med["plain32"],
        # best-of-steps ratios: less sensitive to other load on a shared machine
        "min_step_s": mn,
        "min_record_over_plain32": mn["record"] / mn["plain32"],
        "min_record_over_plain64": mn["record"] / mn["plain64"],
        "min_replay_over_plain32": mn["replay"] / mn["plain32"],
        "log_bytes_per_step": log_bytes,
        "log_bytes_per_step_max": max(run.log_bytes) if run.log_bytes else None,
        "entries_per_step": _median(run.entries),
        "elements_per_step": elements,
        "entries_fraction": _median(run.entries) / elements if elements else 0.0,
        "bytes_per_element": log_bytes / elements if elements else 0.0,
        "dense_ternary_bytes_per_step": dense,
        "log_ratio_to_dense": log_bytes / dense if dense else 0.0,
        "log_ratio_to_dense_max": max(b / d for b, d in zip(run.log_bytes, run.dense_bytes,
                                                          strict=True))
        if run.log_bytes else 0.0,
        "replay_hash_equal_all_steps": all(run.hash_equal) and bool(run.hash_equal),
        "replay_hash_checked_steps": len(run.hash_equal),
        "record_repeats_identical": run.repeat_logs_equal,
        "band_passes_identical": run.band_passes_equal,
        "final_loss": {r: run.losses[r][-1] if run.losses[r] else None for r in ROLES},
        "reference": REFERENCE.get(run.program),
    }
    out["targets"] = []
    for metric, bound, programs in TARGETS:
        if programs is None or run.program in programs:
            # the log-size target is judged on the worst step, the time targets on medians
            value = out["log_ratio_to_dense_max"] if metric == "log_ratio_to_dense" else out[metric]
            out["targets"].append({"metric": metric, "bound": bound, "value": value,
                                   "pass": value <= bound})
    return out


def _fmt_bytes(n: float) -> str:
    for unit, k in (("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n:.0f} B"


def print_table(summaries: list[dict], meta: dict) -> None:
    print()
    print(f"ovt step benchmark — preset {meta['preset']}, {meta['steps']} timed steps "
          f"(+{meta['warmup']} warm-up), each the fastest of {meta['repeats']} repeats")
    print(f"profile {meta['profile']}, replay profile {meta['replay_profile']}, "
          f"policy {meta['policy']}, certified bands (bound rules v{meta['bound_rules']}), "
          f"fused passes in record: {meta['fused']}")
    print(f"torch {meta['torch']}, {meta['cpu_capability']}, python {meta['python']}, "
          f"{meta['machine']}; malloc: {meta['malloc']}")
    names = [s["program"] for s in summaries]
    colw = max(22, *(len(n) + 2 for n in names))

    def row(label, cells):
        print(f"  {label:<34}" + "".join(f"{c:>{colw}}" for c in cells))

    def ref_cell(s, key, fmt):
        ref = s["reference"]
        return f"(ref {ref['workload']} {fmt.format(ref[key])})" if ref and key in ref else ""

    print()
    row("", names)
    row("", ["-" * (colw - 2)] * len(names))
    for role in ROLES:
        row(f"median step, {role}", [f"{s['median_step_s'][role] * 1e3:.2f} ms" for s in summaries])
    row("plain64 / plain32", [f"{s['plain64_over_plain32']:.2f}x" for s in summaries])
    for key, label in (("record_over_plain32", "record / plain32 (trainer)"),
                       ("record_over_plain64", "record / plain64"),
                       ("replay_over_plain32", "replay / plain32 (auditor)"),
                       ("replay_over_record", "replay / record"),
                       ("record_torch_over_record", "record-torch / record"),
                       ("nearest_over_plain64", "nearest / plain64 (the floor)")):
        row(label, [f"{s[key]:.2f}x" for s in summaries])
        if any(s["reference"] and key in s["reference"] for s in summaries):
            row("  reference impl.", [ref_cell(s, key, "{:.1f}x") for s in summaries])
    row("record / plain32, best steps", [f"{s['min_record_over_plain32']:.2f}x" for s in summaries])
    row("record / plain64, best steps", [f"{s['min_record_over_plain64']:.2f}x" for s in summaries])
    row("log bytes / step (median)", [_fmt_bytes(s["log_bytes_per_step"]) for s in summaries])
    row("  reference impl.", [f"(ref {s['reference']['workload']} "
                              f"{_fmt_bytes(s['reference']['log_bytes_per_step'])})"
                              if s["reference"] else "" for s in summaries])
    row("rounded elements / step", [f"{s['elements_per_step']:,.0f}" for s in summaries])
    row("log entries / step", [f"{s['entries_per_step']:,.0f}" for s in summaries])
    row("  entries / elements", [f"{s['entries_fraction'] * 100:.3f} %" for s in summaries])
    row("bytes / rounded element", [f"{s['bytes_per_element']:.5f}" for s in summaries])
    row("  reference impl. (dense ternary)",
        [ref_cell(s, "bytes_per_element", "{:.3f}") for s in summaries])
    row("dense ternary (1.6 bit/el) / step",
        [_fmt_bytes(s["dense_ternary_bytes_per_step"]) for s in summaries])
    row("log / dense ternary (median)",
        [f"{s['log_ratio_to_dense'] * 100:.3f} %" for s in summaries])
    row("log / dense ternary (worst step)",
        [f"{s['log_ratio_to_dense_max'] * 100:.3f} %" for s in summaries])
    row("replay hash == record hash",
        [f"{'yes' if s['replay_hash_equal_all_steps'] else 'NO'} "
         f"({s['replay_hash_checked_steps']} steps)" for s in summaries])
    row("record-torch log, state == record",
        ["yes" if s["band_passes_identical"] else "NO" for s in summaries])
    print()
    print("Targets (issue):")
    for s in summaries:
        for t in s["targets"]:
            mark = "PASS" if t["pass"] else "MISS"
            val = (f"{t['value'] * 100:.3f} %" if t["metric"] == "log_ratio_to_dense"
                   else f"{t['value']:.2f}x")
            bound = (f"{t['bound'] * 100:.1f} %" if t["metric"] == "log_ratio_to_dense"
                     else f"{t['bound']:.1f}x")
            print(f"  [{mark}] {s['program']:<18} {t['metric']:<22} {val:>10}  <= {bound}")
    ok = all(s["replay_hash_equal_all_steps"] and s["record_repeats_identical"]
             and s["band_passes_identical"] for s in summaries)
    verdict = ("every replayed state hash equals the recorded one" if ok
               else "REPLAY DIVERGED — timings are of a wrong replay")
    print(f"\nReplay check: {verdict}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="bench", choices=("test", "bench"))
    p.add_argument("--steps", type=int, default=12, help="timed steps per program (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="discarded steps first (default 2)")
    p.add_argument("--programs", nargs="+", default=list(BUILTIN), choices=list(BUILTIN))
    p.add_argument("--repeats", type=int, default=3,
                   help="run each timed step this many times from the same state and keep the "
                        "fastest (default 3; robust to other load on a shared machine)")
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (default 2)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="device of every role (default cpu: profile cpu-<threads>t; cuda: "
                        "profile cuda)")
    p.add_argument("--replay-profile", default=None,
                   help="profile of the replay executor (default: the same as record); e.g. "
                        "emulated-gpu — a cross-profile check is what `ovt replay-check` is for")
    p.add_argument("--policy", default="float64->float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-step progress on stderr")
    p.add_argument("--malloc-defaults", action="store_true",
                   help="leave glibc's malloc thresholds as they are; by default the benchmark "
                        "keeps freed memory for reuse as ovt's own processes do "
                        "(protocol/engine/allocator.py), for every role alike")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.threads < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1, --warmup >= 0, --threads >= 1")
    kept = None if args.malloc_defaults else allocator.keep_freed_memory()

    try:
        profile = plain_profile(args.device, args.threads)
        replay_profile = Profile.parse(args.replay_profile) if args.replay_profile else profile
        profile.check_runnable()
        replay_profile.check_runnable()
    except OvtError as err:
        p.error(str(err))
    policy = PrecisionPolicy.parse(args.policy)
    torch.set_num_threads(args.threads)

    def progress(name, t, total, secs, same):
        if not args.quiet:
            cells = " ".join(f"{r} {secs[r] * 1e3:7.1f}ms" for r in ROLES)
            print(f"  {name} step {t:>3}/{total}: {cells}  hash {'ok' if same else 'DIFF'}",
                  file=sys.stderr, flush=True)

    meta = {
        "preset": args.preset, "steps": args.steps, "warmup": args.warmup,
        "repeats": args.repeats,
        "threads": args.threads, "profile": profile.describe(),
        "replay_profile": replay_profile.describe(), "policy": policy.name,
        "bound_rules": policy.rules,
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus"
        + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
        "dense_bits_per_element": DENSE_BITS_PER_ELEMENT,
        "loadavg_start": os.getloadavg()[0],
        "malloc": allocator.describe(kept),
        "fused": fused_in_use(args.device),
    }
    if meta["loadavg_start"] > 0.5 and not args.quiet:
        print(f"warning: 1-min load average is {meta['loadavg_start']:.2f} on {os.cpu_count()} "
              f"cpus; other processes competing for the {args.threads} threads distort timings",
              file=sys.stderr)
    started = time.perf_counter()
    summaries = []
    for name in args.programs:
        run = run_program(name, args.preset, args.steps, args.warmup, args.seed, args.init_seed,
                          policy, profile, replay_profile, args.repeats, progress)
        summaries.append(summarize(run) | {"seconds_per_step": run.seconds,
                                           "log_bytes": run.log_bytes})
    meta["wall_s"] = time.perf_counter() - started
    meta["loadavg_end"] = os.getloadavg()[0]
    sys.stderr.flush()
    print_table(summaries, meta)
    print(f"(wall time {meta['wall_s']:.1f} s; 1-min load average {meta['loadavg_start']:.2f} at "
          f"start, {meta['loadavg_end']:.2f} at end on {os.cpu_count()} cpus — other load "
          f"inflates every column, the interleaved ratios less than the absolute times)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "programs": {s["program"]: s for s in summaries}}, f,
                      indent=2)
    return 0 if all(s["replay_hash_equal_all_steps"] and s["record_repeats_identical"]
                    for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
