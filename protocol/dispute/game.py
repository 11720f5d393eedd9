"""The bisection game of SPEC §5.2: a pure, transport-free state machine.

No sockets, no clocks, no randomness: every transition takes the current `GameState` and the
time (unix seconds, passed in by the driver) and returns a new frozen `GameState`. Laid out as
cartesi/dave `Match.sol`: records and state, views (pure predicates), requires (guards that raise
`GameError` for a call that is not legal in this state), transitions (public), private helpers,
and, in `protocol.dispute.transcript`, the canonical transcript with its replay.

The game, as played here:

- `start` checks, in this order:
  (a) both signed commitments (signature, job, role, the party's registered key; the
  trainer's n is the job's steps, the auditor's n may be smaller but not larger): a party
  whose commitment fails loses on the spot ("bad-commitment", fault "both" when both fail);
  (b) the auditor's challenge: step j in 1..n_t, the trainer's leaf j under the trainer's root,
  the auditor's leaf j under the auditor's root (or, when the auditor could not replay step j
  at all, no leaf and an auditor commitment that ends at j - 1), the two leaves differ, and
  both parties' leaf-0 claims, which the challenge carries, are for step 0 and verify under
  their party's signed root. A challenge that fails is the auditor's fault ("bad-challenge"):
  the challenge is the auditor's document. A leaf-0 claim with its inclusion proof binds its
  party whoever delivers it, so the arbiter asks no leaf-0 question. (a) and (b) are the one
  rule for a valid challenge: `Challenge.verify` applies them by calling `start`;
  (c) leaf 0 against the job (SPEC §5.2: "Leaf 0 is checked against the job spec's h_0"):
  a party whose leaf 0 is not (0, h_0, EMPTY_LOG_DIGEST) loses ("h0-mismatch", step 0; fault
  "both" when both differ).
  A game that survives has leaf 0 agreed and runs bisection on [lo, hi] = [0, j]; for j = 1
  it ends at once, with no question, as "disagreed-at" step 1.
- Each question is leaf mid = (lo + hi) // 2, both answers are checked against their party's
  signed root, and equal leaves move lo to mid, different ones move hi to mid. Invariant while
  running: lo < hi, both parties hold the same leaf lo (leaf 0 by the h_0 rule), and their
  leaves hi differ.
- An answer that does not parse as a claim ("malformed"), is for another step than the one
  asked ("wrong-step"), or fails its inclusion proof under its party's signed root, including
  a claim for another job or tree size ("bad-proof"), loses on the spot for that party. A
  party can therefore never answer one step two ways: both answers would have to verify under
  one root.
- Deadlines: a question asked at time `a` must be answered by `a + deadline_s` (inclusive).
  `timeout(state, now)` for now past the deadline, or an answer that arrives after it, ends the
  game against every party that has not answered. When both are silent the fault is "both":
  SPEC §5.2 says a missing answer loses the game for *that* party, and both failed; picking one
  would reward a silent party for the other's silence. The verdict layer decides what "both"
  costs each party.
- When hi - lo == 1 the game ends with fault "none", kind "disagreed-at", step hi: leaf hi - 1
  agreed, leaf hi disagreed; `dispute(state)` holds the leaves re-execution needs (SPEC §5.3).

Rounds: `rounds(state)` counts questions asked, and every question is a bisection round. For
a challenge at step j, a game where both parties answer validly asks exactly B(j) questions,
where B(j) is the number of halvings of [0, j] by mid = (lo + hi) // 2 until hi - lo == 1: the
interval length L becomes floor(L/2) or ceil(L/2), so floor(log2 j) <= B(j) <= ceil(log2 j)
<= ceil(log2 n), exactly log2 j for j a power of two, and 0 for j = 1 (SPEC §5.2's bound).

Outcomes are `Outcome(fault, kind, step, reason)` with fault in FAULTS and kind in KINDS.
Exceptions are for programming errors only: TypeError/ValueError for arguments of the wrong
type or value, `GameError` for a call that is not legal in this state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from protocol.codec.roundinglog import EMPTY_LOG_DIGEST
from protocol.commit.commitments import Claim, SignedCommitment
from protocol.commit.leaf import Leaf
from protocol.errors import EncodingError, GameError, ProofError, SignatureError
from protocol.job.spec import JobSpec

TRAINER = "trainer"
AUDITOR = "auditor"
PARTIES = (TRAINER, AUDITOR)
FAULTS = ("trainer", "auditor", "both", "none")
KINDS = ("bad-commitment", "bad-challenge", "h0-mismatch", "malformed", "wrong-step",
         "bad-proof", "timeout", "disagreed-at")

MAX_ANSWER_BYTES = 4096  # a claim is at most ~2.5 KB; longer answers are recorded by length only
MAX_REASON_CHARS = 500


# ============================================================================================
# Records (immutable; the transcript is a tuple of them)
# ============================================================================================

@dataclass(frozen=True)
class Start:
    """The challenge the game started from; `at` is the start time."""

    challenge_step: int
    at: float
    deadline_s: float
    trainer_leaf: bytes        # the trainer's claim for leaf j, canonical bytes
    auditor_leaf: bytes | None  # the auditor's, or None when its commitment ends at j - 1
    trainer_leaf0: bytes       # the trainer's claim for leaf 0 (carried by the challenge)
    auditor_leaf0: bytes       # the auditor's claim for leaf 0

    TYPE = "start"


@dataclass(frozen=True)
class Question:
    """Round `round` (1-based): leaf `step` asked of both parties at time `at`."""

    round: int
    step: int
    at: float

    TYPE = "question"


@dataclass(frozen=True)
class Answer:
    """An answer as received: `data` is the raw bytes (empty when `length` > MAX_ANSWER_BYTES,
    in which case only the length is kept), received at `at` for the question on `step`."""

    party: str
    step: int
    at: float
    data: bytes
    length: int

    TYPE = "answer"


@dataclass(frozen=True)
class Timeout:
    """The driver called `timeout` at `at`, past the outstanding question's deadline."""

    at: float

    TYPE = "timeout"


