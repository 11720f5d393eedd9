"""Re-execution of the disputed step (SPEC §5.3, protocol/dispute/reexecute.py).

A tiny image-cnn job is trained for real on cpu-2t into a JobStore; the arbiter re-executes
single steps on other profiles from the stored S_{i-1}, the proven examples of B_i and the
stored L_i. Exactness throughout: h_i* must equal the trainer's h_i byte for byte.

`tiny_job` and `evidence` are shared with test_verdict.py (one training per session).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch

from protocol.codec.canonical import decode, encode
from protocol.codec.roundinglog import RoundingLog, SiteLog, decode_log, encode_log, log_digest
from protocol.codec.state import state_digest
from protocol.commit.commitments import SignedCommitment
from protocol.commit.data import (
    DataCommitment,
    ProvenExample,
    commit_dataset,
    example_digest,
    prove_examples,
)
from protocol.commit.keys import KeyPair
from protocol.commit.leaf import Leaf
from protocol.commit.merkle import MerkleTree
from protocol.dispute.game import Dispute
from protocol.dispute.reexecute import Reexecution, reexecute, withheld
from protocol.engine.batches import batch_indices
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError, EncodingError
from protocol.job.create import MAX_EXAMPLES, build_job, job_executor, load_job_program
from protocol.job.run import run_job
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS = 6
TRAINER_PROFILE = Profile.parse("cpu-2t")
ARBITER_PROFILE = Profile.parse("emulated-gpu")


@dataclass(frozen=True)
class TinyJob:
    spec: JobSpec
    root: Path
    store: JobStore
    data_tree: MerkleTree
    trainer_key: KeyPair
    signed: SignedCommitment


_CACHE: dict[str, TinyJob] = {}


def tiny_job(tmp_path_factory) -> TinyJob:
    """The session's one trained tiny job (built on first use, shared by both test files)."""
    if "job" not in _CACHE:
        spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=STEPS,
                                 seed=0, init_seed=1, policy=PrecisionPolicy(),
                                 checkpoint_interval=2, commit_interval=STEPS)
        root = tmp_path_factory.mktemp("tiny-trainer")
        store = JobStore(root, spec)
        store.put_initial(state0)
        key = KeyPair.generate()
        signed = run_job(store, key, profile=TRAINER_PROFILE)
        _, tree = commit_dataset(load_job_program(spec).dataset)
        _CACHE["job"] = TinyJob(spec, root, store, tree, key, signed)
    return _CACHE["job"]


def evidence(job: TinyJob, step: int):
    """What an honest trainer serves for step `step`: S_{step-1}, B_step proven, L_step."""
    ex = job_executor(job.spec, TRAINER_PROFILE)
    prev_state = job.store.state_at(step - 1, ex)
    program = load_job_program(job.spec)
    indices = batch_indices(job.spec.seed, job.spec.data.count, program.batch_size, step)
    examples = prove_examples(program.dataset, job.data_tree, indices)
    return prev_state, examples, job.store.log_bytes(step)


def leaf(job: TinyJob, step: int) -> Leaf:
    stored = job.store.leaf(step)
    return Leaf(step, stored.state_hash, stored.log_hash)


def dispute_at(job: TinyJob, step: int, *, log_hash: bytes | None = None) -> Dispute:
    """The dispute bisection ends with at `step`: the trainer's honest leaves, an auditor
    claiming another h_step. `log_hash` overrides the trainer's ℓ_step (a trainer that signed
    a doctored log)."""
    trainer = leaf(job, step)
    if log_hash is not None:
        trainer = replace(trainer, log_hash=log_hash)
    return Dispute(step, leaf(job, step - 1), trainer,
                   Leaf(step, bytes(32), trainer.log_hash))


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> TinyJob:
    return tiny_job(tmp_path_factory)


# ---- computed: exactly the trainer's h_i ------------------------------------------------------

