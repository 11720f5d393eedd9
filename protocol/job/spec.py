"""The job spec: everything both parties agreed to, and its content id (SPEC §2 "JobSpec").

A `JobSpec` is a pure wire object: its canonical bytes, its id `job_id = sha256(canonical
JobSpec)`, and a strict decoder (any decoded spec re-encodes to exactly the bytes it came from).
Making a spec from a job file, and loading the program it names, is `protocol.job.create`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from protocol.codec.canonical import PROTOCOL_VERSION, decode_object, encode
from protocol.codec.dtypes import DTYPES, dtype_name
from protocol.codec.fields import require_version
from protocol.commit.data import DataCommitment
from protocol.commit.hashing import HASH_SIZE
from protocol.engine.datasets import DataFile
from protocol.engine.precision import PrecisionPolicy
from protocol.errors import ConfigError, EncodingError


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
    micro_batches: int = 1
    # Where the examples come from: None, the program's own dataset; else a user's file, which
    # `data` commits to (protocol.engine.datasets).
    data_file: DataFile | None = None
    protocol_version: int = field(default=PROTOCOL_VERSION)

    def to_body(self) -> dict:
        return {
            "protocol_version": self.protocol_version,
            "program": self.program,
            "program_source_hash": self.program_source_hash,
            "config": self.config,
            "data": self.data.to_body(),
            "data_file": None if self.data_file is None else self.data_file.to_body(),
            "h0": self.h0,
            "steps": self.steps,
            "seed": self.seed,
            "precision": {"compute": dtype_name(self.policy.compute),
                          "target": dtype_name(self.policy.target),
                          "rules": self.policy.rules},
            "checkpoint_interval": self.checkpoint_interval,
            "commit_interval": self.commit_interval,
            "micro_batches": self.micro_batches,
        }

    def to_bytes(self) -> bytes:
        return encode(self.to_body())

    @property
    def job_id(self) -> bytes:
        return hashlib.sha256(self.to_bytes()).digest()

    @classmethod
    def from_bytes(cls, data: bytes) -> JobSpec:
        """Strictly decode a job spec received from anyone (SPEC §2, `decode_object`): the
        spec must re-encode to exactly `data`, since an alias such as protocol_version `True`
        or `1.0` would hash to another job id than the job it decodes to. Raises
        EncodingError for malformed bytes, a missing, unknown or ill-typed field, or an
        alias."""
        return decode_object(data, cls._from_body, cls.to_bytes, what="job spec")

    @classmethod
    def _from_body(cls, body: object) -> JobSpec:
        if not isinstance(body, dict):
            raise EncodingError("job spec must be a map")
        try:
            require_version("job spec", body["protocol_version"])
            data, prec = body["data"], body["precision"]
            _require(isinstance(data, dict) and isinstance(prec, dict), "bad data or precision")
            return cls(
                program=typed(body["program"], str), config=typed(body["config"], dict),
                program_source_hash=_hash32(body["program_source_hash"]),
                data=DataCommitment(_hash32(data["root"]), count(data["count"], 1)),
                h0=_hash32(body["h0"]), steps=count(body["steps"], 1),
                seed=count(body["seed"], 0),
                policy=PrecisionPolicy(DTYPES[prec["compute"]], DTYPES[prec["target"]],
                                       count(prec["rules"], 1)),
                checkpoint_interval=count(body["checkpoint_interval"], 1),
                commit_interval=count(body["commit_interval"], 1),
                micro_batches=count(body["micro_batches"], 1),
                data_file=None if body["data_file"] is None else
                DataFile.from_body(body["data_file"]),
            )
        except (KeyError, TypeError, ValueError, ConfigError) as err:
            raise EncodingError(f"not a valid job spec: {err}") from None

    def summary(self) -> dict:
        """A human/JSON-friendly view (hashes in hex)."""
        body = self.to_body()
        return {"job_id": self.job_id.hex(), **_hexify(body)}


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise EncodingError(message)


def typed(value, kind, what: str = "value"):
    """`value` if it is a `kind` (a bool is no float), else ConfigError naming `what`."""
    if not isinstance(value, kind) or (kind is float and isinstance(value, bool)):
        raise ConfigError(f"{what} must be a {kind.__name__}, got {value!r}")
    return value


def count(value, minimum: int, what: str = "value") -> int:
    """`value` if it is an int (not a bool) >= `minimum`, else ConfigError naming `what`."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return value


def _hash32(value) -> bytes:
    if not isinstance(value, bytes) or len(value) != HASH_SIZE:
        raise ConfigError(f"expected a {HASH_SIZE}-byte hash")
    return value


def _hexify(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {k: _hexify(v) for k, v in value.items()}
    return value
