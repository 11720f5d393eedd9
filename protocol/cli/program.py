"""`ovt program check REF`: the first command to run on your own model.

It builds the program, sets S_0, records one step under the trainer's profile and replays it
under the auditor's, and reports what ovt does with the program: each op that became a
rounding site (how often, how many elements, how many logged), the log's size, the steps'
times, whether the replay was bit-exact — and, where the program does something a step may
not do (an op without a bound rule or decomposition, a device random number generator ovt
cannot serve, a model the portable init does not know), that refusal, in the words of the
error a job would stop with.

Exit codes: 0 the step recorded and replayed bit-exactly; 1 it was refused or not bit-exact;
2 a usage error (no such program, a bad config). One step on one machine shows what ovt makes
of the program; it cannot show what differs only on other hardware or later steps.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass, field

from protocol.cli.commands import config_item
from protocol.codec.roundinglog import encode_log
from protocol.codec.state import state_digest
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import BUILTIN, load_program
from protocol.engine.rounding import SiteRecorder
from protocol.errors import ConfigError, DeterminismError, OvtError, ProgramError

EXIT_OK, EXIT_REFUSED = 0, 1


def add_commands(sub) -> None:
    program = sub.add_parser("program", help="check a training program (your own model) "
                                             "before you make a job of it")
    programs = program.add_subparsers(dest="program_command", metavar="PROGRAM_COMMAND",
                                      required=True)
    check = programs.add_parser("check", help="record and replay one step; report ops, sites, "
                                              "log size and anything refused",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("ref", metavar="REF",
                       help=f"built-in ({', '.join(BUILTIN)}), package.module:function or "
                            f"path/to/file.py:function")
    check.add_argument("--preset", default=None, help="a preset from the program's PRESETS")
    check.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override one config field (value parsed as JSON if it can be)")
    check.add_argument("--micro-batches", type=int, default=1,
                       help="micro-batches per batch (default: %(default)s)")
    check.add_argument("--trainer-profile", default="cpu-2t", help="default: %(default)s")
    check.add_argument("--auditor-profile", default="adversary", help="default: %(default)s")
    check.add_argument("--policy", default="float64->float32",
                       help="compute->target dtypes (default: %(default)s)")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(run=_check)


class _TallyingRecorder(SiteRecorder):
    """A recorder that also names the op of each site, for counts per op (`tally`)."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        super().__init__(policy)
        self.ops: list[str] = []

    def round_site(self, op, ys, bounds):
        out = super().round_site(op, ys, bounds)
        self.ops.append(op)
        return out

    def round_site_in_parts(self, op, numel, results) -> None:
        super().round_site_in_parts(op, numel, results)
        self.ops.append(op)

    def round_result_in_place(self, op, y, bound):
        out = super().round_result_in_place(op, y, bound)
        self.ops.append(op)
        return out

    def claim_exact_site(self, op: str, numel: int) -> bool:
        self.ops.append(op)
        return super().claim_exact_site(op, numel)

    def tally(self) -> tuple[Counter[str], Counter[str], Counter[str]]:
        """Sites, rounded elements and logged entries per op, over the sites rounded so far."""
        sites: Counter[str] = Counter()
        elements: Counter[str] = Counter()
        entries: Counter[str] = Counter()
        for op, site in zip(self.ops, self.sites, strict=True):
            sites[op] += 1
            elements[op] += site.numel
            entries[op] += site.indices.size + site.value_indices.size
        return sites, elements, entries


@dataclass
class CheckReport:
    program: str
    parameters: int = 0
    batch_size: int = 0
    examples: int = 0
    ops: list[dict] = field(default_factory=list)
    sites: int = 0
    elements: int = 0
    entries: int = 0
    log_bytes: int = 0
    record_s: float = 0.0
    replay_s: float = 0.0
    bit_exact: bool = False
    refused: str | None = None
    failed: str | None = None  # the step ran but record and replay did not agree


