"""One adjudication: the bisection game against both parties, re-execution, a signed verdict.

`adjudicate` drives `protocol.dispute.game` (the rules, SPEC §5.2) over two `Party` transports: each
round it asks both parties for the same leaf at once, feeds their answers to the game in the
order they arrive, and when a party has not answered by the per-move deadline it lets the
deadline pass and calls `game.timeout`. A party whose call fails is asked again until the
deadline: only silence at the deadline loses, not a dropped connection that recovers in time.

When the game ends at a disputed step i it gathers the evidence of SPEC §5.3 — S_{i-1}, B_i
with data proofs, the trainer's L_i — from the trainer first and the auditor second, keeping
only what verifies against what both signed (h_{i-1}, the job's data root, the trainer's ℓ_i),
re-executes step i on this machine's profile (`protocol.dispute.reexecute`), and signs the
verdict of SPEC §5.4 (`protocol.dispute.verdict`). Everything a party says is checked by the game
or here; the arbiter trusts only the job spec (whose hash is the job id) and the parties' keys.

Keys: a party's registered key when the caller gives one, else the key of the commitment the
party's own node serves — never a key taken from the challenge, which is the auditor's document
(an auditor could otherwise sign a "trainer" commitment itself and make the real trainer's
answers fail). The game is then played under the challenge's copy of each commitment when that
copy is signed by the party's key (a party is bound by everything it signed), else under the
one its node serves, so a challenge carrying a forged commitment fails as a bad challenge.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from protocol.commit.commitments import SignedCommitment
from protocol.commit.data import ProvenExample
from protocol.commit.keys import KeyPair
from protocol.dispute import game
from protocol.dispute.challenge import Challenge
from protocol.dispute.game import AUDITOR, TRAINER, Dispute, GameState
from protocol.dispute.reexecute import (
    Reexecution,
    check_examples,
    check_log,
    check_state,
    reexecute,
    withheld,
)
from protocol.dispute.verdict import Verdict, sign_verdict
from protocol.engine.profiles import Profile, plain_profile
from protocol.errors import ArbiterError, ConfigError, NoAnswer, OvtError
from protocol.job.create import load_job_program
from protocol.job.spec import JobSpec

from .parties import Party

DEFAULT_DEADLINE_S = 30.0
DEFAULT_EVIDENCE_TIMEOUT_S = 300.0
_RETRY_S = 0.2
_GRACE_S = 5.0  # how long past the deadline a call may take to give up

Events = Callable[[str], None]

_WALL0, _MONO0 = time.time(), time.monotonic()


def _now() -> float:
    """Unix seconds that never run backwards (a wall-clock jump must not move a deadline)."""
    return _WALL0 + (time.monotonic() - _MONO0)


@dataclass(frozen=True)
class Evidence:
    """What step i was re-executed from (kept so a verdict's h_i* can be re-checked)."""

    prev_state: dict[str, torch.Tensor]
    examples: list[ProvenExample]
    log: bytes


@dataclass(frozen=True)
class Adjudication:
    verdict: Verdict
    evidence: Evidence | None  # None when the game ended without a disputed step or evidence


def default_profile() -> Profile:
    """The profile the arbiter re-executes under unless told otherwise (SPEC §5.3: on its own
    hardware, CPU or GPU): `cuda` where a CUDA device exists, else `cpu-2t`."""
    return plain_profile("cuda" if torch.cuda.is_available() else "cpu", 2)


def adjudicate(spec: JobSpec, challenge: Challenge, trainer: Party, auditor: Party, *,
               key: KeyPair, profile: Profile, trainer_key: bytes | None = None,
               auditor_key: bytes | None = None, deadline_s: float = DEFAULT_DEADLINE_S,
               evidence_timeout_s: float = DEFAULT_EVIDENCE_TIMEOUT_S,
               events: Events | None = None) -> Adjudication:
    """Adjudicate `challenge` on job `spec` between the two parties (see the module docstring).

    `trainer_key` / `auditor_key` are the parties' registered public keys; None takes the key
    of the commitment the party's own node serves (see the module docstring). Raises
    ConfigError if the challenge is for another job or a party's commitment cannot be
    established, ProgramError or ConfigError if the job's program cannot be built here,
    ArbiterError if the arbiter itself fails mid-game; every misbehaviour of a party is a
    verdict, not an exception.
    """
    if challenge.job_id != spec.job_id:
        raise ConfigError(f"the challenge is for job {challenge.job_id.hex()}, not "
                          f"{spec.job_id.hex()}")
    say = events or (lambda text: None)
    trainer_signed, trainer_key = _commitment(
        trainer, challenge.trainer_commitment, trainer_key, spec, spec.steps, deadline_s)
    auditor_signed, auditor_key = _commitment(
        auditor, challenge.auditor_commitment, auditor_key, spec,
        challenge.auditor_commitment.commitment.n, deadline_s)
    started = _now()
    state = game.start(
        spec, trainer_signed, auditor_signed, challenge.step, trainer_key=trainer_key,
        auditor_key=auditor_key, trainer_leaf=challenge.trainer_leaf,
        auditor_leaf=challenge.auditor_leaf, trainer_leaf0=challenge.trainer_leaf0,
        auditor_leaf0=challenge.auditor_leaf0, now=started, deadline_s=deadline_s)
    parties = {TRAINER: trainer, AUDITOR: auditor}
    while game.is_running(state):
        state = _round(state, parties, say)
    bisected = _now()

    dispute, reexec, evidence = game.dispute(state), None, None
    if dispute is not None:
        say(f"step {dispute.step} is disputed: fetching S_{dispute.step - 1}, "
            f"B_{dispute.step} and L_{dispute.step}")
        # Built once: its batch size checks B_i, its model re-executes step i. No data file
        # is read: B_i's examples come from the parties, checked against the data root.
        program = load_job_program(spec, examples=False)
        gathered = _gather(spec, dispute, parties, program.batch_size, profile,
                           evidence_timeout_s)
        fetched = _now()
        if isinstance(gathered, Reexecution):  # the `withheld` finding: no evidence to run
            reexec = gathered
        else:
            evidence = gathered
            say(f"re-executing step {dispute.step} on {profile.name}")
            reexec = reexecute(spec, dispute, evidence.prev_state, evidence.examples,
                               evidence.log, program=program, profile=profile)
            if reexec.finding == "bad-evidence":  # checked above, yet does not run: the
                # S_{i-1} both parties signed does not fit the job's program
                reexec = withheld(dispute.step, "both", f"the S_{dispute.step - 1} both "
                                  f"parties signed does not re-execute: {reexec.detail}",
                                  profile.name)
    else:
        fetched = bisected
    done = _now()
    verdict = sign_verdict(
        spec, state, reexec, key=key,
        timings={"bisection_s": bisected - started, "evidence_s": fetched - bisected,
                 "reexecution_s": done - fetched, "total_s": done - started},
        bytes_moved={TRAINER: trainer.bytes_received, AUDITOR: auditor.bytes_received})
    return Adjudication(verdict, evidence)


# -- keys and commitments -----------------------------------------------------------------------

def _commitment(party: Party, copy: SignedCommitment, key: bytes | None, spec: JobSpec, n: int,
                timeout_s: float) -> tuple[SignedCommitment, bytes]:
    """The commitment to play `party`'s side under, and its key (see the module docstring).

    Raises ConfigError when the party's key cannot be established: no key given and its node
    serves no valid commitment of its own."""
    if key is not None and _signed_by(copy, key, spec, party.role, n):
        return copy, key
    try:
        served = party.commitment(n, timeout_s)
        served.verify(job_id=spec.job_id, role=party.role, n=n,
                      public_key=key if key is not None else served.commitment.public_key)
    except (OvtError, ValueError) as err:
        if key is None:
            raise ConfigError(f"cannot establish the {party.role}'s key: its node serves "
                              f"no valid commitment over {n} steps ({err}); give its "
                              f"registered key (--{party.role}-key)") from None
        raise ConfigError(f"no commitment of the {party.role}'s to play under: the "
                          f"challenge's is not signed by its registered key, and its node "
                          f"serves no valid one over {n} steps ({err})") from None
    key = served.commitment.public_key
    return (copy if _signed_by(copy, key, spec, party.role, n) else served), key


def _signed_by(signed: SignedCommitment, key: bytes, spec: JobSpec, role: str, n: int) -> bool:
    try:
        signed.verify(job_id=spec.job_id, role=role, n=n, public_key=key)
    except OvtError:
        return False
    return True


# -- the bisection ------------------------------------------------------------------------------

def _round(state: GameState, parties: dict[str, Party], say: Events) -> GameState:
    """Ask the next question of both parties and play their answers (or their silence)."""
    state, step = game.ask(state, _now())
    limit = game.deadline(state)
    if limit is None:  # a bug: the game just asked a question, so one is outstanding
        raise AssertionError(f"the question for leaf {step} has no deadline")
    answers: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=_fetch_leaf, args=(role, party, step, limit, answers),
                                name=f"ovt-arbiter-{role}", daemon=True)
               for role, party in parties.items()]
    for thread in threads:
        thread.start()
    pending = len(threads)
    while pending and game.is_running(state) and game.needs_answer_from(state):
        try:
            received = [answers.get(timeout=max(limit - _now(), 0) + _GRACE_S)]
        except queue.Empty:  # a party's transport overran its own timeout: silence
            break
        pending -= 1
        if received[0][2] > limit:  # late: the others first (`_the_rest`)
            received += _the_rest(answers, pending)
            pending -= len(received) - 1
            received.sort(key=lambda answer: answer[2])
        for role, data, at in received:
            if isinstance(data, BaseException):
                raise ArbiterError(f"asking the {role} for leaf {step} failed on the "
                                   f"arbiter's side: {data!r}") from data
            if data is not None and game.is_running(state) and game.needs_answer_from(state):
                state = game.answer(state, role, data, max(at, state.clock))
    if game.is_running(state) and game.needs_answer_from(state):
        while _now() <= limit:
            time.sleep(max(limit - _now(), 0) + 0.001)
        state = game.timeout(state, max(_now(), state.clock))
    for thread in threads:
        thread.join(max(limit - _now(), 0) + 1.0)
    say(_describe(state, step))
    return state


