"""The arbiter's re-execution of the one disputed step (SPEC §5.3).

Bisection (SPEC §5.2, `protocol.dispute.game`) ends with leaf i - 1 agreed and leaf i disagreed. The
arbiter then needs three pieces of evidence, each checked against something both parties are
already bound to, before it spends any compute:

- `S_{i-1}`, checked against the agreed `h_{i-1}` (and its step counter against i - 1);
- the examples of `B_i`, checked against the job's data commitment at the indices the job's
  portable data order picks for step i (SPEC §2.1, §3.4);
- the trainer's `L_i`, checked against `ℓ_i` in the trainer's signed leaf i.

Evidence that fails these checks is `"bad-evidence"`: whoever handed it to `reexecute` (the
arbiter's driver) made a mistake, it says nothing about either party, and no verdict may rest on
it. Evidence a party did not serve at all is recorded with `withheld` (its finding names who).
With good evidence the arbiter replays step i in replay mode (SPEC §3.2) on its own profile:
a log that does not decode, claims a rounding choice where none existed, or does not fit the
step's sites is `"invalid-log"` (the trainer signed ℓ_i over it); otherwise the finding is
`"computed"` with `h_i*`. Which party that faults is the verdict's business (SPEC §5.4,
`protocol.dispute.verdict`), not this module's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from protocol.codec.fields import abbrev
from protocol.codec.roundinglog import decode_log, log_digest
from protocol.codec.state import state_digest
from protocol.commit.data import ProvenExample, example_digest, verify_examples
from protocol.engine.batches import batch_indices
from protocol.engine.executor import Executor
from protocol.engine.profiles import Profile
from protocol.errors import (
    ConfigError,
    EncodingError,
    LogFormatError,
    LogMismatchError,
    LogViolationError,
    ProofError,
)

if TYPE_CHECKING:
    from protocol.dispute.game import Dispute
    from protocol.engine.programs.base import TrainingProgram
    from protocol.job.spec import JobSpec

FINDINGS = ("computed", "invalid-log", "withheld", "bad-evidence")
WITHHELD_BY = ("trainer", "auditor", "both")
MAX_DETAIL_CHARS = 1000
MAX_PROFILE_CHARS = 200
MAX_EXAMPLES = 2**20
_HASH_SIZE = 32
_MAX_STEP = 2**63 - 1
_FIELDS = ("step", "finding", "state_hash", "detail", "withheld_by", "profile",
           "prev_state_hash", "log_digest", "example_digests", "seconds")


@dataclass(frozen=True)
class Reexecution:
    """What the arbiter found re-executing disputed step `step` (SPEC §5.3).

    `finding` is one of FINDINGS; `state_hash` is h_i* exactly when the finding is "computed";
    `withheld_by` names the silent party ("trainer", "auditor" or "both") exactly when it is
    "withheld". `prev_state_hash`, `log_digest` and `example_digests` are the digests of the
    evidence actually used (S_{i-1}, L_i, B_i's examples in batch order), so a verdict shows what
    h_i* was computed from; `profile` is the arbiter's profile name and `seconds` the wall time.
    Construction checks every field's shape and raises EncodingError, so `from_body` on
    untrusted input and the arbiter's own construction share one set of rules.
    """

    step: int
    finding: str
    state_hash: bytes | None
    detail: str
    withheld_by: str | None
    profile: str
    prev_state_hash: bytes | None
    log_digest: bytes | None
    example_digests: tuple[bytes, ...]
    seconds: float

    def __post_init__(self) -> None:
        if type(self.step) is not int or not 1 <= self.step <= _MAX_STEP:
            raise EncodingError(f"re-execution step must be an integer >= 1, got "
                                f"{self.step!r}")
        if type(self.finding) is not str or self.finding not in FINDINGS:
            raise EncodingError(f"re-execution finding must be one of {', '.join(FINDINGS)}, "
                                f"got {self.finding!r}")
        if self.finding == "computed":
            _hash("re-execution state_hash", self.state_hash)
        elif self.state_hash is not None:
            raise EncodingError(f"a {self.finding!r} re-execution has no state hash")
        _text("re-execution detail", self.detail, MAX_DETAIL_CHARS)
        if self.finding == "withheld":
            if type(self.withheld_by) is not str or self.withheld_by not in WITHHELD_BY:
                raise EncodingError(f"a withheld re-execution names who withheld the evidence "
                                    f"({', '.join(WITHHELD_BY)}), got {self.withheld_by!r}")
        elif self.withheld_by is not None:
            raise EncodingError(f"a {self.finding!r} re-execution names no withholding party")
        _text("re-execution profile", self.profile, MAX_PROFILE_CHARS, allow_empty=False)
        for name in ("prev_state_hash", "log_digest"):
            value = getattr(self, name)
            if value is not None:
                _hash(f"re-execution {name}", value)
        digests = self.example_digests
        if type(digests) not in (tuple, list) or len(digests) > MAX_EXAMPLES:
            raise EncodingError(f"re-execution example_digests must be a list of at most "
                                f"{MAX_EXAMPLES} hashes")
        for k, value in enumerate(digests):
            _hash(f"re-execution example_digests[{k}]", value)
        object.__setattr__(self, "example_digests", tuple(digests))
        if type(self.seconds) is not float or not math.isfinite(self.seconds) \
                or self.seconds < 0:
            raise EncodingError(f"re-execution seconds must be a finite float >= 0, got "
                                f"{self.seconds!r}")

    def to_body(self) -> dict[str, Any]:
        """The canonical map (what a verdict embeds and signs)."""
        body = {name: getattr(self, name) for name in _FIELDS}
        body["example_digests"] = list(self.example_digests)
        return body

    @classmethod
    def from_body(cls, body: object) -> Reexecution:
        """Strictly rebuild from a decoded map: exactly the fields, each of the right shape.
        Raises EncodingError."""
        if not isinstance(body, dict) or set(body) != set(_FIELDS):
            raise EncodingError(f"a re-execution is a map with the fields "
                                f"{', '.join(sorted(_FIELDS))}")
        if type(body["example_digests"]) is not list:
            raise EncodingError("re-execution example_digests must be a list")
        return cls(**body)


def withheld(step: int, by: str, detail: str, profile: str) -> Reexecution:
    """The record for a step the arbiter could not re-execute because `by` ("trainer",
    "auditor" or "both") did not serve the evidence it owes (SPEC §5.4: a party that fails to
    answer is at fault). `profile` is the arbiter's profile name."""
    return Reexecution(step, "withheld", None, _line(detail), by, profile, None, None, (), 0.0)


def check_state(dispute: Dispute, state: object) -> tuple[bytes | None, str | None]:
    """S_{i-1} against the agreed h_{i-1}, and its step counter against i - 1 (SPEC §5.3).
    Returns (its digest, or None if it cannot be hashed; the problem, or None if it is good)."""
    step = dispute.step
    if not isinstance(state, Mapping):
        return None, f"S_{step - 1} cannot be hashed as a state: a {type(state).__name__} is " \
                     f"not a mapping"
    try:
        digest = state_digest(state)
    except (TypeError, AttributeError, ValueError, RuntimeError) as err:
        return None, f"S_{step - 1} cannot be hashed as a state: {err}"
    if digest != dispute.agreed.state_hash:
        return digest, (f"S_{step - 1} hashes to {abbrev(digest)}, not the agreed "
                        f"h_{step - 1} = {abbrev(dispute.agreed.state_hash)}")
    counter = state.get("step")
    if not isinstance(counter, torch.Tensor) or counter.numel() != 1 \
            or counter.is_floating_point() or int(counter) != step - 1:
        return digest, f"S_{step - 1} does not hold the step counter {step - 1}"
    return digest, None


def check_examples(spec: JobSpec, step: int, examples: object,
                   batch_size: int) -> tuple[tuple[bytes, ...], str | None]:
    """B_`step`'s examples against the job's data commitment at the indices its data order
    picks (SPEC §2.1). The data order is a permutation of the spec's data count, so `spec`
    must have passed `protocol.job.create.load_job_program(spec, examples=False)` (which
    gives `batch_size`): it refuses a count that is not the program's dataset's or is over
    MAX_EXAMPLES. Returns (the examples' digests, or () if they cannot be hashed; the problem,
    or None)."""
    if not isinstance(examples, list | tuple) or \
            not all(isinstance(e, ProvenExample) for e in examples):
        return (), "the examples of B_i must be a list of ProvenExample"
    try:
        digests = tuple(example_digest(e.example) for e in examples)
    except (TypeError, AttributeError, ValueError, RuntimeError) as err:
        return (), f"an example of B_{step} cannot be hashed: {err}"
    indices = batch_indices(spec.seed, spec.data.count, batch_size, step)
    try:
        verify_examples(spec.data, list(examples), indices)
    except (ProofError, TypeError, ValueError) as err:
        return digests, f"the examples are not B_{step} of the data commitment: {err}"
    return digests, None


def check_log(dispute: Dispute, log: object) -> tuple[bytes | None, str | None]:
    """L_i's bytes against the trainer's ℓ_i (SPEC §5.3). Returns (their digest, or None if
    they are not bytes; the problem, or None)."""
    step = dispute.step
    if not isinstance(log, bytes | bytearray | memoryview):
        return None, f"L_{step} must be bytes, not {type(log).__name__}"
    digest = log_digest(bytes(log))
    if digest != dispute.trainer.log_hash:
        return digest, (f"L_{step} hashes to {abbrev(digest)}, not the trainer's "
                        f"ℓ_{step} = {abbrev(dispute.trainer.log_hash)}")
    return digest, None


def reexecute(spec: JobSpec, dispute: Dispute, prev_state: dict[str, torch.Tensor],
              examples: list[ProvenExample], log: bytes, *, program: TrainingProgram,
              profile: Profile) -> Reexecution:
    """Check the evidence for disputed step i = `dispute.step` and replay it (SPEC §5.3).

    `program` is the job's program as `protocol.job.create.load_job_program(spec,
    examples=False)` builds it (B_i's examples are `examples`, checked here): the caller builds
    it once, for this and for the batch size its evidence checks need, and hands it over
    unused (the executor loads S_{i-1} into its model).

    Checks, in order: S_{i-1} hashes to the agreed h_{i-1} and holds step counter i - 1;
    `examples` are exactly the committed examples of B_i; `log` hashes to the trainer's ℓ_i.
    The first that fails gives finding "bad-evidence" (a driver error, not a party's fault).
    Then step i runs in replay mode on a fresh executor on `profile`: a log that does not
    decode, a log violation or a log/site mismatch gives "invalid-log" (SPEC §3.2, §3.3),
    otherwise "computed" with h_i* = the hash of the resulting state.

    Raises only for the arbiter's own problems: a profile that cannot run here (ConfigError).
    """
    started = time.perf_counter()
    step = dispute.step
    prev_hash, problem = check_state(dispute, prev_state)
    digests, examples_problem = check_examples(spec, step, examples, program.batch_size)
    log_hash, log_problem = check_log(dispute, log)

    def result(finding: str, detail: str, state_hash: bytes | None = None) -> Reexecution:
        return Reexecution(step, finding, state_hash, _line(detail), None, profile.name,
                           prev_hash, log_hash, digests, time.perf_counter() - started)

    problem = problem or examples_problem or log_problem
    if problem is not None:
        return result("bad-evidence", problem)

    # Replay step i (SPEC §3.2 replay mode) on the arbiter's own profile.
    ex = Executor(program, seed=spec.seed, policy=spec.policy, profile=profile,
                  micro_batches=spec.micro_batches)
    try:
        ex.load_state(prev_state)
    except ConfigError as err:
        return result("bad-evidence", f"S_{step - 1} does not fit the job's program: {err}")
    try:
        ex.step(decode_log(bytes(log)), examples=[e.example for e in examples])
    except (LogFormatError, LogViolationError, LogMismatchError) as err:
        return result("invalid-log", str(err))
    if ex.step_count != step:  # load_state set the counter from S_{i-1}, checked above
        raise AssertionError(f"the executor ran step {ex.step_count}, not {step}")
    h_star = state_digest(ex.state())
    return result("computed", f"replayed step {step} with the trainer's L_{step} on "
                              f"{profile.describe()}: h_{step}* = {abbrev(h_star)}", h_star)


# ---- helpers ----------------------------------------------------------------------------------


def _line(text: str) -> str:
    """One line, at most MAX_DETAIL_CHARS (error messages may span lines or run long)."""
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS - 1] + "…"


def _hash(name: str, value: object) -> None:
    if type(value) is not bytes or len(value) != _HASH_SIZE:
        raise EncodingError(f"{name} must be {_HASH_SIZE} bytes")


def _text(name: str, value: object, limit: int, *, allow_empty: bool = True) -> None:
    if type(value) is not str or len(value) > limit or (not allow_empty and not value):
        raise EncodingError(f"{name} must be a string of {'1' if not allow_empty else '0'}.."
                            f"{limit} characters")
    if "\n" in value or "\r" in value:
        raise EncodingError(f"{name} must be one line")
