"""The decision table of SPEC §5.4: (game, re-execution) -> (fault, finding, step, reason).

A dispute ends in one of two ways. Either the bisection game itself ended against a party
(a bad commitment or challenge, leaf 0 not matching h_0, a malformed or unprovable answer, a
missed deadline: `protocol.dispute.game`), and that is the verdict; or it ended with leaf
i - 1 agreed and leaf i disagreed, and the arbiter re-executed step i (SPEC §5.3,
`protocol.dispute.reexecute`).
`decide` is the one table mapping (game, re-execution) to (fault, finding, step, reason):

| game / re-execution                     | fault    | finding          |
|-----------------------------------------|----------|------------------|
| game over against a party               | it       | the game's kind  |
| evidence withheld by p                  | p        | withheld         |
| L_i does not decode / violates / misfits| trainer  | invalid-log      |
| h_i* equals the trainer's h_i           | auditor  | false-challenge  |
| h_i* equals the auditor's h_i           | trainer  | wrong-state      |
| h_i* equals neither                     | none     | inconclusive     |
| no auditor h_i; h_i* is the trainer's   | none     | not-upheld       |
| no auditor h_i; h_i* is not the trainer's | trainer | wrong-state     |

An auditor files no h_i of its own when it could not replay step i: the trainer served it a
log that did not match ℓ_i, or one that was invalid. If the log the arbiter gets re-executes to
the trainer's h_i, nobody is provably at fault (the trainer may have served the auditor another
log than the arbiter), so the challenge is not upheld rather than false; if it re-executes to
anything else, the trainer's signed h_i does not follow from its own valid log.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.codec.fields import abbrev
from protocol.dispute.game import KINDS, GameState, dispute
from protocol.dispute.reexecute import Reexecution

REEXECUTION_FINDINGS = ("withheld", "invalid-log", "false-challenge", "wrong-state",
                        "inconclusive", "not-upheld")
FINDINGS = tuple(k for k in KINDS if k != "disagreed-at") + REEXECUTION_FINDINGS


@dataclass(frozen=True)
class Finding:
    """Who is at fault ("trainer", "auditor", "both" or "none"), the finding (a game kind or
    one of REEXECUTION_FINDINGS), the step concerned (None when the game ended at its start on
    a bad commitment) and one readable line saying why."""

    fault: str
    finding: str
    step: int | None
    reason: str


def decide(game: GameState, reexec: Reexecution | None) -> Finding:
    """The verdict's decision for a finished game and the re-execution of its disputed step
    (SPEC §5.4; the table is in the module docstring).

    A game that ended against a party decides alone, and `reexec` must be None: nothing was
    re-executed. A game that ended "disagreed-at" step i needs `reexec` for step i. Raises
    ValueError for a running game, a missing, superfluous or other-step re-execution, and for
    "bad-evidence" (the driver handed evidence that does not match the dispute: no verdict may
    rest on that). Deterministic, so `verify_verdict` can recompute it from the transcript.
    """
    if not isinstance(game, GameState):
        raise TypeError(f"expected a GameState, not {type(game).__name__}")
    if reexec is not None and not isinstance(reexec, Reexecution):
        raise TypeError(f"expected a Reexecution or None, not {type(reexec).__name__}")
    outcome = game.outcome
    if outcome is None:
        raise ValueError("the game is still running: a verdict needs a finished game")
    if outcome.kind != "disagreed-at":
        # SPEC §5.4: a party that failed to answer, sent a bad proof or contradicted its signed
        # root is at fault; the game already decided who.
        if reexec is not None:
            raise ValueError(f"the game ended with {outcome.kind!r} ({outcome.fault} at fault): "
                             f"no step is disputed, so there is no re-execution to record")
        return Finding(outcome.fault, outcome.kind, outcome.step, outcome.reason)

    d = dispute(game)
    assert d is not None  # the game ended "disagreed-at", so a step is disputed
    i = d.step
    if reexec is None:
        raise ValueError(f"step {i} is disputed: the verdict needs its re-execution")
    if reexec.step != i:
        raise ValueError(f"the re-execution is of step {reexec.step}, but step {i} is disputed")
    if reexec.finding == "bad-evidence":
        raise ValueError(f"the re-execution of step {i} ran on bad evidence ({reexec.detail}); "
                         f"fetch the evidence again: no verdict may rest on it")
    if reexec.finding == "withheld":
        assert reexec.withheld_by is not None  # Reexecution requires it for "withheld"
        who = "both parties" if reexec.withheld_by == "both" else f"the {reexec.withheld_by}"
        return Finding(reexec.withheld_by, "withheld", i,
                       f"step {i}: {who} did not serve the evidence re-execution needs "
                       f"({reexec.detail})")
    if reexec.finding == "invalid-log":
        return Finding("trainer", "invalid-log", i,
                       f"step {i}: the trainer's rounding log L_{i} (ℓ_{i} = "
                       f"{abbrev(d.trainer.log_hash)}) is invalid: {reexec.detail}")
    h_star, trainer_h = reexec.state_hash, d.trainer.state_hash
    assert h_star is not None  # "computed" is the finding left; Reexecution requires its hash
    if d.auditor is None:  # the auditor could not replay step i at all (module docstring)
        if h_star == trainer_h:
            return Finding("none", "not-upheld", i,
                           f"step {i}: the trainer's L_{i} is valid and re-executes to its "
                           f"h_{i} = {abbrev(trainer_h)}; the auditor, which could not replay "
                           f"the step, filed no h_{i} to weigh: nobody is provably at fault")
        return Finding("trainer", "wrong-state", i,
                       f"step {i}: the trainer's own valid L_{i} re-executes to h_{i}* = "
                       f"{abbrev(h_star)}, not to its signed h_{i} = {abbrev(trainer_h)}")
    auditor_h = d.auditor.state_hash
    if h_star == trainer_h:
        return Finding("auditor", "false-challenge", i,
                       f"step {i}: re-executed h_{i}* = {abbrev(h_star)} equals the trainer's "
                       f"h_{i}; the auditor's challenge (its h_{i} = {abbrev(auditor_h)}) is "
                       f"false")
    if h_star == auditor_h:
        return Finding("trainer", "wrong-state", i,
                       f"step {i}: re-executed h_{i}* = {abbrev(h_star)} equals the auditor's "
                       f"h_{i}, not the trainer's h_{i} = {abbrev(trainer_h)}")
    return Finding("none", "inconclusive", i,
                   f"step {i}: re-executed h_{i}* = {abbrev(h_star)} equals neither the "
                   f"trainer's h_{i} = {abbrev(trainer_h)} nor the auditor's h_{i} = "
                   f"{abbrev(auditor_h)}")


def describe_finding(f: Finding) -> str:
    """One line: who, what, where and why."""
    return f"{f.fault} at fault, {f.finding} at step {f.step} ({f.reason!r})"
