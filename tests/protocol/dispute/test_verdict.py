"""Verdicts (SPEC §5.4, protocol/dispute/{decision,verdict,evidence}.py): the decision table,
signing, offline checking.

Games are played with test_game's players (real RFC 6962 trees, real signed commitments) and
end every way; verdicts are signed and must verify from their bytes alone, while every changed
byte, and every decision re-signed by the arbiter's own key that the transcript does not
support, is rejected. The evidence round trip re-executes a real step of a trained tiny job.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from protocol.codec.state import state_digest
from protocol.commit.keys import KeyPair, sign_object
from protocol.commit.leaf import Leaf
from protocol.dispute.decision import Finding, decide
from protocol.dispute.evidence import load_evidence, recheck_evidence, save_evidence
from protocol.dispute.game import AUDITOR, TRAINER, dispute, disputed_step, rounds
from protocol.dispute.reexecute import Reexecution, reexecute, withheld
from protocol.dispute.transcript import transcript_bytes
from protocol.dispute.verdict import (
    MAX_VERDICT_BYTES,
    SIGNATURE_KIND,
    Verdict,
    sign_verdict,
    summary,
    verify_verdict,
)
from protocol.errors import VerdictError
from protocol.job.create import load_job_program
from tests.protocol.dispute.test_game import (
    BadProofLiar,
    Player,
    Staller,
    begin,
    diverging_leaves,
    game_for,
    h,
    honest_leaves,
    make_spec,
    play,
)
from tests.protocol.dispute.test_reexecute import ARBITER_PROFILE, STEPS, evidence, tiny_job

ARBITER = KeyPair.generate()
N, D = 8, 5
TIMINGS = {"bisection_s": 0.125, "evidence_s": 0.5, "reexecution_s": 1.0, "total_s": 1.625}
BYTES = {"trainer": 4096, "auditor": 3072}


def reexec_for(state, finding: str = "computed", h_star: bytes | None = None,
               by: str | None = None) -> Reexecution:
    """A re-execution record of the game's disputed step, using the dispute's evidence."""
    d = dispute(state)
    if finding == "withheld":
        return withheld(d.step, by, f"no S_{d.step - 1} within the deadline", "cpu-2t")
    return Reexecution(d.step, finding, h_star if finding == "computed" else None,
                       "log violation at site 3" if finding == "invalid-log" else "replayed",
                       None, "cpu-2t", d.agreed.state_hash, d.trainer.log_hash,
                       (h("example", 1), h("example", 2)), 0.75)


def played(n: int = N, d: int = D, **kw):
    spec, trainer, auditor, state = game_for(n, d, **kw)
    return spec, trainer, auditor, play(state, trainer, auditor)


def _disputed(finding: str, who: str | None = None, *, h_star: str | None = None):
    spec, trainer, auditor, state = played()
    star = {"trainer": trainer.leaf(D).state_hash, "auditor": auditor.leaf(D).state_hash,
            "other": h("other state"), None: None}[h_star]
    return spec, state, reexec_for(state, finding, star, who)


def _no_auditor_leaf(h_star: str):
    spec = make_spec(N)
    trainer = Player(TRAINER, spec, honest_leaves(N))
    auditor = Player(AUDITOR, spec, honest_leaves(N)[:D])  # could not replay step D
    state = play(begin(spec, trainer, auditor, D, auditor_leaf=None), trainer, auditor)
    star = trainer.leaf(D).state_hash if h_star == "trainer" else h("other state")
    return spec, state, reexec_for(state, "computed", star)


def _ended(kind: str):
    if kind == "bad-proof":
        spec, _, _, state = played(trainer_cls=BadProofLiar, trainer_kw={"from_round": 3})
    elif kind == "timeout":
        spec, _, _, state = played(auditor_cls=Staller, auditor_kw={"from_round": 2})
    elif kind == "both-timeout":
        spec, _, _, state = played(trainer_cls=Staller, auditor_cls=Staller,
                                   trainer_kw={"from_round": 1}, auditor_kw={"from_round": 1})
    elif kind == "h0-mismatch":  # decided at start, from the challenge's leaf-0 claims
        spec = make_spec(N)
        trainer = Player(TRAINER, spec, honest_leaves(N, h("another S_0")))
        auditor = Player(AUDITOR, spec, diverging_leaves(N, D))
        state = begin(spec, trainer, auditor, N)
    elif kind == "bad-challenge":  # challenged at a leaf both agree on
        spec, _, _, state = played(j=D - 2)
    else:  # bad-commitment: the trainer's commitment is not under its registered key
        spec = make_spec(N)
        trainer = Player(TRAINER, spec, honest_leaves(N))
        auditor = Player(AUDITOR, spec, diverging_leaves(N, D))
        state = begin(spec, trainer, auditor, N, trainer_key=KeyPair.generate().public_key)
    return spec, state, None


# name -> (builder, expected (fault, finding, step))
CASES = {
    "false-challenge": (lambda: _disputed("computed", h_star="trainer"),
                        ("auditor", "false-challenge", D)),
    "wrong-state": (lambda: _disputed("computed", h_star="auditor"),
                    ("trainer", "wrong-state", D)),
    "inconclusive": (lambda: _disputed("computed", h_star="other"), ("none", "inconclusive", D)),
    "invalid-log": (lambda: _disputed("invalid-log"), ("trainer", "invalid-log", D)),
    "withheld-trainer": (lambda: _disputed("withheld", "trainer"), ("trainer", "withheld", D)),
    "withheld-auditor": (lambda: _disputed("withheld", "auditor"), ("auditor", "withheld", D)),
    "withheld-both": (lambda: _disputed("withheld", "both"), ("both", "withheld", D)),
    "no-auditor-leaf-not-upheld": (lambda: _no_auditor_leaf("trainer"),
                                   ("none", "not-upheld", D)),
    "no-auditor-leaf-wrong-state": (lambda: _no_auditor_leaf("other"),
                                    ("trainer", "wrong-state", D)),
    "bad-proof": (lambda: _ended("bad-proof"), ("trainer", "bad-proof", None)),
    "timeout": (lambda: _ended("timeout"), ("auditor", "timeout", None)),
    "both-timeout": (lambda: _ended("both-timeout"), ("both", "timeout", N // 2)),
    "h0-mismatch": (lambda: _ended("h0-mismatch"), ("trainer", "h0-mismatch", 0)),
    "bad-challenge": (lambda: _ended("bad-challenge"), ("auditor", "bad-challenge", D - 2)),
    "bad-commitment": (lambda: _ended("bad-commitment"), ("trainer", "bad-commitment", None)),
}


def signed(spec, state, reexec, key: KeyPair = ARBITER, now: int = 1_700_000_100) -> Verdict:
    return sign_verdict(spec, state, reexec, timings=TIMINGS, bytes_moved=BYTES, key=key,
                        now=now)


def resign(verdict: Verdict, key: KeyPair = ARBITER, **changes) -> bytes:
    """The verdict with `changes`, re-signed by `key`: a validly signed lie."""
    verdict = replace(verdict, **changes)
    return replace(verdict, signature=sign_object(SIGNATURE_KIND, verdict.body(),
                                                  key)).to_bytes()


# ---- the decision table -----------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_decide_follows_the_table(name):
    build, (fault, finding, step) = CASES[name]
    spec, state, reexec = build()
    result = decide(state, reexec)
    assert (result.fault, result.finding) == (fault, finding)
    if step is not None:
        assert result.step == step
    if reexec is None:
        assert result == Finding(state.outcome.fault, state.outcome.kind, state.outcome.step,
                                 state.outcome.reason)
    else:
        assert result.reason.startswith(f"step {D}:") and "\n" not in result.reason
        if reexec.state_hash is not None:
            assert reexec.state_hash.hex()[:16] in result.reason


def test_decide_checks_the_trainer_first_when_both_claim_the_same_state():
    """Leaves that differ only in ℓ_i: h_i* reproducing the trainer's state with the trainer's
    log means the challenge was false."""
    spec = make_spec(N)
    trainer = Player(TRAINER, spec, honest_leaves(N))
    leaves = [leaf if leaf.step < D else Leaf(leaf.step, leaf.state_hash, h("A log", leaf.step))
              for leaf in honest_leaves(N)]
    auditor = Player(AUDITOR, spec, leaves)
    state = play(begin(spec, trainer, auditor, N), trainer, auditor)
    assert decide(state, reexec_for(state, "computed", trainer.leaf(D).state_hash)).fault == \
        "auditor"


def test_decide_refuses_what_cannot_be_a_verdict():
    spec, trainer, auditor, state = played()
    good = reexec_for(state, "computed", h("x"))
    with pytest.raises(ValueError, match="running"):
        decide(begin(spec, trainer, auditor, N), None)
    with pytest.raises(ValueError, match="needs its re-execution"):
        decide(state, None)
    with pytest.raises(ValueError, match="step 4"):
        decide(state, replace(good, step=D - 1))
    with pytest.raises(ValueError, match="bad evidence"):
        decide(state, Reexecution(D, "bad-evidence", None, "S_4 hashes to ...", None, "cpu-2t",
                                  None, None, (), 0.1))
    _, ended, _ = _ended("timeout")
    with pytest.raises(ValueError, match="no step is disputed"):
        decide(ended, good)
    with pytest.raises(TypeError):
        decide(state, "computed")


# ---- signing and verifying --------------------------------------------------------------------

@pytest.mark.parametrize("name", CASES)
def test_signed_verdicts_verify_and_round_trip(name):
    build, (fault, finding, _) = CASES[name]
    spec, state, reexec = build()
    v = signed(spec, state, reexec)
    data = v.to_bytes()
    assert Verdict.from_bytes(data) == v and Verdict.from_bytes(data).to_bytes() == data
    assert verify_verdict(data) == v
    assert verify_verdict(data, arbiter_key=ARBITER.public_key) == v
    assert (v.fault, v.finding) == (fault, finding) and v.reexecution == reexec
    assert v.job_id == spec.job_id and v.spec == spec.to_bytes()
    assert v.transcript == transcript_bytes(state)
    assert v.rounds == rounds(state)
    assert "leaf0_checks" not in v.body()
    if name in ("h0-mismatch", "bad-challenge", "bad-commitment"):
        assert v.rounds == 0  # decided at start: no question asked
    assert (v.timings, v.bytes_moved, v.time) == (TIMINGS, BYTES, 1_700_000_100)
    assert len(v.signature) == 64 and v.arbiter_key == ARBITER.public_key


def test_round_count_is_the_bisection_bound():
    spec, state, reexec = _disputed("computed", h_star="trainer")
    v = signed(spec, state, reexec)
    assert v.rounds == math.ceil(math.log2(N)) == rounds(state)  # every question bisects


@pytest.mark.parametrize(("n", "d"), [(23, 23), (23, 1), (1000, 777), (1, 1)])
def test_round_count_is_within_the_bound_for_any_challenge(n, d):
    spec, trainer, auditor, state = played(n, d)
    v = signed(spec, state, reexec_for(state, "computed", trainer.leaf(d).state_hash))
    assert v.rounds == rounds(state) <= math.ceil(math.log2(n))
    assert verify_verdict(v.to_bytes()).rounds == v.rounds


def test_verdicts_are_deterministic_given_the_time():
    spec, state, reexec = _disputed("computed", h_star="auditor")
    assert signed(spec, state, reexec).to_bytes() == signed(spec, state, reexec).to_bytes()


def test_every_changed_byte_is_rejected():
    spec, trainer, auditor, state = played(4, 3)
    v = signed(spec, state, reexec_for(state, "computed", trainer.leaf(3).state_hash))
    data = v.to_bytes()
    verify_verdict(data)
    for i in range(len(data)):
        for flip in (0x01, 0x80):
            changed = data[:i] + bytes([data[i] ^ flip]) + data[i + 1:]
            with pytest.raises(VerdictError):
                verify_verdict(changed)
    for changed in (data[:-1], data + b"\x00", b""):
        with pytest.raises(VerdictError):
            verify_verdict(changed)


def _false_challenge():
    spec, trainer, auditor, state = played()
    reexec = reexec_for(state, "computed", trainer.leaf(D).state_hash)
    return spec, trainer, auditor, state, signed(spec, state, reexec)


@pytest.mark.parametrize(("change", "message"), [
    ({"fault": "trainer"}, "does not follow"),
    ({"finding": "wrong-state"}, "does not follow"),
    ({"fault": "trainer", "finding": "wrong-state"}, "does not follow"),
    ({"step": D - 1}, "does not follow"),
    ({"step": None}, "does not follow"),
    ({"reason": "the auditor is wrong"}, "does not follow"),
    ({"rounds": 2}, "rounds"),
    ({"rounds": 4}, "rounds"),
    ({"rounds": 0}, "rounds"),
    ({"reexecution": None}, "does not fit"),
])
def test_a_resigned_edit_is_rejected(change, message):
    """The arbiter's own valid signature over a decision the transcript does not support."""
    *_, v = _false_challenge()
    with pytest.raises(VerdictError, match=message):
        verify_verdict(resign(v, **change))


