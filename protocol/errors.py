"""The one error hierarchy of ovt.

Every error a user or a peer can cause is an `OvtError`: it explains itself in one line
(`str(err)`) and carries an exit code, so the CLI catches `OvtError` in one place and never shows
a traceback for a user mistake. Internal bugs stay ordinary exceptions.

Daemons turn these errors into gRPC status codes in one place, at their edge
(`proto.status.STATUS_OF`, applied to every servicer by `proto.status.rpc_errors`): a servicer
raises the error that says what went wrong, never a status code.
"""

from __future__ import annotations


class OvtError(Exception):
    """Base of all expected failures. `exit_code` is what the CLI exits with."""

    exit_code = 2


class ConfigError(OvtError):
    """Bad user input: unknown program, bad profile string, bad option value."""


class ProgramError(OvtError):
    """A training program could not be loaded or does something a step may not do."""


class LogFormatError(OvtError):
    """Rounding-log bytes that do not decode: bad magic, truncated, non-canonical, trailing."""


class StateFormatError(OvtError):
    """State bytes that do not decode as the canonical state encoding (SPEC §2 "State")."""


class LogMismatchError(OvtError):
    """A rounding log whose structure (site count, site sizes) differs from the replayed step.

    SPEC §3.3: the same program replays the same site sequence, so any difference means the log
    belongs to another program, config or step.
    """


class LogViolationError(OvtError):
    """A logged rounding decision where no choice existed (SPEC §3.2, validity rule).

    Raised in replay when a logged element's replayed value lies farther than 4e' from the
    rounding boundary (e' its certified error bound), or its op is correctly rounded (e' = 0).
    Carries the step, site, op, flat element index, the distance δ' and the bound e'.
    """

    exit_code = 3

    def __init__(self, step: int | None, site: int, op: str, index: int, distance: float,
                 bound: float, note: str | None = None) -> None:
        self.step, self.site, self.op = step, site, op
        self.index, self.distance, self.bound, self.note = index, distance, bound, note
        where = f"step {step}, " if step is not None else ""
        if note is not None:
            why = f"{distance:.6g} away, e' = {bound:.6g}: {note}"
        elif bound > 0:
            why = (f"{distance:.6g} from the rounding boundary, {distance / bound:.3g} times its "
                   f"certified error bound e' = {bound:.6g} (the limit is 4)")
        else:
            why = (f"{distance:.6g} from the rounding boundary, and its op is correctly rounded "
                   f"(error bound 0): every machine computes the same value")
        super().__init__(
            f"log violation at {where}site {site} ({op}), element {index}: replayed value is "
            f"{why}; the log claims a rounding choice that did not exist"
        )


class DeterminismError(OvtError):
    """A step did something that cannot be replayed bit-exactly (e.g. used a device RNG)."""


class EncodingError(OvtError):
    """Bytes that are not the canonical encoding of an allowed value (SPEC §2: one byte string
    per value). Raised for malformed, truncated, non-canonical or oversized input."""


class ProofError(OvtError):
    """A Merkle inclusion proof that is malformed (wrong length, index out of range)."""


class RootMismatchError(ProofError):
    """A proof that recomputes to another root than the one committed to.

    Carries both roots so the caller can show what was expected and what came out.
    """

    def __init__(self, expected: bytes, computed: bytes, what: str = "inclusion proof") -> None:
        self.expected, self.computed = expected, computed
        super().__init__(f"{what} does not verify: expected root {expected.hex()}, "
                         f"computed {computed.hex()}")


class SignatureError(OvtError):
    """A signature that does not verify, or a signed object bound to another job, role or
    protocol version than the one it is presented for."""


class StoreError(OvtError):
    """A stored object that is missing or fails its hash check and cannot be regenerated."""


class GameError(OvtError):
    """A call that is not legal in the dispute game's current state (SPEC §5.2): a move after
    the game is over, an answer when no question is outstanding or from an unknown party, a
    question while one is outstanding, a timeout before the deadline, time running backwards.

    A party's bad move (bad proof, malformed answer, silence) is never a GameError: it is an
    outcome, that party losing. A GameError means the caller drove the game wrongly.
    """


class TranscriptError(GameError):
    """A game transcript that does not replay: malformed records, an illegal move, or recorded
    decisions or an outcome other than the ones the moves re-derive (SPEC §5.4, offline re-check).
    """


class VerdictError(OvtError):
    """A verdict that is not accepted (SPEC §5.4): bytes that do not parse strictly, a signature
    that does not verify or is not the expected arbiter's, a transcript that does not replay, a
    decision that does not follow from the transcript and the re-execution, or re-execution
    evidence that does not reproduce the verdict's finding. One type, so a CLI catches it in one
    place; the message names the first check that failed and its cause."""


# --- a peer's request, as a serving party judges it (mapped to gRPC codes in proto.serving) ---

class RequestError(OvtError):
    """A request that is malformed: a field of the wrong size or shape, a stream out of order."""


class NotFoundError(OvtError):
    """A request about a job (or an audit, a challenge) this party does not hold."""


class OutOfRangeError(OvtError):
    """A request for a step or range this party does not have (not yet, or not in the job)."""


class RefusedError(OvtError):
    """A well-formed request this party will not serve in its present state: no commitment
    yet, a program it does not allow, a store that holds another job under the same id."""


class ResourceLimitError(OvtError):
    """A request beyond a documented per-peer limit (queued jobs, bytes, concurrent streams)."""


class UnavailableError(OvtError):
    """This party is shutting down and takes no new work."""


# --- a peer's answer, as the asking party judges it ---

class PeerError(OvtError):
    """A peer that answered wrongly, not at all, or with something that does not verify."""


class NoAnswer(PeerError):
    """A party to a dispute did not answer, or answered with something that is not an answer
    at all (the arbiter records it as that party's failure, never as its own)."""


class WorkerError(OvtError):
    """A worker process of this party that died, did not start or stopped answering: a
    data-parallel worker (`protocol.engine.dataparallel`; the step it was computing is run
    again) or an audit interval's (`protocol.job.intervals`)."""


class ArbiterError(OvtError):
    """The arbiter itself failed (not a party): no verdict can be signed."""
