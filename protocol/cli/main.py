"""The `ovt` command line.

Exit codes: 0 success (for replay-check: bit-exact), 1 the check ran and the replay was not
bit-exact, 2 a usage or input error (explained in one line, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from protocol.cli import job as jobcli
from protocol.cli import program as programcli
from protocol.cli.commands import config_item, run_command
from protocol.engine import profiles
from protocol.engine.dataparallel import require_world
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.programs.registry import BUILTIN, load_program
from protocol.engine.replaycheck import CheckResult, SideSpec, replay_check
from protocol.errors import ConfigError, OvtError

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE = 0, 1, 2

_REPLAY_CHECK_HELP = """\
Train N steps under the trainer's hardware profile, replay them under the auditor's profile,
and compare the state hash h_t after every step.

In --mode ovt (default) every floating-point op is computed in the policy's compute dtype and
rounded to the target dtype; each element gets a certified error bound e from its op's rule,
the trainer logs the elements within 2e of a rounding boundary, and the auditor replays with
that log, so the two agree bit for bit. In --mode plain both train in ordinary float32, which
shows what hardware nondeterminism does without ovt.

Profiles (presets): {presets}; or key=value pairs, e.g.
'threads=1,splitk=7,chunks=5,order=pairwise', 'adversary=1', 'device=cuda'. The adversary moves
every result by its proven bound toward the nearest rounding boundary: the worst any machine
within the rules could do.

