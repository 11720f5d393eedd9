"""`run_audit(sample=F)` and `ovt-auditor audit --sample F`: a sampled audit replays round(F·I)
of the job's I checkpoint intervals, drawn once per job from the auditor's key and the
trainer's signed root; one that finds nothing is "sampled, not verified", signs nothing and
exits 4, never 0; one whose sample holds a cheat challenges it exactly as a full audit does,
and the arbiter rules the trainer at fault — also when the trainer refuses the sampled S_c;
a second root for the job gets a full audit, not a second draw; a sample of every interval
is a full audit; and a daemon that audits in full does not join a sampled verdict."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from arbiter.adjudicate import adjudicate
from arbiter.parties import StoreParty
from auditor_node.audit import (
    CHALLENGE_FILE,
    DIVERGED,
    MATCHED,
    SAMPLED,
    AuditRecord,
    run_audit,
)
from auditor_node.cli import main, verdict_line
from auditor_node.runner import AuditRunner
from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import StoreDirectory
from protocol.codec.canonical import decode
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from protocol.job.faults import Fault
from protocol.job.intervals import Interval, plan_intervals, usable_cpus
from protocol.job.run import run_job
from protocol.job.sampling import draw_sample
from protocol.job.store import SPEC_FILE, JobStore
from trainer_node.faults import TrainerFaults

from .conftest import (
    AUDITOR_PROFILE,
    CHEAT_STEP,
    FALSIFIED_STEP,
    STEPS,
    TINY,
    Counting,
    serve_claims,
)
from .daemon import Auditors, watch_audit
from .test_parallel_audit import Refusing

pytestmark = pytest.mark.network
two_cpus = pytest.mark.skipif(usable_cpus() < 2, reason="2 audit processes need 2 CPUs")
CHEAT_INTERVAL = Interval(6, 10)  # the interval holding CHEAT_STEP
CALL_TIMEOUT_S = 10


def _key_whose_sample(spec, signed, fraction, wanted: bool, holding: Interval) -> KeyPair:
    """An auditor key whose sample of `signed` holds `holding` (wanted) or not: the tests pick
    the auditor, since no one, the test included, can steer a given key's sample."""
    plan = plan_intervals(spec)
    for _ in range(200):
        key = KeyPair.generate()
        if (holding in draw_sample(plan, fraction, key, signed).chosen) == wanted:
            return key
    raise AssertionError("no key in 200 draws gave the sample wanted")


@pytest.fixture(scope="module")
def cheater_signed(trained, cheater_root):
    store = JobStore(cheater_root, trained.spec)
    try:
        return store.commitment(STEPS)
    finally:
        store.close()


def test_a_sample_that_misses_the_cheat_says_sampled_not_verified(trained, cheater_root,
                                                                  cheater_signed, tmp_path):
    key = _key_whose_sample(trained.spec, cheater_signed, 0.25, False, CHEAT_INTERVAL)
    counting = Counting(StoreDirectory(cheater_root))
    with serve_claims(counting) as address:
        record = run_audit(address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE,
                           sample=0.25)
    assert record.state == SAMPLED
    (chosen,) = record.sample.chosen  # round(0.25 · 4) = 1 of the 4 intervals 1-5 ... 16-20
    assert record.sample.intervals == 4 and chosen != CHEAT_INTERVAL
    assert record.replayed == record.sample.replayed_steps() == STEPS // 4
    assert counting.steps("GetCheckpoint") == [chosen.start]
    assert counting.steps("GetLog") == list(chosen.steps)
    assert record.reason.startswith(f"sampled, not verified: replayed 1 of 4 intervals "
                                    f"(steps {chosen}): 5 of the job's 20 steps")
    assert "caught with probability at least 0.250" in record.reason
    assert "verified" not in record.reason.replace("not verified", "")
    assert record.auditor_commitment is None and record.challenge is None
    store = JobStore(tmp_path, trained.spec)
    assert store.commitment() is None  # it signed nothing over leaves it did not replay
    assert not (store.dir / CHALLENGE_FILE).exists()


