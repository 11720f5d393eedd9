"""FAULT INJECTION: each cheating trainer of `trainer_node.faults` really cheats at its step k
(its leaves equal an honest trainer's before k and differ at k), an auditor replaying it on other
hardware catches it at exactly k for the expected reason, and the serving faults (forged and
stalled point queries) behave as documented while the streamed GetLeaves stays honest."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import safetensors.torch

from auditor_node.audit import MATCHED, run_audit, trainer_claim
from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import ClaimsServicer, RemoteClaims, StoreDirectory
from protocol.codec.roundinglog import EMPTY_LOG_DIGEST
from protocol.commit.commitments import Claim, SignedCommitment
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, ProofError
from protocol.job.create import build_job, job_executor
from protocol.job.faults import ALL_KINDS, TRAINING_KINDS, Fault, parse_fault
from protocol.job.run import StepHooks, StoreSource, replay_job, run_job
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore
from tests.auditor_node.conftest import serve_claims
from trainer_node.cli import main
from trainer_node.faults import KINDS, TrainerFaults
from trainer_node.server import TrainerConfig, TrainerNode

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS = 6
MIDDLE = 3
TRAINER_PROFILE = Profile.parse("cpu-2t")
AUDITOR_PROFILE = Profile.parse("emulated-gpu")

# What an auditor replaying the faulty trainer reports at step k ({k}: the step).
VIOLATION = "the trainer's rounding log is invalid: log violation at step {k},"
MISMATCH = "the trainer's rounding log is invalid: step {k}: replay reached site 0 "
STATE = "state hash differs from the trainer's"
EXPECTED_REASON = {
    "relabel": VIOLATION, "swap-examples": VIOLATION,
    "log-invent": VIOLATION,
    "lr": STATE,  # the honest log replays; only the update, far from every band, differs
    "skip-step": MISMATCH,  # the empty log has no sites (LogMismatchError)
    "swap-checkpoint": STATE, "log-flip": STATE, "log-drop": STATE,
}
# Which parts of leaf k differ from the honest trainer's: (state hash, log hash).
EXPECTED_LEAF_CHANGE = {
    "swap-checkpoint": (True, False),
    "log-flip": (False, True), "log-invent": (False, True),  # S_k honest, L_k a lie
    # a doubled learning rate changes only step k's update, whose elements are far inside their
    # certified bands: L_k may equal the honest log (None: either way)
    "lr": (True, None),
    # a relabelled example changes the loss, the backward and the update; where none of their
    # elements lies in a band (a tiny job's step may log its forward alone) L_k is the honest
    # log, and where the entries that differ fit the honest values too it replays validly: the
    # audit then finds the state instead of a violation, at step k all the same
    "relabel": (True, None),
}


@dataclass(frozen=True)
class Job:
    spec: JobSpec
    state0: dict
    honest: JobStore
    signed: SignedCommitment


def _job(tmp: Path, *, program: str = "image-cnn", config=TINY, preset=None,
         steps: int = STEPS) -> Job:
    spec, state0 = build_job(program=program, config=config, preset=preset, steps=steps,
                             seed=0, init_seed=1, policy=PrecisionPolicy(),
                             checkpoint_interval=5, commit_interval=10)
    store = JobStore(tmp, spec)
    store.put_initial(state0)
    return Job(spec, state0, store, run_job(store, KeyPair.generate(),
                                            profile=TRAINER_PROFILE))


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> Job:
    return _job(tmp_path_factory.mktemp("honest"))


def _train(job: Job, root: Path, hooks: StepHooks | None) -> JobStore:
    store = JobStore(root, job.spec)
    store.put_initial(job.state0)
    run_job(store, KeyPair.generate(), profile=TRAINER_PROFILE, hooks=hooks)
    return store


def _audit(job: Job, trainer: JobStore, root: Path):
    return replay_job(JobStore(root, job.spec), StoreSource(trainer), KeyPair.generate(),
                      profile=AUDITOR_PROFILE)


def _assert_cheats_at(job: Job, faulty: JobStore, k: int, kind: str) -> None:
    honest, cheat = job.honest.leaves(), faulty.leaves()
    assert cheat[:k] == honest[:k]
    changed = (cheat[k].state_hash != honest[k].state_hash,
               cheat[k].log_hash != honest[k].log_hash)
    expected = EXPECTED_LEAF_CHANGE.get(kind, (True, True))
    assert all(e is None or c == e for c, e in zip(changed, expected, strict=True)), changed


def test_base_hooks_change_nothing(job, tmp_path):
    store = _train(job, tmp_path, StepHooks())
    assert store.leaves() == job.honest.leaves()
    assert store.tree().root == job.signed.commitment.root


@pytest.mark.parametrize("k", [1, MIDDLE, STEPS])
@pytest.mark.parametrize("kind", [kind for kind in TRAINING_KINDS if kind != "skip-warmup"])
def test_a_training_fault_cheats_at_k_and_an_audit_catches_it_there(job, tmp_path, kind, k):
    try:
        faulty = _train(job, tmp_path / "trainer", TrainerFaults([Fault(kind, k)]))
    except ConfigError as err:
        # a flip every honest replay absorbs is a legal move, not a cheat: where a step of this
        # tiny job has no other, there is nothing to catch (the other steps have one)
        assert kind in ("log-flip", "log-drop") and "changes S_t" in str(err), err
        pytest.skip(f"{kind}:{k}: {err}")
    _assert_cheats_at(job, faulty, k, kind)
    if kind == "skip-step":
        assert faulty.leaf(k).log_hash == EMPTY_LOG_DIGEST
    outcome = _audit(job, faulty, tmp_path / "auditor")
    assert outcome.first_divergent_step == k
    reasons = [EXPECTED_REASON[kind]] + ([STATE] if kind == "relabel" else [])
    assert any(outcome.reason.startswith(r.format(k=k)) for r in reasons), outcome.reason
    assert not outcome.matches


def test_skip_warmup_needs_a_schedule(job, tmp_path):
    # the cheat itself, on a job with a schedule: tests/arbiter/test_attacks.py
    with pytest.raises(ConfigError, match="has no learning-rate schedule"):
        _train(job, tmp_path, TrainerFaults([Fault("skip-warmup", 2)]))


def test_skip_step_stores_the_previous_state_with_the_step_counter(job, tmp_path):
    faulty = _train(job, tmp_path, TrainerFaults([Fault("skip-step", 5)]))
    skipped, before = faulty.checkpoint(5), job.honest.checkpoint(5)  # interval 5: stored
    assert int(skipped["step"]) == 5
    honest4 = faulty.state_at(4, job_executor(job.spec, TRAINER_PROFILE))
    assert all(skipped[name].equal(honest4[name]) for name in honest4 if name != "step")
    assert before is not None and not all(before[n].equal(skipped[n]) for n in before)


def test_faults_combine_and_the_first_one_is_caught(job, tmp_path):
    # (step 3: step 2's log has no entry whose flip changes S_2, which is no cheat)
    hooks = TrainerFaults([parse_fault("skip-step:5"), parse_fault("log-flip:3")])
    faulty = _train(job, tmp_path / "trainer", hooks)
    _assert_cheats_at(job, faulty, 3, "log-flip")
    assert faulty.leaf(5).log_hash == EMPTY_LOG_DIGEST
    outcome = _audit(job, faulty, tmp_path / "auditor")
    assert (outcome.first_divergent_step, outcome.reason) == (3, STATE)


def test_relabel_cheats_on_the_char_transformer(tmp_path):
    job = _job(tmp_path / "honest", program="char-transformer", config=None, preset="test",
               steps=3)
    faulty = _train(job, tmp_path / "trainer", TrainerFaults([Fault("relabel", 2)]))
    _assert_cheats_at(job, faulty, 2, "relabel")
    outcome = _audit(job, faulty, tmp_path / "auditor")
    assert outcome.first_divergent_step == 2
    assert outcome.reason.startswith(VIOLATION.format(k=2)), outcome.reason


# -- parsing and the command line ----------------------------------------------------------------

def test_parse_fault():
    assert parse_fault("relabel:5") == Fault("relabel", 5)
    assert parse_fault(" stall:12 ") == Fault("stall", 12)
    assert str(parse_fault("log-drop:1")) == "log-drop:1"


@pytest.mark.parametrize("text", ["bogus:1", "relabel", "relabel:", "relabel:0", "relabel:-1",
                                  "relabel:+2", "relabel:x", ":3", ""])
def test_parse_fault_rejects_bad_input_naming_the_kinds(text):
    with pytest.raises(ConfigError, match="bad fault") as err:
        parse_fault(text)
    message = str(err.value)
    assert "STEP must be" in message or all(kind in message for kind in ALL_KINDS)


def test_parse_fault_takes_only_the_kinds_asked_for():
    assert parse_fault("false-challenge:2") == Fault("false-challenge", 2)
    with pytest.raises(ConfigError, match="bad fault 'false-challenge:2'") as err:
        parse_fault("false-challenge:2", KINDS)
    assert "false-challenge" not in str(err.value).split("one of", 1)[1]


def test_unknown_faults_are_refused():
    with pytest.raises(ConfigError, match="not a trainer fault"):
        TrainerFaults([Fault("false-challenge", 1)])


@pytest.mark.parametrize("bad", ["bogus:1", "false-challenge:1"])
def test_serve_with_a_bad_fault_exits_2_with_one_error_line(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--store", str(tmp_path / "store"), "--key", str(tmp_path / "k"),
              "--inject-fault", "relabel:2", "--inject-fault", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("ovt-trainer serve: error: ")
    assert f"'{bad}'" in errors[0] and "relabel, swap-examples" in errors[0]
    assert "Traceback" not in err
    assert not (tmp_path / "store").exists()


def test_serve_help_says_fault_injection(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "FAULT INJECTION, for tests and demos only" in " ".join(capsys.readouterr().out
                                                                    .split())


# -- serving faults, over gRPC -------------------------------------------------------------------

FORGED, STALLED = 2, 4


@pytest.fixture(scope="module")
def cheater(job):
    """The honest store served by a trainer that forges leaf FORGED and stalls on STALLED."""
    faults = TrainerFaults([Fault("forge-leaf", FORGED), Fault("stall", STALLED)])
    servicer = ClaimsServicer(StoreDirectory(job.honest.dir.parent),
                              leaf_fault=faults.leaf_fault)
    with serve_claims(servicer) as address, grpc.insecure_channel(address) as channel:
        yield address, channel


@pytest.mark.network
def test_a_forged_leaf_does_not_verify_under_the_signed_root(job, cheater):
    _, channel = cheater
    honest = _point_claim(channel, job.spec, FORGED - 1)
    honest.verify(job.signed)
    assert honest.state_hash == job.honest.leaf(FORGED - 1).state_hash
    forged = _point_claim(channel, job.spec, FORGED)
    assert forged.state_hash != job.honest.leaf(FORGED).state_hash
    with pytest.raises(ProofError):
        forged.verify(job.signed)
    # the streamed leaves (the auditor's, and its challenge's) stay honest
    assert trainer_claim(channel, job.spec, FORGED, job.signed, 10).state_hash == \
        job.honest.leaf(FORGED).state_hash


def _point_claim(channel, spec, step: int) -> Claim:
    """Leaf `step` as a unary GetLeaf (the arbiter's point query) answers it, unverified."""
    reply = ovt_pb2_grpc.ClaimsStub(channel).GetLeaf(
        ovt_pb2.StepRef(job_id=spec.job_id, step=step), timeout=10)
    return Claim(spec.job_id, step, reply.state_hash, reply.log_hash, tuple(reply.proof),
                 reply.tree_size)


@pytest.mark.network
def test_a_stalled_leaf_ends_at_the_callers_deadline(job, cheater):
    _, channel = cheater
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        ovt_pb2_grpc.ClaimsStub(channel).GetLeaf(
            ovt_pb2.StepRef(job_id=job.spec.job_id, step=STALLED), timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 5.0


@pytest.mark.network
def test_streamed_leaves_are_unaffected_and_an_audit_matches(job, cheater, tmp_path):
    address, channel = cheater
    remote = RemoteClaims(channel, job.spec, deadline_s=10)
    assert [remote.leaf(t) for t in range(STEPS + 1)] == job.honest.leaves()
    record = run_audit(address, job.spec.job_id, tmp_path, KeyPair.generate(), AUDITOR_PROFILE,
                       deadline_s=10)
    assert record.state == MATCHED


@pytest.mark.network
def test_a_server_stop_ends_a_stalled_call(job):
    faults = TrainerFaults([Fault("stall", 1)])
    servicer = ClaimsServicer(StoreDirectory(job.honest.dir.parent),
                              leaf_fault=faults.leaf_fault)
    with serve_claims(servicer) as address, grpc.insecure_channel(address) as channel:
        call = ovt_pb2_grpc.ClaimsStub(channel).GetLeaf.future(
            ovt_pb2.StepRef(job_id=job.spec.job_id, step=1), timeout=60)
        time.sleep(0.3)
        assert not call.done()
    start = time.monotonic()
    with pytest.raises(grpc.RpcError):
        call.result(timeout=10)
    assert time.monotonic() - start < 10


@pytest.mark.network
def test_the_trainer_daemon_injects_its_faults_and_warns(job, tmp_path, caplog):
    key = KeyPair.generate()
    faults = (Fault("skip-step", 2), Fault("forge-leaf", 1))
    node = TrainerNode(TrainerConfig(listen="127.0.0.1:0", store=tmp_path, key=key,
                                     profile=TRAINER_PROFILE, faults=faults))
    assert any("FAULT INJECTION" in r.getMessage() and "skip-step:2" in r.getMessage()
               for r in caplog.records if r.levelno == logging.WARNING)
    port = node.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            ovt_pb2_grpc.TrainerStub(channel).Submit(ovt_pb2.SubmitRequest(
                spec=job.spec.to_bytes(), initial_state=safetensors.torch.save(job.state0)),
                timeout=30)
            stream = ovt_pb2_grpc.TrainerStub(channel).Watch(
                ovt_pb2.JobRef(job_id=job.spec.job_id), timeout=120)
            try:
                assert next(s for s in stream if s.state in ("done", "failed")).state == "done"
            finally:
                stream.cancel()
            store = node.stores.get(job.spec.job_id)
            _assert_cheats_at(job, store, 2, "skip-step")
            signed = store.commitment(STEPS)
            with pytest.raises(ProofError):
                _point_claim(channel, job.spec, 1).verify(signed)
    finally:
        assert node.stop()