def test_a_resigned_reexecution_edit_is_rejected():
    spec, trainer, auditor, state, v = _false_challenge()
    r = v.reexecution
    lies = {
        "another h*": (replace(r, state_hash=auditor.leaf(D).state_hash), "does not follow"),
        "another step": (replace(r, step=D + 1), "does not fit"),
        "another S_{i-1}": (replace(r, prev_state_hash=h("S", D - 1)), "agreed"),
        "another log": (replace(r, log_digest=h("L", D)), "ℓ_5"),
        "withheld": (withheld(D, "trainer", "x", "cpu-2t"), "does not follow"),
    }
    for lie, message in lies.values():
        with pytest.raises(VerdictError, match=message):
            verify_verdict(resign(v, reexecution=lie))


def test_a_reexecution_added_to_a_finished_game_is_rejected():
    spec, state, _ = _ended("bad-proof")
    v = signed(spec, state, None)
    with pytest.raises(VerdictError, match="does not fit"):
        verify_verdict(resign(v, reexecution=reexec_for(_disputed("computed", h_star="other")[1],
                                                        "computed", h("x"))))


def test_a_transcript_of_another_game_is_rejected():
    spec, trainer, auditor, state, v = _false_challenge()
    _, _, _, other = played(d=3)  # the same job, a dispute at another step
    with pytest.raises(VerdictError, match="does not fit"):
        verify_verdict(resign(v, transcript=transcript_bytes(other)))
    running = begin(spec, trainer, auditor, N)
    with pytest.raises(VerdictError, match="not over"):
        verify_verdict(resign(v, transcript=transcript_bytes(running)))
    with pytest.raises(VerdictError, match="does not parse"):
        verify_verdict(resign(v, transcript=b"\xc0"))