@pytest.fixture(scope="module")
def caught(trained, cheater_address, cheater_signed, tmp_path_factory):
    key = _key_whose_sample(trained.spec, cheater_signed, 0.25, True, CHEAT_INTERVAL)
    root = tmp_path_factory.mktemp("sampled-auditor")
    return run_audit(cheater_address, trained.spec.job_id, root, key, AUDITOR_PROFILE,
                     sample=0.25), root, key


def test_a_sample_holding_the_cheat_challenges_it_as_a_full_audit(caught, trained):
    record, root, key = caught
    assert record.state == DIVERGED and record.divergent_step == CHEAT_STEP
    assert record.sample.chosen == (CHEAT_INTERVAL,)
    # escalated: steps 1..7 replayed in full, then the sampled replay of 6-10 stitched on
    own = record.auditor_commitment
    own.verify(job_id=trained.spec.job_id, role="auditor", n=CHEAT_STEP - 1,
               public_key=key.public_key)
    store = JobStore(root, trained.spec)
    assert [leaf.step for leaf in store.leaves()] == list(range(CHEAT_STEP))
    challenge = Challenge.from_bytes(record.challenge.read_bytes())
    challenge.verify(trained.spec)
    assert challenge.step == CHEAT_STEP


def test_the_arbiter_settles_the_sampled_audits_challenge(caught, trained, cheater_root):
    record, root, _ = caught
    verdict = adjudicate(trained.spec, Challenge.from_bytes(record.challenge.read_bytes()),
                         StoreParty("trainer", JobStore(cheater_root, trained.spec)),
                         StoreParty("auditor", JobStore(root, trained.spec)),
                         key=KeyPair.generate(), profile=Profile.parse("cpu-1t")).verdict
    assert (verdict.fault, verdict.step) == ("trainer", CHEAT_STEP), verdict.reason


@two_cpus
def test_cli_sampled_audit_exits_4_and_never_says_verified(trained, trainer_address,
                                                            auditor_key, tmp_path, capsys):
    args = ["audit", "--trainer", trainer_address, "--job", trained.spec.job_id.hex(),
            "--store", str(tmp_path), "--key", str(auditor_key), "--sample", "0.5"]
    assert main(args) == 4
    line = capsys.readouterr().out
    assert "SAMPLED, NOT VERIFIED: sampled, not verified: replayed 2 of 4 intervals" in line
    assert "MATCHED" not in line and "verified" not in line.lower().replace("not verified", "")
    # again in two processes: the same key and root draw the same sample
    assert main([*args, "--processes", "2", "--json"]) == 4
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["state"] == "sampled" and verdict["auditor_root"] is None
    assert verdict["sample"]["verified"] is False
    assert verdict["sample"]["steps_replayed"] == STEPS // 2
    assert verdict["sample"]["catch_probability_at_least"] == 0.5
    assert verdict["sample"]["catch_probability_distinct_intervals"] == {"1": 0.5, "2": 5 / 6}
    sampled = ", ".join(f"{first}-{last}" for first, last in verdict["sample"]["sampled"])
    assert f"(steps {sampled}): 10 of the job's 20 steps" in line


@pytest.mark.parametrize("option, value", [("--sample", "0"), ("--sample", "1.5"),
                                           ("--sample", "-0.25"), ("--sample", "abc"),
                                           ("--sample", "nan"), ("--sample", "inf"),
                                           ("--processes", "0"), ("--processes", "two"),
                                           ("--processes", str(usable_cpus() + 1))])
def test_cli_bad_sample_or_processes_is_one_line_and_exits_2(trained, auditor_key, tmp_path,
                                                              capsys, option, value):
    code = main(["audit", "--trainer", "127.0.0.1:1", "--job", trained.spec.job_id.hex(),
                 "--store", str(tmp_path / "store"), "--key", str(auditor_key), option,
                 value])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith(f"ovt-auditor: error: {option} must be ") and repr(value) in err, err
    assert "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "store").exists()  # refused before the trainer was asked


def test_a_sampled_record_round_trips_and_a_full_audits_has_no_sample_field(caught):
    record, _, _ = caught
    assert AuditRecord.from_bytes(record.to_bytes()) == record
    full = AuditRecord(job_id=record.job_id, state=DIVERGED, steps=STEPS)
    assert "sample" not in decode(full.to_bytes())  # a full audit's record is unchanged