@pytest.mark.parametrize("step", range(1, STEPS + 1))
def test_reexecution_on_another_profile_gives_exactly_the_trainers_state(job, step):
    prev_state, examples, log = evidence(job, step)
    r = reexecute(job.spec, dispute_at(job, step), prev_state, examples, log,
                  program=_program(job), profile=ARBITER_PROFILE)
    assert r.finding == "computed", r.detail
    assert r.state_hash == job.store.leaf(step).state_hash
    assert r.step == step and r.withheld_by is None and r.profile == "emulated-gpu"
    assert r.prev_state_hash == job.store.leaf(step - 1).state_hash
    assert r.log_digest == job.store.leaf(step).log_hash
    assert r.example_digests == tuple(example_digest(e.example) for e in examples)
    assert len(r.example_digests) == TINY["batch_size"]
    assert r.seconds > 0 and "\n" not in r.detail


def test_reexecution_does_not_modify_the_evidence(job):
    prev_state, examples, log = evidence(job, 3)
    before = state_digest(prev_state), [example_digest(e.example) for e in examples]
    reexecute(job.spec, dispute_at(job, 3), prev_state, examples, log, program=_program(job),
              profile=ARBITER_PROFILE)
    assert (state_digest(prev_state), [example_digest(e.example) for e in examples]) == before


@pytest.mark.parametrize("count, message", [
    (65, "holds 64 examples, but the job commits to 65"),
    (2**40, f"counts {2**40} examples; at most {MAX_EXAMPLES} are taken"),
], ids=["other", "absurd"])
def test_a_spec_whose_data_count_is_not_its_programs_is_refused_before_a_data_order(
        job, monkeypatch, count, message):
    """The arbiter builds the program from the spec first (`adjudicate`, `recheck_evidence`),
    then checks B_i against the data commitment, making the data order, a permutation of the
    spec's count: a count that is not the program's (or over MAX_EXAMPLES, for a data file's)
    is refused there, a ConfigError and no verdict, before any permutation is made of it."""
    prev_state, examples, log = evidence(job, 3)
    spec = replace(job.spec, data=DataCommitment(job.spec.data.root, count))
    monkeypatch.setattr("protocol.engine.rng.RandomStream.permutation",
                        lambda *a: pytest.fail("a data order was made"))
    with pytest.raises(ConfigError, match=re.escape(message)):
        reexecute(spec, dispute_at(job, 3), prev_state, examples, log,
                  program=load_job_program(spec, examples=False), profile=ARBITER_PROFILE)


# ---- invalid-log: the trainer signed a log that cannot be right --------------------------------

def _program(job):
    """The job's program as the arbiter builds it (no data file; B_i from the parties)."""
    return load_job_program(job.spec, examples=False)


def _invented(log: RoundingLog) -> RoundingLog:
    """The log with an entry invented at every unlogged element of its first large site: most
    of them lie far from any rounding boundary, so replay must find a violation."""
    k = next(i for i, s in enumerate(log.sites) if s.numel > 1000)
    site = log.sites[k]
    extra = np.setdiff1d(np.arange(site.numel, dtype=np.int64), site.indices)
    indices = np.concatenate([site.indices, extra])
    up = np.concatenate([site.up, np.ones(extra.size, dtype=bool)])
    order = np.argsort(indices)
    sites = list(log.sites)
    sites[k] = SiteLog(site.numel, indices[order], up[order])
    return RoundingLog(tuple(sites))


def test_log_with_invented_entries_is_invalid(job):
    prev_state, examples, log = evidence(job, 4)
    forged = encode_log(_invented(decode_log(log)))
    r = reexecute(job.spec, dispute_at(job, 4, log_hash=log_digest(forged)), prev_state,
                  examples, forged, program=_program(job), profile=ARBITER_PROFILE)
    assert r.finding == "invalid-log" and r.state_hash is None
    assert "log violation at step 4" in r.detail
    assert r.log_digest == log_digest(forged)


