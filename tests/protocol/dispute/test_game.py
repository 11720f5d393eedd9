"""The bisection game (SPEC §5.2, protocol/dispute/game.py): one test per branch, liars as fixtures.

Players hold real leaf lists (fake (t, h_t, ℓ_t)), real RFC 6962 trees and real signed
commitments, and answer from their trees. Liars are scripted players (dave's bad_commitment /
patched_commitment): they answer honestly until a chosen round, then cheat one way.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec.canonical import PROTOCOL_VERSION
from protocol.codec.roundinglog import EMPTY_LOG_DIGEST
from protocol.commit.commitments import Claim, Commitment, SignedCommitment, sign_commitment
from protocol.commit.data import DataCommitment
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.commit.merkle import MerkleTree
from protocol.dispute import game
from protocol.dispute.game import (
    AUDITOR,
    TRAINER,
    Answer,
    Decision,
    Outcome,
    Question,
    answer,
    ask,
    can_ask,
    deadline,
    deadline_passed,
    dispute,
    disputed_step,
    is_over,
    is_running,
    needs_answer_from,
    rounds,
    start,
    timeout,
)
from protocol.dispute.transcript import decode_transcript, replay_transcript, transcript_bytes
from protocol.engine.precision import PrecisionPolicy
from protocol.errors import EncodingError, GameError, TranscriptError
from protocol.job.spec import JobSpec

DEADLINE = 10.0
T0 = 1_000.0
H0 = hashlib.sha256(b"h0").digest()


def h(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def make_spec(n: int, h0: bytes = H0) -> JobSpec:
    return JobSpec(program="fake", program_source_hash=bytes(32), config={},
                   data=DataCommitment(bytes(32), 1), h0=h0, steps=n, seed=0,
                   policy=PrecisionPolicy(), checkpoint_interval=1, commit_interval=1)


def honest_leaves(n: int, h0: bytes = H0) -> list[Leaf]:
    return [Leaf(0, h0, EMPTY_LOG_DIGEST)] + [Leaf(t, h("T", t), h("log", t))
                                              for t in range(1, n + 1)]


def diverging_leaves(n: int, d: int, h0: bytes = H0) -> list[Leaf]:
    """The trainer's leaves up to d - 1, then the auditor's own from step d on."""
    return [leaf if leaf.step < d else Leaf(leaf.step, h("A", leaf.step), leaf.log_hash)
            for leaf in honest_leaves(n, h0)]


# ---- players ---------------------------------------------------------------------------------

class Player:
    """An honest party: answers every question from the tree it committed to."""

    def __init__(self, role: str, spec: JobSpec, leaves: list[Leaf], *,
                 key: KeyPair | None = None, job_id: bytes | None = None,
                 sign_role: str | None = None) -> None:
        self.role, self.spec, self.leaves = role, spec, leaves
        self.key = key or KeyPair.generate()
        self.tree = MerkleTree([leaf.hash for leaf in leaves])
        self.job_id = spec.job_id if job_id is None else job_id
        commitment = Commitment(self.job_id, len(leaves) - 1, self.tree.root,
                                leaves[-1].state_hash, self.key.public_key,
                                sign_role or role, 1_700_000_000)
        self.signed = sign_commitment(commitment, self.key)

    @property
    def n(self) -> int:
        return len(self.leaves) - 1

    def claim(self, step: int) -> Claim:
        leaf = self.leaves[step]
        return Claim(self.job_id, step, leaf.state_hash, leaf.log_hash,
                     tuple(self.tree.proof(step)), self.tree.size)

    def leaf(self, step: int) -> Leaf:
        leaf = self.leaves[step]
        return Leaf(step, leaf.state_hash, leaf.log_hash)

    def respond(self, step: int, round_: int) -> bytes | Claim | None:
        """The answer to round `round_`'s question on `step` (None: stay silent)."""
        return self.claim(step).to_bytes()


