"""`ovt keygen` and `ovt job create|show|run|audit`: jobs, keys and stores from the shell.

    ovt keygen --out trainer.key
    ovt job create job.toml --out job.ovtjob          # also writes job.s0.safetensors
    ovt job show job.ovtjob
    ovt job run job.ovtjob --store trainer-store --key trainer.key
    ovt job audit job.ovtjob --trainer-store trainer-store --store auditor-store \\
        --key auditor.key --profile emulated-gpu

A job with a data file (a [data] section) needs `--data-dir DIR` to run or audit: the folder
its path is relative to (the job file's folder at creation).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import safetensors.torch

from protocol.cli.commands import add_data_dir_option
from protocol.codec.state import load_safetensors, state_digest
from protocol.commit.keys import KeyPair
from protocol.engine.dataparallel import require_world
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, StateFormatError, StoreError
from protocol.files import atomic_write
from protocol.job import create as jobcreate
from protocol.job.create import create_job, locate_data_file
from protocol.job.run import StoreSource, replay_job, run_job
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

_CREATE_HELP = jobcreate.__doc__


def add_commands(sub) -> None:
    keygen = sub.add_parser("keygen", help="make an Ed25519 key file for a trainer, auditor or "
                                           "arbiter")
    keygen.add_argument("--out", type=Path, required=True, help="private key file to write")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing file")
    keygen.set_defaults(run=_keygen)

    job = sub.add_parser("job", help="create, inspect, run and audit jobs (library level)")
    jobs = job.add_subparsers(dest="job_command", metavar="JOB_COMMAND", required=True)
    create = jobs.add_parser("create", help="turn a TOML job file into a job spec and S_0",
                             description=_CREATE_HELP,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    create.add_argument("job_file", type=Path)
    create.add_argument("--out", type=Path, default=None,
                        help="spec file to write (default: JOB_FILE with suffix .ovtjob); S_0 "
                             "goes beside it as <name>.s0.safetensors")
    create.set_defaults(run=_create)
    show = jobs.add_parser("show", help="print a job spec and its id")
    show.add_argument("spec", type=Path)
    show.add_argument("--json", action="store_true")
    show.set_defaults(run=_show)
    run = jobs.add_parser("run", help="train a job into a store (resumes an interrupted run)")
    run.add_argument("spec", type=Path)
    run.add_argument("--store", type=Path, required=True, help="the trainer's store directory")
    run.add_argument("--key", type=Path, required=True, help="the trainer's key file")
    run.add_argument("--profile", default="cpu-2t", help="hardware profile (default: %(default)s)")
    _add_workers_option(run)
    add_data_dir_option(run)
    run.set_defaults(run=_run)
    audit = jobs.add_parser("audit", help="replay a job from a trainer's store on this profile")
    audit.add_argument("spec", type=Path)
    audit.add_argument("--trainer-store", type=Path, required=True)
    audit.add_argument("--store", type=Path, required=True, help="the auditor's store directory")
    audit.add_argument("--key", type=Path, required=True, help="the auditor's key file")
    audit.add_argument("--profile", default="emulated-gpu",
                       help="hardware profile (default: %(default)s)")
    _add_workers_option(audit)
    add_data_dir_option(audit)
    audit.set_defaults(run=_audit)


def _add_workers_option(parser) -> None:
    parser.add_argument("--workers", type=int, default=1, metavar="W",
                        help="processes computing each step's micro-batches, this one "
                             "included (1 to the job's micro_batches; the leaves are the same "
                             "for any W, on either side; default: %(default)s)")


def _check_workers(args, spec: JobSpec) -> None:
    require_world(args.workers, spec.micro_batches, "--workers")


def _keygen(args) -> int:
    key = KeyPair.generate()
    key.save(args.out, overwrite=args.force)
    print(f"wrote {args.out}; public key {key.public_key.hex()}")
    return 0


def _create(args) -> int:
    spec, state0 = create_job(args.job_file)
    out = args.out or args.job_file.with_suffix(".ovtjob")
    atomic_write(out, spec.to_bytes())
    s0_path = _s0_path(out)
    atomic_write(s0_path, safetensors.torch.save(state0))
    print(f"job {spec.job_id.hex()}\n  spec {out}\n  S_0  {s0_path} (h_0 {spec.h0.hex()})")
    return 0


def _show(args) -> int:
    spec = _load_spec(args.spec)
    if args.json:
        print(json.dumps(spec.summary(), indent=2))
        return 0
    for key, value in spec.summary().items():
        print(f"{key:20} {json.dumps(value) if isinstance(value, dict) else value}")
    return 0


def _run(args) -> int:
    spec = _load_spec(args.spec)
    _check_workers(args, spec)
    locate_data_file(spec, args.data_dir)  # before a store is made for a job it cannot run
    store = JobStore(args.store, spec)
    if store.last_step() < 0:
        store.put_initial(_load_s0(args.spec, spec))
    signed = run_job(store, KeyPair.load(args.key), profile=Profile.parse(args.profile),
                     progress=_progress, data_dir=args.data_dir, workers=args.workers)
    print(f"job {spec.job_id.hex()}: {spec.steps} steps, root {signed.commitment.root.hex()}")
    return 0


def _audit(args) -> int:
    spec = _load_spec(args.spec)
    _check_workers(args, spec)
    locate_data_file(spec, args.data_dir)
    trainer = JobStore.open(args.trainer_store, spec.job_id.hex())
    outcome = replay_job(JobStore(args.store, spec), StoreSource(trainer),
                         KeyPair.load(args.key), profile=Profile.parse(args.profile),
                         progress=_progress, data_dir=args.data_dir, workers=args.workers)
    if outcome.matches:
        print(f"job {spec.job_id.hex()}: replay MATCHES the trainer (root "
              f"{outcome.commitment.commitment.root.hex()})")
        return 0
    print(f"job {spec.job_id.hex()}: replay DIVERGES at step {outcome.first_divergent_step}: "
          f"{outcome.reason}")
    return 1


def _load_spec(path: Path) -> JobSpec:
    try:
        return JobSpec.from_bytes(path.read_bytes())
    except OSError as err:
        raise ConfigError(f"cannot read job spec {path}: {err.strerror}") from None


def _s0_path(spec_path: Path) -> Path:
    return spec_path.with_name(spec_path.stem + ".s0.safetensors")


def _load_s0(spec_path: Path, spec: JobSpec):
    path = _s0_path(spec_path)
    try:
        state = load_safetensors(path.read_bytes())
    except (OSError, StateFormatError) as err:
        raise ConfigError(f"cannot read the initial state {path}: {err}") from None
    if state_digest(state) != spec.h0:
        raise StoreError(f"{path} does not hash to the job's h_0")
    return state


def _progress(step: int, steps: int) -> None:
    if sys.stderr.isatty():
        print(f"\rstep {step}/{steps}", end="\n" if step == steps else "", file=sys.stderr,
              flush=True)