@dataclass(frozen=True)
class Decision:
    """Both answers on `step` were valid: `agreed` or not, and the new [lo, hi]."""

    step: int
    agreed: bool
    lo: int
    hi: int

    TYPE = "decision"


@dataclass(frozen=True)
class Outcome:
    """How the game ended: `fault` in FAULTS, `kind` in KINDS, the step concerned (the
    question's step, the disputed step, the challenged step for "bad-challenge", 0 for
    "h0-mismatch", None for "bad-commitment") and a one-line reason. Always the last record of
    a finished game's transcript."""

    fault: str
    kind: str
    step: int | None
    reason: str

    TYPE = "end"


Record = Start | Question | Answer | Timeout | Decision | Outcome


@dataclass(frozen=True)
class Dispute:
    """What re-execution needs (SPEC §5.3): leaf `step - 1` that both hold, and both parties'
    leaf `step` (the auditor's is None when it could not replay the challenged step)."""

    step: int
    agreed: Leaf
    trainer: Leaf
    auditor: Leaf | None


# ============================================================================================
# State
# ============================================================================================

@dataclass(frozen=True)
class GameState:
    """One bisection game. Never mutated: every transition returns a new state.

    `agreed` is the leaf both hold at `lo` (leaf 0 is (0, h_0, EMPTY_LOG_DIGEST) by rule, checked
    at start against both parties' leaf-0 claims); `trainer_hi` / `auditor_hi` are the leaves
    at `hi`. `question` / `asked_at` describe the outstanding question (None when none is), and
    `trainer_answer` / `auditor_answer` the valid answers received to it so far. `clock` is the
    time of the latest event; time may not run backwards.
    """

    job_id: bytes
    h0: bytes
    trainer: SignedCommitment
    auditor: SignedCommitment
    trainer_key: bytes
    auditor_key: bytes
    challenge_step: int
    deadline_s: float
    lo: int
    hi: int
    agreed: Leaf
    trainer_hi: Leaf | None
    auditor_hi: Leaf | None
    question: int | None
    asked_at: float | None
    trainer_answer: Leaf | None
    auditor_answer: Leaf | None
    clock: float
    transcript: tuple[Record, ...]
    outcome: Outcome | None