class Liar(Player):
    """Honest before round `from_round`, then `cheat(step)` (dave's patched commitment)."""

    def __init__(self, *args, from_round: int = 2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.from_round = from_round

    def respond(self, step: int, round_: int) -> bytes | Claim | None:
        return super().respond(step, round_) if round_ < self.from_round else self.cheat(step)

    def cheat(self, step: int) -> bytes | Claim | None:
        raise NotImplementedError


class BadProofLiar(Liar):
    """Answers a leaf inconsistent with its signed root: another h_t, the honest proof."""

    def cheat(self, step: int) -> bytes:
        return replace(self.claim(step), state_hash=h("forged", step)).to_bytes()


class PatchedLiar(Liar):
    """Switches trees mid-game (changes its answers): from `from_round` on it answers from a
    patched tree, whose leaves differ from the committed ones from step 1 on."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        patched = [leaf if leaf.step == 0 else Leaf(leaf.step, h("P", leaf.step), leaf.log_hash)
                   for leaf in self.leaves]
        self.patched_tree = MerkleTree([leaf.hash for leaf in patched])
        self.patched = patched

    def cheat(self, step: int) -> bytes:
        leaf = self.patched[step]
        return Claim(self.job_id, step, leaf.state_hash, leaf.log_hash,
                     tuple(self.patched_tree.proof(step)), self.patched_tree.size).to_bytes()


class Staller(Liar):
    def cheat(self, step: int) -> None:
        return None


class GarbageLiar(Liar):
    def cheat(self, step: int) -> bytes:
        return b"\xc1not a claim"


class OversizedLiar(Liar):
    def cheat(self, step: int) -> bytes:
        return b"\x00" * (game.MAX_ANSWER_BYTES + 1)


class WrongStepLiar(Liar):
    def cheat(self, step: int) -> bytes:
        return self.claim(step + 1 if step + 1 <= self.n else step - 1).to_bytes()


class CrossJobLiar(Liar):
    """Answers with a claim naming another job (its own proof is otherwise honest)."""

    def cheat(self, step: int) -> bytes:
        return replace(self.claim(step), job_id=h("other job")).to_bytes()


class ClaimObjectPlayer(Player):
    """Honest, answering with Claim objects instead of bytes."""

    def respond(self, step: int, round_: int) -> Claim:
        return self.claim(step)


# ---- driving a game --------------------------------------------------------------------------

def begin(spec: JobSpec, trainer: Player, auditor: Player, j: int, *,
          trainer_key: bytes | None = None, auditor_key: bytes | None = None,
          auditor_leaf: Claim | None | str = "auto", trainer_leaf: Claim | None = None,
          trainer_leaf0: Claim | None = None, auditor_leaf0: Claim | None = None):
    """Start a game as the auditor's challenge would: both challenged leaves and both parties'
    leaf-0 claims (by default each party's own, from its committed tree)."""
    if auditor_leaf == "auto":
        auditor_leaf = auditor.claim(j) if auditor.n >= j else None
    return start(spec, trainer.signed, auditor.signed, j,
                 trainer_key=trainer.key.public_key if trainer_key is None else trainer_key,
                 auditor_key=auditor.key.public_key if auditor_key is None else auditor_key,
                 trainer_leaf=trainer.claim(j) if trainer_leaf is None else trainer_leaf,
                 auditor_leaf=auditor_leaf,
                 trainer_leaf0=trainer.claim(0) if trainer_leaf0 is None else trainer_leaf0,
                 auditor_leaf0=auditor.claim(0) if auditor_leaf0 is None else auditor_leaf0,
                 now=T0, deadline_s=DEADLINE)


def play(state, trainer: Player, auditor: Player):
    """The arbiter's loop: ask, collect both answers (1 s later), time out the silent."""
    players = {TRAINER: trainer, AUDITOR: auditor}
    while is_running(state):
        state, step = ask(state, state.clock + 1.0)
        for party, player in players.items():
            data = player.respond(step, rounds(state))
            if data is not None and is_running(state):
                state = answer(state, party, data, state.asked_at + 1.0)
        if is_running(state) and needs_answer_from(state):
            state = timeout(state, state.asked_at + DEADLINE + 0.5)
    return state


def game_for(n: int, d: int, *, j: int | None = None, trainer_cls=Player, auditor_cls=Player,
             trainer_kw=None, auditor_kw=None):
    """A trainer with honest leaves 0..n, an auditor diverging from step d, challenge at j
    (default n: the auditor committed to all n steps; j = d: it committed to 0..d only)."""
    spec = make_spec(n)
    j = n if j is None else j
    trainer = trainer_cls(TRAINER, spec, honest_leaves(n), **(trainer_kw or {}))
    auditor = auditor_cls(AUDITOR, spec, diverging_leaves(n, d)[:j + 1], **(auditor_kw or {}))
    return spec, trainer, auditor, begin(spec, trainer, auditor, j)


def replayed(spec, trainer, auditor, state):
    return replay_transcript(spec, trainer.signed, auditor.signed,
                             trainer_key=trainer.key.public_key,
                             auditor_key=auditor.key.public_key,
                             transcript=transcript_bytes(state))


def assert_outcome(state, fault: str, kind: str, step: int | None = None) -> None:
    assert is_over(state)
    assert (state.outcome.fault, state.outcome.kind) == (fault, kind), state.outcome
    if step is not None:
        assert state.outcome.step == step


def assert_running_invariant(state, trainer: Player, auditor: Player) -> None:
    assert state.lo < state.hi
    assert state.agreed == trainer.leaf(state.lo) == auditor.leaf(state.lo)
    assert state.trainer_hi == trainer.leaf(state.hi)
    if state.hi <= auditor.n:
        assert state.auditor_hi == auditor.leaf(state.hi) != state.trainer_hi
    else:
        assert state.auditor_hi is None


def round_bound(j: int) -> int:
    """At most ceil(log2 j) halvings of [0, j]: every question is a bisection round."""
    return math.ceil(math.log2(j))


def halvings(j: int, d: int) -> int:
    """B(j) on the path to divergent step d: the halvings of [0, j] by mid = (lo + hi) // 2
    until hi - lo == 1 (leaf 0 agreed at start, leaves from d on disagreed)."""
    lo, hi, count = 0, j, 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if mid < d else (lo, mid)
        count += 1
    return count


# ---- bisection finds the divergent step --------------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "truncated"])
@pytest.mark.parametrize("d", range(1, 33))
def test_bisection_ends_at_the_divergent_step_n32(d, mode):
    spec, trainer, auditor, state = game_for(32, d, j=32 if mode == "full" else d)
    j = state.challenge_step
    state = play(state, trainer, auditor)
    assert_outcome(state, "none", "disagreed-at", d)
    assert disputed_step(state) == d
    assert dispute(state) == game.Dispute(d, trainer.leaf(d - 1), trainer.leaf(d),
                                          auditor.leaf(d))
    assert rounds(state) == halvings(j, d) <= round_bound(j)
    assert math.floor(math.log2(j)) <= rounds(state)
    asked = [r.step for r in state.transcript if isinstance(r, Question)]
    assert 0 not in asked and len(set(asked)) == len(asked)  # no step is asked twice
    assert not asked or asked[0] == j // 2
    assert replayed(spec, trainer, auditor, state).outcome == state.outcome


@pytest.mark.parametrize(("n", "d"), [(1, 1), (2, 1), (2, 2), (1000, 1), (1000, 2),
                                      (1000, 500), (1000, 777), (1000, 999), (1000, 1000)])
def test_bisection_ends_at_the_divergent_step_other_sizes(n, d):
    for j in (n, d):
        spec, trainer, auditor, state = game_for(n, d, j=j)
        state = play(state, trainer, auditor)
        assert_outcome(state, "none", "disagreed-at", d)
        assert rounds(state) == halvings(j, d) <= round_bound(j)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("j", [1, 2, 4, 8, 16, 32, 1024])
def test_round_count_is_exactly_log2_for_powers_of_two(j, where):
    d = {"first": 1, "middle": j // 2 + 1 if j > 1 else 1, "last": j}[where]
    spec, trainer, auditor, state = game_for(j, d)
    state = play(state, trainer, auditor)
    assert_outcome(state, "none", "disagreed-at", d)
    assert rounds(state) == int(math.log2(j))


@pytest.mark.parametrize("mode", ["full", "truncated"])
def test_challenge_at_step_one_ends_at_start_with_no_question(mode):
    """j = 1: leaf 0 agreed at start (the h_0 rule), leaf 1 disagreed: nothing to bisect."""
    spec = make_spec(8)
    trainer = Player(TRAINER, spec, honest_leaves(8))
    auditor = Player(AUDITOR, spec, diverging_leaves(8, 1)[:None if mode == "full" else 1])
    state = begin(spec, trainer, auditor, 1)
    assert_outcome(state, "none", "disagreed-at", 1)
    assert rounds(state) == 0 and len(state.transcript) == 2
    assert dispute(state) == game.Dispute(1, trainer.leaf(0), trainer.leaf(1),
                                          auditor.leaf(1) if mode == "full" else None)
    assert replayed(spec, trainer, auditor, state) == state
    with pytest.raises(GameError, match="over"):
        ask(state, T0 + 1)


def test_challenge_without_the_auditor_leaf_disputes_the_challenged_step():
    """The auditor could not replay step j: its commitment ends at j - 1 and agrees up to it."""
    spec = make_spec(32)
    trainer = Player(TRAINER, spec, honest_leaves(32))
    auditor = Player(AUDITOR, spec, honest_leaves(32)[:20])  # n_a = 19
    state = play(begin(spec, trainer, auditor, 20, auditor_leaf=None), trainer, auditor)
    assert_outcome(state, "none", "disagreed-at", 20)
    assert dispute(state) == game.Dispute(20, trainer.leaf(19), trainer.leaf(20), None)


def test_answers_may_be_claim_objects():
    spec, trainer, auditor, state = game_for(16, 5, trainer_cls=ClaimObjectPlayer)
    assert disputed_step(play(state, trainer, auditor)) == 5


# ---- liars lose on the spot ------------------------------------------------------------------

def _liar_game(liar_cls, party: str, from_round: int = 2, n: int = 32, d: int = 11):
    kw = {"from_round": from_round}
    if party == TRAINER:
        return game_for(n, d, trainer_cls=liar_cls, trainer_kw=kw)
    return game_for(n, d, auditor_cls=liar_cls, auditor_kw=kw)


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
def test_leaf_inconsistent_with_root_loses_bad_proof(party):
    spec, trainer, auditor, state = _liar_game(BadProofLiar, party, from_round=3)
    state = play(state, trainer, auditor)
    assert_outcome(state, party, "bad-proof")
    assert rounds(state) == 3
    assert replayed(spec, trainer, auditor, state).outcome == state.outcome


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
def test_party_changing_answers_between_rounds_is_caught_by_the_proof(party):
    """Honest in rounds 1-2, then answers from a patched tree: the leaf it now gives for a step
    differs from the one its signed root holds there, so the proof fails."""
    spec, trainer, auditor, state = _liar_game(PatchedLiar, party, from_round=3)
    state = play(state, trainer, auditor)
    assert_outcome(state, party, "bad-proof")
    step = state.outcome.step
    liar = trainer if party == TRAINER else auditor
    assert liar.patched[step] != liar.leaves[step]


def test_one_step_cannot_be_answered_two_ways():
    """Whatever leaf a party gives for step s besides its committed one fails the proof."""
    spec, trainer, auditor, state = game_for(32, 11)
    state, step = ask(state, T0 + 1)
    state, step = ask(answer(answer(state, TRAINER, trainer.claim(step), T0 + 2), AUDITOR,
                             auditor.claim(step), T0 + 2), T0 + 3)
    other = PatchedLiar(TRAINER, spec, honest_leaves(32), key=trainer.key).cheat(step)
    assert_outcome(answer(state, TRAINER, other, T0 + 4), TRAINER, "bad-proof", step)
    assert not is_over(answer(state, TRAINER, trainer.claim(step), T0 + 4))


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
def test_stalling_party_loses_at_the_deadline(party):
    spec, trainer, auditor, state = _liar_game(Staller, party, from_round=2)
    state = play(state, trainer, auditor)
    assert_outcome(state, party, "timeout")
    assert rounds(state) == 2
    assert replayed(spec, trainer, auditor, state).outcome == state.outcome


def test_both_silent_is_fault_both():
    spec, trainer, auditor, state = game_for(32, 11, trainer_cls=Staller, auditor_cls=Staller,
                                             trainer_kw={"from_round": 1},
                                             auditor_kw={"from_round": 1})
    state = play(state, trainer, auditor)
    assert_outcome(state, "both", "timeout", 16)  # the first question is already bisection
    assert replayed(spec, trainer, auditor, state).outcome == state.outcome


def test_answer_after_the_deadline_loses():
    spec, trainer, auditor, state = game_for(32, 11)
    state, step = ask(state, T0 + 1)
    state = answer(state, AUDITOR, auditor.claim(step), T0 + 2)
    late = answer(state, TRAINER, trainer.claim(step), T0 + 1 + DEADLINE + 0.001)
    assert_outcome(late, TRAINER, "timeout", step)
    assert isinstance(late.transcript[-2], Answer)  # the late answer is on the record


def test_late_answer_when_both_owe_one_faults_both():
    spec, trainer, auditor, state = game_for(32, 11)
    state, step = ask(state, T0 + 1)
    assert_outcome(answer(state, AUDITOR, auditor.claim(step), T0 + 100), "both", "timeout")


def test_answer_exactly_at_the_deadline_is_accepted():
    spec, trainer, auditor, state = game_for(32, 11)
    state, step = ask(state, T0 + 1)
    state = answer(state, TRAINER, trainer.claim(step), T0 + 1 + DEADLINE)
    assert is_running(state) and needs_answer_from(state) == {AUDITOR}


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
@pytest.mark.parametrize(("liar_cls", "kind"), [(GarbageLiar, "malformed"),
                                                (OversizedLiar, "malformed"),
                                                (WrongStepLiar, "wrong-step"),
                                                (CrossJobLiar, "bad-proof")])
def test_malformed_answers_lose(party, liar_cls, kind):
    spec, trainer, auditor, state = _liar_game(liar_cls, party, from_round=2)
    state = play(state, trainer, auditor)
    assert_outcome(state, party, kind)
    assert replayed(spec, trainer, auditor, state).outcome == state.outcome


# ---- leaf 0 against h_0, at start (SPEC §5.2) --------------------------------------------------

def _h0_pair(bad: tuple[str, ...], n: int = 32, d: int = 9):
    """Players whose committed leaf 0 holds another S_0 for each party in `bad`."""
    spec = make_spec(n)
    h0s = {p: h("another S_0", p) if p in bad else H0 for p in (TRAINER, AUDITOR)}
    return (spec, Player(TRAINER, spec, honest_leaves(n, h0s[TRAINER])),
            Player(AUDITOR, spec, diverging_leaves(n, d, h0s[AUDITOR])))


@pytest.mark.parametrize("bad", [(TRAINER,), (AUDITOR,), (TRAINER, AUDITOR)])
def test_leaf0_not_matching_h0_loses_at_start(bad):
    spec, trainer, auditor = _h0_pair(bad)
    state = begin(spec, trainer, auditor, 32)
    assert_outcome(state, bad[0] if len(bad) == 1 else "both", "h0-mismatch", 0)
    assert rounds(state) == 0 and len(state.transcript) == 2
    assert replayed(spec, trainer, auditor, state) == state


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
def test_leaf0_with_a_nonempty_log_loses_at_start(party):
    spec = make_spec(8)
    leaves = {TRAINER: honest_leaves(8), AUDITOR: diverging_leaves(8, 3)}
    leaves[party][0] = Leaf(0, H0, h("a log at step 0"))
    trainer, auditor = Player(TRAINER, spec, leaves[TRAINER]), Player(AUDITOR, spec,
                                                                      leaves[AUDITOR])
    assert_outcome(begin(spec, trainer, auditor, 8), party, "h0-mismatch", 0)


def test_leaf0_mismatch_at_step_one_still_loses():
    """j = 1 would end at once as disagreed-at, but only once leaf 0 is agreed."""
    spec, trainer, auditor = _h0_pair((AUDITOR,), n=4, d=1)
    assert_outcome(begin(spec, trainer, auditor, 1), AUDITOR, "h0-mismatch", 0)


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
@pytest.mark.parametrize("how", ["forged", "other-step", "other-party", "other-job"])
def test_leaf0_claim_that_does_not_verify_is_a_bad_challenge(party, how):
    """The leaf-0 claims are the auditor's to deliver, in its challenge: one that is for
    another step or fails its proof under its party's root (a forged trainer leaf 0 included)
    is the auditor's fault, not the party's."""
    spec, trainer, auditor = _pair()
    player, other = (trainer, auditor) if party == TRAINER else (auditor, trainer)
    claim = {"forged": replace(player.claim(0), state_hash=h("forged S_0")),
             "other-step": player.claim(1),
             "other-party": other.claim(0),
             "other-job": replace(player.claim(0), job_id=h("other job"))}[how]
    state = begin(spec, trainer, auditor, 32, **{f"{party}_leaf0": claim})
    assert_outcome(state, AUDITOR, "bad-challenge", 32)
    assert "leaf 0" in state.outcome.reason or "leaf-0" in state.outcome.reason
    assert replayed(spec, trainer, auditor, state) == state


def test_forged_h0_leaf_does_not_save_a_party_with_another_leaf0():
    """A trainer committed to another S_0 cannot be rescued by delivering the h_0 leaf: the
    forged claim fails its proof, and the challenge carrying it is rejected."""
    spec, trainer, auditor = _h0_pair((TRAINER,))
    forged = replace(trainer.claim(0), state_hash=H0)
    assert_outcome(begin(spec, trainer, auditor, 32, trainer_leaf0=forged), AUDITOR,
                   "bad-challenge")
    assert_outcome(begin(spec, trainer, auditor, 32), TRAINER, "h0-mismatch", 0)


def test_start_checks_commitments_then_challenge_then_h0():
    spec, trainer, auditor = _h0_pair((TRAINER,))
    stranger = KeyPair.generate().public_key
    assert_outcome(begin(spec, trainer, auditor, 32, auditor_key=stranger), AUDITOR,
                   "bad-commitment", None)
    assert_outcome(begin(spec, trainer, auditor, 32, trainer_key=stranger), TRAINER,
                   "bad-commitment", None)
    assert_outcome(begin(spec, trainer, auditor, 5), AUDITOR, "bad-challenge", 5)  # agreed leaf


# ---- start: commitments and the challenge ------------------------------------------------------

def _pair(n=32, d=11, **trainer_kw):
    spec = make_spec(n)
    return (spec, Player(TRAINER, spec, honest_leaves(n), **trainer_kw),
            Player(AUDITOR, spec, diverging_leaves(n, d)))


def test_start_accepts_valid_commitments():
    spec, trainer, auditor = _pair()
    state = begin(spec, trainer, auditor, 32)
    assert is_running(state) and can_ask(state) and (state.lo, state.hi) == (0, 32)
    assert_running_invariant(state, trainer, auditor)
    assert state.agreed == Leaf(0, H0, EMPTY_LOG_DIGEST)
    assert rounds(state) == 0 and needs_answer_from(state) == frozenset()
    start_record = state.transcript[0]
    assert start_record.trainer_leaf0 == trainer.claim(0).to_bytes()
    assert start_record.auditor_leaf0 == auditor.claim(0).to_bytes()


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
def test_cross_job_commitment_loses_at_start(party):
    spec, trainer, auditor = _pair()
    other = make_spec(32, h0=h("other job"))
    if party == TRAINER:
        trainer = Player(TRAINER, other, honest_leaves(32), key=trainer.key)
    else:
        auditor = Player(AUDITOR, other, diverging_leaves(32, 11), key=auditor.key)
    assert_outcome(begin(spec, trainer, auditor, 32), party, "bad-commitment", None)


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
def test_cross_role_commitment_loses_at_start(party):
    spec, trainer, auditor = _pair()
    if party == TRAINER:
        trainer = Player(TRAINER, spec, honest_leaves(32), key=trainer.key, sign_role=AUDITOR)
    else:
        auditor = Player(AUDITOR, spec, diverging_leaves(32, 11), key=auditor.key,
                         sign_role=TRAINER)
    assert_outcome(begin(spec, trainer, auditor, 32), party, "bad-commitment")


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
def test_unregistered_key_loses_at_start(party):
    spec, trainer, auditor = _pair()
    stranger = KeyPair.generate().public_key
    state = begin(spec, trainer, auditor, 32,
                  **{f"{party}_key": stranger})
    assert_outcome(state, party, "bad-commitment")


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
def test_bad_signature_loses_at_start(party):
    spec, trainer, auditor = _pair()
    player = trainer if party == TRAINER else auditor
    player.signed = SignedCommitment(replace(player.signed.commitment, root=h("forged root")),
                                     player.signed.signature)
    assert_outcome(begin(spec, trainer, auditor, 32), party, "bad-commitment")


def test_trainer_commitment_over_other_n_loses():
    spec = make_spec(32)
    trainer = Player(TRAINER, spec, honest_leaves(31))
    auditor = Player(AUDITOR, spec, diverging_leaves(31, 4))
    assert_outcome(begin(spec, trainer, auditor, 31), TRAINER, "bad-commitment")


def test_auditor_commitment_over_more_steps_than_the_job_loses():
    spec = make_spec(32)
    trainer = Player(TRAINER, spec, honest_leaves(32))
    auditor = Player(AUDITOR, spec, diverging_leaves(33, 4))
    assert_outcome(begin(spec, trainer, auditor, 32), AUDITOR, "bad-commitment")


def test_both_commitments_bad_is_fault_both():
    spec, trainer, auditor = _pair()
    stranger = KeyPair.generate().public_key
    state = begin(spec, trainer, auditor, 32, trainer_key=stranger, auditor_key=stranger)
    assert_outcome(state, "both", "bad-commitment")


@pytest.mark.parametrize("j", [0, 33, -1])
def test_challenge_outside_the_steps_is_the_auditors_fault(j):
    spec, trainer, auditor = _pair()
    state = begin(spec, trainer, auditor, j, trainer_leaf=trainer.claim(32),
                  auditor_leaf=auditor.claim(32))
    assert_outcome(state, AUDITOR, "bad-challenge")


def test_challenge_with_a_leaf_for_another_step_is_the_auditors_fault():
    spec, trainer, auditor = _pair()
    state = begin(spec, trainer, auditor, 20, trainer_leaf=trainer.claim(21))
    assert_outcome(state, AUDITOR, "bad-challenge", 20)


def test_challenge_with_a_forged_trainer_leaf_is_the_auditors_fault():
    spec, trainer, auditor = _pair()
    forged = replace(trainer.claim(20), state_hash=h("forged"))
    assert_outcome(begin(spec, trainer, auditor, 20, trainer_leaf=forged), AUDITOR,
                   "bad-challenge")


def test_challenge_with_a_forged_auditor_leaf_is_the_auditors_fault():
    spec, trainer, auditor = _pair()
    forged = replace(auditor.claim(20), state_hash=h("forged"))
    assert_outcome(begin(spec, trainer, auditor, 20, auditor_leaf=forged), AUDITOR,
                   "bad-challenge")


def test_challenge_at_an_agreed_leaf_is_the_auditors_fault():
    spec, trainer, auditor = _pair(d=11)
    assert_outcome(begin(spec, trainer, auditor, 10), AUDITOR, "bad-challenge", 10)


def test_challenge_without_auditor_leaf_needs_commitment_ending_before_it():
    spec, trainer, auditor = _pair()
    assert_outcome(begin(spec, trainer, auditor, 20, auditor_leaf=None), AUDITOR,
                   "bad-challenge", 20)


# ---- illegal calls -----------------------------------------------------------------------------

@pytest.fixture
def asked():
    spec, trainer, auditor, state = game_for(32, 11)
    state, step = ask(state, T0 + 1)
    return spec, trainer, auditor, state


def test_ask_while_a_question_is_outstanding_raises(asked):
    with pytest.raises(GameError, match="outstanding"):
        ask(asked[3], T0 + 2)


def test_ask_when_over_raises():
    spec, trainer, auditor, state = game_for(32, 11)
    with pytest.raises(GameError, match="over"):
        ask(play(state, trainer, auditor), T0 + 1000)


def test_answer_when_over_raises():
    spec, trainer, auditor, state = game_for(32, 11)
    with pytest.raises(GameError, match="over"):
        answer(play(state, trainer, auditor), TRAINER, trainer.claim(0), T0 + 1000)


@pytest.mark.parametrize("party", ["arbiter", "", None, 1])
def test_answer_from_an_unknown_party_raises(asked, party):
    with pytest.raises(GameError, match="unknown party"):
        answer(asked[3], party, asked[1].claim(0), T0 + 2)


def test_answer_without_a_question_raises():
    spec, trainer, auditor, state = game_for(32, 11)
    with pytest.raises(GameError, match="no question"):
        answer(state, TRAINER, trainer.claim(0), T0 + 1)


def test_second_answer_from_a_party_raises(asked):
    spec, trainer, auditor, state = asked
    step = state.question
    state = answer(state, TRAINER, trainer.claim(step), T0 + 2)
    with pytest.raises(GameError, match="already answered"):
        answer(state, TRAINER, trainer.claim(step), T0 + 3)


def test_timeout_before_the_deadline_raises(asked):
    assert not deadline_passed(asked[3], T0 + 1 + DEADLINE)
    with pytest.raises(GameError, match="not passed"):
        timeout(asked[3], T0 + 1 + DEADLINE)


def test_timeout_without_a_question_raises():
    spec, trainer, auditor, state = game_for(32, 11)
    with pytest.raises(GameError, match="no question"):
        timeout(state, T0 + 1000)


def test_timeout_when_over_raises():
    spec, trainer, auditor, state = game_for(32, 11)
    with pytest.raises(GameError, match="over"):
        timeout(play(state, trainer, auditor), T0 + 1000)


@pytest.mark.parametrize("move", ["ask", "answer", "timeout"])
def test_time_running_backwards_raises(asked, move):
    spec, trainer, auditor, state = asked
    step = state.question
    with pytest.raises(GameError, match="backwards"):
        if move == "ask":
            ask(answer(answer(state, TRAINER, trainer.claim(step), T0 + 2), AUDITOR,
                       auditor.claim(step), T0 + 2), T0 + 1.5)
        elif move == "answer":
            answer(state, TRAINER, trainer.claim(step), T0)
        else:
            timeout(answer(state, TRAINER, trainer.claim(step), T0 + 5), T0 + 3)


def test_arguments_of_the_wrong_type_raise_type_error(asked):
    spec, trainer, auditor, state = asked
    with pytest.raises(TypeError):
        answer(state, TRAINER, 42, T0 + 2)
    with pytest.raises(TypeError):
        answer(state, TRAINER, trainer.claim(0), "now")
    with pytest.raises(TypeError):
        ask("state", T0)
    with pytest.raises(TypeError):
        start(spec, trainer.signed.to_bytes(), auditor.signed, 32,
              trainer_key=trainer.key.public_key, auditor_key=auditor.key.public_key,
              trainer_leaf=trainer.claim(32), auditor_leaf=auditor.claim(32),
              trainer_leaf0=trainer.claim(0), auditor_leaf0=auditor.claim(0), now=T0,
              deadline_s=DEADLINE)
    with pytest.raises(TypeError):
        start(spec, trainer.signed, auditor.signed, True, trainer_key=trainer.key.public_key,
              auditor_key=auditor.key.public_key, trainer_leaf=trainer.claim(1),
              auditor_leaf=auditor.claim(1), trainer_leaf0=trainer.claim(0),
              auditor_leaf0=auditor.claim(0), now=T0, deadline_s=DEADLINE)


@pytest.mark.parametrize("party", [TRAINER, AUDITOR])
@pytest.mark.parametrize("bad", [None, b"claim bytes", "leaf 0"])
def test_leaf0_claims_are_required_claim_objects(party, bad):
    spec, trainer, auditor = _pair()
    leaf0 = {"trainer_leaf0": trainer.claim(0), "auditor_leaf0": auditor.claim(0),
             f"{party}_leaf0": bad}
    with pytest.raises(TypeError, match=f"{party}_leaf0"):
        start(spec, trainer.signed, auditor.signed, 32, trainer_key=trainer.key.public_key,
              auditor_key=auditor.key.public_key, trainer_leaf=trainer.claim(32),
              auditor_leaf=auditor.claim(32), now=T0, deadline_s=DEADLINE, **leaf0)
    with pytest.raises(TypeError):
        start(spec, trainer.signed, auditor.signed, 32, trainer_key=trainer.key.public_key,
              auditor_key=auditor.key.public_key, trainer_leaf=trainer.claim(32),
              auditor_leaf=auditor.claim(32), now=T0, deadline_s=DEADLINE)


@pytest.mark.parametrize(("now", "deadline_s"), [(math.nan, 1.0), (T0, 0.0), (T0, math.inf)])
def test_bad_times_raise_value_error(now, deadline_s):
    spec, trainer, auditor = _pair()
    with pytest.raises(ValueError):
        start(spec, trainer.signed, auditor.signed, 32, trainer_key=trainer.key.public_key,
              auditor_key=auditor.key.public_key, trainer_leaf=trainer.claim(32),
              auditor_leaf=auditor.claim(32), trainer_leaf0=trainer.claim(0),
              auditor_leaf0=auditor.claim(0), now=now, deadline_s=deadline_s)


# ---- views -----------------------------------------------------------------------------------

def test_views_follow_one_round(asked):
    spec, trainer, auditor, state = asked
    assert not can_ask(state) and state.question == 16 and rounds(state) == 1
    assert deadline(state) == T0 + 1 + DEADLINE
    assert needs_answer_from(state) == {TRAINER, AUDITOR}
    state = answer(state, AUDITOR, auditor.claim(16), T0 + 2)
    assert needs_answer_from(state) == {TRAINER}
    state = answer(state, TRAINER, trainer.claim(16), T0 + 3)
    assert can_ask(state) and deadline(state) is None
    assert (state.lo, state.hi) == (0, 16) and state.transcript[-1] == Decision(16, False, 0, 16)
    assert_running_invariant(state, trainer, auditor)
    state, step = ask(state, T0 + 4)
    assert step == 8 and rounds(state) == 2
    state = answer(answer(state, TRAINER, trainer.claim(8), T0 + 5), AUDITOR,
                   auditor.claim(8), T0 + 5)
    assert (state.lo, state.hi) == (8, 16) and state.transcript[-1] == Decision(8, True, 8, 16)
    assert_running_invariant(state, trainer, auditor)
    assert disputed_step(state) is None and dispute(state) is None


# ---- transcript ------------------------------------------------------------------------------

def _finished(kind: str):
    if kind == "honest":
        spec, trainer, auditor, state = game_for(32, 7)
    elif kind == "start-failure":
        spec, trainer, auditor = _pair()
        state = begin(spec, trainer, auditor, 10)
    elif kind == "h0-mismatch":
        spec, trainer, auditor = _h0_pair((AUDITOR,))
        state = begin(spec, trainer, auditor, 32)
    else:
        cls = {"bad-proof": BadProofLiar, "timeout": Staller, "malformed": OversizedLiar}[kind]
        spec, trainer, auditor, state = _liar_game(cls, TRAINER, from_round=3)
    return spec, trainer, auditor, play(state, trainer, auditor) if is_running(state) else state


@pytest.mark.parametrize("kind", ["honest", "start-failure", "h0-mismatch", "bad-proof",
                                  "timeout", "malformed"])
def test_replay_rederives_the_outcome(kind):
    spec, trainer, auditor, state = _finished(kind)
    data = transcript_bytes(state)
    again = replayed(spec, trainer, auditor, state)
    assert again.outcome == state.outcome and again.transcript == state.transcript
    assert transcript_bytes(again) == data
    assert decode_transcript(data).records == state.transcript
    assert replay_transcript(spec, trainer.signed, auditor.signed,
                             trainer_key=trainer.key.public_key,
                             auditor_key=auditor.key.public_key,
                             transcript=state.transcript).outcome == state.outcome


def test_replay_of_a_running_game_rederives_the_state(asked):
    spec, trainer, auditor, state = asked
    state = answer(state, TRAINER, trainer.claim(state.question), T0 + 2)
    assert replayed(spec, trainer, auditor, state) == state


def test_replay_rejects_a_changed_outcome():
    spec, trainer, auditor, state = _finished("honest")
    forged = state.transcript[:-1] + (replace(state.outcome, fault=TRAINER),)
    with pytest.raises(TranscriptError, match="differs"):
        replay_transcript(spec, trainer.signed, auditor.signed,
                          trainer_key=trainer.key.public_key,
                          auditor_key=auditor.key.public_key, transcript=forged)


def test_replay_rejects_a_changed_answer():
    spec, trainer, auditor, state = _finished("honest")
    i = next(i for i, r in enumerate(state.transcript) if isinstance(r, Answer) and r.step)
    record = state.transcript[i]
    tampered = replace(record, data=BadProofLiar(TRAINER, spec, trainer.leaves,
                                                 key=trainer.key).cheat(record.step))
    with pytest.raises(TranscriptError):
        replay_transcript(spec, trainer.signed, auditor.signed,
                          trainer_key=trainer.key.public_key,
                          auditor_key=auditor.key.public_key,
                          transcript=state.transcript[:i] + (tampered,) + state.transcript[i + 1:])


def test_replay_rejects_an_illegal_move_sequence():
    spec, trainer, auditor, state = _finished("honest")
    with pytest.raises(TranscriptError, match="does not replay"):
        replay_transcript(spec, trainer.signed, auditor.signed,
                          trainer_key=trainer.key.public_key,
                          auditor_key=auditor.key.public_key,
                          transcript=state.transcript[:1] + state.transcript[2:])


def test_replay_rejects_other_keys():
    spec, trainer, auditor, state = _finished("honest")
    with pytest.raises(TranscriptError, match="another job"):
        replay_transcript(spec, trainer.signed, auditor.signed,
                          trainer_key=auditor.key.public_key,
                          auditor_key=auditor.key.public_key,
                          transcript=transcript_bytes(state))


def test_replay_rejects_a_transcript_without_start():
    spec, trainer, auditor, state = _finished("honest")
    with pytest.raises(TranscriptError, match="start record"):
        replay_transcript(spec, trainer.signed, auditor.signed,
                          trainer_key=trainer.key.public_key,
                          auditor_key=auditor.key.public_key, transcript=state.transcript[1:])


@pytest.mark.parametrize("field", ["trainer_leaf0", "auditor_leaf0"])
def test_replay_rejects_a_start_whose_leaf0_does_not_parse(field):
    spec, trainer, auditor, state = _finished("honest")
    for bad in (b"\xc1not a claim", b"", trainer.claim(1).to_bytes()[:-1]):
        first = replace(state.transcript[0], **{field: bad})
        with pytest.raises(TranscriptError, match="do not parse"):
            replay_transcript(spec, trainer.signed, auditor.signed,
                              trainer_key=trainer.key.public_key,
                              auditor_key=auditor.key.public_key,
                              transcript=(first,) + state.transcript[1:])


@pytest.mark.parametrize("field", ["trainer_leaf0", "auditor_leaf0"])
def test_replay_rejects_a_start_with_a_changed_leaf0(field):
    """Another valid claim in the start record (the other party's leaf 0, or a forged h_0
    leaf) re-derives another start, so the recorded moves no longer replay."""
    spec, trainer, auditor, state = _finished("honest")
    player = trainer if field == "trainer_leaf0" else auditor
    other = auditor if player is trainer else trainer
    for claim in (other.claim(0), replace(player.claim(0), log_hash=h("log 0"))):
        first = replace(state.transcript[0], **{field: claim.to_bytes()})
        with pytest.raises(TranscriptError):
            replay_transcript(spec, trainer.signed, auditor.signed,
                              trainer_key=trainer.key.public_key,
                              auditor_key=auditor.key.public_key,
                              transcript=(first,) + state.transcript[1:])


def test_decode_transcript_needs_the_leaf0_fields():
    from protocol.codec.canonical import decode, encode
    spec, trainer, auditor, state = _finished("honest")
    body = decode(transcript_bytes(state))
    for field in ("trainer_leaf0", "auditor_leaf0"):
        for value in ("missing", None):
            start_body = dict(body["records"][0])
            if value == "missing":
                del start_body[field]
            else:
                start_body[field] = value
            with pytest.raises(EncodingError):
                decode_transcript(encode({**body, "records": [start_body] +
                                          body["records"][1:]}))


def test_replay_rejects_inconsistent_answer_lengths():
    spec, trainer, auditor, state = _finished("honest")
    i = next(i for i, r in enumerate(state.transcript) if isinstance(r, Answer))
    bad = replace(state.transcript[i], length=state.transcript[i].length + 1)
    with pytest.raises(TranscriptError, match="length"):
        replay_transcript(spec, trainer.signed, auditor.signed,
                          trainer_key=trainer.key.public_key,
                          auditor_key=auditor.key.public_key,
                          transcript=state.transcript[:i] + (bad,) + state.transcript[i + 1:])


def _without_times(records):
    """Records with their timestamps (and the start's deadline) zeroed."""
    out = [replace(r, at=0.0) if hasattr(r, "at") else r for r in records]
    return [replace(r, deadline_s=0.0) if hasattr(r, "deadline_s") else r for r in out]


def test_every_changed_byte_of_a_transcript_fails_to_replay_or_only_moves_a_time():
    """Any byte changed outside the timing fields makes replay fail. A timestamp or deadline
    nudged so that every answer stays on time replays, to a transcript with other bytes: the
    verdict's signature, not the replay, is what pins the bytes."""
    spec, trainer, auditor, state = _finished("bad-proof")
    data = transcript_bytes(state)
    for i in range(len(data)):
        changed = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]
        try:
            again = replay_transcript(spec, trainer.signed, auditor.signed,
                                      trainer_key=trainer.key.public_key,
                                      auditor_key=auditor.key.public_key, transcript=changed)
        except (TranscriptError, EncodingError):
            continue
        assert transcript_bytes(again) == changed
        assert _without_times(again.transcript) == _without_times(state.transcript)


def test_decode_transcript_rejects_unknown_records():
    spec, trainer, auditor, state = _finished("honest")
    from protocol.codec.canonical import decode, encode
    body = decode(transcript_bytes(state))
    body["records"].append({"type": "bribe", "amount": 1})
    with pytest.raises(EncodingError):
        decode_transcript(encode(body))


@pytest.mark.parametrize("alias", [float(PROTOCOL_VERSION)])
def test_aliased_protocol_version_is_refused(alias):
    """Finding 3 (issue 10): a transcript whose protocol_version is `True` or `1.0` (equal to 1,
    other bytes) decoded to the same transcript as its canonical bytes."""
    from protocol.codec.canonical import decode, encode
    _, _, _, state = _finished("honest")
    aliased = encode({**decode(transcript_bytes(state)), "protocol_version": alias})
    assert aliased != transcript_bytes(state)
    with pytest.raises(EncodingError, match="protocol version"):
        decode_transcript(aliased)


@pytest.mark.parametrize("field, alias", [("step", True), ("round", 1.0), ("at", 1),
                                          ("step", "1")])
def test_aliased_record_fields_are_refused(field, alias):
    """A question's step `True`, round `1.0` or time `1` is refused by exact type."""
    from protocol.codec.canonical import decode, encode
    _, _, _, state = _finished("honest")
    body = decode(transcript_bytes(state))
    i = next(i for i, r in enumerate(body["records"]) if r["type"] == "question")
    body["records"][i] = {**body["records"][i], field: alias}
    with pytest.raises(EncodingError, match=f"field {field} has the wrong type"):
        decode_transcript(encode(body))


@pytest.mark.parametrize("record", [{"type": []}, {"type": {}}, {"type": None}, 5, [], b"x"],
                         ids=["list-type", "map-type", "no-type", "int", "list", "bytes"])
def test_transcript_record_of_the_wrong_type_is_an_encoding_error(record):
    """Finding 7 (issue 10): a record whose "type" is a list or a map made the decoder raise
    TypeError (unhashable) instead of the project's own error."""
    from protocol.codec.canonical import decode, encode
    _, _, _, state = _finished("honest")
    body = decode(transcript_bytes(state))
    with pytest.raises(EncodingError, match="known \"type\""):
        decode_transcript(encode({**body, "records": body["records"] + [record]}))


def test_outcome_is_the_last_record():
    spec, trainer, auditor, state = _finished("timeout")
    assert isinstance(state.transcript[-1], Outcome) and state.transcript[-1] == state.outcome


# ---- random move sequences -------------------------------------------------------------------

_N = 32
_SPEC = make_spec(_N)
_TRAINER = Player(TRAINER, _SPEC, honest_leaves(_N))
_AUDITORS = {d: Player(AUDITOR, _SPEC, diverging_leaves(_N, d)) for d in (1, 2, 11, 17, 31, 32)}

# Weighted towards legal, honest progress ("auto") so that games get deep; every kind of bad or
# illegal move stays likely enough to show up within a game.
_moves = st.lists(st.tuples(
    st.sampled_from(["auto"] * 12 + ["ask", "answer", "answer", "timeout"]),
    st.sampled_from([TRAINER, AUDITOR] * 10 + ["mallory"]),
    st.sampled_from([0] * 30 + [-1, 1, 5]),                   # step offset from the question
    st.sampled_from(["honest"] * 40 + ["tampered", "garbage"]),
    st.sampled_from([0.5] * 10 + [0.0, 3.0, 11.0, -1.0]),     # time step
), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d=st.sampled_from(sorted(_AUDITORS)), moves=_moves)
def test_random_moves_only_raise_game_error_and_keep_the_invariant(d, moves):
    trainer, auditor = _TRAINER, _AUDITORS[d]
    players = {TRAINER: trainer, AUDITOR: auditor, "mallory": trainer}
    state = begin(_SPEC, trainer, auditor, _N)
    now = T0
    for action, party, offset, how, dt in moves:
        now += dt
        if action == "auto":  # the legal move: ask if it is the arbiter's turn, else answer
            action = "ask" if can_ask(state) else "answer"
            party = min(needs_answer_from(state), default=party)
        try:
            if action == "ask":
                state, _ = ask(state, now)
            elif action == "timeout":
                state = timeout(state, now)
            else:
                step = min(max((state.question or 0) + offset, 0), _N)
                claim = players[party].claim(step)
                data = {"honest": claim.to_bytes(), "garbage": b"\x93\x01\x02",
                        "tampered": replace(claim, log_hash=h("t")).to_bytes()}[how]
                state = answer(state, party, data, now)
        except GameError:
            pass
        if is_running(state):
            assert_running_invariant(state, trainer, auditor)
            assert state.outcome is None
        else:
            o = state.outcome
            assert o.fault in game.FAULTS and o.kind in game.KINDS
            if o.kind == "disagreed-at":
                assert o.step == d
        now = max(now, state.clock)
    again = replay_transcript(_SPEC, trainer.signed, auditor.signed,
                              trainer_key=trainer.key.public_key,
                              auditor_key=auditor.key.public_key,
                              transcript=transcript_bytes(state))
    assert again == state
