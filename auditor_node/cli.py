"""`ovt-auditor`: the auditor daemon and one-off audits.

    ovt-auditor serve --listen 127.0.0.1:7001 --store auditor-store --key auditor.key \\
        [--profile emulated-gpu] [--port-file FILE] [--tls-cert C --tls-key K] [--tls-ca CA] \\
        [--processes P] [--sample F]
    ovt-auditor audit --trainer 127.0.0.1:7000 --job JOB_ID --store auditor-store \\
        --key auditor.key [--profile emulated-gpu] [--tls-ca CA] [--json] \\
        [--processes P] [--sample F]

`--processes P` (at most the CPUs this process may use) replays the intervals between the
trainer's checkpoints in P worker processes (same signed root as one); `--sample F` replays
only a fraction F of them, drawn once per job where the trainer can neither foresee nor steer
it (`protocol.job.sampling`), and reports "sampled, not verified" with the probability that a
cheat would have been caught. A sample that holds every interval (F = 1) is a full audit: it
signs, and exits 0 when the roots match.

Exit codes: 0 success (audit: the roots match: verified), 1 the audit diverged (the challenge
is written), 4 a sampled audit found no divergence (sampled, NOT verified: never 0), 2 an
error, explained in one line on stderr, never a traceback. `serve` exits 0 on SIGTERM or Ctrl-C
after a graceful shutdown; an interrupted audit resumes when the daemon starts again.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from proto.limits import add_limit_options, limits_of
from protocol.cli.commands import add_data_dir_option, run_command
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError
from protocol.files import atomic_write
from protocol.job.create import DEFAULT_MAX_PARAMS
from protocol.job.faults import Fault
from protocol.job.intervals import require_processes
from protocol.job.sampling import REPORTED_CHEATS, Sample

from .audit import DEFAULT_MAX_STEPS, DIVERGED, MATCHED, SAMPLED, AuditRecord, run_audit
from .faults import KINDS as FAULT_KINDS
from .faults import AuditorFaults, parse_auditor_fault
from .server import AuditorNode

EXIT_OK, EXIT_DIVERGED, EXIT_SAMPLED = 0, 1, 4
_PLAINTEXT_HELP = ("allow plaintext gRPC on a non-loopback address (listening and connecting "
                   "to trainers); unsafe: anyone on the path can read and alter the traffic")


def main(argv: list[str] | None = None) -> int:
    return run_command("ovt-auditor", _parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ovt-auditor", description="Replay trainers' jobs on this machine's hardware and "
                                        "check their signed roots (SPEC §5.1).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser("serve", help="run the auditor daemon (Auditor + Claims + health)")
    serve.add_argument("--listen", required=True, help="HOST:PORT; port 0 picks a free one")
    serve.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    serve.add_argument("--tls-cert", type=Path, help="server certificate (PEM)")
    serve.add_argument("--tls-key", type=Path, help="server private key (PEM)")
    add_limit_options(serve)
    serve.set_defaults(run=_serve)
    audit = sub.add_parser("audit", help="audit one job in this process and print the verdict")
    audit.add_argument("--trainer", required=True, help="the trainer's HOST:PORT")
    audit.add_argument("--job", required=True, help="the job id (64 hex digits)")
    audit.add_argument("--json", action="store_true", help="print the verdict as JSON")
    audit.set_defaults(run=_audit)
    for command in (serve, audit):
        command.add_argument("--store", type=Path, required=True,
                             help="the auditor's store directory")
        command.add_argument("--key", type=Path, required=True, help="the auditor's key file")
        command.add_argument("--profile", default="emulated-gpu",
                             help="hardware profile to replay on (default: %(default)s)")
        command.add_argument("--tls-ca", type=Path,
                             help="CA (or self-signed cert) to check trainers' TLS against")
        command.add_argument("--allow-program", action="append", default=[], metavar="REF",
                             help="a user program (package.module:function or "
                                  "file.py:function) jobs may run here; built-ins always may")
        command.add_argument("--processes", default="1", metavar="P",
                             help="replay the intervals between the trainer's checkpoints in "
                                  "P worker processes (at most the CPUs this process may use), "
                                  "each on cores/P threads (default: 1, one sequential "
                                  "replay); the signed root is the same")
        command.add_argument("--sample", metavar="F",
                             help="replay only a fraction F (0 < F <= 1) of the intervals, "
                                  "drawn once per job from a seed the trainer cannot predict; "
                                  "finding nothing is SAMPLED, NOT VERIFIED (exit 4), and "
                                  "signs nothing; a sample of every interval (F = 1) is a "
                                  "full audit")
        command.add_argument("--max-params", type=int, default=DEFAULT_MAX_PARAMS,
                             help="the largest built-in model (in parameters, counted from the "
                                  "job's config before anything is built) a trainer's job may "
                                  "make this auditor build (default: %(default)s)")
        command.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS,
                             help="the most steps of a job this auditor audits (a trainer "
                                  "chooses a job's steps; default: %(default)s)")
        add_data_dir_option(command)
        command.add_argument("--insecure-allow-remote-plaintext", action="store_true",
                             help=_PLAINTEXT_HELP)
        command.add_argument("--inject-fault", action="append", default=[], type=_fault,
                             metavar="KIND:STEP",
                             help="FAULT INJECTION, for tests and demos only: makes this "
                                  "auditor LIE at step STEP of every audit (repeatable). KIND: "
                                  f"{', '.join(FAULT_KINDS)} (see auditor_node/faults.py)")
    return parser


def _fault(text: str) -> Fault:
    """argparse type of --inject-fault: a bad value is a usage error (exit 2, one line)."""
    try:
        return parse_auditor_fault(text)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _processes(text: str) -> int:
    """--processes: a whole number from 1 to the CPUs this process may use. Raises
    ConfigError (one line, exit 2)."""
    try:
        processes = int(text)
    except ValueError:
        processes = 0
    if processes < 1:
        raise ConfigError(f"--processes must be a whole number >= 1, got {text!r}")
    try:
        return require_processes(processes)
    except ConfigError as err:
        raise ConfigError(f"--processes must be at most the CPUs this process may use, got "
                          f"{text!r}: {err}") from None


def _sample(text: str | None) -> float | None:
    """--sample: None (a full audit) or a fraction F with 0 < F <= 1. Raises ConfigError."""
    if text is None:
        return None
    try:
        fraction = float(text)
    except ValueError:
        fraction = float("nan")  # refused below, like every value outside (0, 1]
    if not 0 < fraction <= 1:
        raise ConfigError(f"--sample must be a fraction F with 0 < F <= 1 (e.g. 0.25), got "
                          f"{text!r}")
    return fraction


def _positive(option: str, value: int) -> int:
    """The value of a count option (--max-params, --max-steps), at least 1. Raises
    ConfigError."""
    if value < 1:
        raise ConfigError(f"{option} must be at least 1, got {value}")
    return value


def _warn_faults(args) -> None:
    if args.inject_fault:
        print(f"ovt-auditor: WARNING: FAULT INJECTION: this auditor LIES on purpose "
              f"({', '.join(map(str, args.inject_fault))}); for tests and demos only",
              file=sys.stderr, flush=True)


def _serve(args) -> int:
    node = AuditorNode(args.store, KeyPair.load(args.key), Profile.parse(args.profile),
                       listen=args.listen, tls_cert=args.tls_cert, tls_key=args.tls_key,
                       tls_ca=args.tls_ca, allowed_programs=args.allow_program,
                       allow_remote_plaintext=args.insecure_allow_remote_plaintext,
                       limits=limits_of(args),
                       max_params=_positive("--max-params", args.max_params),
                       max_steps=_positive("--max-steps", args.max_steps),
                       data_dir=args.data_dir, processes=_processes(args.processes),
                       sample=_sample(args.sample),
                       faults=tuple(args.inject_fault))  # it warns when faults are set
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    port = node.start()
    try:
        if args.port_file:
            try:
                atomic_write(args.port_file, f"{port}\n".encode())
            except OSError as err:
                raise ConfigError(f"cannot write the port file {args.port_file}: "
                                  f"{err.strerror}") from None
        print(f"ovt-auditor: serving on port {port} (profile {args.profile}, store "
              f"{args.store})", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        node.stop()
    print("ovt-auditor: stopped", file=sys.stderr, flush=True)
    return EXIT_OK


def _audit(args) -> int:
    try:
        job_id = bytes.fromhex(args.job)
    except ValueError:
        job_id = b""
    if len(job_id) != 32:
        raise ConfigError(f"--job must be a job id of 64 hex digits, got {args.job!r}")
    processes, sample = _processes(args.processes), _sample(args.sample)
    _warn_faults(args)
    record = run_audit(args.trainer, job_id, args.store, KeyPair.load(args.key),
                       Profile.parse(args.profile), tls_ca=args.tls_ca,
                       allow_remote_plaintext=args.insecure_allow_remote_plaintext,
                       allowed_programs=args.allow_program, progress=_progress,
                       max_params=_positive("--max-params", args.max_params),
                       max_steps=_positive("--max-steps", args.max_steps),
                       data_dir=args.data_dir,
                       hooks=AuditorFaults(args.inject_fault) if args.inject_fault else None,
                       processes=processes, sample=sample)
    if sys.stderr.isatty() and 0 < record.replayed < record.steps:
        print(file=sys.stderr)  # end the progress line
    print(json.dumps(record_json(record), indent=2) if args.json else verdict_line(record))
    return {MATCHED: EXIT_OK, SAMPLED: EXIT_SAMPLED}.get(record.state, EXIT_DIVERGED)


def verdict_line(record: AuditRecord) -> str:
    """The one line `audit` prints. Raises ValueError for a matched record without the
    auditor's commitment, which `run_audit` never returns (the root it prints is that one's)."""
    job = record.job_id.hex()
    note = f" ({record.note})" if record.note else ""
    if record.state == MATCHED:
        if record.auditor_commitment is None:
            raise ValueError(f"job {job}: a matched audit record without the auditor's "
                             f"commitment")
        return (f"job {job}: MATCHED: {record.steps} steps replayed, root "
                f"{record.auditor_commitment.commitment.root.hex()}{note}")
    if record.state == SAMPLED:
        return f"job {job}: SAMPLED, NOT VERIFIED: {record.reason}{note}"
    where = f"; challenge written to {record.challenge}" if record.challenge else ""
    found = (f" (found by a sampled audit of {len(record.sample.chosen)} of "
             f"{record.sample.intervals} intervals, then replayed in full up to it)"
             if record.sample and record.state == DIVERGED else "")
    return (f"job {job}: DIVERGED at step {record.divergent_step}: {record.reason}{found}"
            f"{note}{where}")


def record_json(record: AuditRecord) -> dict:
    def root(signed):
        return None if signed is None else signed.commitment.root.hex()

    return {"job_id": record.job_id.hex(), "state": record.state, "steps": record.steps,
            "replayed": record.replayed, "divergent_step": record.divergent_step,
            "reason": record.reason, "trainer_root": root(record.trainer_commitment),
            "auditor_root": root(record.auditor_commitment),
            "auditor_public_key": None if record.auditor_commitment is None else
            record.auditor_commitment.commitment.public_key.hex(),
            "challenge": None if record.challenge is None else str(record.challenge),
            "note": record.note,
            "sample": None if record.sample is None else sample_json(record.sample)}


def sample_json(sample: Sample) -> dict:
    """A sample as JSON: the intervals drawn, their steps (the record's `replayed` counts every
    step replayed), and the catch probabilities they give (floats)."""
    return {"verified": False, "intervals": sample.intervals,
            "sampled": [[iv.first, iv.last] for iv in sample.chosen],
            "steps_replayed": sample.replayed_steps(),
            "catch_probability_at_least": float(sample.caught(1)[0]),
            "catch_probability_distinct_intervals": {
                str(m): float(sample.caught(m)[1]) for m in REPORTED_CHEATS
                if m <= sample.intervals}}


def _progress(step: int, steps: int) -> None:
    if sys.stderr.isatty():
        print(f"\rreplayed step {step}/{steps}", end="\n" if step == steps else "",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