@two_cpus
def test_the_daemon_runs_sampled_audits_in_parallel(trained, trainer_address, auditor_key,
                                                    tmp_path):
    auditors = Auditors(tmp_path, auditor_key)
    try:
        daemon = auditors.launch(tmp_path / "store", "--processes", "2", "--sample", "0.5")
        with grpc.insecure_channel(daemon.wait_serving().address) as channel:
            ovt_pb2_grpc.AuditorStub(channel).Audit(ovt_pb2.AuditRequest(
                trainer_address=trainer_address, job_id=trained.spec.job_id),
                timeout=CALL_TIMEOUT_S)
            report = watch_audit(channel, trained.spec.job_id)[-1]
            assert report.state == "sampled", daemon.log_text()
            assert report.reason.startswith("sampled, not verified: replayed 2 of 4")
            assert ": 10 of the job's 20 steps" in report.reason
            assert report.commitment == b"" and report.step == STEPS // 2
            with pytest.raises(grpc.RpcError) as err:
                ovt_pb2_grpc.AuditorStub(channel).GetChallenge(
                    ovt_pb2.JobRef(job_id=trained.spec.job_id), timeout=CALL_TIMEOUT_S)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert daemon.terminate() == 0, daemon.log_text()
    finally:
        auditors.close()


@two_cpus
@pytest.mark.slow
def test_a_quarter_sample_of_a_200_step_job_replays_50_steps_and_catches_its_cheat(
        tmp_path):
    """The issue's case: 200 steps, 8 intervals of 25, F = 0.25: 2 intervals, 50 steps."""
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=200, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=25,
                             commit_interval=200)
    cheat, holding = 137, Interval(126, 150)
    store = JobStore(tmp_path / "trainer", spec)
    store.put_initial(state0)
    signed = run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-2t"),
                     hooks=TrainerFaults([Fault("swap-checkpoint", cheat)]))
    counting = Counting(StoreDirectory(tmp_path / "trainer"))
    with serve_claims(counting) as address:
        missed = run_audit(address, spec.job_id, tmp_path / "a1",
                           _key_whose_sample(spec, signed, 0.25, False, holding),
                           AUDITOR_PROFILE, sample=0.25, processes=2)
        assert missed.state == SAMPLED and len(missed.sample.chosen) == 2
        assert missed.replayed == 50 and len(counting.steps("GetLog")) == 50
        assert "caught with probability at least 0.250" in missed.reason
        found = run_audit(address, spec.job_id, tmp_path / "a2",
                          _key_whose_sample(spec, signed, 0.25, True, holding),
                          AUDITOR_PROFILE, sample=0.25, processes=2)
    assert found.state == DIVERGED and found.divergent_step == cheat
    assert holding in found.sample.chosen
    Challenge.from_bytes(found.challenge.read_bytes()).verify(spec)


def test_a_cheater_refusing_the_sampled_checkpoint_is_challenged_anyway(
        trained, cheater_root, cheater_signed, tmp_path):
    """The reviewer's attack: the sample holds 6-10, the cheat is at 8, and the trainer refuses
    GetCheckpoint(5) hoping for a failed audit and a fresh draw. The auditor replays 1-10 from
    its own states instead and files the challenge a full audit files."""
    key = _key_whose_sample(trained.spec, cheater_signed, 0.25, True, CHEAT_INTERVAL)
    refusing = Refusing(StoreDirectory(cheater_root), range(1, STEPS + 1))
    with serve_claims(refusing) as address:
        record = run_audit(address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE,
                           sample=0.25)
    assert refusing.steps("GetCheckpoint") == [5, 0]  # S_5 refused; S_0 for its own replay
    assert record.state == DIVERGED and record.divergent_step == CHEAT_STEP
    assert record.sample.chosen == (CHEAT_INTERVAL,)
    assert "the trainer did not serve sampled interval 6-10's S_5" in record.note
    assert AuditRecord.from_bytes(record.to_bytes()) == record  # the note is kept
    assert record.auditor_commitment.commitment.n == CHEAT_STEP - 1
    challenge = Challenge.from_bytes(record.challenge.read_bytes())
    challenge.verify(trained.spec)
    assert challenge.step == CHEAT_STEP