def test_a_transcript_whose_moves_do_not_replay_is_rejected():
    spec, trainer, auditor, state, v = _false_challenge()
    forged = state.transcript[:-1] + (replace(state.outcome, fault=TRAINER),)
    with pytest.raises(VerdictError, match="does not replay"):
        verify_verdict(resign(v, transcript=transcript_bytes(replace(state,
                                                                          transcript=forged))))


def test_a_spec_of_another_job_is_rejected():
    *_, v = _false_challenge()
    other = make_spec(N + 1)
    with pytest.raises(VerdictError, match="hashes to job"):
        verify_verdict(resign(v, spec=other.to_bytes()))
    with pytest.raises(VerdictError, match="transcript is of job"):
        verify_verdict(resign(v, spec=other.to_bytes(), job_id=other.job_id))
    with pytest.raises(VerdictError, match="job spec does not parse"):
        verify_verdict(resign(v, spec=b"\x80"))


def test_the_expected_arbiter_key_is_enforced():
    *_, v = _false_challenge()
    other = KeyPair.generate()
    with pytest.raises(VerdictError, match="expected"):
        verify_verdict(v.to_bytes(), arbiter_key=other.public_key)
    # Signed by another key while naming ours: the signature does not verify.
    with pytest.raises(VerdictError, match="signature"):
        verify_verdict(resign(v, key=other))
    # Another arbiter's honest verdict verifies on its own, but not as ours.
    theirs = resign(v, key=other, arbiter_key=other.public_key)
    assert verify_verdict(theirs).arbiter_key == other.public_key
    with pytest.raises(VerdictError, match="expected"):
        verify_verdict(theirs, arbiter_key=ARBITER.public_key)