# ============================================================================================
# Views (pure predicates)
# ============================================================================================

def is_over(state: GameState) -> bool:
    return state.outcome is not None


def is_running(state: GameState) -> bool:
    return state.outcome is None


def can_ask(state: GameState) -> bool:
    """True when it is the arbiter's move: running and no question outstanding."""
    return is_running(state) and state.question is None


def needs_answer_from(state: GameState) -> frozenset[str]:
    """The parties that still owe an answer to the outstanding question (empty if none)."""
    if not is_running(state) or state.question is None:
        return frozenset()
    return frozenset(p for p in PARTIES if _answer_of(state, p) is None)


def deadline(state: GameState) -> float | None:
    """The last moment an answer to the outstanding question is accepted (None if none)."""
    if state.asked_at is None or not is_running(state):
        return None
    return state.asked_at + state.deadline_s


def deadline_passed(state: GameState, now: float) -> bool:
    limit = deadline(state)
    return limit is not None and _time(now, "now") > limit


def rounds(state: GameState) -> int:
    """Questions asked so far: every one a bisection round, at most ceil(log2 j)."""
    return sum(1 for r in state.transcript if isinstance(r, Question))


def disputed_step(state: GameState) -> int | None:
    """Step i when bisection ended with leaf i - 1 agreed and leaf i disagreed, else None."""
    o = state.outcome
    return o.step if o is not None and o.kind == "disagreed-at" else None


def dispute(state: GameState) -> Dispute | None:
    step = disputed_step(state)
    if step is None:
        return None
    assert state.trainer_hi is not None and state.agreed.step == step - 1
    return Dispute(step, state.agreed, state.trainer_hi, state.auditor_hi)


def fault(state: GameState) -> str | None:
    return None if state.outcome is None else state.outcome.fault


# ============================================================================================
# Requires (guards: GameError when a call is not legal in this state)
# ============================================================================================

def require_running(state: GameState) -> None:
    if state.outcome is not None:
        raise GameError(f"the game is over ({state.outcome.fault} at fault: "
                        f"{state.outcome.kind})")


def require_no_question(state: GameState) -> None:
    if state.question is not None:
        raise GameError(f"a question on step {state.question} is still outstanding")


def require_question(state: GameState) -> None:
    if state.question is None:
        raise GameError("no question is outstanding")


def require_party(party: object) -> None:
    if not isinstance(party, str) or party not in PARTIES:
        raise GameError(f"unknown party {party!r}: the parties are {', '.join(PARTIES)}")


def require_not_answered(state: GameState, party: str) -> None:
    if _answer_of(state, party) is not None:
        raise GameError(f"the {party} has already answered the question on step "
                        f"{state.question}")


def require_clock(state: GameState, now: float) -> None:
    if now < state.clock:
        raise GameError(f"time runs backwards: {now} is before the last event at {state.clock}")


def require_deadline_passed(state: GameState, now: float) -> None:
    limit = deadline(state)
    if limit is None or not now > limit:
        raise GameError(f"the deadline {limit} of the question on step {state.question} has "
                        f"not passed at {now}")


# ============================================================================================
# Transitions
# ============================================================================================