def check_program(ref: str, config: dict, preset: str | None, *, micro_batches: int,
                  trainer: Profile, auditor: Profile, policy: PrecisionPolicy) -> CheckReport:
    """Record step 1 of `ref` under `trainer`, replay it under `auditor`, and report.

    A refusal (DeterminismError, ProgramError) is the report's `refused`, not an exception.
    Raises ConfigError or ProgramError where the program cannot be built at all.
    """
    program = load_program(ref, config, preset)
    report = CheckReport(ref, parameters=sum(p.numel() for p in program.model.parameters()),
                         batch_size=program.batch_size, examples=len(program.dataset))
    recorder = _TallyingRecorder(policy)
    try:
        ex = Executor(program, seed=0, policy=policy, profile=trainer,
                      micro_batches=micro_batches)
        ex.init_state(1)
        state0 = ex.state()
        start = time.perf_counter()
        log = ex.step(rounder=recorder).log
        report.record_s = time.perf_counter() - start
        assert log is not None
        state1 = state_digest(ex.state())
        replay = Executor(load_program(ref, config, preset), seed=0, policy=policy,
                          profile=auditor, micro_batches=micro_batches)
        replay.load_state(state0)
        start = time.perf_counter()
        replay.step(log)
        report.replay_s = time.perf_counter() - start
        report.bit_exact = state_digest(replay.state()) == state1
    except (DeterminismError, ProgramError) as err:
        report.refused = str(err)
    except OvtError as err:  # a replay that rejects the log, a state that does not fit: a fault
        report.failed = str(err)
    sites, elements, entries = recorder.tally()
    report.ops = [{"op": op, "sites": sites[op], "elements": elements[op],
                   "entries": entries[op]} for op in sorted(sites, key=lambda o: -elements[o])]
    report.sites, report.elements, report.entries = (
        sum(sites.values()), sum(elements.values()), sum(entries.values()))
    report.log_bytes = len(encode_log(recorder.log())) if report.refused is None else 0
    if report.failed is not None:
        report.bit_exact = False
    return report


def _check(args) -> int:
    if args.micro_batches < 1:
        raise ConfigError("--micro-batches must be at least 1")
    report = check_program(args.ref, dict(config_item(item) for item in args.set), args.preset,
                           micro_batches=args.micro_batches,
                           trainer=Profile.parse(args.trainer_profile),
                           auditor=Profile.parse(args.auditor_profile),
                           policy=PrecisionPolicy.parse(args.policy))
    if args.json:
        print(json.dumps(report.__dict__, indent=2))
    else:
        _print(report, args)
    return EXIT_OK if report.refused is None and report.bit_exact else EXIT_REFUSED


def _print(report: CheckReport, args) -> None:
    print(f"ovt program check: {report.program}: {report.parameters:,} parameters, batch "
          f"{report.batch_size}, {report.examples:,} examples")
    if report.ops:
        print(f"  {'op':40} {'sites':>6} {'elements':>11} {'logged':>8}")
        for row in report.ops:
            print(f"  {row['op']:40} {row['sites']:>6} {row['elements']:>11,} "
                  f"{row['entries']:>8}")
    if report.refused is not None:
        print(f"REFUSED after {report.sites} sites: {report.refused}")
        return
    dense = report.elements / 5
    print(f"step 1: {report.sites} sites, {report.elements:,} rounded elements, "
          f"{report.entries} logged ({100 * report.entries / max(report.elements, 1):.3f}%); "
          f"log {report.log_bytes:,} B ({report.log_bytes / max(dense, 1):.4f} of dense "
          f"ternary)")
    print(f"time: record {report.record_s * 1e3:.0f} ms ({args.trainer_profile}), replay "
          f"{report.replay_s * 1e3:.0f} ms ({args.auditor_profile})")
    if report.failed is not None:
        print(f"result: NOT bit-exact — the replay stopped: {report.failed}")
    else:
        print("result: BIT-EXACT replay" if report.bit_exact
              else "result: NOT bit-exact — please report this: the rules should make it so")
