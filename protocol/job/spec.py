"""The job spec: everything both parties agreed to, and its content id (SPEC §2 "JobSpec").

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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from protocol.codec.canonical import decode, encode
from protocol.codec.state import state_digest
from protocol.commit.data import DataCommitment, commit_dataset
from protocol.commit.signing import PROTOCOL_VERSION
from protocol.engine.executor import Executor
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.engine.programs.registry import load_program, program_source
from protocol.errors import ConfigError, EncodingError, ProgramError

_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
_JOB_KEYS = {"program", "preset", "steps", "seed", "init_seed", "checkpoint_interval",
             "commit_interval", "config", "precision"}
_PRECISION_KEYS = {"compute", "target", "tau", "tau_ieee"}


@dataclass(frozen=True)
class JobSpec:
    program: str
    program_source_hash: bytes
    config: dict
    data: DataCommitment
    h0: bytes
    steps: int
    seed: int
    policy: PrecisionPolicy
    checkpoint_interval: int
    commit_interval: int
    protocol_version: int = field(default=PROTOCOL_VERSION)

    def to_body(self) -> dict:
        return {
            "protocol_version": self.protocol_version,
            "program": self.program,
            "program_source_hash": self.program_source_hash,
            "config": self.config,
            "data": self.data.to_body(),
            "h0": self.h0,
            "steps": self.steps,
            "seed": self.seed,
            "precision": {"compute": _dtype_name(self.policy.compute),
                          "target": _dtype_name(self.policy.target),
                          "tau": float(self.policy.tau), "tau_ieee": float(self.policy.tau_ieee)},
            "checkpoint_interval": self.checkpoint_interval,
            "commit_interval": self.commit_interval,
        }

    def to_bytes(self) -> bytes:
        return encode(self.to_body())

    @property
    def job_id(self) -> bytes:
        return hashlib.sha256(self.to_bytes()).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> JobSpec:
        """Strictly decode a job spec received from anyone (EncodingError if malformed)."""
        body = decode(data)
        try:
            return cls._from_body(body)
        except (KeyError, TypeError, ValueError, ConfigError) as err:
            raise EncodingError(f"not a valid job spec: {err}") from None

    @classmethod
    def _from_body(cls, body: dict) -> JobSpec:
        _require(isinstance(body, dict), "job spec must be a map")
        if body["protocol_version"] != PROTOCOL_VERSION:
            raise EncodingError(f"job spec has protocol version {body['protocol_version']}, "
                                f"this ovt speaks {PROTOCOL_VERSION}")
        data, prec = body["data"], body["precision"]
        _require(isinstance(data, dict) and isinstance(prec, dict), "bad data or precision")
        spec = cls(
            program=_typed(body["program"], str), config=_typed(body["config"], dict),
            program_source_hash=_hash32(body["program_source_hash"]),
            data=DataCommitment(_hash32(data["root"]), _count(data["count"], 1)),
            h0=_hash32(body["h0"]), steps=_count(body["steps"], 1), seed=_count(body["seed"], 0),
            policy=PrecisionPolicy(_DTYPES[prec["compute"]], _DTYPES[prec["target"]],
                                   _typed(prec["tau"], float), _typed(prec["tau_ieee"], float)),
            checkpoint_interval=_count(body["checkpoint_interval"], 1),
            commit_interval=_count(body["commit_interval"], 1),
        )
        if spec.to_body() != body:
            raise EncodingError("job spec has unknown or non-canonical fields")
        return spec

    def program_instance(self):
        """Load the agreed program and check that its source is the one committed to."""
        digest = hashlib.sha256(program_source(self.program)).digest()
        if digest != self.program_source_hash:
            raise ProgramError(f"the source of program {self.program!r} differs from the one "
                               f"this job committed to ({digest.hex()[:16]}… != "
                               f"{self.program_source_hash.hex()[:16]}…)")
        return load_program(self.program, self.config)

    def summary(self) -> dict:
        """A human/JSON-friendly view (hashes in hex)."""
        body = self.to_body()
        return {"job_id": self.job_id.hex(), **_hexify(body)}


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
        program=_typed(request["program"], str, "program"),
        config=_typed(request.get("config", {}), dict, "config"),
        preset=request.get("preset"), steps=_count(request["steps"], 1, "steps"),
        seed=_count(request.get("seed", 0), 0, "seed"),
        init_seed=_count(request.get("init_seed", 1), 0, "init_seed"),
        policy=_policy(request.get("precision", {})),
        checkpoint_interval=_count(request.get("checkpoint_interval", 50), 1,
                                   "checkpoint_interval"),
        commit_interval=_count(request.get("commit_interval", 50), 1, "commit_interval"))


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
    _typed(section, dict, "precision")
    unknown = set(section) - _PRECISION_KEYS
    if unknown:
        raise ConfigError(f"unknown keys in [precision]: {', '.join(sorted(unknown))}")
    try:
        compute = _DTYPES[section.get("compute", "float64")]
        target = _DTYPES[section.get("target", "float32")]
    except KeyError as err:
        raise ConfigError(f"unknown dtype {err.args[0]!r} in [precision]") from None
    return PrecisionPolicy(compute, target, section.get("tau"), section.get("tau_ieee", 0.0))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise EncodingError(message)


def _typed(value, kind, what: str = "value"):
    if not isinstance(value, kind) or (kind is float and isinstance(value, bool)):
        raise ConfigError(f"{what} must be a {kind.__name__}, got {value!r}")
    return value


def _count(value, minimum: int, what: str = "value") -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _hash32(value) -> bytes:
    if not isinstance(value, bytes) or len(value) != 32:
        raise ConfigError("expected a 32-byte hash")
    return value


def _hexify(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _hexify(v) for k, v in value.items()}
    return value