def test_malformed_and_oversized_verdicts_are_rejected():
    *_, v = _false_challenge()
    from protocol.codec.canonical import encode
    body = {**v.body(), "signature": v.signature}
    for bad in ({**body, "bribe": 1}, {k: x for k, x in body.items() if k != "time"},
                {**body, "timings": {"total_s": -1.0}}, {**body, "rounds": -1},
                {**body, "bytes_moved": {"trainer": 1.5}}, {**body, "protocol_version": 99},
                {**body, "arbiter_key": bytes(31)}, {**body, "finding": "bribed"},
                {**body, "leaf0_checks": 1}):  # the field of the leaf-0 question is gone
        with pytest.raises(VerdictError, match="does not parse"):
            verify_verdict(encode(bad))
    with pytest.raises(VerdictError, match="does not parse"):
        verify_verdict(b"\x00" * (MAX_VERDICT_BYTES + 1))
    with pytest.raises(TypeError):
        verify_verdict("a verdict")


def test_sign_verdict_refuses_bad_input():
    spec, trainer, auditor, state = played()
    good = reexec_for(state, "computed", h("x"))
    with pytest.raises(ValueError, match="bad evidence"):
        signed(spec, state, Reexecution(D, "bad-evidence", None, "x", None, "cpu-2t", None,
                                        None, (), 0.0))
    with pytest.raises(ValueError, match="another job"):
        signed(make_spec(N + 1), state, good)
    with pytest.raises(ValueError, match="timings"):
        sign_verdict(spec, state, good, timings={"total_s": -1.0}, bytes_moved={}, key=ARBITER)
    v = sign_verdict(spec, state, good, timings={"total_s": 2}, bytes_moved={}, key=ARBITER)
    assert v.timings == {"total_s": 2.0} and type(v.timings["total_s"]) is float
    assert verify_verdict(v.to_bytes()) == v


