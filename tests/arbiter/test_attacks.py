"""The attack suite (issue 5, SPEC §6): every cheat, at the first, a middle and the last step.

A cheating trainer (trainer_node.faults, the same hooks the daemon's --inject-fault uses) trains
the job; an auditor on other hardware replays it and files its challenge; the arbiter bisects
between the two stores and re-executes on a third profile. The verdict must name the trainer
and the exact step, in at most ceil(log2 n) bisection rounds, and re-verify offline. A lying
auditor must lose the same way. An honest trainer must never be found at fault: 20 seeded jobs
over 5 profile pairs, each challenged by a lying auditor at a seeded step.
"""

from __future__ import annotations

import random

import pytest

from auditor_node.faults import AuditorFaults
from protocol.dispute.verdict import verify_verdict
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError
from protocol.job.create import build_job
from protocol.job.faults import parse_fault
from protocol.job.run import StepHooks
from trainer_node.faults import TrainerFaults

from .conftest import STEPS, audit, log2_bound, settle, tiny_job, train

# What the arbiter finds re-executing each cheat's step: a trainer that trained on other data or
# with another setting still serves the log it recorded, which does not fit the honest replay
# (invalid-log); one whose log and state disagree otherwise replays to another state. A doubled
# learning rate changes only the update, whose elements lie far inside their certified bands, so
# the recorded log still fits the honest replay and the state is what differs. Other labels
# change only the loss and the backward pass; where the cheater's log has no entry there that
# the honest replay finds out of its band (a step of this tiny job may have none), it fits too,
# and the state differs.
TRAINING_CHEATS = {"relabel": ("invalid-log", "wrong-state"), "swap-examples": ("invalid-log",),
                   "skip-step": ("invalid-log",), "lr": ("wrong-state",),
                   "log-invent": ("invalid-log",), "swap-checkpoint": ("wrong-state",),
                   "log-flip": ("wrong-state",), "log-drop": ("wrong-state",)}
