"""`run_audit` against an in-process trainer Claims server: a match on another hardware profile,
a lying trainer caught at the falsified step with a verifiable challenge, a spec that does not
hash to the job id, a crash of the auditor that resumes without re-fetching, and the
`ovt-auditor audit` command."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest

from auditor_node.audit import CHALLENGE_FILE, DIVERGED, MATCHED, run_audit
from auditor_node.cli import main
from auditor_node.leafcache import CACHE_FILE
from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory, chunks
from proto.serving import build_server, make_self_signed_cert
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.engine.programs.registry import parameter_count
from protocol.errors import EncodingError, OvtError, PeerError, ResourceLimitError
from protocol.job.store import JobStore
from tests.auditor_node.crashes import Crash, crash_at

from .conftest import AUDITOR_PROFILE, FALSIFIED_STEP, STEPS, Counting, serve_claims

pytestmark = pytest.mark.network


def test_audit_on_another_profile_matches_and_signs(trained, trainer_address, tmp_path):
    key = KeyPair.generate()
    record = run_audit(trainer_address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE)
    assert record.state == MATCHED and record.divergent_step is None
    assert record.steps == record.replayed == STEPS
    own = record.auditor_commitment
    own.verify(job_id=trained.spec.job_id, role="auditor", n=STEPS, public_key=key.public_key)
    assert own.commitment.root == trained.signed.commitment.root
    assert record.trainer_commitment == trained.signed
    store = JobStore(tmp_path, trained.spec)
    assert store.commitment(STEPS) == own  # served by the auditor's own Claims service
    assert not (store.dir / CHALLENGE_FILE).exists()


@pytest.fixture(scope="module")
def caught(trained, liar_address, tmp_path_factory):
    root = tmp_path_factory.mktemp("auditor")
    record = run_audit(liar_address, trained.spec.job_id, root, KeyPair.generate(),
                       AUDITOR_PROFILE)
    return record, root


def test_a_lying_trainer_is_caught_at_the_falsified_step(caught, trained):
    record, root = caught
    assert record.state == DIVERGED
    assert record.divergent_step == FALSIFIED_STEP
    assert record.reason == "state hash differs from the trainer's"
    assert record.auditor_commitment.commitment.n == FALSIFIED_STEP
    assert record.challenge == root / trained.spec.job_id.hex() / CHALLENGE_FILE


def test_the_challenge_decodes_and_both_proofs_verify(caught, trained):
    record, _ = caught
    challenge = Challenge.from_bytes(record.challenge.read_bytes())
    challenge.verify(trained.spec)
    assert challenge.step == FALSIFIED_STEP and challenge.job_id == trained.spec.job_id
    assert challenge.trainer_commitment == record.trainer_commitment
    assert challenge.auditor_commitment == record.auditor_commitment
    challenge.trainer_leaf.verify(challenge.trainer_commitment)
    challenge.auditor_leaf.verify(challenge.auditor_commitment)
    assert challenge.trainer_leaf.state_hash == bytes(32)  # what the liar claimed
    honest = JobStore(trained.root, trained.spec).leaf(FALSIFIED_STEP)
    assert challenge.auditor_leaf.state_hash == honest.state_hash
    for leaf0, signed in ((challenge.trainer_leaf0, challenge.trainer_commitment),
                          (challenge.auditor_leaf0, challenge.auditor_commitment)):
        leaf0.verify(signed)
        assert (leaf0.step, leaf0.state_hash) == (0, trained.spec.h0)


def _swap_leaves(c):
    return dataclasses.replace(c, trainer_leaf=c.auditor_leaf, auditor_leaf=c.trainer_leaf)


def _swap_commitments(c):
    return dataclasses.replace(c, trainer_commitment=c.auditor_commitment,
                               auditor_commitment=c.trainer_commitment)


def _agreeing_leaves(c):
    return dataclasses.replace(c, auditor_leaf=dataclasses.replace(
        c.auditor_leaf, state_hash=c.trainer_leaf.state_hash))


CORRUPTED_CHALLENGES = {
    "swapped-leaves": _swap_leaves,
    "swapped-commitments": _swap_commitments,
    "other-step": lambda c: dataclasses.replace(c, step=c.step - 1),
    "agreeing-leaves": _agreeing_leaves,
    "auditor-leaf-dropped": lambda c: dataclasses.replace(c, auditor_leaf=None),
    "other-job": lambda c: dataclasses.replace(c, job_id=bytes(32)),
    "swapped-leaves-0": lambda c: dataclasses.replace(c, trainer_leaf0=c.auditor_leaf0,
                                                      auditor_leaf0=c.trainer_leaf0),
    "leaf-j-as-leaf-0": lambda c: dataclasses.replace(c, trainer_leaf0=c.trainer_leaf),
}


@pytest.mark.parametrize("corrupt", CORRUPTED_CHALLENGES.values(), ids=CORRUPTED_CHALLENGES)
def test_corrupted_challenges_do_not_verify(caught, trained, corrupt):
    record, _ = caught
    challenge = corrupt(Challenge.from_bytes(record.challenge.read_bytes()))
    with pytest.raises(OvtError):
        Challenge.from_bytes(challenge.to_bytes()).verify(trained.spec)


@pytest.mark.parametrize("mangle", [lambda b: b + b"\x00", lambda b: b[:-1],
                                    lambda b: b[:10], lambda b: b"\x80"],
                         ids=["trailing-byte", "truncated", "prefix", "empty-map"])
def test_malformed_challenge_bytes_are_refused(caught, mangle):
    record, _ = caught
    with pytest.raises(EncodingError):
        Challenge.from_bytes(mangle(record.challenge.read_bytes()))


class _OtherSpec(ClaimsServicer):
    def __init__(self, stores, spec_bytes):
        super().__init__(stores)
        self.spec_bytes = spec_bytes

    def GetSpec(self, request, context):
        return ovt_pb2.SpecReply(spec=self.spec_bytes)


def test_a_spec_that_does_not_hash_to_the_job_id_is_refused(trained, tmp_path):
    other = dataclasses.replace(trained.spec, seed=99).to_bytes()
    with serve_claims(_OtherSpec(StoreDirectory(trained.root), other)) as address:
        with pytest.raises(PeerError, match="not to the job id"):
            run_audit(address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                      AUDITOR_PROFILE)
    assert not (tmp_path / trained.spec.job_id.hex()).exists()


class _BadLog(ClaimsServicer):
    """Serves a rounding log for step 6 that is not the one its signed leaf commits to."""

    def GetLog(self, request, context):
        if request.step == 6:
            return ovt_pb2.LogReply(log=b"not the committed log")
        return super().GetLog(request, context)


def test_a_log_that_does_not_match_its_leaf_is_challenged_without_an_auditor_leaf(
        trained, tmp_path):
    with serve_claims(_BadLog(StoreDirectory(trained.root))) as address:
        record = run_audit(address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                           AUDITOR_PROFILE)
    assert record.state == DIVERGED and record.divergent_step == 6
    assert "does not match its own leaf" in record.reason
    challenge = Challenge.from_bytes(record.challenge.read_bytes())
    challenge.verify(trained.spec)
    assert challenge.auditor_leaf is None and challenge.auditor_commitment.commitment.n == 5


def test_a_crashed_auditor_resumes_without_refetching(trained, tmp_path):
    counting = Counting(StoreDirectory(trained.root))
    key = KeyPair.generate()
    with serve_claims(counting) as address:
        with pytest.raises(Crash):
            run_audit(address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE,
                      progress=crash_at(8))
        assert counting.steps("GetCheckpoint") == [0]
        assert counting.steps("GetLog") == list(range(1, 9))
        # the leaves come in one streamed window (the whole job here), none point-queried
        assert counting.steps("GetLeaves") == list(range(0, STEPS + 1))
        assert counting.steps("GetLeaf") == []
        assert (tmp_path / trained.spec.job_id.hex() / CACHE_FILE).exists()
        counting.calls.clear()
        record = run_audit(address, trained.spec.job_id, tmp_path, key, AUDITOR_PROFILE)
    assert record.state == MATCHED
    assert record.auditor_commitment.commitment.root == trained.signed.commitment.root
    assert counting.steps("GetCheckpoint") == []
    assert counting.steps("GetLog") == list(range(9, STEPS + 1))
    # the leaves verified before the crash (0..8) come from the auditor's cache
    assert counting.steps("GetLeaves") == list(range(9, STEPS + 1))
    assert counting.steps("GetLeaf") == []


def test_cli_audit_matches_and_prints_the_root(trained, trainer_address, auditor_key,
                                               tmp_path, capsys):
    args = ["audit", "--trainer", trainer_address, "--job", trained.spec.job_id.hex(),
            "--store", str(tmp_path / "store"), "--key", str(auditor_key)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "MATCHED" in out and trained.signed.commitment.root.hex() in out
    assert main([*args, "--json"]) == 0  # the finished audit is answered from the store
    verdict = json.loads(capsys.readouterr().out)
    assert verdict["state"] == "matched"
    assert verdict["auditor_root"] == verdict["trainer_root"] == \
        trained.signed.commitment.root.hex()


def test_cli_audit_of_a_liar_exits_1_and_names_the_challenge(trained, liar_address,
                                                             auditor_key, tmp_path, capsys):
    code = main(["audit", "--trainer", liar_address, "--job", trained.spec.job_id.hex(),
                 "--store", str(tmp_path), "--key", str(auditor_key)])
    out = capsys.readouterr().out
    assert code == 1
    assert f"DIVERGED at step {FALSIFIED_STEP}" in out and CHALLENGE_FILE in out


@pytest.mark.parametrize("args, message", [
    (["--job", "abcd"], "64 hex digits"),
    (["--trainer", "127.0.0.1:1"], "GetSpec failed: UNAVAILABLE"),
    (["--trainer", "no-port"], "bad address"),
    (["--trainer", "10.0.0.1:5"], "refusing plaintext"),
    (["--profile", "nope"], "unknown profile"),
])
def test_cli_errors_are_one_line_and_exit_2(trained, trainer_address, auditor_key, tmp_path,
                                            capsys, args, message):
    base = {"--trainer": trainer_address, "--job": trained.spec.job_id.hex(),
            "--store": str(tmp_path), "--key": str(auditor_key)}
    base.update(dict(zip(args[::2], args[1::2], strict=True)))
    assert main(["audit", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ovt-auditor: error: ") and message in err, err
    assert "\n" not in err and "Traceback" not in err


def test_audit_over_tls_checks_the_trainer_certificate(trained, tmp_path):
    cert, key = make_self_signed_cert(tmp_path / "tls")
    claims = ClaimsServicer(StoreDirectory(trained.root))
    server, port = build_server(
        "127.0.0.1:0", [lambda s: ovt_pb2_grpc.add_ClaimsServicer_to_server(claims, s)],
        tls_cert=cert, tls_key=key, allow_remote_plaintext=False)
    server.start()
    try:
        record = run_audit(f"127.0.0.1:{port}", trained.spec.job_id, tmp_path / "store",
                           KeyPair.generate(), AUDITOR_PROFILE, tls_ca=cert)
        assert record.state == MATCHED
        stranger, _ = make_self_signed_cert(tmp_path / "other")
        with pytest.raises(PeerError, match="UNAVAILABLE"):
            run_audit(f"127.0.0.1:{port}", trained.spec.job_id, tmp_path / "store",
                      KeyPair.generate(), AUDITOR_PROFILE, tls_ca=stranger, deadline_s=5)
    finally:
        server.stop(grace=None)


def test_a_model_over_max_params_is_refused_before_anything_is_built(trained, trainer_address,
                                                                    tmp_path):
    # Regression (hostile-peer finding 6, the auditor's side): a trainer's spec alone made the
    # auditor build whatever model it named.
    params = parameter_count(trained.spec.program, trained.spec.config)
    with pytest.raises(ResourceLimitError, match=f"has {params} parameters"):
        run_audit(trainer_address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                  AUDITOR_PROFILE, max_params=params - 1)
    assert not (tmp_path / trained.spec.job_id.hex()).exists()
    record = run_audit(trainer_address, trained.spec.job_id, tmp_path, KeyPair.generate(),
                       AUDITOR_PROFILE, max_params=params)
    assert record.state == "matched"


class _HostileS0(ClaimsServicer):
    """A trainer whose S_0 is a safetensors file of a dtype torch would fail on (U16)."""

    def GetCheckpoint(self, request, context):
        if request.step != 0:
            yield from super().GetCheckpoint(request, context)
            return
        header = json.dumps({"w": {"dtype": "U16", "shape": [1], "data_offsets": [0, 2]}})
        yield from chunks(struct.pack("<Q", len(header)) + header.encode() + b"\x01\x00")


def test_finding_7_cli_audit_of_a_hostile_s0_exits_2_in_one_line(trained, auditor_key,
                                                                   tmp_path, capsys):
    """Issue 10, finding 7: `ovt-auditor audit` against a hostile S_0 exited 1 (the code for
    "diverged") with a traceback."""
    with serve_claims(_HostileS0(StoreDirectory(trained.root))) as address:
        code = main(["audit", "--trainer", address, "--job", trained.spec.job_id.hex(),
                     "--store", str(tmp_path / "store"), "--key", str(auditor_key)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("ovt-auditor: error: ") and "not a safetensors state" in err, err
    assert "\n" not in err and "Traceback" not in err
