"""`ovt-arbiter adjudicate | verify | demo`: settle a dispute, re-check a verdict, see it happen.

    ovt-arbiter adjudicate --trainer 127.0.0.1:50051 --auditor 127.0.0.1:50052 --job ID \\
        --out verdict.ovtv [--key arbiter.key] [--device cuda] [--evidence evidence/]
    ovt-arbiter verify verdict.ovtv [--evidence evidence/]
    ovt-arbiter demo

`adjudicate` takes the auditor's challenge (from the auditor, or `--challenge FILE`), plays the
bisection game against both nodes (SPEC §5.2), fetches and checks S_{i-1}, B_i and L_i,
re-executes the disputed step on this machine (SPEC §5.3), and writes a signed verdict (SPEC
§5.4) with its full transcript; `--evidence DIR` also keeps what the step was re-executed from.
`verify` re-checks a verdict offline: the signature, every move and proof of the transcript,
and that the finding follows from them; with `--evidence` it re-executes the step as well.
`demo` runs the whole story on loopback: an honest trainer and an auditor on other hardware
agree, a cheating trainer is challenged, and the arbiter's verdict names the step.

Exit codes: 0 success (adjudicate: a verdict was written, whoever is at fault; verify: the
verdict is valid), 1 verify: the verdict is invalid, 2 bad input, an unreachable node, or no
challenge to adjudicate (one line on stderr).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import grpc

from proto import ovt_pb2, ovt_pb2_grpc
from proto.serving import make_channel
from protocol.cli.commands import run_command
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.dispute.evidence import recheck_evidence, save_evidence
from protocol.dispute.verdict import summary, verify_verdict
from protocol.engine.profiles import Profile, plain_profile
from protocol.engine.programs.registry import require_allowed
from protocol.errors import ConfigError, EncodingError, VerdictError
from protocol.files import atomic_write
from protocol.job.create import DEFAULT_MAX_PARAMS, require_model_size
from protocol.job.spec import JobSpec

from .adjudicate import (
    DEFAULT_DEADLINE_S,
    DEFAULT_EVIDENCE_TIMEOUT_S,
    adjudicate,
    default_profile,
)
from .demo import add_demo_command
from .parties import RemoteParty

EXIT_INVALID = 1
CALL_TIMEOUT_S = 30.0


def main(argv: list[str] | None = None) -> int:
    return run_command("ovt-arbiter", _parser().parse_args(argv))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ovt-arbiter", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    adj = sub.add_parser("adjudicate", help="settle an auditor's challenge against a trainer")
    adj.add_argument("--trainer", required=True, help="the trainer's HOST:PORT")
    adj.add_argument("--auditor", required=True, help="the auditor's HOST:PORT")
    adj.add_argument("--job", required=True, help="the job id (64 hex digits)")
    adj.add_argument("--out", type=Path, required=True, help="the verdict file to write")
    adj.add_argument("--challenge", type=Path, default=None,
                     help="the auditor's challenge file (default: ask the auditor for it)")
    adj.add_argument("--key", type=Path, default=None,
                     help="the arbiter's key file (`ovt keygen`); default: a fresh key for "
                          "this verdict only")
    adj.add_argument("--trainer-key", default=None, metavar="HEX",
                     help="the trainer's registered public key; default: the key of the "
                          "commitment the trainer's node serves (never the challenge's)")
    adj.add_argument("--auditor-key", default=None, metavar="HEX",
                     help="the auditor's registered public key; default: the key of the "
                          "commitment the auditor's node serves")
    adj.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                     help="per-move deadline of the bisection (default: %(default)s)")
    adj.add_argument("--evidence-timeout", type=float, default=DEFAULT_EVIDENCE_TIMEOUT_S,
                     metavar="SECONDS", help="how long each node may take to serve S_{i-1}, "
                     "B_i or L_i (default: %(default)s)")
    _program_options(adj)
    adj.add_argument("--evidence", type=Path, default=None, metavar="DIR",
                     help="also keep S_{i-1}, B_i and L_i here, for `verify --evidence`")
    _profile_options(adj)
    _tls_options(adj)
    adj.add_argument("--json", action="store_true", help="print the verdict as JSON")
    adj.set_defaults(run=_adjudicate)

    ver = sub.add_parser("verify", help="re-check a verdict offline")
    ver.add_argument("verdict", type=Path)
    ver.add_argument("--arbiter-key", default=None, metavar="HEX",
                     help="require the verdict to be signed by this key")
    ver.add_argument("--evidence", type=Path, default=None, metavar="DIR",
                     help="re-execute the disputed step from this evidence as well")
    _program_options(ver)
    _profile_options(ver)
    ver.add_argument("--json", action="store_true", help="print the verdict as JSON")
    ver.set_defaults(run=_verify)

    add_demo_command(sub)
    return parser


def _program_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-program", action="append", default=[], metavar="REF",
                        help="also re-execute jobs of this non-built-in program (loading a "
                             "program runs its code here; repeatable)")
    parser.add_argument("--max-params", type=int, default=DEFAULT_MAX_PARAMS,
                        help="re-execute only built-in models of at most this many parameters "
                             "(counted from the job's config before anything is built; "
                             "default: %(default)s)")


def _require_program(spec: JobSpec, args: argparse.Namespace) -> None:
    """The job's program may be loaded here (built-in or allowed) and is not too big to build.
    Raises ConfigError or ResourceLimitError (exit 2, no verdict)."""
    require_allowed(spec.program, args.allow_program, "arbiter")
    require_model_size(spec, args.max_params)


def _profile_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="re-execute on this device (default: cuda if available, else cpu)")
    parser.add_argument("--profile", default=None,
                        help="hardware profile to re-execute under (default: cpu-2t, or cuda)")


def _tls_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tls-ca", type=Path, default=None,
                        help="CA certificate (PEM) the nodes' certificates chain to")
    parser.add_argument("--insecure-allow-remote-plaintext", action="store_true",
                        help="allow plaintext to a non-loopback node (only on a trusted network)")


def profile_of(args) -> Profile:
    """The re-execution profile: --profile (on --device where given), else cpu-2t or cuda as
    --device says, else `default_profile()`."""
    if args.profile is not None:
        profile = Profile.parse(args.profile)
        if args.device is not None and profile.device != args.device:
            profile = dataclasses.replace(profile, name=f"{profile.name}+device={args.device}",
                                          device=args.device)
    elif args.device is not None:
        profile = plain_profile(args.device, 2)
    else:
        profile = default_profile()
    profile.check_runnable()
    return profile


def _hex_bytes(text: str, what: str, size: int) -> bytes:
    """`text` as `size` bytes in hex; ConfigError (exit 2) naming option `what` otherwise."""
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != size:
        raise ConfigError(f"{what} must be {size * 2} hex digits, got {text!r}")
    return value


def _key_option(text: str | None, what: str) -> bytes | None:
    """The public key option `what` (64 hex digits), None when it is not given."""
    return None if text is None else _hex_bytes(text, what, 32)


# -- adjudicate ---------------------------------------------------------------------------------

def _adjudicate(args) -> int:
    job_id = _hex_bytes(args.job, "--job", 32)
    trainer_key = _key_option(args.trainer_key, "--trainer-key")
    auditor_key = _key_option(args.auditor_key, "--auditor-key")
    if not (args.deadline > 0 and args.evidence_timeout > 0):
        raise ConfigError("--deadline and --evidence-timeout must be positive")
    key = KeyPair.load(args.key) if args.key is not None else KeyPair.generate()
    if args.key is None:
        print(f"ovt-arbiter: signing with a fresh key {key.public_key.hex()} (give --key to "
              f"sign as a known arbiter)", file=sys.stderr)
    profile = profile_of(args)
    tls = dict(tls_ca=args.tls_ca, allow_remote_plaintext=args.insecure_allow_remote_plaintext)
    with make_channel(args.trainer, **tls) as t_channel, \
            make_channel(args.auditor, **tls) as a_channel:
        spec = _fetch_spec(job_id, [("trainer", t_channel), ("auditor", a_channel)])
        _require_program(spec, args)
        challenge = _challenge(args, a_channel, job_id)
        print(f"ovt-arbiter: job {job_id.hex()[:16]}…: the auditor challenges step "
              f"{challenge.step} of {spec.steps}", file=sys.stderr)
        result = adjudicate(
            spec, challenge, RemoteParty("trainer", t_channel, spec),
            RemoteParty("auditor", a_channel, spec), key=key, profile=profile,
            trainer_key=trainer_key, auditor_key=auditor_key, deadline_s=args.deadline,
            evidence_timeout_s=args.evidence_timeout,
            events=lambda text: print(f"  {text}", file=sys.stderr, flush=True))
    _write(args.out, result.verdict.to_bytes(), "verdict")
    if args.evidence is not None and result.evidence is not None:
        try:
            save_evidence(args.evidence, result.evidence.prev_state, result.evidence.examples,
                          result.evidence.log)
        except OSError as err:
            raise ConfigError(f"the verdict is written, but not the evidence to "
                              f"{args.evidence}: {err.strerror}") from None
    _show(result.verdict, args.json, written=args.out)
    return 0


def _fetch_spec(job_id: bytes, channels) -> JobSpec:
    """The job spec from the first node whose copy hashes to the job id."""
    problems = []
    for role, channel in channels:
        try:
            reply = ovt_pb2_grpc.ClaimsStub(channel).GetSpec(ovt_pb2.JobRef(job_id=job_id),
                                                             timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            problems.append(f"the {role}: {err.code().name}: {err.details()}")
            continue
        if hashlib.sha256(reply.spec).digest() != job_id:
            problems.append(f"the {role}'s spec does not hash to the job id")
            continue
        try:
            return JobSpec.from_bytes(reply.spec)
        except EncodingError as err:
            problems.append(f"the {role}'s spec does not decode: {err}")
    raise ConfigError(f"no node served job {job_id.hex()}: " + "; ".join(problems))


def _challenge(args, channel: grpc.Channel, job_id: bytes) -> Challenge:
    """The challenge to adjudicate: `--challenge`'s file, or the auditor's, once its report
    says it audited the job at `--trainer` (an auditor node audits a job at one trainer, and
    serves that audit's challenge by the job's id alone). Raises ConfigError."""
    if args.challenge is not None:
        try:
            data = args.challenge.read_bytes()
        except OSError as err:
            raise ConfigError(f"cannot read the challenge {args.challenge}: {err.strerror}") \
                from None
        where = str(args.challenge)
    else:
        stub, ref = ovt_pb2_grpc.AuditorStub(channel), ovt_pb2.JobRef(job_id=job_id)
        try:  # the audit's trainer asked before and after: the challenge is that audit's
            audited = {stub.GetAudit(ref, timeout=CALL_TIMEOUT_S).trainer}
            data = stub.GetChallenge(ref, timeout=CALL_TIMEOUT_S).challenge
            audited.add(stub.GetAudit(ref, timeout=CALL_TIMEOUT_S).trainer)
        except grpc.RpcError as err:
            raise ConfigError(f"the auditor has no challenge to adjudicate: "
                              f"{err.code().name}: {err.details()}") from None
        if audited != {args.trainer}:
            # Its challenge is about the commitment of the trainer it audited, which the
            # trainer at --trainer never signed: the arbiter would rule it a bad challenge.
            raise ConfigError(f"the auditor audited job {job_id.hex()} at trainer "
                              f"{', '.join(sorted(audited))!r}, not at --trainer "
                              f"{args.trainer!r}; if both name the same node, give the "
                              f"challenge with --challenge FILE")
        where = "the auditor's challenge"
    try:
        challenge = Challenge.from_bytes(bytes(data))
    except EncodingError as err:
        raise ConfigError(f"{where} is not a challenge: {err}") from None
    if challenge.job_id != job_id:
        raise ConfigError(f"{where} is for job {challenge.job_id.hex()}, not {job_id.hex()}")
    return challenge


def _write(path: Path, data: bytes, what: str) -> None:
    try:
        atomic_write(path, data)
    except OSError as err:
        raise ConfigError(f"cannot write the {what} {path}: {err.strerror}") from None


# -- verify -------------------------------------------------------------------------------------

def _verify(args) -> int:
    try:
        data = args.verdict.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {args.verdict}: {err.strerror}") from None
    arbiter_key = _key_option(args.arbiter_key, "--arbiter-key")
    try:
        verdict = verify_verdict(data, arbiter_key=arbiter_key)
        if args.evidence is not None:
            _require_program(JobSpec.from_bytes(verdict.spec), args)
            recheck_evidence(verdict, args.evidence, profile=profile_of(args))
    except VerdictError as err:
        print(f"ovt-arbiter: INVALID verdict: {err}", file=sys.stderr)
        return EXIT_INVALID
    _show(verdict, args.json, rechecked=args.evidence is not None,
          key_checked=arbiter_key is not None)
    return 0


def _show(verdict, as_json: bool, *, written: Path | None = None, rechecked: bool = False,
          key_checked: bool = False) -> None:
    """Print the verdict (`written`: where adjudicate wrote it; else verify's findings: whether
    the evidence was `rechecked` and the signing key `key_checked` against --arbiter-key)."""
    if as_json:
        shown = verdict_json(verdict)
        print(json.dumps(shown if written is not None else
                         {**shown, "arbiter_key_checked": key_checked}, indent=2))
        return
    print(summary(verdict))
    if written is not None:
        print(f"verdict written to {written} ({len(verdict.to_bytes())} bytes); re-check it "
              f"with `ovt-arbiter verify {written}`")
        return
    print("VALID: the signature, every move of the transcript and the finding check out"
          + ("; re-executing the step from the evidence gives the verdict's h_i*"
             if rechecked else ""))
    key = verdict.arbiter_key.hex()
    print(f"signed by the expected arbiter key {key}" if key_checked else
          f"signed by arbiter key {key}, NOT checked against an expected key: a valid verdict "
          f"proves nothing unless you trust this key (give --arbiter-key)")


def verdict_json(verdict) -> dict:
    """The verdict's findings as JSON (hashes and keys in hex; the transcript by size only)."""
    r = verdict.reexecution
    return {
        "job_id": verdict.job_id.hex(), "fault": verdict.fault, "finding": verdict.finding,
        "step": verdict.step, "reason": verdict.reason, "rounds": verdict.rounds,
        "timings": verdict.timings,
        "bytes_moved": verdict.bytes_moved, "arbiter_key": verdict.arbiter_key.hex(),
        "time": verdict.time, "transcript_bytes": len(verdict.transcript),
        "reexecution": None if r is None else {
            "step": r.step, "finding": r.finding, "profile": r.profile, "detail": r.detail,
            "state_hash": r.state_hash.hex() if r.state_hash else None,
            "withheld_by": r.withheld_by, "seconds": r.seconds},
    }


if __name__ == "__main__":
    sys.exit(main())
