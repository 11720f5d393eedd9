"""`ovt-trainer serve | submit | status | certs`: the trainer daemon and its client.

    ovt-trainer serve --listen 127.0.0.1:50051 --store trainer-store --key trainer.key
    ovt-trainer submit --trainer 127.0.0.1:50051 job.ovtjob      # prints the job id
    ovt-trainer status --trainer 127.0.0.1:50051 --job ID --watch

`serve` resumes unfinished jobs from its store, trains one job at a time and serves the Claims
and Trainer services; SIGTERM or SIGINT stops it after the current step (exit 0). Plaintext is
served only on a loopback address unless `--insecure-allow-remote-plaintext`; give
`--tls-cert/--tls-key` (and clients `--tls-ca`) otherwise.

Exit codes: 0 success (status: the job is not failed), 1 the job failed, 2 bad input or an
unreachable or refusing trainer (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal
import sys
import threading
from pathlib import Path

import grpc

from proto import ovt_pb2, ovt_pb2_grpc
from proto.limits import add_limit_options, limits_of
from proto.serving import make_channel, make_self_signed_cert
from proto.submit import submit_job
from protocol.cli.commands import add_data_dir_option, run_command
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, PeerError
from protocol.files import atomic_write
from protocol.job.create import DEFAULT_MAX_PARAMS
from protocol.job.faults import Fault, parse_fault

from .faults import KINDS as FAULT_KINDS
from .server import TrainerConfig, TrainerNode
from .service import DEFAULT_MAX_INFLIGHT_BYTES

EXIT_FAILED = 1
EXIT_USAGE = 2
CALL_TIMEOUT_S = 60.0
SUBMIT_TIMEOUT_S = 3600.0  # S_0 may be gigabytes


def main(argv: list[str] | None = None) -> int:
    return run_command("ovt-trainer", _parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ovt-trainer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = sub.add_parser("serve", help="run the trainer daemon")
    serve.add_argument("--listen", default="127.0.0.1:50051",
                       help="HOST:PORT to listen on; port 0 picks a free one (default: "
                            "%(default)s)")
    serve.add_argument("--store", type=Path, required=True, help="store root (one directory "
                                                                 "per job)")
    serve.add_argument("--key", type=Path, required=True, help="the trainer's Ed25519 key file")
    serve.add_argument("--profile", default="cpu-2t",
                       help="hardware profile to train on, e.g. cpu-2t or device=cuda "
                            "(default: %(default)s)")
    serve.add_argument("--device", default=None,
                       help="device to train on, e.g. cpu or cuda:0 (overrides the profile's)")
    serve.add_argument("--threads", type=int, default=None,
                       help="intra-op threads for training (overrides the profile's count)")
    add_limit_options(serve)
    serve.add_argument("--train-workers", type=int, default=1, metavar="W",
                       help="processes computing each job's micro-batches, this one included "
                            "(gloo over 127.0.0.1; a job uses at most its micro_batches of "
                            "them, and its leaves are the same for any count; default: "
                            "%(default)s)")
    serve.add_argument("--max-message-mb", type=int, default=64,
                       help="largest gRPC message accepted or sent, MiB (default: %(default)s)")
    serve.add_argument("--max-state-mb", type=int, default=8192,
                       help="largest S_0 a client may submit, MiB (default: %(default)s)")
    serve.add_argument("--max-inflight-mb", type=int, default=DEFAULT_MAX_INFLIGHT_BYTES >> 20,
                       help="S_0 bytes all submissions in flight may hold together (on disk "
                            "as they stream), MiB (default: %(default)s)")
    serve.add_argument("--max-params", type=int, default=DEFAULT_MAX_PARAMS,
                       help="most parameters of a built-in model a job may ask for "
                            "(default: %(default)s = 2**28)")
    serve.add_argument("--allow-program", action="append", default=[], metavar="REF",
                       help="a user program (package.module:function or file.py:function) "
                            "clients may submit jobs for; built-ins are always allowed")
    add_data_dir_option(serve)
    serve.add_argument("--port-file", type=Path, default=None,
                       help="write the bound port here (atomically) once serving")
    serve.add_argument("--tls-cert", type=Path, default=None, help="PEM certificate chain")
    serve.add_argument("--tls-key", type=Path, default=None, help="PEM private key")
    serve.add_argument("--insecure-allow-remote-plaintext", action="store_true",
                       help="serve plaintext on a non-loopback address (anyone on the path "
                            "can read and alter the traffic)")
    serve.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    serve.add_argument("--inject-fault", action="append", default=[], metavar="KIND:STEP",
                       type=_fault,
                       help="FAULT INJECTION, for tests and demos only: makes this trainer "
                            "CHEAT at step STEP of every job (repeatable). KIND: "
                            f"{', '.join(FAULT_KINDS)} (see trainer_node/faults.py)")
    serve.set_defaults(run=_serve)

    submit = sub.add_parser("submit", help="submit a job spec and its S_0 to a trainer")
    submit.add_argument("spec", type=Path, help="job spec written by `ovt job create`; S_0 is "
                                                "read from <name>.s0.safetensors beside it")
    _client_options(submit)
    submit.set_defaults(run=_submit)

    status = sub.add_parser("status", help="show (or --watch) a job's progress")
    status.add_argument("--job", required=True, help="job id (hex)")
    status.add_argument("--watch", action="store_true",
                        help="print a line per step until the job is done or failed")
    _client_options(status)
    status.set_defaults(run=_status)

    certs = sub.add_parser("certs", help="make a self-signed TLS certificate for local use")
    certs.add_argument("--out", type=Path, required=True,
                       help="folder for cert.pem and key.pem (serve with --tls-cert/--tls-key; "
                            "clients pass cert.pem as --tls-ca)")
    certs.add_argument("--hostname", default="localhost", help="default: %(default)s")
    certs.set_defaults(run=_certs)
    return parser


def _fault(text: str) -> Fault:
    """argparse type of --inject-fault: a bad value is a usage error (exit 2, one line)."""
    try:
        return parse_fault(text, FAULT_KINDS)
    except ConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _certs(args) -> int:
    if (args.out / "key.pem").exists() or (args.out / "cert.pem").exists():
        raise ConfigError(f"{args.out} already holds cert.pem or key.pem; not overwriting")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        cert, key = make_self_signed_cert(args.out, args.hostname)
    except OSError as err:
        raise ConfigError(f"cannot write cert.pem and key.pem into {args.out}: "
                          f"{err.strerror or err}") from None
    print(f"wrote {cert} and {key} (valid for {args.hostname}, localhost, 127.0.0.1, ::1)")
    return 0


def _client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trainer", required=True, help="the trainer's HOST:PORT")
    parser.add_argument("--tls-ca", type=Path, default=None,
                        help="CA (or self-signed) certificate to check the trainer's TLS with")
    parser.add_argument("--insecure-allow-remote-plaintext", action="store_true",
                        help="talk plaintext to a non-loopback trainer")


# -- serve ------------------------------------------------------------------------------------

def _serve(args) -> int:
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s ovt-trainer %(levelname)s %(message)s")
    if min(args.max_message_mb, args.max_state_mb, args.max_inflight_mb, args.max_params,
           args.train_workers, 1 if args.threads is None else args.threads) < 1:
        raise ConfigError("--max-message-mb, --max-state-mb, --max-inflight-mb, --max-params, "
                          "--train-workers and --threads must be at least 1")
    profile = _profile(args)
    node = TrainerNode(TrainerConfig(
        listen=args.listen, store=args.store, key=KeyPair.load(args.key), profile=profile,
        tls_cert=args.tls_cert, tls_key=args.tls_key,
        allow_remote_plaintext=args.insecure_allow_remote_plaintext,
        max_message_bytes=args.max_message_mb << 20, max_state_bytes=args.max_state_mb << 20,
        max_inflight_bytes=args.max_inflight_mb << 20, max_params=args.max_params,
        limits=limits_of(args),
        allowed_programs=tuple(args.allow_program), data_dir=args.data_dir,
        workers=args.train_workers, faults=tuple(args.inject_fault)))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    port = node.start()
    try:
        _announce(port, args.port_file)
        while not stop.wait(0.5):
            pass
        logging.getLogger("ovt.trainer").info("stopping: the running job stops after its step")
    finally:
        stopped = node.stop()
    return 0 if stopped else EXIT_USAGE


def _announce(port: int, port_file: Path | None) -> None:
    if port_file is not None:
        try:
            atomic_write(port_file, f"{port}\n".encode())
        except OSError as err:
            raise ConfigError(f"cannot write the port file {port_file}: {err.strerror}") \
                from None
    print(f"ovt-trainer: serving on port {port}", file=sys.stderr, flush=True)


def _profile(args) -> Profile:
    """--profile with --device and --threads laid over it."""
    profile = Profile.parse(args.profile)
    changes: dict = {}
    if args.device is not None:
        changes["device"] = Profile.parse(f"device={args.device}").device  # validates it
    if args.threads is not None:
        changes["threads"] = args.threads
    if not changes:
        return profile
    suffix = ",".join(f"{key}={value}" for key, value in changes.items())
    return dataclasses.replace(profile, name=f"{profile.name}+{suffix}", **changes)


# -- client -----------------------------------------------------------------------------------

def _stub(args) -> ovt_pb2_grpc.TrainerStub:
    channel = make_channel(args.trainer, tls_ca=args.tls_ca,
                           allow_remote_plaintext=args.insecure_allow_remote_plaintext)
    return ovt_pb2_grpc.TrainerStub(channel)


def _rpc_error(call: str, err: grpc.RpcError) -> PeerError:
    return PeerError(f"trainer {call} failed: {err.code().name}: {err.details()}")


def _submit(args) -> int:
    spec_bytes = _read(args.spec, "job spec")
    state0 = _read(args.spec.with_name(args.spec.stem + ".s0.safetensors"), "initial state")
    channel = make_channel(args.trainer, tls_ca=args.tls_ca,
                           allow_remote_plaintext=args.insecure_allow_remote_plaintext)
    with channel:
        try:
            job_id = submit_job(channel, spec_bytes, state0, timeout=SUBMIT_TIMEOUT_S)
        except grpc.RpcError as err:
            raise _rpc_error("SubmitStream", err) from None
    print(job_id.hex())
    return 0


def _status(args) -> int:
    try:
        job_id = bytes.fromhex(args.job)
    except ValueError:
        raise ConfigError(f"--job must be a hex job id, got {args.job!r}") from None
    stub, ref = _stub(args), ovt_pb2.JobRef(job_id=job_id)
    status: ovt_pb2.JobStatus | None = None
    try:
        if not args.watch:
            status = stub.Status(ref, timeout=CALL_TIMEOUT_S)
            print(_line(status))
        else:
            for status in stub.Watch(ref):
                print(_line(status), flush=True)
    except grpc.RpcError as err:
        raise _rpc_error("Watch" if args.watch else "Status", err) from None
    if status is None:  # a Watch that ended OK before its first message: the trainer's fault
        raise PeerError(f"trainer ended Watch of job {job_id.hex()} without sending its status")
    return EXIT_FAILED if status.state == "failed" else 0


def _line(status: ovt_pb2.JobStatus) -> str:
    line = f"job {status.job_id.hex()} {status.state} step {status.step}/{status.steps}"
    return f"{line}: {status.error}" if status.error else line


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror}") from None


if __name__ == "__main__":
    sys.exit(main())
