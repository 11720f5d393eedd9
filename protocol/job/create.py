"""Making a job: a `JobSpec` and its S_0 from a job file; loading the program a spec names.

A user writes a small TOML file (program, config, steps, seed, precision, intervals);
`create_job` turns it into a `JobSpec` by loading the program, hashing its source, committing to
its dataset and producing the initial state S_0 once, from the portable generator (SPEC §3.4:
S_0 is committed by `h_0` and shipped, never re-derived on another machine).
`job_id = sha256(canonical JobSpec)`.

Example job file:

    program = "char-transformer"     # built-in, package.module:function or file.py:function
    preset = "test"                  # optional size preset of a built-in
    steps = 200
    seed = 0                         # data order and dropout
    init_seed = 1                    # S_0 (used once, at creation)
    checkpoint_interval = 50
    commit_interval = 50
    [config]                         # program config overrides
    lr = 0.003
    [precision]                      # optional; these are the defaults
    compute = "float64"
    target = "float32"
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path

import torch

from protocol.codec.dtypes import DTYPES
from protocol.codec.state import state_digest
from protocol.commit.data import commit_dataset
from protocol.engine.executor import Executor
from protocol.engine.precision import RULES_VERSION, PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.base import TrainingProgram
from protocol.engine.programs.registry import load_program, parameter_count, program_source
from protocol.errors import ConfigError, ProgramError, ResourceLimitError
from protocol.job.spec import JobSpec, count, typed

DEFAULT_MAX_PARAMS = 2**28  # the largest built-in model a peer's spec may ask for (1 GiB f32)
_JOB_KEYS = {"program", "preset", "steps", "seed", "init_seed", "checkpoint_interval",
             "commit_interval", "config", "precision"}
_PRECISION_KEYS = {"compute", "target", "rules"}


def load_job_program(spec: JobSpec) -> TrainingProgram:
    """Load the program `spec` names, after checking its source is the one committed to.

    Raises ProgramError if the source differs (or the program cannot be loaded), ConfigError if
    its config is not valid for it.
    """
    check_program_source(spec)
    return load_program(spec.program, spec.config)


def check_program_source(spec: JobSpec) -> None:
    """Check that the source of the program `spec` names is the one the job committed to,
    without loading the program. Raises ProgramError if it differs or cannot be read."""
    digest = hashlib.sha256(program_source(spec.program)).digest()
    if digest != spec.program_source_hash:
        raise ProgramError(f"the source of program {spec.program!r} differs from the one "
                           f"this job committed to ({digest.hex()[:16]}… != "
                           f"{spec.program_source_hash.hex()[:16]}…)")


def require_model_size(spec: JobSpec, max_params: int) -> int | None:
    """Refuse a built-in model of more than `max_params` parameters, counted from the spec's
    config alone, before anything is built (a peer's spec must not make a node allocate what
    it likes). Returns the count; None for a user program, which only building can tell.

    Raises ResourceLimitError over the bound, ConfigError for a config the built-in rejects.
    """
    params = parameter_count(spec.program, spec.config)
    if params is not None and params > max_params:
        raise ResourceLimitError(f"program {spec.program!r} with this config has {params} "
                                 f"parameters; at most {max_params} are taken here "
                                 f"(--max-params)")
    return params


def job_executor(spec: JobSpec, profile: Profile) -> Executor:
    """An executor for `spec`'s program, seed and precision on `profile` (holding no state)."""
    return Executor(load_job_program(spec), seed=spec.seed, policy=spec.policy, profile=profile)


def create_job(job_file: Path) -> tuple[JobSpec, dict[str, torch.Tensor]]:
    """Build a JobSpec and its initial state S_0 from a TOML job file."""
    try:
        request = tomllib.loads(Path(job_file).read_text())
    except OSError as err:
        raise ConfigError(f"cannot read job file {job_file}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"job file {job_file} is not valid TOML: {err}") from None
    unknown = set(request) - _JOB_KEYS
    if unknown:
        raise ConfigError(f"unknown keys in job file: {', '.join(sorted(unknown))}; "
                          f"allowed: {', '.join(sorted(_JOB_KEYS))}")
    if "program" not in request or "steps" not in request:
        raise ConfigError("a job file needs at least 'program' and 'steps'")
    return build_job(
        program=typed(request["program"], str, "program"),
        config=typed(request.get("config", {}), dict, "config"),
        preset=request.get("preset"), steps=count(request["steps"], 1, "steps"),
        seed=count(request.get("seed", 0), 0, "seed"),
        init_seed=count(request.get("init_seed", 1), 0, "init_seed"),
        policy=_policy(request.get("precision", {})),
        checkpoint_interval=count(request.get("checkpoint_interval", 50), 1,
                                   "checkpoint_interval"),
        commit_interval=count(request.get("commit_interval", 50), 1, "commit_interval"))


def build_job(*, program: str, config: dict, preset: str | None, steps: int, seed: int,
              init_seed: int, policy: PrecisionPolicy, checkpoint_interval: int,
              commit_interval: int) -> tuple[JobSpec, dict[str, torch.Tensor]]:
    """The JobSpec and S_0 for a program (the library form of `ovt job create`)."""
    instance = load_program(program, config, preset)
    ex = Executor(instance, seed=seed, policy=policy, profile=Profile("create"))
    ex.init_state(init_seed)
    state0 = ex.state()
    data, _ = commit_dataset(instance.dataset)
    spec = JobSpec(
        program=program, program_source_hash=hashlib.sha256(program_source(program)).digest(),
        config=dict(instance.config), data=data, h0=state_digest(state0), steps=steps,
        seed=seed, policy=policy, checkpoint_interval=checkpoint_interval,
        commit_interval=commit_interval)
    return spec, state0


def _policy(section: dict) -> PrecisionPolicy:
    typed(section, dict, "precision")
    unknown = set(section) - _PRECISION_KEYS
    if unknown:
        raise ConfigError(f"unknown keys in [precision]: {', '.join(sorted(unknown))}")
    try:
        compute = DTYPES[section.get("compute", "float64")]
        target = DTYPES[section.get("target", "float32")]
    except KeyError as err:
        raise ConfigError(f"unknown dtype {err.args[0]!r} in [precision]") from None
    return PrecisionPolicy(compute, target, section.get("rules", RULES_VERSION))