def test_log_with_a_missing_site_is_invalid(job):
    prev_state, examples, log = evidence(job, 2)
    decoded = decode_log(log)
    short = encode_log(RoundingLog(decoded.sites[:-1]))
    r = reexecute(job.spec, dispute_at(job, 2, log_hash=log_digest(short)), prev_state,
                  examples, short, program=_program(job), profile=ARBITER_PROFILE)
    assert r.finding == "invalid-log" and r.state_hash is None


def test_log_with_a_flipped_direction_replays_to_another_state(job):
    """A legal-looking log with one direction flipped: replay follows the log, so h_i* is not
    the trainer's h_i. Most flips are absorbed by later rounding (intermediate values), so the
    entries are tried latest first until one is not. Each is a legal choice at its own site;
    one upstream of later entries can move those out of their bands, and the log is then
    invalid at a later site (also a catch, not this test's)."""
    prev_state, examples, log = evidence(job, 3)
    decoded = decode_log(log)
    candidates = [(k, e) for k in reversed(range(len(decoded.sites)))
                  for e in range(decoded.sites[k].indices.size)][:32]
    assert candidates
    for k, entry in candidates:
        site = decoded.sites[k]
        up = site.up.copy()
        up[entry] = not up[entry]
        sites = list(decoded.sites)
        sites[k] = dataclasses.replace(site, up=up)
        flipped = encode_log(RoundingLog(tuple(sites)))
        r = reexecute(job.spec, dispute_at(job, 3, log_hash=log_digest(flipped)), prev_state,
                      examples, flipped, program=_program(job), profile=ARBITER_PROFILE)
        if r.finding == "invalid-log":
            later = re.search(r"site (\d+) ", r.detail)
            assert later is not None and int(later.group(1)) > k, r.detail
            continue
        assert r.finding == "computed", r.detail
        if r.state_hash != job.store.leaf(3).state_hash:
            return
    raise AssertionError(f"none of {len(candidates)} flipped directions changed S_3")


def test_log_that_does_not_decode_is_invalid(job):
    prev_state, examples, _ = evidence(job, 2)
    garbage = b"OVTL\x01\xff"
    r = reexecute(job.spec, dispute_at(job, 2, log_hash=log_digest(garbage)), prev_state,
                  examples, garbage, program=_program(job), profile=ARBITER_PROFILE)
    assert r.finding == "invalid-log" and r.state_hash is None


# ---- bad-evidence: what the driver handed over is not what both parties agreed on ------------

def _bad(job, step, *, prev_state=None, examples=None, log=None, dispute=None) -> Reexecution:
    good_state, good_examples, good_log = evidence(job, step)
    r = reexecute(job.spec, dispute or dispute_at(job, step),
                  good_state if prev_state is None else prev_state,
                  good_examples if examples is None else examples,
                  good_log if log is None else log, program=_program(job),
                  profile=ARBITER_PROFILE)
    assert r.finding == "bad-evidence" and r.state_hash is None and r.withheld_by is None
    return r


def test_wrong_previous_state_is_bad_evidence(job):
    other_state, _, _ = evidence(job, 3)  # S_2 handed over for step 4
    r = _bad(job, 4, prev_state=other_state)
    assert "agreed h_3" in r.detail and r.prev_state_hash == job.store.leaf(2).state_hash


def test_previous_state_with_one_changed_bit_is_bad_evidence(job):
    prev_state, _, _ = evidence(job, 4)
    name = next(k for k in sorted(prev_state) if prev_state[k].is_floating_point())
    changed = dict(prev_state)
    bits = changed[name].clone().view(torch.int32)
    bits.view(-1)[0] ^= 1
    changed[name] = bits.view(torch.float32)
    _bad(job, 4, prev_state=changed)


def test_previous_state_with_another_step_counter_is_bad_evidence(job):
    prev_state, _, _ = evidence(job, 4)
    changed = {**prev_state, "step": torch.tensor(7, dtype=torch.int64)}
    agreed = Leaf(3, state_digest(changed), job.store.leaf(3).log_hash)
    r = _bad(job, 4, prev_state=changed, dispute=replace(dispute_at(job, 4), agreed=agreed))
    assert "step counter" in r.detail


