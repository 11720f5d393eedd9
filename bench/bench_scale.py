"""ovt at GPT-2-small width: record, cross-profile replay, log size and the old fixed band.

Builds one executor per role from one initial state S_0 of "token-lm" (preset gpt2-small-2l:
vocabulary 50,257, d 768, 12 heads, 2 layers, sequence 64, batch 8, AdamW; `--full` for all 12
layers) and runs them interleaved, one step of each per step index, so that other load on a
shared machine slows them alike (`--low-memory`: the ovt roles first, then the plain ones, so
only one phase's executors are held; at gpt2-small-2l all five roles together peak near 19 GB):

    record             ovt trainer on cpu-<threads>t (or cuda): records L_t   (mode "ovt")
    replay:<profile>   ovt auditor replaying L_t under each replay profile (default
                       emulated-gpu and adversary, the bound adversary; one not defined here
                       is reported and skipped)
    plain32            ordinary float32 training                          (mode "plain")
    plain64            ordinary float64 training                          (mode "plain64")

After every step each replay's state hash must equal the record's (bit-exact yes/no); a replay
that diverges or rejects the log is reported with its step and error and stops. The log figures
are per recorded step: encoded bytes, entries (direction and value entries), rounded elements,
bytes per rounded element. Next to them, from the same record steps, the figure of the fixed
band ovt used before certified bounds: the elements per step closer than tau = 2**-8 target ULP
to a float32 rounding boundary, at the sites of non-IEEE ops (elements whose certified bound is
0 are correctly rounded ops, which the old policy also exempted, tau_ieee = 0). A small counting
wrapper around the recorder counts them; its own time is subtracted from the record step's.

Step times are `StepResult.seconds` (forward, backward, optimizer update, the log decided or
checked done); medians over the
steps after `--warmup` (default 1), with their ratios. Memory: the process's peak resident set
(VmHWM, or `ru_maxrss` where there is no /proc) at the end, and its resident set once every
executor and S_0 is built, over all roles together (they run in one process); `--memory` adds
each role's own peak, one subprocess per role building its executor, loading S_0 and running
step 1 (a replay with L_1), each reading its peak when its step is done.

    python bench/bench_scale.py                      # gpt2-small-2l, 10 steps (minutes)
    python bench/bench_scale.py --full --steps 3 --low-memory   # the 12-layer model
    python bench/bench_scale.py --preset test --steps 2   # quick smoke run (seconds)
    python bench/bench_scale.py --device cuda --replay-profiles cuda,threads=8   # on a GPU

With `--device cuda` the record and plain roles run under the `cuda` profile (TF32,
reduced-precision reductions and cuDNN pinned off), and `--memory` reports each role's peak of
CUDA memory allocated (`torch.cuda.max_memory_allocated`) next to its resident set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from protocol.codec.roundinglog import RoundingLog, decode_log, encode_log
from protocol.codec.state import decode_state, encode_state, state_digest
from protocol.engine import allocator
from protocol.engine.bounds import dense_bound
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile, plain_profile
from protocol.engine.programs import token_lm
from protocol.engine.programs.registry import load_program, parameter_count
from protocol.engine.rounding import SiteRecorder
from protocol.errors import OvtError

PROGRAM = token_lm.NAME
OLD_TAU = 2.0**-8  # the superseded fixed band, in target ULPs (SPEC §3.1)
DEFAULT_REPLAYS = ("emulated-gpu", "adversary")
PLAIN = ("plain32", "plain64")
MODE_OF = {"record": "ovt", "plain32": "plain", "plain64": "plain64"}


class OldBandCounter:
    """A rounder wrapper: counts the elements of each site closer than `tau` target ULPs to a
    target rounding boundary, then hands the site to the wrapped rounder unchanged.

    `general` counts only elements with a nonzero certified bound (the old policy's general
    ops; its IEEE ops had tau_ieee = 0), `any_op` every one. `seconds` is the time spent
    counting, to be taken off the step's time. Since bound rules version 2 both counts are lower
    bounds of what the old policy logged: it banded addcmul, addcdiv and lerp, which are now
    fixed formulas with e = 0 (never in `general`), and sites of the fused pointwise pass
    (`claim_exact_site`, delegated to the recorder) are not seen at all (not in `any_op`).
    """

    def __init__(self, inner, policy: PrecisionPolicy, tau: float = OLD_TAU) -> None:
        self.inner, self.policy, self.tau = inner, policy, tau
        self.general = self.any_op = 0
        self.seconds = 0.0

    rounds_in_parts = True  # (the recorder it wraps does; `round_site_in_parts`)
    rounds_in_place = True  # (and `round_result_in_place`)

    def round_site(self, op, ys, *rest):
        bounds = rest[0] if rest and isinstance(rest[0], (list, tuple)) else [None] * len(ys)
        for y, bound in zip(ys, bounds, strict=False):
            self._count(y, bound)
        return self.inner.round_site(op, ys, *rest)

    def round_result_in_place(self, op, y, bound):
        """A site of one result the recorder may overwrite with its rounding: counted first."""
        self._count(y, bound)
        return self.inner.round_result_in_place(op, y, bound)

    def round_site_in_parts(self, op, numel, results):
        """A large elementwise site in parts (`RoundingMode._in_parts`): each part counted as
        it passes to the recorder."""
        def counted(parts):
            for y, bound, out in parts:
                self._count(y, bound)
                yield y, bound, out
        self.inner.round_site_in_parts(op, numel, (counted(parts) for parts in results))

    def _count(self, y: torch.Tensor, bound) -> None:
        if y.is_cuda:  # the op that made y finishes here, on the step's clock, not the count's
            torch.cuda.synchronize(y.device)
        start = time.perf_counter()
        idx = band_indices(y.detach().reshape(-1), self.policy, self.tau)
        self.any_op += idx.numel()
        bound = dense_bound(bound, y)
        if isinstance(bound, torch.Tensor):
            coords = torch.unravel_index(idx, tuple(y.shape))
            b = bound.to(y.device).expand(y.shape)[coords]
            self.general += int((b > 0).sum())
        elif bound is not None and float(bound) > 0:
            self.general += idx.numel()
        self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


_CHUNK = 1 << 18  # elements per pass: small temporaries, in cache, at 10**8-element sites


def band_indices(flat: torch.Tensor, policy: PrecisionPolicy, tau: float) -> torch.Tensor:
    """Flat indices (int64) of the elements of `flat` (compute dtype) less than `tau` target
    ULPs from a target rounding boundary.

    Target-normal values: the low `s` bits of the compute value (s = the compute dtype's extra
    mantissa bits) are its position inside its target ULP, so the test is exact (just above a
    power of two the boundary below is >= 1/4 ULP away, outside any small band). Target-subnormal
    values: the position is y / (subnormal ULP), an exact power-of-two scaling. NaN, inf and
    values beyond the target's range are not rounding sites.
    """
    fmt = policy.fmt
    shift = fmt["shift"]
    half, mask = 1 << (shift - 1), (1 << shift) - 1
    width = tau * 2.0**shift
    sub_ulp = fmt["min_normal"] * 2.0 ** -fmt["target_mantissa"]
    fmax = torch.finfo(policy.target).max
    bits = flat.view(fmt["int_dtype"])
    found = []
    for start in range(0, flat.numel(), _CHUNK):
        chunk, cbits = flat[start:start + _CHUNK], bits[start:start + _CHUNK]
        low = torch.bitwise_and(cbits, mask)
        near = low.sub_(half).abs_() < width
        tiny = chunk.abs() < fmt["min_normal"]
        if bool(tiny.any()):
            pos = chunk[tiny] / sub_ulp
            near[tiny] = (pos - torch.floor(pos) - 0.5).abs() < tau
        idx = near.nonzero().squeeze(1)
        if idx.numel():
            idx = idx[chunk[idx].abs() <= fmax]  # drops NaN, inf and target overflow
            found.append(idx + start)
    return torch.cat(found) if found else torch.zeros(0, dtype=torch.int64, device=flat.device)


@dataclass
class Run:
    roles: list[str]
    seconds: dict[str, list[float]] = field(default_factory=dict)
    losses: dict[str, list[float]] = field(default_factory=dict)
    log_bytes: list[int] = field(default_factory=list)
    entries: list[int] = field(default_factory=list)
    directions: list[int] = field(default_factory=list)
    values: list[int] = field(default_factory=list)
    elements: list[int] = field(default_factory=list)
    old_band: list[int] = field(default_factory=list)
    old_band_any_op: list[int] = field(default_factory=list)
    count_seconds: list[float] = field(default_factory=list)
    replay_ok: dict[str, list[bool]] = field(default_factory=dict)
    replay_error: dict[str, str | None] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    rss_setup_mib: float = 0.0
    rss_live_setup_mib: float = 0.0
    rss_peak_mib: float = 0.0
    rss_per_role_mib: dict[str, float] = field(default_factory=dict)
    cuda_per_role_mib: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for role in self.roles:
            self.seconds.setdefault(role, [])
            self.losses.setdefault(role, [])


def _rss_mib(key: str = "VmHWM") -> float:
    """This process's peak resident set so far, MiB: VmHWM where Linux has it (ru_maxrss there
    survives fork and exec, so a child would report its parent's peak), else ru_maxrss (KiB on
    Linux, bytes on macOS). key="VmRSS": the resident set now (0 without /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    if key != "VmHWM":
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def state_in(state: dict, dtype: torch.dtype) -> dict:
    """`state` with its floating tensors in `dtype` (exact widening of S_0 for plain64)."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def replay_profiles(names: list[str]) -> tuple[dict[str, Profile], dict[str, str]]:
    """The replay profiles that parse here, and why each other one is skipped."""
    ok, skipped = {}, {}
    for name in names:
        try:
            profile = Profile.parse(name)
            profile.check_runnable()
            ok[name] = profile
        except OvtError as err:
            skipped[name] = str(err)
    return ok, skipped


def build(preset: str, role: str, profile: Profile, policy: PrecisionPolicy, seed: int
          ) -> Executor:
    mode = "ovt" if role.startswith("replay:") else MODE_OF[role]
    return Executor(load_program(PROGRAM, preset=preset), seed=seed, policy=policy,
                    profile=profile, mode=mode)


def run(preset: str, steps: int, warmup: int, seed: int, init_seed: int, policy: PrecisionPolicy,
        profile: Profile, replays: dict[str, Profile], skipped: dict[str, str],
        low_memory: bool = False, progress=None) -> tuple[Run, dict, RoundingLog | None]:
    """Run every role interleaved for `steps` steps (with `low_memory`, the ovt roles first,
    then the plain ones, each phase's executors freed before the next). Returns the run, S_0
    and L_1."""
    ovt_roles = ["record", *(f"replay:{n}" for n in replays)]
    roles = [*ovt_roles, *PLAIN]
    profiles = {"record": profile, "plain32": profile, "plain64": profile,
                **{f"replay:{n}": p for n, p in replays.items()}}
    out = Run(roles, skipped=dict(skipped))
    out.replay_ok = {n: [] for n in replays}
    out.replay_error = {n: None for n in replays}
    s0: dict = {}
    first_log = None
    for phase in ([ovt_roles, list(PLAIN)] if low_memory else [roles]):
        execs = {role: build(preset, role, profiles[role], policy, seed) for role in phase}
        fresh = not s0
        if fresh:  # the first phase has the record role: it makes S_0
            execs["record"].init_state(init_seed)
            s0 = execs["record"].state()
        for role, ex in execs.items():
            if not (fresh and role == "record"):
                ex.load_state(state_in(s0, ex.dtype))
        out.rss_setup_mib = max(out.rss_setup_mib, _rss_mib())
        out.rss_live_setup_mib = max(out.rss_live_setup_mib, _rss_mib("VmRSS"))
        for t in range(1, steps + 1):
            log = _one_step(execs, t, steps, warmup, policy, out, progress)
            if first_log is None:
                first_log = log
        del execs
        gc.collect()
    out.rss_peak_mib = _rss_mib()
    return out, s0, first_log


def _one_step(execs: dict[str, Executor], t: int, steps: int, warmup: int,
              policy: PrecisionPolicy, out: Run, progress) -> RoundingLog | None:
    """Step t of every role in `execs`, in role order; record's log feeds the replays."""
    keep = t > warmup or steps <= warmup
    secs: dict[str, float] = {}
    losses: dict[str, float] = {}
    log, data, counter, record_hash = None, b"", None, b""
    if "record" in execs:
        counter = OldBandCounter(SiteRecorder(policy), policy)
        rec = execs["record"].step(rounder=counter)
        start = time.perf_counter()  # (the executor times a recorder's log, not a wrapper's)
        log = counter.inner.log()
        decided = time.perf_counter() - start
        data = encode_log(log)
        record_hash = state_digest(execs["record"].state())
        secs["record"], losses["record"] = rec.seconds - counter.seconds + decided, rec.loss
    for role, ex in execs.items():
        if role.startswith("replay:"):
            name = role.removeprefix("replay:")
            if out.replay_error[name] is not None:
                continue  # this replay already failed: later steps would only compound it
            try:
                res = ex.step(log)
            except OvtError as err:
                out.replay_ok[name].append(False)
                out.replay_error[name] = f"step {t}: {type(err).__name__}: {err}"
                continue
            same = state_digest(ex.state()) == record_hash
            out.replay_ok[name].append(same)
            secs[role], losses[role] = res.seconds, res.loss
            if not same:
                out.replay_error[name] = f"step {t}: state hash differs from the record's"
        elif role in PLAIN:
            res = ex.step()
            secs[role], losses[role] = res.seconds, res.loss
    if keep:
        for role, sec in secs.items():
            out.seconds[role].append(sec)
            out.losses[role].append(losses[role])
        if log is not None and counter is not None:
            out.log_bytes.append(len(data))
            out.entries.append(log.n_entries)
            out.directions.append(getattr(log, "n_directions", log.n_entries))
            out.values.append(getattr(log, "n_values", 0))
            out.elements.append(log.n_elements)
            out.old_band.append(counter.general)
            out.old_band_any_op.append(counter.any_op)
            out.count_seconds.append(counter.seconds)
    if progress:
        checks = {n: ok[-1] for n, ok in out.replay_ok.items()
                  if ok and f"replay:{n}" in execs}
        progress(t, steps, secs, checks, len(data) if log is not None else None,
                 log.n_entries if log is not None else None)
    return log


def summarize(r: Run, replays: list[str]) -> dict:
    med = {role: _median(r.seconds[role]) for role in r.roles}
    elements = _median(r.elements)
    log_bytes = _median(r.log_bytes)

    def ratio(a: str, b: str) -> float:
        return med[a] / med[b] if med[b] else float("nan")

    out: dict = {
        "steps_timed": len(r.seconds["record"]),
        "median_step_s": med,
        "plain64_over_plain32": ratio("plain64", "plain32"),
        "record_over_plain32": ratio("record", "plain32"),
        "record_over_plain64": ratio("record", "plain64"),
        "log_bytes_per_step": log_bytes,
        "log_bytes_per_step_max": max(r.log_bytes) if r.log_bytes else None,
        "entries_per_step": _median(r.entries),
        "direction_entries_per_step": _median(r.directions),
        "value_entries_per_step": _median(r.values),
        "elements_per_step": elements,
        "bytes_per_element": log_bytes / elements if elements else 0.0,
        "entries_fraction": _median(r.entries) / elements if elements else 0.0,
        "old_band_tau": OLD_TAU,
        "old_band_elements_per_step": _median(r.old_band),
        "old_band_elements_per_step_any_op": _median(r.old_band_any_op),
        "old_band_fraction": _median(r.old_band) / elements if elements else 0.0,
        "old_band_count_s_per_step": _median(r.count_seconds),
        "replays": {},
        "skipped_replays": r.skipped,
        "rss_setup_mib": r.rss_setup_mib,
        "rss_live_setup_mib": r.rss_live_setup_mib,
        "rss_peak_mib": r.rss_peak_mib,
        "rss_per_role_mib": r.rss_per_role_mib,
        "cuda_per_role_mib": r.cuda_per_role_mib,
        "final_loss": {role: r.losses[role][-1] if r.losses[role] else None
                       for role in r.roles},
    }
    for name in replays:
        role = f"replay:{name}"
        ok = r.replay_ok.get(name, [])
        out["replays"][name] = {
            "bit_exact": bool(ok) and all(ok) and r.replay_error.get(name) is None,
            "steps_checked": len(ok),
            "error": r.replay_error.get(name),
            "median_step_s": med.get(role),
            "over_plain32": ratio(role, "plain32") if r.seconds.get(role) else None,
            "over_record": ratio(role, "record") if r.seconds.get(role) else None,
        }
    return out


# --- per-role peak memory, one subprocess per role -----------------------------------------

def memory_per_role(args, roles: list[str], s0: dict, log: RoundingLog | None
                    ) -> tuple[dict[str, float], dict[str, float]]:
    """Each role's peak resident set (MiB), and its peak of CUDA memory allocated where its
    profile runs on CUDA, each measured in its own subprocess."""
    with tempfile.TemporaryDirectory(prefix="ovt-bench-scale-") as tmp:
        s0_path, log_path = Path(tmp) / "s0.ovts", Path(tmp) / "l1.ovtl"
        s0_path.write_bytes(encode_state(s0))
        if log is not None:
            log_path.write_bytes(encode_log(log))
        peaks, cuda_peaks = {}, {}
        for role in roles:
            cmd = [sys.executable, __file__, "--_memory-probe", role, "--preset", args.preset,
                   "--threads", str(args.threads), "--device", args.device,
                   "--policy", args.policy, "--seed",
                   str(args.seed), "--_s0", str(s0_path), "--_log", str(log_path),
                   *(["--malloc-defaults"] if args.malloc_defaults else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                peaks[role] = float("nan")
                print(f"warning: memory probe for {role} failed: {proc.stderr.strip()[-500:]}",
                      file=sys.stderr)
                continue
            probe = json.loads(proc.stdout.strip().splitlines()[-1])
            peaks[role] = probe["peak_mib"]
            if probe["cuda_peak_mib"] is not None:
                cuda_peaks[role] = probe["cuda_peak_mib"]
    return peaks, cuda_peaks


def memory_probe(args) -> int:
    """One role, one step from S_0 in this fresh process; print its peak RSS (and its peak of
    CUDA memory allocated, null off CUDA) as JSON."""
    role = args._memory_probe
    policy = PrecisionPolicy.parse(args.policy)
    profile = Profile.parse(role.removeprefix("replay:")) if role.startswith("replay:") \
        else plain_profile(args.device, args.threads)
    torch.set_num_threads(args.threads)
    ex = build(args.preset, role, profile, policy, args.seed)
    ex.load_state(state_in(decode_state(Path(args._s0).read_bytes()), ex.dtype))
    if role.startswith("replay:"):
        ex.step(decode_log(Path(args._log).read_bytes()))
    else:
        ex.step()
    # (the allocator's own count, kept as ops are queued; the step ends synchronized anyway)
    cuda_peak = torch.cuda.max_memory_allocated(profile.device) / 2**20 \
        if profile.device.startswith("cuda") else None
    print(json.dumps({"role": role, "peak_mib": _rss_mib(), "cuda_peak_mib": cuda_peak}))
    return 0


# --- output ----------------------------------------------------------------------------------

def _fmt_bytes(n: float) -> str:
    for unit, k in (("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def print_report(s: dict, meta: dict) -> None:
    print()
    print(f"ovt at scale — {meta['program']} preset {meta['preset']} ({meta['params']:,} "
          f"parameters), {meta['steps']} steps, medians over {s['steps_timed']} "
          f"(first {meta['warmup']} not timed)")
    print(f"record profile {meta['profile']}; policy {meta['policy']}; torch {meta['torch']}, "
          f"{meta['cpu_capability']}, {meta['machine']}; malloc: {meta['malloc']}")
    print()
    print("Replays (state hash equal to the record's after every step):")
    for name, rep in s["replays"].items():
        verdict = "yes" if rep["bit_exact"] else "NO"
        extra = f" — {rep['error']}" if rep["error"] else ""
        print(f"  bit-exact under {name:<14} {verdict} ({rep['steps_checked']} steps){extra}")
    for name, why in s["skipped_replays"].items():
        print(f"  {name:<30} skipped: {why}")
    print()
    print("Log, per recorded step (median):")
    print(f"  log bytes / step                {_fmt_bytes(s['log_bytes_per_step'])}"
          f"  (max {_fmt_bytes(s['log_bytes_per_step_max'] or 0)})")
    print(f"  rounded elements / step         {s['elements_per_step']:,.0f}")
    print(f"  log entries / step              {s['entries_per_step']:,.0f}  "
          f"({s['direction_entries_per_step']:,.0f} directions, "
          f"{s['value_entries_per_step']:,.0f} values; "
          f"{s['entries_fraction'] * 100:.4f} % of elements)")
    print(f"  log bytes / rounded element     {s['bytes_per_element']:.6f}")
    print(f"  old fixed band, tau = 2^-8 ULP  {s['old_band_elements_per_step']:,.0f} elements "
          f"/ step within tau of a boundary ({s['old_band_fraction'] * 100:.4f} %; "
          f"{s['old_band_elements_per_step_any_op']:,.0f} counting IEEE ops too)")
    print()
    med = s["median_step_s"]
    print("Step time (median, seconds):")
    for role, sec in med.items():
        print(f"  {role:<22} {sec:10.3f}")
    print(f"  plain64 / plain32      {s['plain64_over_plain32']:10.2f}x")
    print(f"  record / plain32       {s['record_over_plain32']:10.2f}x")
    print(f"  record / plain64       {s['record_over_plain64']:10.2f}x")
    for name, rep in s["replays"].items():
        if rep["over_plain32"] is not None:
            print(f"  replay:{name} / plain32 {rep['over_plain32']:8.2f}x   "
                  f"/ record {rep['over_record']:.2f}x")
    print(f"  (record excludes the old-band counting, {s['old_band_count_s_per_step']:.3f} s "
          f"/ step)")
    print()
    together = "one phase's roles at a time" if meta["low_memory"] else "every role together"
    print(f"Memory of this process, {together}: peak (VmHWM) {s['rss_peak_mib']:,.0f} MiB; "
          f"{s['rss_live_setup_mib']:,.0f} MiB resident once the executors and S_0 were built "
          f"(peak by then {s['rss_setup_mib']:,.0f} MiB, S_0's portable init included)")
    for role, mib in s["rss_per_role_mib"].items():
        cuda = s["cuda_per_role_mib"].get(role)
        on_cuda = f", CUDA peak {cuda:,.0f} MiB allocated" if cuda is not None else ""
        print(f"  {role:<22} {mib:10,.0f} MiB  (own process, step 1 alone{on_cuda})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2-small-2l", choices=list(token_lm.PRESETS))
    p.add_argument("--full", action="store_true", help="preset gpt2-small (12 layers)")
    p.add_argument("--steps", type=int, default=10, help="recorded steps (default 10)")
    p.add_argument("--warmup", type=int, default=1,
                   help="first steps left out of the medians (still replayed and checked)")
    p.add_argument("--threads", type=int, default=2,
                   help="intra-op threads; on the CPU the record profile is cpu-<N>t (default 2)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="device of the record and plain roles (default cpu: profile "
                        "cpu-<threads>t; cuda: profile cuda)")
    p.add_argument("--replay-profiles", default=",".join(DEFAULT_REPLAYS),
                   help=f"comma-separated (default {','.join(DEFAULT_REPLAYS)})")
    p.add_argument("--policy", default="float64->float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-seed", type=int, default=0)
    p.add_argument("--low-memory", action="store_true",
                   help="run the ovt roles first, then the plain ones (not interleaved), "
                        "holding one phase's executors at a time (for --full on <= 32 GB)")
    p.add_argument("--memory", action="store_true",
                   help="also measure each role's peak RSS in its own subprocess")
    p.add_argument("--json", metavar="FILE", help="write the numbers as JSON")
    p.add_argument("--quiet", action="store_true", help="no per-step progress on stderr")
    p.add_argument("--malloc-defaults", action="store_true",
                   help="leave glibc's malloc thresholds as they are; by default the benchmark "
                        "keeps freed memory for reuse as ovt's own processes do "
                        "(protocol/engine/allocator.py), for every role alike")
    p.add_argument("--_memory-probe", help=argparse.SUPPRESS)
    p.add_argument("--_s0", help=argparse.SUPPRESS)
    p.add_argument("--_log", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.full:
        args.preset = "gpt2-small"
    kept = None if args.malloc_defaults else allocator.keep_freed_memory()
    if args._memory_probe:
        return memory_probe(args)
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        p.error("--steps must be >= 1, --warmup >= 0, --threads >= 1")

    torch.set_num_threads(args.threads)
    policy = PrecisionPolicy.parse(args.policy)
    profile = plain_profile(args.device, args.threads)
    try:
        profile.check_runnable()
    except OvtError as err:
        p.error(str(err))
    names = [n.strip() for n in args.replay_profiles.split(",") if n.strip()]
    replays, skipped = replay_profiles(names)
    for name, why in skipped.items():
        print(f"note: replay profile {name!r} is not available, skipping it: {why}",
              file=sys.stderr)

    def progress(t, total, secs, same, nbytes, entries):
        if not args.quiet:
            cells = " ".join(f"{r} {s:.2f}s" for r, s in secs.items())
            checks = " ".join(f"{n} {'ok' if ok else 'DIFF'}" for n, ok in same.items())
            logged = f" | log {nbytes:,} B, {entries:,} entries" if nbytes is not None else ""
            print(f"  step {t:>3}/{total}: {cells}{logged}{' | ' if checks else ''}{checks}",
                  file=sys.stderr, flush=True)

    meta = {
        "program": PROGRAM, "preset": args.preset,
        "params": parameter_count(PROGRAM, token_lm.PRESETS[args.preset]),
        "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
        "low_memory": args.low_memory,
        "profile": profile.describe(), "replay_profiles": names, "policy": policy.name,
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus" + (
            f", {torch.cuda.get_device_name()}" if args.device == "cuda" else ""),
        "malloc": allocator.describe(kept),
        "loadavg_start": os.getloadavg()[0],
    }
    started = time.perf_counter()
    result, s0, first_log = run(args.preset, args.steps, args.warmup, args.seed, args.init_seed,
                                policy, profile, replays, skipped, args.low_memory, progress)
    if args.memory:
        result.rss_per_role_mib, result.cuda_per_role_mib = memory_per_role(
            args, result.roles, s0, first_log)
    meta["wall_s"] = time.perf_counter() - started
    meta["loadavg_end"] = os.getloadavg()[0]
    summary = summarize(result, list(replays))
    sys.stderr.flush()
    print_report(summary, meta)
    print(f"(wall time {meta['wall_s']:.1f} s; 1-min load average {meta['loadavg_start']:.2f} "
          f"at start, {meta['loadavg_end']:.2f} at end on {os.cpu_count()} cpus)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary,
                       "seconds_per_step": result.seconds, "log_bytes": result.log_bytes,
                       "old_band": result.old_band}, f, indent=2)
    return 0 if all(r["bit_exact"] for r in summary["replays"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