@pytest.mark.parametrize("name", ["wrong-state", "withheld-both", "bad-commitment"])
def test_summary_says_who_where_and_why(name):
    build, (fault, finding, _) = CASES[name]
    spec, state, reexec = build()
    v = signed(spec, state, reexec)
    text = summary(v)
    who = {"both": "both parties are at fault"}.get(fault, f"the {fault} is at fault")
    assert who in text and finding in text and v.reason in text
    assert ARBITER.public_key.hex() in text and "trainer 4096 B" in text
    assert "total_s 1.625 s" in text
    assert "leaf-0" not in text
    if name == "wrong-state":
        assert f"at step {D}" in text
        assert (f"bisection: {v.rounds} rounds for a challenge at step {N}; "
                f"bound ⌈log2 {N}⌉ = {math.ceil(math.log2(N))}") in text


# ---- a real dispute: re-execution, evidence and its offline re-check ---------------------------

REAL_D = 4


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """The tiny trained job disputed at step REAL_D by an auditor claiming other states from
    there on; the arbiter re-executes step REAL_D on another profile."""
    job = tiny_job(tmp_path_factory)
    trainer = Player(TRAINER, job.spec, job.store.leaves())
    auditor = Player(AUDITOR, job.spec, [
        leaf if leaf.step < REAL_D else Leaf(leaf.step, h("A", leaf.step), leaf.log_hash)
        for leaf in job.store.leaves()])
    state = play(begin(job.spec, trainer, auditor, STEPS), trainer, auditor)
    assert disputed_step(state) == REAL_D
    ev = evidence(job, REAL_D)
    r = reexecute(job.spec, dispute(state), *ev, program=load_job_program(job.spec, examples=False),
                  profile=ARBITER_PROFILE)
    return job, auditor, state, r, ev


def test_real_false_challenge_verdict(real):
    job, auditor, state, r, _ = real
    assert r.finding == "computed" and r.state_hash == job.store.leaf(REAL_D).state_hash
    v = verify_verdict(signed(job.spec, state, r).to_bytes(), arbiter_key=ARBITER.public_key)
    assert (v.fault, v.finding, v.step) == ("auditor", "false-challenge", REAL_D)


