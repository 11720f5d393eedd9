"""The auditor's challenge (SPEC §5.1): strict bytes, and one rule for a valid challenge (the
game's, `game.start`), whether `Challenge.verify` or an arbiter applies it (issue 10, findings 3
and 4)."""

from __future__ import annotations

import pytest

from protocol.codec.canonical import PROTOCOL_VERSION, decode, encode
from protocol.dispute.challenge import Challenge
from protocol.dispute.game import AUDITOR, TRAINER
from protocol.errors import EncodingError, ProofError, SignatureError
from protocol.job.spec import JobSpec
from tests.protocol.dispute.test_game import Player, diverging_leaves, honest_leaves, make_spec

N, D = 16, 5


def challenge_at(j: int, *, diverge_at: int = D,
                 trainer_steps: int = N) -> tuple[JobSpec, Challenge]:
    """An auditor's challenge at step j over its own leaves 0..j, which differ from the
    trainer's from step `diverge_at` on."""
    spec = make_spec(N)
    trainer = Player(TRAINER, spec, honest_leaves(trainer_steps))
    auditor = Player(AUDITOR, spec, diverging_leaves(N, diverge_at)[:j + 1])
    return spec, Challenge(spec.job_id, j, "state hash differs from the trainer's",
                           trainer.signed, trainer.claim(j), auditor.signed, auditor.claim(j),
                           trainer.claim(0), auditor.claim(0))


def test_a_valid_challenge_round_trips_and_verifies():
    spec, challenge = challenge_at(D)
    data = challenge.to_bytes()
    assert Challenge.from_bytes(data) == challenge
    assert Challenge.from_bytes(data).to_bytes() == data
    challenge.verify(spec)


@pytest.mark.parametrize("alias", [float(PROTOCOL_VERSION)])
def test_aliased_protocol_version_is_refused(alias):
    """Finding 3: a float equal to the version (`1.0` for version 1, also `True`) made bytes
    that decoded to the very challenge whose own bytes are other ones."""
    _, challenge = challenge_at(D)
    body = decode(challenge.to_bytes())
    aliased = encode({**body, "protocol_version": alias})
    assert aliased != challenge.to_bytes()
    with pytest.raises(EncodingError, match="protocol version"):
        Challenge.from_bytes(aliased)


def test_challenge_at_step_0_is_refused_by_the_games_rule():
    """Finding 4: the old `Challenge.verify` compared the leaves' state hashes only, so leaves 0
    that differ passed as a challenge at step 0; the game rules j outside 1..n a bad
    challenge, and `verify` now applies the game's rule."""
    spec, challenge = challenge_at(0, diverge_at=0)
    assert challenge.trainer_leaf.state_hash != challenge.auditor_leaf.state_hash
    with pytest.raises(ProofError, match="outside 1..16"):
        challenge.verify(spec)


def test_challenge_under_a_trainer_commitment_over_other_steps_is_refused():
    """Finding 4: the old `verify` never compared the trainer's n with the job's steps."""
    spec, challenge = challenge_at(D, trainer_steps=N - 4)
    with pytest.raises(SignatureError, match="expected n = 16"):
        challenge.verify(spec)


def test_challenge_of_another_job_is_refused():
    spec, challenge = challenge_at(D)
    with pytest.raises(ProofError, match="is for job"):
        challenge.verify(make_spec(N + 1))
    assert challenge.job_id == spec.job_id