def start(spec: JobSpec, trainer: SignedCommitment, auditor: SignedCommitment,
          challenge_step: int, *, trainer_key: bytes, auditor_key: bytes,
          trainer_leaf: Claim, auditor_leaf: Claim | None, trainer_leaf0: Claim,
          auditor_leaf0: Claim, now: float, deadline_s: float) -> GameState:
    """A new game for the auditor's challenge at `challenge_step` (see the module docstring).

    `trainer_key` / `auditor_key` are the public keys the parties registered; `trainer_leaf` /
    `auditor_leaf` the challenged leaves with their proofs and `trainer_leaf0` /
    `auditor_leaf0` both parties' leaf 0 with its proof (all as in the auditor's challenge). A
    failed check ends the game at once (an outcome, not an exception), as does a challenge at
    step 1 that survives them (leaf 0 agreed, leaf 1 disputed). Raises TypeError or ValueError
    only for arguments of the wrong type or value.
    """
    if not isinstance(spec, JobSpec):
        raise TypeError(f"spec must be a JobSpec, not {type(spec).__name__}")
    job_id, h0, steps = spec.job_id, spec.h0, spec.steps
    for name, value in (("trainer", trainer), ("auditor", auditor)):
        if not isinstance(value, SignedCommitment):
            raise TypeError(f"{name} must be a SignedCommitment, not {type(value).__name__}")
    for name, key in (("trainer_key", trainer_key), ("auditor_key", auditor_key)):
        if type(key) is not bytes:
            raise TypeError(f"{name} must be bytes, not {type(key).__name__}")
    if type(challenge_step) is not int:
        raise TypeError(f"challenge_step must be an int, not {type(challenge_step).__name__}")
    if not isinstance(trainer_leaf, Claim):
        raise TypeError(f"trainer_leaf must be a Claim, not {type(trainer_leaf).__name__}")
    if auditor_leaf is not None and not isinstance(auditor_leaf, Claim):
        raise TypeError(f"auditor_leaf must be a Claim or None, not "
                        f"{type(auditor_leaf).__name__}")
    for name, leaf0 in (("trainer_leaf0", trainer_leaf0), ("auditor_leaf0", auditor_leaf0)):
        if not isinstance(leaf0, Claim):
            raise TypeError(f"{name} must be a Claim, not {type(leaf0).__name__}")
    now = _time(now, "now")
    deadline_s = _time(deadline_s, "deadline_s")
    if not deadline_s > 0:
        raise ValueError(f"deadline_s must be positive, got {deadline_s}")

    record = Start(challenge_step, now, deadline_s, trainer_leaf.to_bytes(),
                   None if auditor_leaf is None else auditor_leaf.to_bytes(),
                   trainer_leaf0.to_bytes(), auditor_leaf0.to_bytes())
    state = GameState(
        job_id=job_id, h0=h0, trainer=trainer, auditor=auditor, trainer_key=trainer_key,
        auditor_key=auditor_key, challenge_step=challenge_step, deadline_s=deadline_s, lo=0,
        hi=challenge_step, agreed=Leaf(0, h0, EMPTY_LOG_DIGEST), trainer_hi=None,
        auditor_hi=None, question=None, asked_at=None,
        trainer_answer=None, auditor_answer=None, clock=now, transcript=(record,), outcome=None)

    bad = {}
    try:
        trainer.verify(job_id=job_id, role=TRAINER, n=steps, public_key=trainer_key)
    except SignatureError as err:
        bad[TRAINER] = f"trainer commitment: {err}"
    try:
        auditor.verify(job_id=job_id, role=AUDITOR, public_key=auditor_key)
        if auditor.commitment.n > steps:
            raise SignatureError(f"commitment is over n = {auditor.commitment.n} steps, more "
                                 f"than the job's {steps}")
    except SignatureError as err:
        bad[AUDITOR] = f"auditor commitment: {err}"
    if bad:
        party = "both" if len(bad) == 2 else next(iter(bad))
        return _end(state, party, "bad-commitment", None, "; ".join(bad.values()))

    problem = _challenge_problem(state, steps, trainer_leaf, auditor_leaf, trainer_leaf0,
                                 auditor_leaf0)
    if problem is not None:
        return _end(state, AUDITOR, "bad-challenge", challenge_step, problem)

    # SPEC §5.2: leaf 0 is checked against the job spec's h_0 (and the empty log).
    off = [p for p, claim in ((TRAINER, trainer_leaf0), (AUDITOR, auditor_leaf0))
           if claim.leaf != state.agreed]
    if off:
        who = "both" if len(off) == 2 else off[0]
        return _end(state, who, "h0-mismatch", 0,
                    f"the {' and the '.join(off)}'s committed leaf 0 is not (0, h_0, empty "
                    f"log) of the job spec")

    state = replace(state, trainer_hi=trainer_leaf.leaf,
                    auditor_hi=None if auditor_leaf is None else auditor_leaf.leaf)
    if state.hi - state.lo == 1:
        return _end(state, "none", "disagreed-at", state.hi,
                    f"leaf {state.lo} agreed, leaf {state.hi} disagreed: step {state.hi} is "
                    f"disputed")
    return state


