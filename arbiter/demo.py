"""`ovt-arbiter demo`: the whole protocol on loopback, as real daemons (the README's main job).

1. Build the bundled default job (`jobs/default.toml`, or `--job-file`).
2. Start, as separate processes on 127.0.0.1 (ephemeral ports): an honest trainer (cpu-2t), a
   cheating trainer (the same hardware, started with `--inject-fault`), and one auditor per
   trainer on another hardware profile (emulated-gpu: another accumulation order).
3. Submit the same job to both trainers; the honest trainer's audit matches bit for bit.
4. The cheating trainer's audit diverges and the auditor files a challenge; the arbiter plays
   the bisection game against the cheating trainer and its auditor, re-executes the disputed
   step (on CUDA where there is a device, else cpu-2t; `--arbiter-profile`), writes a signed
   verdict and re-checks it offline, and the verdict must name the cheating trainer and the
   step the fault was injected at.

Exit code 0 only if all of that happened as described. Every process it starts is stopped on
the way out, also on Ctrl-C; `--workdir` keeps the stores, logs and the verdict for a look.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.submit import submit_job
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.dispute.verdict import summary, verify_verdict
from protocol.engine.dataparallel import require_world
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError
from protocol.files import atomic_write
from protocol.job.create import create_job
from protocol.job.faults import TRAINING_KINDS, parse_fault

from .adjudicate import adjudicate, default_profile
from .parties import RemoteParty

DEFAULT_JOB = Path(__file__).resolve().parent.parent / "jobs" / "default.toml"
DEFAULT_FAULT = "relabel:23"
START_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 1800.0
CALL_TIMEOUT_S = 30.0


def add_demo_command(sub) -> None:
    demo = sub.add_parser("demo", help="honest and cheating trainer, auditor and arbiter on "
                                       "loopback (the main job)", description=__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--job-file", type=Path, default=DEFAULT_JOB,
                      help="the job (TOML, as for `ovt job create`; default: the bundled "
                           "jobs/default.toml)")
    demo.add_argument("--fault", default=DEFAULT_FAULT, metavar="KIND:STEP",
                      help="the cheating trainer's injected training fault (default: "
                           f"%(default)s; KIND: {', '.join(TRAINING_KINDS)})")
    demo.add_argument("--trainer-profile", default="cpu-2t",
                      help="both trainers' hardware profile (default: %(default)s)")
    demo.add_argument("--auditor-profile", default="emulated-gpu",
                      help="the auditors' hardware profile (default: %(default)s)")
    demo.add_argument("--arbiter-profile", default=None,
                      help="the arbiter's re-execution profile (default: cuda where there is "
                           "a CUDA device, else cpu-2t)")
    demo.add_argument("--trainer-workers", type=int, default=1, metavar="W",
                      help="processes each trainer computes a step's micro-batches on "
                           "(`ovt-trainer serve --train-workers`; the job needs at least W "
                           "micro_batches; default: %(default)s)")
    demo.add_argument("--workdir", type=Path, default=None,
                      help="keep keys, stores, logs and the verdict here (default: a temporary "
                           "directory, removed at the end)")
    demo.set_defaults(run=run_demo)


def run_demo(args) -> int:
    for text in (args.trainer_profile, args.auditor_profile):
        Profile.parse(text).check_runnable()
    args.arbiter = default_profile() if args.arbiter_profile is None else \
        Profile.parse(args.arbiter_profile)
    args.arbiter.check_runnable()
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        return _demo(args, args.workdir)
    with tempfile.TemporaryDirectory(prefix="ovt-demo-") as tmp:
        return _demo(args, Path(tmp))


def _demo(args, work: Path) -> int:
    try:
        return _story(args, work)
    except grpc.RpcError as err:  # a daemon that died or refused: its log says why
        raise ConfigError(f"a daemon failed: {err.code().name}: {err.details()} (logs in "
                          f"{work}; run with --workdir to keep them)") from None


def _story(args, work: Path) -> int:
    fault_kind, fault_step = _fault(args.fault)
    spec, state0 = create_job(args.job_file)
    if not 1 <= fault_step <= spec.steps:
        raise ConfigError(f"--fault step {fault_step} is outside the job's 1..{spec.steps}")
    require_world(args.trainer_workers, spec.micro_batches, "--trainer-workers")
    workers = ("--train-workers", args.trainer_workers)
    job_id = spec.job_id
    _say(f"job {job_id.hex()[:16]}…: {spec.program}, {spec.steps} steps"
         + (f", trainers on {args.trainer_workers} processes" if args.trainer_workers > 1 else "")
         + f"; the cheating trainer injects {args.fault}")
    for role in ("trainer", "cheater", "auditor"):
        KeyPair.generate().save(work / f"{role}.key", overwrite=True)
    with _Daemons(work) as daemons:
        honest = daemons.start("honest-trainer", "trainer_node.cli", "--key",
                               work / "trainer.key", "--profile", args.trainer_profile,
                               *workers)
        cheater = daemons.start("cheating-trainer", "trainer_node.cli", "--key",
                                work / "cheater.key", "--profile", args.trainer_profile,
                                "--inject-fault", args.fault, *workers)
        audit_h = daemons.start("auditor-of-honest", "auditor_node.cli", "--key",
                                work / "auditor.key", "--profile", args.auditor_profile)
        audit_c = daemons.start("auditor-of-cheater", "auditor_node.cli", "--key",
                                work / "auditor.key", "--profile", args.auditor_profile)
        addresses = {name: daemons.address(name) for name in daemons.names()}
        _say("daemons serving on " + ", ".join(f"{n} {a}" for n, a in addresses.items()))

        with contextlib.ExitStack() as stack:
            channels = {name: stack.enter_context(grpc.insecure_channel(address))
                        for name, address in addresses.items()}
            state0_bytes = safetensors.torch.save(state0)
            for trainer in (honest, cheater):
                submit_job(channels[trainer], spec.to_bytes(), state0_bytes,
                           timeout=RUN_TIMEOUT_S)
            for trainer in (honest, cheater):
                _watch_training(channels[trainer], trainer, job_id)

            honest_report = _audit(channels[audit_h], addresses[honest], audit_h, job_id)
            if honest_report.state != "matched":
                return _fail(f"the honest trainer's audit ended {honest_report.state}: "
                             f"{honest_report.reason or honest_report.error}")
            _say(f"honest trainer: its {args.auditor_profile} auditor replayed all "
                 f"{spec.steps} steps and signed the same root, bit for bit")

            cheat_report = _audit(channels[audit_c], addresses[cheater], audit_c, job_id)
            if cheat_report.state != "diverged":
                return _fail(f"the cheating trainer's audit ended {cheat_report.state}, not "
                             f"diverged")
            _say(f"cheating trainer: its auditor diverged at step "
                 f"{cheat_report.divergent_step} ({cheat_report.reason}) and filed a challenge")
            challenge = Challenge.from_bytes(ovt_pb2_grpc.AuditorStub(channels[audit_c])
                                             .GetChallenge(ovt_pb2.JobRef(job_id=job_id),
                                                           timeout=CALL_TIMEOUT_S).challenge)
            _say("arbiter: bisecting between the cheating trainer and the auditor")
            result = adjudicate(
                spec, challenge, RemoteParty("trainer", channels[cheater], spec),
                RemoteParty("auditor", channels[audit_c], spec), key=KeyPair.generate(),
                profile=args.arbiter, events=lambda text: _say(f"  {text}"))
    verdict_path = work / "verdict.ovtv"
    atomic_write(verdict_path, result.verdict.to_bytes())
    verdict = verify_verdict(verdict_path.read_bytes())
    print(summary(verdict), flush=True)
    _say("the verdict re-checks offline" + (f": `ovt-arbiter verify {verdict_path}`"
                                            if args.workdir else " (--workdir keeps it)"))
    if verdict.fault != "trainer" or verdict.step != fault_step:
        return _fail(f"expected the trainer at fault at step {fault_step}, got "
                     f"{verdict.fault} at step {verdict.step}")
    _say(f"demo passed: the honest trainer was verified, the cheating trainer was caught at "
         f"step {fault_step} ({fault_kind})")
    return 0


def _fault(text: str) -> tuple[str, int]:
    """A training fault (the story needs a cheat an audit can see: serving faults lie only to
    the arbiter, and the demo's honest auditor would simply match)."""
    fault = parse_fault(text, TRAINING_KINDS)
    return fault.kind, fault.step


def _say(text: str) -> None:
    print(f"[demo] {text}", file=sys.stderr, flush=True)


def _progress(text: str) -> None:
    """One progress line, rewritten in place on a terminal (and not repeated into a log)."""
    if sys.stderr.isatty():
        print(f"\r[demo] {text}\033[K", end="", file=sys.stderr, flush=True)


def _progress_end(text: str | None = None) -> None:
    if sys.stderr.isatty():
        print(file=sys.stderr, flush=True)
    elif text:
        _say(text)


def _fail(text: str) -> int:
    _say(f"FAILED: {text}")
    return 1


def _watch_training(channel: grpc.Channel, name: str, job_id: bytes) -> None:
    """Follow a trainer's job to its end, as a progress line."""
    stream = ovt_pb2_grpc.TrainerStub(channel).Watch(ovt_pb2.JobRef(job_id=job_id),
                                                     timeout=RUN_TIMEOUT_S)
    status = None
    for status in stream:
        _progress(f"{name}: step {status.step}/{status.steps} {status.state}")
        if status.state in ("done", "failed"):
            break
    _progress_end(f"{name}: step {status.step}/{status.steps} {status.state}"
                  if status else None)
    stream.cancel()
    if status is None or status.state != "done":
        raise ConfigError(f"{name} did not finish the job: "
                          f"{status.error if status else 'no status'}")


def _audit(channel: grpc.Channel, trainer_address: str, name: str,
           job_id: bytes) -> ovt_pb2.AuditReport:
    stub = ovt_pb2_grpc.AuditorStub(channel)
    stub.Audit(ovt_pb2.AuditRequest(trainer_address=trainer_address, job_id=job_id),
               timeout=CALL_TIMEOUT_S)
    stream = stub.WatchAudit(ovt_pb2.JobRef(job_id=job_id), timeout=RUN_TIMEOUT_S)
    report = None
    for report in stream:
        _progress(f"{name}: replayed {report.step}/{report.steps} {report.state}")
        if report.state in ("matched", "diverged", "failed"):
            break
    _progress_end(f"{name}: replayed {report.step}/{report.steps} {report.state}"
                  if report else None)
    stream.cancel()
    if report is None or report.state == "failed":
        raise ConfigError(f"{name} failed: {report.error if report else 'no report'}")
    return report


class _Daemons:
    """Daemon processes with port files; all stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: dict[str, tuple[subprocess.Popen, Path, Path]] = {}

    def __enter__(self) -> _Daemons:
        return self

    def start(self, name: str, module: str, *args) -> str:
        port_file, log = self.work / f"{name}.port", self.work / f"{name}.log"
        port_file.unlink(missing_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, "serve", "--listen", "127.0.0.1:0", "--store",
                 str(self.work / name), "--port-file", str(port_file), *map(str, args)],
                stdout=out, stderr=subprocess.STDOUT)
        self.procs[name] = (proc, port_file, log)
        return name

    def names(self) -> list[str]:
        return list(self.procs)

    def address(self, name: str) -> str:
        proc, port_file, log = self.procs[name]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(f"{name} did not start (exit {proc.poll()}); its log "
                                  f"{log}:\n{log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        return f"127.0.0.1:{int(port_file.read_text())}"

    def __exit__(self, *exc) -> None:
        for proc, _, _ in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _, _ in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