def test_evidence_round_trips_and_rechecks(real, tmp_path):
    job, auditor, state, r, (prev_state, examples, log) = real
    v = signed(job.spec, state, r)
    save_evidence(tmp_path, prev_state, examples, log)
    state_back, examples_back, log_back = load_evidence(tmp_path)
    assert state_digest(state_back) == state_digest(prev_state)
    assert sorted(state_back) == sorted(prev_state)
    assert [(e.index, state_digest(e.example), list(e.proof)) for e in examples_back] == \
        [(e.index, state_digest(e.example), list(e.proof)) for e in examples]
    assert log_back == log
    again = recheck_evidence(v, tmp_path, profile=ARBITER_PROFILE)
    assert (again.finding, again.state_hash) == ("computed", r.state_hash)
    again = recheck_evidence(v.to_bytes(), tmp_path, profile=ARBITER_PROFILE)
    assert again.state_hash == r.state_hash


def test_recheck_catches_an_arbiter_lying_about_h_star(real, tmp_path):
    """h_i* is the one thing a transcript replay cannot re-derive: a verdict claiming the
    auditor's h_i verifies, but re-running the step from the evidence exposes it."""
    job, auditor, state, r, ev = real
    lie = signed(job.spec, state, replace(r, state_hash=auditor.leaf(REAL_D).state_hash))
    assert verify_verdict(lie.to_bytes()).fault == "trainer"
    save_evidence(tmp_path, *ev)
    with pytest.raises(VerdictError, match="the verdict says computed"):
        recheck_evidence(lie, tmp_path, profile=ARBITER_PROFILE)


def test_recheck_rejects_evidence_of_another_step(real, tmp_path):
    job, auditor, state, r, _ = real
    save_evidence(tmp_path, *evidence(job, REAL_D + 1))
    with pytest.raises(VerdictError, match="not the evidence of step 4"):
        recheck_evidence(signed(job.spec, state, r), tmp_path, profile=ARBITER_PROFILE)


def test_recheck_needs_a_reexecution(tmp_path):
    spec, state, _ = _ended("timeout")
    with pytest.raises(VerdictError, match="no evidence"):
        recheck_evidence(signed(spec, state, None), tmp_path, profile=ARBITER_PROFILE)
    spec, state, reexec = _disputed("withheld", "trainer")
    with pytest.raises(VerdictError, match="no evidence"):
        recheck_evidence(signed(spec, state, reexec), tmp_path, profile=ARBITER_PROFILE)


def test_load_evidence_is_strict(real, tmp_path):
    from protocol.codec.canonical import decode, encode
    from protocol.dispute.evidence import EXAMPLES_FILE, STATE_FILE
    _, _, _, _, ev = real
    with pytest.raises(VerdictError, match="cannot read"):
        load_evidence(tmp_path / "missing")
    save_evidence(tmp_path, *ev)
    path = tmp_path / EXAMPLES_FILE
    good = path.read_bytes()
    body = decode(good)
    bad_bodies = [
        {**body, "extra": 1},
        {**body, "kind": "pickle"},
        {**body, "examples": [{**body["examples"][0], "proof": [b"\x00" * 31]}]},
        {**body, "examples": [{**body["examples"][0], "index": -1}]},
        {**body, "examples": [{**body["examples"][0], "example": b"OVTS\x01"}]},
        {**body, "examples": [{**body["examples"][0], "label": 3}]},
    ]
    for bad in bad_bodies:
        path.write_bytes(encode(bad))
        with pytest.raises(VerdictError):
            load_evidence(tmp_path)
    path.write_bytes(good + b"\x00")
    with pytest.raises(VerdictError, match="does not parse"):
        load_evidence(tmp_path)
    path.write_bytes(good)
    state_path = tmp_path / STATE_FILE
    state_path.write_bytes(state_path.read_bytes()[:-5])
    with pytest.raises(VerdictError, match="safetensors"):
        load_evidence(tmp_path)