The report lists per-step hash equality, the first divergent step, log sizes, the elements per
step inside the band (the trainer's freedom), timings and, for the probed steps, the largest
divergence per op as a fraction of its bound (at most 1 on conforming hardware).
""".format(presets=", ".join(profiles.PRESETS))


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    return run_command("ovt", args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ovt", description="Optimistic verifiable training: bit-exact replay of PyTorch "
                                "training across hardware.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    rc = sub.add_parser("replay-check", help="train under one profile, replay under another",
                        description=_REPLAY_CHECK_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    rc.add_argument("--program", default="char-transformer",
                    help=f"built-in ({', '.join(BUILTIN)}), package.module:function or "
                         f"path/to/file.py:function (default: %(default)s)")
    rc.add_argument("--preset", default=None,
                    help="size preset from the program's PRESETS, e.g. a built-in's test or "
                         "bench (default: none, the program's own defaults; a built-in's "
                         "defaults are its test preset)")
    rc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override one program config field (value parsed as JSON if it can be)")
    rc.add_argument("--steps", type=int, default=50, help="training steps (default: %(default)s)")
    rc.add_argument("--trainer-profile", default="cpu-2t", help="default: %(default)s")
    rc.add_argument("--auditor-profile", default="emulated-gpu", help="default: %(default)s")
    rc.add_argument("--mode", choices=("ovt", "plain"), default="ovt",
                    help="ovt: rounded training with logs; plain: ordinary float32 (default: ovt)")
    rc.add_argument("--policy", default="float64->float32",
                    help="compute->target dtypes: float64->float32 or float32->bfloat16")
    rc.add_argument("--micro-batches", type=int, default=1,
                    help="split each batch into this many micro-batches whose gradients are "
                         "summed (default: %(default)s)")
    rc.add_argument("--trainer-workers", type=int, default=1, metavar="W",
                    help="processes computing the trainer's micro-batches, gloo over 127.0.0.1 "
                         "(at most --micro-batches; default: %(default)s)")
    rc.add_argument("--auditor-workers", type=int, default=1, metavar="W",
                    help="processes computing the auditor's micro-batches (default: "
                         "%(default)s)")
    rc.add_argument("--seed", type=int, default=0, help="job seed: data order, dropout")
    rc.add_argument("--init-seed", type=int, default=1, help="seed of the initial state S_0")
    rc.add_argument("--probe-steps", default="1",
                    help="comma list of steps whose per-op divergence is measured, or 'none'")
    rc.add_argument("--run-dir", type=Path, default=None,
                    help="keep S_0, logs and per-side results here (default: a temp dir)")
    rc.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    rc.set_defaults(run=_replay_check)
    jobcli.add_commands(sub)
    programcli.add_commands(sub)
    return parser


def _replay_check(args) -> int:
    if args.steps < 1:
        raise ConfigError("--steps must be at least 1")
    if args.micro_batches < 1:
        raise ConfigError("--micro-batches must be at least 1")
    for option, workers in (("--trainer-workers", args.trainer_workers),
                            ("--auditor-workers", args.auditor_workers)):
        require_world(workers, args.micro_batches, option)
        if workers > 1 and args.mode != "ovt":
            raise ConfigError(f"{option} needs --mode ovt")
    policy = PrecisionPolicy.parse(args.policy)
    trainer_profile = profiles.Profile.parse(args.trainer_profile)
    auditor_profile = profiles.Profile.parse(args.auditor_profile)
    probe = _probe_steps(args.probe_steps, args.steps)
    if probe and max(args.trainer_workers, args.auditor_workers) > 1:
        if args.probe_steps != "1":  # asked for, not the default
            raise ConfigError("the divergence probe runs in one process: --probe-steps needs "
                              "--trainer-workers 1 and --auditor-workers 1")
        probe = ()
    config = dict(config_item(item) for item in args.set)
    load_program(args.program, config, args.preset)  # bad program or config: fail before running
    with tempfile.TemporaryDirectory(prefix="ovt-replay-check-") as tmp:
        run_dir = str(args.run_dir or tmp)
        common = dict(program=args.program, preset=args.preset, config=config, seed=args.seed,
                      init_seed=args.init_seed, steps=args.steps, policy=args.policy,
                      mode=args.mode, probe_steps=probe, run_dir=run_dir,
                      micro_batches=args.micro_batches)
        trainer = SideSpec(role="trainer", profile=args.trainer_profile,
                           workers=args.trainer_workers, **common)
        auditor = SideSpec(role="auditor", profile=args.auditor_profile,
                           workers=args.auditor_workers, **common)
        result = replay_check(trainer, auditor, None if args.json else _Progress(args.steps))
    if args.json:
        print(json.dumps(_json_report(args, policy, trainer_profile, auditor_profile, result),
                         indent=2))
    else:
        _print_report(args, policy, trainer_profile, auditor_profile, result)
    if result.trainer.error:
        raise OvtError(f"trainer failed: {result.trainer.error}")
    return EXIT_OK if result.bit_exact else EXIT_DIVERGED


def _probe_steps(text: str, steps: int) -> tuple[int, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        chosen = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        raise ConfigError(f"--probe-steps must be a comma list of step numbers, got {text!r}") \
            from None
    if any(not 1 <= s <= steps for s in chosen):
        raise ConfigError(f"--probe-steps must lie in 1..{steps}")
    return chosen


class _Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.enabled = steps, sys.stderr.isatty()

    def __call__(self, phase: str, step: int) -> None:
        if not self.enabled:
            return
        done = int(30 * step / self.steps)
        end = "\n" if step == self.steps else ""
        print(f"\r{phase:6s} [{'#' * done}{'.' * (30 - done)}] {step}/{self.steps}", end=end,
              file=sys.stderr, flush=True)


def _json_report(args, policy, tp, ap, result: CheckResult) -> dict:
    t, a = result.trainer, result.auditor
    steps = []
    for k in range(1, len(t.hashes)):
        steps.append({
            "step": k, "trainer_hash": t.hashes[k],
            "auditor_hash": a.hashes[k] if k < len(a.hashes) else None,
            "equal": k < len(a.hashes) and a.hashes[k] == t.hashes[k],
            "loss": t.losses[k - 1], "trainer_s": t.seconds[k - 1],
            "auditor_s": a.seconds[k - 1] if k - 1 < len(a.seconds) else None,
            "log_bytes": t.log_bytes[k - 1] if t.log_bytes else None,
            "log_entries": t.entries[k - 1] if t.entries else None,
            "rounded_elements": t.elements[k - 1] if t.elements else None,
        })
    return {
        "program": args.program, "preset": args.preset, "mode": args.mode,
        "policy": policy.name, "bound_rules": policy.rules,
        "trainer_profile": {"name": tp.name, "describe": tp.describe()},
        "auditor_profile": {"name": ap.name, "describe": ap.describe()},
        "initial_hash": t.hashes[0] if t.hashes else None,
        **result.summary(), "steps": steps, "divergence": a.divergence,
    }


def _print_report(args, policy, tp, ap, result: CheckResult) -> None:
    t, a = result.trainer, result.auditor
    preset = f"preset {args.preset}" if args.preset else "its default config"
    print(f"ovt replay-check: {args.program} ({preset}), {args.steps} steps, mode {args.mode}"
          + (f", {args.micro_batches} micro-batches" if args.micro_batches > 1 else "")
          + (f", {args.trainer_workers} trainer / {args.auditor_workers} auditor processes"
             if max(args.trainer_workers, args.auditor_workers) > 1 else ""))
    if args.mode == "ovt":
        print(f"  policy {policy.name}, certified bands (bound rules v{policy.rules})")
    print(f"  trainer profile {tp.name} ({tp.describe()}); auditor profile {ap.name} "
          f"({ap.describe()})")
    print(f"  {'step':>5} {'trainer h_t':16} {'auditor h_t':16} {'equal':5} {'log B':>7} "
          f"{'entries':>8} {'train ms':>8} {'replay ms':>9}")
    for k in range(1, len(t.hashes)):
        ah = a.hashes[k] if k < len(a.hashes) else "-"
        equal = "yes" if ah == t.hashes[k] else "NO"
        log_b = t.log_bytes[k - 1] if t.log_bytes else "-"
        entries = t.entries[k - 1] if t.entries else "-"
        replay_ms = f"{a.seconds[k - 1] * 1e3:.1f}" if k - 1 < len(a.seconds) else "-"
        print(f"  {k:>5} {t.hashes[k][:16]} {ah[:16]:16} {equal:5} {log_b:>7} {entries:>8} "
              f"{t.seconds[k - 1] * 1e3:>8.1f} {replay_ms:>9}")
    _print_summary(args, policy, result)


def _print_summary(args, policy, result: CheckResult) -> None:
    t, a, s = result.trainer, result.auditor, result.summary()
    if result.bit_exact:
        print(f"result: BIT-EXACT — all {result.steps} state hashes equal")
    else:
        print(f"result: NOT bit-exact — first divergent step: {s['first_divergent_step']}")
    for who, err in (("trainer", t.error), ("auditor", a.error)):
        if err:
            print(f"  {who} stopped: {err}")
    if t.log_bytes:
        elements = s["elements_per_step"]
        dense = elements / 5  # ternary digits packed 5 per byte: 1.6 bits per element
        print(f"log: median {s['median_log_bytes']:.0f} B/step, {s['median_entries']:.0f} "
              f"entries of {elements} rounded elements "
              f"({100 * s['median_entries'] / elements:.4f}%, at most {s['max_entries']} in a "
              f"step: the trainer's freedom); dense ternary would be {dense:.0f} B: ratio "
              f"{s['median_log_bytes'] / dense:.5f}")
    if t.seconds and a.seconds:
        print(f"time: median step {1e3 * s['median_trainer_step_s']:.1f} ms trainer, "
              f"{1e3 * s['median_auditor_step_s']:.1f} ms auditor")
    if a.divergence:
        print(f"divergence between the profiles, per op (probed steps {args.probe_steps}), "
              f"as a fraction of the certified bound e (conforming hardware: at most 1; the "
              f"adversary, which adds its proven bound on top, up to 1.5; the band absorbs 2):")
        rows = sorted(a.divergence.items(), key=lambda kv: -kv[1]["max_fraction_of_bound"])
        for op, d in rows:
            zero = f", {d['zero_bound_rounded_apart']} with bound 0 round apart (UNSOUND)" \
                if d["zero_bound_rounded_apart"] else ""
            print(f"  {op:44} max {d['max_fraction_of_bound']:.3g} of e "
                  f"({d['differing']}/{d['elements']} differ){zero}")
        worst = max(d["max_fraction_of_bound"] for d in a.divergence.values())
        print(f"  worst: {worst:.3g} of e")


if __name__ == "__main__":
    sys.exit(main())
