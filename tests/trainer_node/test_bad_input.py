"""Bad input against a live `ovt-trainer serve` (started with --max-message-mb 1 and
--max-params MAX_PARAMS): each request gets the right status code with a one-line message, and
the server keeps serving."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc

from .daemon import STEPS, Trainers, channel_to, make_job, submit, watch_until

pytestmark = pytest.mark.network
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
PRECONDITION, OUT_OF_RANGE = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
MAX_PARAMS = 1000  # the tiny job's CNN has 814 parameters; with 8 channels it has 2770


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_job):
    """A daemon that has trained the tiny job, and a channel to it."""
    trainers = Trainers(tmp_path_factory.mktemp("bad-input"))
    try:
        daemon = trainers.start(trainers.tmp_path / "store", "--max-message-mb", "1",
                                "--max-params", str(MAX_PARAMS))
        with channel_to(daemon) as channel:
            submit(channel, tiny_job.spec.to_bytes(), tiny_job.state0_bytes)
            assert watch_until(channel, tiny_job.job_id,
                               lambda s: s.state in ("done", "failed")).state == "done"
            yield daemon, channel
    finally:
        trainers.close()


def _other_state0() -> bytes:
    return safetensors.torch.save(make_job(init_seed=2)[1])


def _submit_cases(spec, state0: bytes):
    good = spec.to_bytes()
    return {
        "truncated spec": (good[:-7], state0, INVALID),
        "spec with trailing byte": (good + b"\0", state0, INVALID),
        "empty spec": (b"", state0, INVALID),
        "S_0 of another init seed": (good, _other_state0(), INVALID),
        "garbage safetensors": (good, b"\x08\0\0\0\0\0\0\0{garbage", INVALID),
        "safetensors header length past the end": (good, b"\xff" * 8 + b"{}", INVALID),
        "empty S_0": (good, b"", INVALID),
        "program not allowed": (dataclasses.replace(spec, program="os:system").to_bytes(),
                                state0, PRECONDITION),
        "program source differs": (dataclasses.replace(
            spec, program_source_hash=b"\1" * 32).to_bytes(), state0, PRECONDITION),
        "config the program rejects": (dataclasses.replace(
            spec, config={**spec.config, "no_such_field": 1}).to_bytes(), state0,
            PRECONDITION),
        "model over --max-params": (dataclasses.replace(
            spec, config={**spec.config, "channels": 8}).to_bytes(), state0, EXHAUSTED),
        "oversized message": (good, b"\0" * (2 << 20), EXHAUSTED),
    }


def _assert_refused(call, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    details = err.value.details() or ""
    assert "\n" not in details and "Traceback" not in details


def _assert_still_serving(daemon, channel, tiny_job) -> None:
    assert daemon.proc.poll() is None
    ref = ovt_pb2.JobRef(job_id=tiny_job.job_id)
    assert ovt_pb2_grpc.ClaimsStub(channel).GetSpec(ref, timeout=30).spec == \
        tiny_job.spec.to_bytes()
    assert ovt_pb2_grpc.TrainerStub(channel).Status(ref, timeout=30).state == "done"


def test_bad_submissions(live, tiny_job):
    daemon, channel = live
    stub = ovt_pb2_grpc.TrainerStub(channel)
    for name, (spec, state0, code) in _submit_cases(tiny_job.spec, tiny_job.state0_bytes).items():
        request = ovt_pb2.SubmitRequest(spec=spec, initial_state=state0)
        try:
            _assert_refused(lambda r=request: stub.Submit(r, timeout=60), code)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None
        _assert_still_serving(daemon, channel, tiny_job)


@pytest.mark.parametrize("job_id,code", [(b"\7" * 32, NOT_FOUND), (b"\7" * 5, INVALID),
                                         (b"", INVALID)],
                         ids=["unknown", "5-bytes", "empty"])
def test_bad_job_ids(live, tiny_job, job_id, code):
    daemon, channel = live
    trainer, claims = ovt_pb2_grpc.TrainerStub(channel), ovt_pb2_grpc.ClaimsStub(channel)
    ref = ovt_pb2.JobRef(job_id=job_id)
    _assert_refused(lambda: trainer.Status(ref, timeout=30), code)
    _assert_refused(lambda: list(trainer.Watch(ref, timeout=30)), code)
    _assert_refused(lambda: claims.GetSpec(ref, timeout=30), code)
    _assert_still_serving(daemon, channel, tiny_job)


def test_out_of_range_claims(live, tiny_job):
    daemon, channel = live
    claims, job_id = ovt_pb2_grpc.ClaimsStub(channel), tiny_job.job_id
    _assert_refused(lambda: claims.GetLeaf(ovt_pb2.StepRef(job_id=job_id, step=STEPS + 1),
                                           timeout=30), OUT_OF_RANGE)
    _assert_refused(lambda: list(claims.GetCheckpoint(
        ovt_pb2.StepRef(job_id=job_id, step=2**63), timeout=30)), OUT_OF_RANGE)
    _assert_refused(lambda: list(claims.GetLeaves(
        ovt_pb2.StepRange(job_id=job_id, first=5, last=2), timeout=30)), OUT_OF_RANGE)
    _assert_refused(lambda: claims.GetCommitment(
        ovt_pb2.CommitmentRequest(job_id=job_id, n=STEPS + 7), timeout=30), PRECONDITION)
    _assert_still_serving(daemon, channel, tiny_job)