def _the_rest(answers: queue.Queue, pending: int) -> list[tuple]:
    """The `pending` answers still to come, each waited for up to `_GRACE_S` (every fetching
    thread reports by its deadline, its transport's timeout past it at most).

    An answer received after the deadline loses (SPEC §5.2), and the game then ends against
    every party that has not answered yet, whose time is up too — in the order of receipt. The
    queue's order is not quite that: a thread that read the clock in time but was preempted
    before queueing its answer (the interpreter switches threads every few milliseconds) comes
    after a later answer. So before a late answer is played the others must be in, and `_round`
    plays them all in the order they were received: an answer in time is never blamed for a
    later one."""
    rest = []
    for _ in range(pending):
        try:
            rest.append(answers.get(timeout=_GRACE_S))
        except queue.Empty:  # its transport overran its own timeout: silence
            break
    return rest


def _fetch_leaf(role: str, party: Party, step: int, limit: float, out: queue.Queue) -> None:
    """Ask `party` for leaf `step` until it answers or the deadline passes, then report the
    answer (None: none came) exactly once, so `_round` never waits on a thread that died. Any
    other exception is the arbiter's own failure, not the party's silence: it is reported as
    such and ends the adjudication without a verdict."""
    data: bytes | BaseException | None = None
    try:
        while (remaining := limit - _now()) > 0:
            try:
                data = party.leaf(step, remaining)
                break
            except NoAnswer:
                time.sleep(min(_RETRY_S, max(limit - _now(), 0)))
    except BaseException as err:  # reported to the main thread, which raises it
        data = err
    finally:
        out.put((role, data, _now()))