POSITIONS = (1, STEPS // 2 + 1, STEPS)


def _assert_verdict(result, fault: str, step: int, n: int = STEPS) -> None:
    verdict = result.verdict
    assert (verdict.fault, verdict.step) == (fault, step), verdict.reason
    assert verdict.rounds <= log2_bound(n)
    assert verify_verdict(verdict.to_bytes()).to_bytes() == verdict.to_bytes()


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("kind", TRAINING_CHEATS)
def test_a_cheating_trainer_is_at_fault_at_its_step(job, tmp_path, kind, position):
    spec, state0 = job
    hooks = TrainerFaults([parse_fault(f"{kind}:{position}")])
    try:
        cheater = train(tmp_path / "trainer", spec, state0, hooks=hooks)
    except ConfigError as err:
        # a flip every honest replay absorbs is a legal move, not a cheat: where a step of this
        # tiny job has no other, there is nothing to catch (the other positions have one)
        assert kind in ("log-flip", "log-drop") and "changes S_t" in str(err), err
        pytest.skip(f"{kind}:{position}: {err}")
    dispute = audit(tmp_path / "auditor", cheater)
    assert dispute.challenge is not None and dispute.challenge.step == position
    result = settle(dispute)
    _assert_verdict(result, "trainer", position)
    assert result.verdict.finding in TRAINING_CHEATS[kind]


@pytest.fixture(scope="module")
def scheduled_job():
    """A job with a warm-up + cosine schedule, clipping and 2 micro-batches (SPEC §3.5)."""
    return build_job(program="char-transformer", preset="test", steps=6, seed=0, init_seed=1,
                     config={"warmup_steps": 4, "decay_steps": 4, "min_lr": 1e-4,
                             "clip_grad_norm": 0.5},
                     policy=PrecisionPolicy(), checkpoint_interval=2, commit_interval=6,
                     micro_batches=2)


@pytest.mark.parametrize("position", (4,))
def test_a_trainer_that_cuts_the_warmup_short_is_at_fault_at_that_step(scheduled_job, tmp_path,
                                                                        position):
    spec, state0 = scheduled_job
    honest = audit(tmp_path / "honest-auditor", train(tmp_path / "honest", spec, state0))
    assert honest.challenge is None  # the schedule, clipping and micro-batches replay exactly
    cheater = train(tmp_path / "trainer", spec, state0,
                    hooks=TrainerFaults([parse_fault(f"skip-warmup:{position}")]))
    dispute = audit(tmp_path / "auditor", cheater)
    assert dispute.challenge is not None and dispute.challenge.step == position
    result = settle(dispute)
    _assert_verdict(result, "trainer", position, n=6)
    # another rate moves the update (wrong-state) and, early on, elements the log named
    assert result.verdict.finding in ("wrong-state", "invalid-log")


def test_a_trainer_on_two_processes_is_verified_and_caught_like_one(scheduled_job, tmp_path):
    """Issue 14: the micro-batches computed by 2 processes (SPEC §3.5) give the 1-process
    trainer's leaves, an auditor on 2 processes replays the 1-process trainer, and the cheat of
    a 2-process trainer is caught and adjudicated at its step."""
    spec, state0 = scheduled_job
    one = train(tmp_path / "one", spec, state0)
    two = train(tmp_path / "two", spec, state0, workers=2)
    assert [leaf.hash for leaf in two.leaves()] == [leaf.hash for leaf in one.leaves()]
    assert audit(tmp_path / "honest-auditor", one, workers=2).challenge is None
    cheater = train(tmp_path / "cheater", spec, state0, workers=2,
                    hooks=TrainerFaults([parse_fault("relabel:3")]))
    dispute = audit(tmp_path / "auditor", cheater)
    assert dispute.challenge is not None and dispute.challenge.step == 3
    _assert_verdict(settle(dispute), "trainer", 3, n=6)


def test_a_lying_auditor_loses_against_an_honest_scheduled_trainer(scheduled_job, tmp_path):
    """The arbiter re-executes the job's step as the job defines it — schedule, clipping and
    micro-batches included — so the honest trainer wins."""
    spec, state0 = scheduled_job
    trainer = train(tmp_path / "trainer", spec, state0)
    dispute = audit(tmp_path / "auditor", trainer,
                    hooks=AuditorFaults([parse_fault("false-challenge:3")]))
    assert dispute.challenge is not None and dispute.challenge.step == 3
    _assert_verdict(settle(dispute), "auditor", 3, n=6)


class UndecodableLog(StepHooks):
    """A trainer that commits to a rounding log that does not decode at one step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after(self, t, ex, log):
        return ex.state(), (b"not a rounding log" if t == self.step else log)


@pytest.mark.parametrize("position", (1, STEPS))
def test_an_undecodable_log_is_challenged_and_ruled_invalid_log(job, tmp_path, position):
    # Regression (hostile-peer finding 2): the audit caught LogViolationError and
    # LogMismatchError but not LogFormatError, so it ended FAILED and the cheat escaped.
    spec, state0 = job
    cheater = train(tmp_path / "trainer", spec, state0, hooks=UndecodableLog(position))
    dispute = audit(tmp_path / "auditor", cheater)
    assert dispute.challenge is not None and dispute.challenge.step == position
    result = settle(dispute)
    _assert_verdict(result, "trainer", position)
    assert result.verdict.finding == "invalid-log"


@pytest.mark.parametrize("position", POSITIONS)
def test_a_lying_auditor_is_at_fault_at_its_step(job, tmp_path, position):
    spec, state0 = job
    trainer = train(tmp_path / "trainer", spec, state0)
    dispute = audit(tmp_path / "auditor", trainer,
                    hooks=AuditorFaults([parse_fault(f"false-challenge:{position}")]))
    assert dispute.challenge.step == position
    result = settle(dispute)
    _assert_verdict(result, "auditor", position)
    assert result.verdict.finding == "false-challenge"


PAIRS = [("cpu-2t", "emulated-gpu", "cpu-1t"), ("cpu-1t", "channels-last", "emulated-gpu"),
         ("emulated-gpu", "cpu-1t", "channels-last"), ("channels-last", "cpu-2t", "cpu-1t"),
         ("cpu-1t", "cpu-2t", "emulated-gpu")]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "->".join(p))
def test_an_honest_trainer_is_never_at_fault(tmp_path, seed, pair):
    trainer_p, auditor_p, arbiter_p = (Profile.parse(p) for p in pair)
    steps = 6
    spec, state0 = tiny_job(seed=seed, steps=steps)
    trainer = train(tmp_path / "trainer", spec, state0, profile=trainer_p)
    honest_audit = audit(tmp_path / "auditor", trainer, profile=auditor_p)
    assert honest_audit.challenge is None  # other hardware, the same bits
    k = random.Random(f"{seed}{pair}").randint(1, steps)
    lying = audit(tmp_path / "liar", trainer, profile=auditor_p,
                  hooks=AuditorFaults([parse_fault(f"false-challenge:{k}")]))
    result = settle(lying, profile=arbiter_p)
    _assert_verdict(result, "auditor", k, n=steps)
