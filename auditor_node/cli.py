"""`ovt-auditor`: the auditor daemon and one-off audits.

    ovt-auditor serve --listen 127.0.0.1:7001 --store auditor-store --key auditor.key \\
        [--profile emulated-gpu] [--port-file FILE] [--tls-cert C --tls-key K] [--tls-ca CA]
    ovt-auditor audit --trainer 127.0.0.1:7000 --job JOB_ID --store auditor-store \\
        --key auditor.key [--profile emulated-gpu] [--tls-ca CA] [--json]

Exit codes: 0 success (audit: the roots match), 1 the audit diverged (the challenge is written),
2 an error, explained in one line on stderr, never a traceback. `serve` exits 0 on SIGTERM or
Ctrl-C after a graceful shutdown; an interrupted audit resumes when the daemon starts again.
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

from .audit import MATCHED, AuditRecord, run_audit
from .faults import KINDS as FAULT_KINDS
from .faults import AuditorFaults, parse_auditor_fault
from .server import AuditorNode

EXIT_OK, EXIT_DIVERGED = 0, 1
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
        command.add_argument("--max-params", type=int, default=DEFAULT_MAX_PARAMS,
                             help="the largest built-in model (in parameters, counted from the "
                                  "job's config before anything is built) a trainer's job may "
                                  "make this auditor build (default: %(default)s)")
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


def _positive(max_params: int) -> int:
    if max_params < 1:
        raise ConfigError(f"--max-params must be at least 1, got {max_params}")
    return max_params


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
                       limits=limits_of(args), max_params=_positive(args.max_params),
                       data_dir=args.data_dir,
                       faults=tuple(args.inject_fault))  # it warns when faults are set
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    port = node.start()
    try:
        if args.port_file:
            atomic_write(args.port_file, f"{port}\n".encode())
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
    _warn_faults(args)
    record = run_audit(args.trainer, job_id, args.store, KeyPair.load(args.key),
                       Profile.parse(args.profile), tls_ca=args.tls_ca,
                       allow_remote_plaintext=args.insecure_allow_remote_plaintext,
                       allowed_programs=args.allow_program, progress=_progress,
                       max_params=_positive(args.max_params), data_dir=args.data_dir,
                       hooks=AuditorFaults(args.inject_fault) if args.inject_fault else None)
    if sys.stderr.isatty() and 0 < record.replayed < record.steps:
        print(file=sys.stderr)  # end the progress line
    print(json.dumps(record_json(record), indent=2) if args.json else verdict_line(record))
    return EXIT_OK if record.state == MATCHED else EXIT_DIVERGED


def verdict_line(record: AuditRecord) -> str:
    job = record.job_id.hex()
    if record.state == MATCHED:
        return (f"job {job}: MATCHED: {record.steps} steps replayed, root "
                f"{record.auditor_commitment.commitment.root.hex()}")
    where = f"; challenge written to {record.challenge}" if record.challenge else ""
    return f"job {job}: DIVERGED at step {record.divergent_step}: {record.reason}{where}"


def record_json(record: AuditRecord) -> dict:
    def root(signed):
        return None if signed is None else signed.commitment.root.hex()

    return {"job_id": record.job_id.hex(), "state": record.state, "steps": record.steps,
            "replayed": record.replayed, "divergent_step": record.divergent_step,
            "reason": record.reason, "trainer_root": root(record.trainer_commitment),
            "auditor_root": root(record.auditor_commitment),
            "auditor_public_key": None if record.auditor_commitment is None else
            record.auditor_commitment.commitment.public_key.hex(),
            "challenge": None if record.challenge is None else str(record.challenge)}


def _progress(step: int, steps: int) -> None:
    if sys.stderr.isatty():
        print(f"\rreplayed step {step}/{steps}", end="\n" if step == steps else "",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