def test_an_honest_trainer_refusing_a_sampled_checkpoint_gets_it_replayed_in_full(
        trained, tmp_path):
    """No cheat: the escalation up to the refused interval's end finds nothing, so the audit
    stays sampled, not verified, counting the steps replayed in full, and signs nothing."""
    key = _key_whose_sample(trained.spec, trained.signed, 0.25, True, CHEAT_INTERVAL)
    refusing = Refusing(StoreDirectory(trained.root), {5})
    with serve_claims(refusing) as address:
        record = run_audit(address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE,
                           sample=0.25)
    assert record.state == SAMPLED and record.auditor_commitment is None
    assert record.replayed == 10
    assert "(steps 6-10) and steps 1-10 in full from its own states: 10 of the job's 20 " \
        "steps, no divergence found" in record.reason
    assert "the auditor replayed steps 1-10 from its own states" in record.note
    store = JobStore(tmp_path, trained.spec)
    assert store.leaves() == JobStore(trained.root, trained.spec).leaves()[:11]
    assert store.commitment() is None


def test_one_draw_per_job_and_a_second_root_gets_a_full_audit(trained, trainer_address,
                                                             liar_address, tmp_path):
    """The first sampled audit records its sample; another of the same root replays it
    (whatever F); one of another root for the job (the liar's: leaf 12 falsified, validly
    signed) is refused a second draw and runs in full, which catches the falsified leaf."""
    key = KeyPair.generate()
    first = run_audit(trainer_address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE,
                      sample=0.25)
    again = run_audit(trainer_address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE,
                      sample=0.5)
    assert first.state == again.state == SAMPLED and again.sample == first.sample
    full = run_audit(liar_address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE,
                     sample=0.25)
    assert full.state == DIVERGED and full.divergent_step == FALSIFIED_STEP
    assert full.sample is None and "the trainer signed two roots for job" in full.note
    assert first.trainer_commitment.commitment.root.hex() in full.note
    assert "the trainer signed two roots" in verdict_line(full)


def test_cli_a_sample_of_every_interval_is_a_full_audit(trained, trainer_address, auditor_key,
                                                       tmp_path, capsys):
    code = main(["audit", "--trainer", trainer_address, "--job", trained.spec.job_id.hex(),
                 "--store", str(tmp_path), "--key", str(auditor_key), "--sample", "1"])
    line = capsys.readouterr().out
    assert code == 0, line
    assert f"MATCHED: {STEPS} steps replayed, root {trained.signed.commitment.root.hex()}" in line
    assert "a sample of F = 1 holds all 4 intervals: a full audit" in line


def _finished(runner: AuditRunner, job_id: bytes):
    status = runner.get(job_id)
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while not status.finished:
        assert time.monotonic() < deadline, status
        status = runner.wait(job_id, status.version, CALL_TIMEOUT_S)
    return status


def test_a_full_audit_request_after_a_sampled_verdict_runs_the_full_audit(tmp_path):
    """A sampled verdict is joined by later sampled requests, but not by a full one: a
    runner that audits in full (restarted without --sample) runs it instead of answering
    "sampled" for ever."""
    job_id, calls = bytes(range(32)), []

    def audit(trainer, job_id, store_root, key, profile, *, progress, **options):
        calls.append(options.get("sample"))
        (store_root / job_id.hex() / SPEC_FILE).write_bytes(b"the job's spec")
        return AuditRecord(job_id=job_id, state=SAMPLED if "sample" in options else MATCHED,
                           steps=STEPS)

    states = []
    for sample in (0.25, 0.25, None):
        runner = AuditRunner(tmp_path, KeyPair.generate(), AUDITOR_PROFILE, audit=audit,
                             sample=sample)
        runner.start()
        try:
            runner.submit(job_id, "127.0.0.1:1")
            states.append(_finished(runner, job_id).state)
        finally:
            assert runner.stop(timeout=CALL_TIMEOUT_S)
    assert states == [SAMPLED, SAMPLED, MATCHED]
    assert calls == [0.25, None]  # the second sampled request joined the first's verdict