def ask(state: GameState, now: float) -> tuple[GameState, int]:
    """The arbiter's move: ask both parties for leaf (lo + hi) // 2, the next bisection round.

    Returns the new state and the step asked. GameError if over or a question is outstanding.
    """
    _require_state(state)
    now = _time(now, "now")
    require_running(state)
    require_no_question(state)
    require_clock(state, now)
    step = (state.lo + state.hi) // 2
    record = Question(rounds(state) + 1, step, now)
    return replace(state, question=step, asked_at=now, clock=now,
                   transcript=state.transcript + (record,)), step


def answer(state: GameState, party: str, claim: Claim | bytes, now: float) -> GameState:
    """`party`'s answer to the outstanding question, as a Claim or its raw bytes, received at
    `now`. A bad answer, or one after the deadline, ends the game (see the module docstring).

    GameError for an unknown party, no outstanding question, a second answer from the same
    party, or time running backwards; TypeError if `claim` is neither a Claim nor bytes.
    """
    if isinstance(claim, Claim):
        data = claim.to_bytes()
    elif isinstance(claim, bytes | bytearray | memoryview):
        data = bytes(claim)
    else:
        raise TypeError(f"an answer is a Claim or bytes, not {type(claim).__name__}")
    return receive(state, party, data, len(data), _time(now, "now"))


def timeout(state: GameState, now: float) -> GameState:
    """Ends the game against every party that has not answered the outstanding question by its
    deadline (fault "both" when neither has). GameError unless a question is outstanding and
    its deadline has passed at `now`."""
    _require_state(state)
    now = _time(now, "now")
    require_running(state)
    require_question(state)
    require_clock(state, now)
    require_deadline_passed(state, now)
    return _silent_lose(_record(state, Timeout(now), now))


# ============================================================================================
# Private
# ============================================================================================

def receive(state: GameState, party: str, data: bytes, length: int, now: float) -> GameState:
    _require_state(state)
    require_running(state)
    require_party(party)
    require_question(state)
    require_not_answered(state, party)
    require_clock(state, now)
    step, asked_at = state.question, state.asked_at
    # require_question above; `ask` sets question and asked_at together, `_decide` clears both
    assert step is not None and asked_at is not None
    state = _record(state, Answer(party, step, now, data if length <= MAX_ANSWER_BYTES else b"",
                                  length), now)
    if now > asked_at + state.deadline_s:
        return _silent_lose(state)
    if length > MAX_ANSWER_BYTES:
        return _lose(state, party, "malformed", f"the {party}'s answer is {length} bytes, over "
                                                f"the limit of {MAX_ANSWER_BYTES}")
    try:
        claim = Claim.from_bytes(data)
    except EncodingError as err:
        return _lose(state, party, "malformed", f"the {party}'s answer is not a claim: {err}")
    if claim.step != step:
        return _lose(state, party, "wrong-step", f"the {party} answered leaf {claim.step} to a "
                                                 f"question on leaf {step}")
    try:
        claim.verify(_commitment(state, party))
    except (ProofError, SignatureError) as err:
        return _lose(state, party, "bad-proof", f"the {party}'s leaf {step} does not verify "
                                                f"under its signed root: {err}")
    if party == TRAINER:
        state = replace(state, trainer_answer=claim.leaf)
    else:
        state = replace(state, auditor_answer=claim.leaf)
    if needs_answer_from(state):
        return state
    return _decide(state)