def _describe(state: GameState, step: int) -> str:
    q = game.rounds(state)
    if state.outcome is not None and state.outcome.kind != "disagreed-at":
        return f"round {q} (leaf {step}): {state.outcome.reason}"
    decision = next(r for r in reversed(state.transcript) if isinstance(r, game.Decision))
    verb = "agree" if decision.agreed else "disagree"
    return f"round {q} (leaf {step}): the parties {verb}; interval now " \
           f"[{decision.lo}, {decision.hi}]"


# -- the evidence (SPEC §5.3) -------------------------------------------------------------------

def _gather(spec: JobSpec, dispute: Dispute, parties: dict[str, Party], batch_size: int,
            profile: Profile, timeout_s: float) -> Evidence | Reexecution:
    """S_{i-1}, B_i (of the program's `batch_size` examples) and L_i, each from the first
    party whose answer verifies. When nobody's does, the `withheld` finding instead (L_i is
    the trainer's alone to serve; S_{i-1} and B_i either party could, so neither serving one
    is on both)."""
    i = dispute.step
    wanted = (  # what to ask, and `protocol.dispute.reexecute`'s own check of it (SPEC §5.3)
        (f"S_{i - 1}", lambda p: p.state(i - 1, timeout_s),
         lambda state: check_state(dispute, state)[1], "both"),
        (f"B_{i}", lambda p: p.batch(i, timeout_s),
         lambda examples: check_examples(spec, i, examples, batch_size)[1], "both"),
        (f"L_{i}", lambda p: p.log(i, timeout_s), lambda log: check_log(dispute, log)[1],
         TRAINER),
    )
    found, problems = [], []
    for name, fetch, problem_of, owed_by in wanted:
        value = None
        for role, party in parties.items():
            try:
                candidate = fetch(party)
                problem = problem_of(candidate)
                if problem is None:
                    value = candidate
                    break
                problems.append(f"the {role}'s {name}: {problem}")
            except OvtError as err:  # the party's failure: NoAnswer, or bytes that do not decode
                problems.append(f"the {role} did not serve {name}: {err}")
            except Exception as err:  # the checks report a bad value; anything else is a bug
                raise ArbiterError(f"checking the {role}'s {name} failed on the arbiter's "
                                   f"side: {err!r}") from err
        if value is None:
            return withheld(i, owed_by, f"nobody served a valid {name}: "
                            + "; ".join(problems), profile.name)
        found.append(value)
    return Evidence(*found)