def test_unhashable_previous_state_is_bad_evidence(job):
    prev_state, _, _ = evidence(job, 4)
    _bad(job, 4, prev_state={**prev_state, "extra": torch.zeros(2, dtype=torch.complex64)})


def test_examples_of_another_step_are_bad_evidence(job):
    _, other, _ = evidence(job, 5)
    r = _bad(job, 4, examples=other)
    assert "not B_4" in r.detail


def test_reordered_examples_are_bad_evidence(job):
    _, examples, _ = evidence(job, 4)
    _bad(job, 4, examples=examples[::-1])


def test_missing_example_is_bad_evidence(job):
    _, examples, _ = evidence(job, 4)
    _bad(job, 4, examples=examples[:-1])


def test_relabelled_example_is_bad_evidence(job):
    _, examples, _ = evidence(job, 4)
    first = examples[0]
    changed = {k: v.clone() for k, v in first.example.items()}
    name = next(k for k, v in changed.items() if not v.is_floating_point())  # the label
    changed[name] = (changed[name] + 1) % 10
    forged = [ProvenExample(first.index, changed, first.proof)] + list(examples[1:])
    _bad(job, 4, examples=forged)


def test_log_of_another_step_is_bad_evidence(job):
    r = _bad(job, 4, log=job.store.log_bytes(5))
    assert r.log_digest == job.store.leaf(5).log_hash and "ℓ_4" in r.detail


# ---- the record -------------------------------------------------------------------------------

def test_withheld_names_who():
    r = withheld(7, "auditor", "no S_6 served\nwithin the deadline", "cuda")
    assert (r.step, r.finding, r.withheld_by, r.profile, r.state_hash) == \
        (7, "withheld", "auditor", "cuda", None)
    assert r.detail == "no S_6 served within the deadline"  # one line
    with pytest.raises(EncodingError):
        withheld(7, "client", "x", "cuda")


def _computed() -> Reexecution:
    return Reexecution(3, "computed", b"\x01" * 32, "ok", None, "cpu-2t", b"\x02" * 32,
                       b"\x03" * 32, (b"\x04" * 32, b"\x05" * 32), 0.25)


def test_body_round_trips_exactly():
    for r in (_computed(), withheld(2, "both", "silent", "cpu-1t")):
        data = encode(r.to_body())
        again = Reexecution.from_body(decode(data))
        assert again == r and encode(again.to_body()) == data


@pytest.mark.parametrize("change", [
    {"finding": "guessed"}, {"state_hash": None}, {"state_hash": b"\x01" * 31},
    {"withheld_by": "trainer"}, {"step": 0}, {"step": True}, {"step": 3.0},
    {"seconds": 1}, {"seconds": -1.0}, {"seconds": float("inf")}, {"profile": ""},
    {"detail": "two\nlines"}, {"detail": "x" * 1001}, {"prev_state_hash": b""},
    {"log_digest": "00" * 32}, {"example_digests": [b"\x04" * 31]},
    {"example_digests": b"\x04" * 32},
])
def test_from_body_rejects_bad_fields(change):
    body = {**_computed().to_body(), **change}
    with pytest.raises(EncodingError):
        Reexecution.from_body(body)


def test_from_body_rejects_missing_and_extra_fields():
    body = _computed().to_body()
    with pytest.raises(EncodingError):
        Reexecution.from_body({k: v for k, v in body.items() if k != "detail"})
    with pytest.raises(EncodingError):
        Reexecution.from_body({**body, "verdict": "trainer"})
    with pytest.raises(EncodingError):
        Reexecution.from_body([body])
    with pytest.raises(EncodingError):  # withheld without who
        Reexecution.from_body({**withheld(2, "both", "x", "p").to_body(), "withheld_by": None})