def _decide(state: GameState) -> GameState:
    """Both valid answers to the question are in: move lo or hi, and end at hi - lo == 1."""
    step, t, a = state.question, state.trainer_answer, state.auditor_answer
    # `receive` calls this only once both valid answers to the outstanding question are in
    assert step is not None and t is not None and a is not None
    lo, hi, agreed_leaf = state.lo, state.hi, state.agreed
    trainer_hi, auditor_hi = state.trainer_hi, state.auditor_hi
    agreed = t == a
    if agreed:
        lo, agreed_leaf = step, t
    else:
        hi, trainer_hi, auditor_hi = step, t, a
    state = replace(state, lo=lo, hi=hi, agreed=agreed_leaf, trainer_hi=trainer_hi,
                    auditor_hi=auditor_hi, question=None, asked_at=None,
                    trainer_answer=None, auditor_answer=None,
                    transcript=state.transcript + (Decision(step, agreed, lo, hi),))
    if hi - lo == 1:
        return _end(state, "none", "disagreed-at", hi,
                    f"leaf {lo} agreed, leaf {hi} disagreed: step {hi} is disputed")
    return state


def _challenge_problem(state: GameState, steps: int, trainer_leaf: Claim,
                       auditor_leaf: Claim | None, trainer_leaf0: Claim,
                       auditor_leaf0: Claim) -> str | None:
    """Why the auditor's challenge (challenged leaves and both leaf-0 claims) is invalid, or
    None if it is valid."""
    j, n_a = state.challenge_step, state.auditor.commitment.n
    if not 1 <= j <= steps:
        return f"challenged step {j} is outside 1..{steps}"
    leaves = [(TRAINER, trainer_leaf, state.trainer)]
    if auditor_leaf is None:
        if n_a != j - 1:
            return (f"a challenge without the auditor's leaf {j} needs the auditor's "
                    f"commitment to end at step {j - 1}, not {n_a}")
    else:
        leaves.append((AUDITOR, auditor_leaf, state.auditor))
    for party, claim, signed in leaves:
        if claim.step != j:
            return f"the {party}'s challenged leaf is for step {claim.step}, not {j}"
        try:
            claim.verify(signed)
        except (ProofError, SignatureError) as err:
            return f"the {party}'s challenged leaf {j} does not verify: {err}"
    if auditor_leaf is not None and auditor_leaf.leaf == trainer_leaf.leaf:
        return f"the challenged leaves {j} agree"
    for party, claim, signed in ((TRAINER, trainer_leaf0, state.trainer),
                                 (AUDITOR, auditor_leaf0, state.auditor)):
        if claim.step != 0:
            return f"the {party}'s leaf-0 claim is for step {claim.step}, not 0"
        try:
            claim.verify(signed)
        except (ProofError, SignatureError) as err:
            return f"the {party}'s leaf 0 does not verify under its signed root: {err}"
    return None


def _silent_lose(state: GameState) -> GameState:
    silent = [p for p in PARTIES if _answer_of(state, p) is None]
    who = "both" if len(silent) == 2 else silent[0]
    return _end(state, who, "timeout", state.question,
                f"no answer from the {' or the '.join(silent)} on leaf {state.question} by the "
                f"deadline {deadline(state)}")


def _lose(state: GameState, party: str, kind: str, reason: str) -> GameState:
    return _end(state, party, kind, state.question, reason)


def _end(state: GameState, who: str, kind: str, step: int | None, reason: str) -> GameState:
    assert who in FAULTS and kind in KINDS
    outcome = Outcome(who, kind, step, reason[:MAX_REASON_CHARS])
    return replace(state, outcome=outcome, transcript=state.transcript + (outcome,))


def _record(state: GameState, record: Record, now: float) -> GameState:
    return replace(state, clock=now, transcript=state.transcript + (record,))


def _answer_of(state: GameState, party: str) -> Leaf | None:
    return state.trainer_answer if party == TRAINER else state.auditor_answer


def _commitment(state: GameState, party: str) -> SignedCommitment:
    return state.trainer if party == TRAINER else state.auditor


def _require_state(state: object) -> None:
    if not isinstance(state, GameState):
        raise TypeError(f"expected a GameState, not {type(state).__name__}")


def _time(value: object, name: str) -> float:
    if type(value) is not int and type(value) is not float:
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)
