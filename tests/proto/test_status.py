"""proto.status: the one table from ovt's errors to gRPC status codes, applied at
the servicers' edge; a bug is INTERNAL with one log line, never UNKNOWN."""

from __future__ import annotations

import logging

import grpc
import pytest

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory
from proto.serving import build_server
from proto.status import STATUS_OF, rpc_errors, status_of
from protocol import errors


class Aborted(Exception):
    """What grpc's context.abort raises, as far as a servicer can tell."""


class FakeContext:
    def __init__(self) -> None:
        self._code: grpc.StatusCode | None = None
        self.details = ""

    def abort(self, code: grpc.StatusCode, details: str):
        self._code, self.details = code, details
        raise Aborted

    def code(self) -> grpc.StatusCode | None:
        return self._code


def _servicer(raise_in_unary: BaseException | None, raise_in_stream: BaseException | None):
    @rpc_errors
    class Servicer:
        def Unary(self, request, context):
            if raise_in_unary is not None:
                raise raise_in_unary
            return "reply"

        def Stream(self, request, context):
            yield "first"
            if raise_in_stream is not None:
                raise raise_in_stream

        def _helper(self):  # not an RPC: left alone
            raise RuntimeError("not wrapped")

    return Servicer()


@pytest.mark.parametrize(("error", "code"), [
    (errors.RequestError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (errors.EncodingError("bad"), grpc.StatusCode.INTERNAL),  # not wrapped: our own data
    (errors.NotFoundError("no job"), grpc.StatusCode.NOT_FOUND),
    (errors.OutOfRangeError("step"), grpc.StatusCode.OUT_OF_RANGE),
    (errors.RefusedError("no"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ProgramError("no"), grpc.StatusCode.FAILED_PRECONDITION),
    (errors.ResourceLimitError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.UnavailableError("stopping"), grpc.StatusCode.UNAVAILABLE),
    (errors.StoreError("corrupt"), grpc.StatusCode.DATA_LOSS),
    (errors.LogFormatError("garbled"), grpc.StatusCode.INTERNAL),  # via OvtError
])
def test_each_error_gets_its_status_and_its_message(error, code):
    context = FakeContext()
    with pytest.raises(Aborted):
        _servicer(error, None).Unary(None, context)
    assert (context.code(), context.details) == (code, str(error))
    assert status_of(error) == code


def test_an_error_class_not_in_the_table_gets_its_nearest_parents_status():
    class NewKindOfNotFound(errors.NotFoundError):
        pass

    class NewError(errors.OvtError):
        pass

    assert status_of(NewKindOfNotFound("x")) == grpc.StatusCode.NOT_FOUND
    assert status_of(NewError("x")) == STATUS_OF[errors.OvtError]


def test_a_bug_is_internal_with_one_log_line(caplog):
    context = FakeContext()
    with caplog.at_level(logging.ERROR, logger="ovt.rpc"), pytest.raises(Aborted):
        _servicer(KeyError("oops"), None).Unary(None, context)
    assert context.code() == grpc.StatusCode.INTERNAL
    assert "KeyError" in context.details and "oops" not in context.details
    assert [r.message for r in caplog.records] == ["Unary: internal error"]


def test_a_status_the_method_set_itself_stands():
    context = FakeContext()

    @rpc_errors
    class Servicer:
        def Unary(self, request, context):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, "mine")

    with pytest.raises(Aborted):
        Servicer().Unary(None, context)
    assert (context.code(), context.details) == (grpc.StatusCode.PERMISSION_DENIED, "mine")


def test_a_stream_is_mapped_after_what_it_already_sent():
    context = FakeContext()
    stream = _servicer(None, errors.StoreError("gone"))
    replies = []
    with pytest.raises(Aborted):
        for reply in stream.Stream(None, context):
            replies.append(reply)
    assert replies == ["first"] and context.code() == grpc.StatusCode.DATA_LOSS


def test_only_rpc_methods_are_wrapped():
    with pytest.raises(RuntimeError, match="not wrapped"):
        _servicer(None, None)._helper()
    assert _servicer(None, None).Unary(None, FakeContext()) == "reply"


def test_this_partys_own_failure_is_logged_for_the_operator(caplog):
    context = FakeContext()
    with caplog.at_level(logging.ERROR, logger="ovt.rpc"), pytest.raises(Aborted):
        _servicer(errors.StoreError("checkpoint 7 is corrupt"), None).Unary(None, context)
    assert context.code() == grpc.StatusCode.DATA_LOSS
    assert [r.message for r in caplog.records] == ["Unary: checkpoint 7 is corrupt"]


def test_a_peers_bad_request_is_not_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="ovt.rpc"), pytest.raises(Aborted):
        _servicer(errors.RequestError("job_id must be 32 bytes"), None).Unary(None, FakeContext())
    assert caplog.records == []


@rpc_errors
class _Drain(ovt_pb2_grpc.TrainerServicer):
    """A SubmitStream that reads every part its peer sends."""

    def SubmitStream(self, request_iterator, context):
        for _ in request_iterator:
            pass
        return ovt_pb2.SubmitReply()


@pytest.mark.network
def test_finding_9_an_undecodable_request_is_invalid_argument_and_logs_nothing(tmp_path,
                                                                              caplog):
    """Issue 10, finding 9: grpcio answered a request that is not its message INTERNAL (this
    party's own failure, as far as a peer can tell) and logged a traceback for every one."""
    claims = ClaimsServicer(StoreDirectory(tmp_path))
    server, port = build_server(
        "127.0.0.1:0", [lambda s: ovt_pb2_grpc.add_ClaimsServicer_to_server(claims, s),
                        lambda s: ovt_pb2_grpc.add_TrainerServicer_to_server(_Drain(), s)],
        tls_cert=None, tls_key=None, allow_remote_plaintext=False)
    server.start()
    garbled = b"\x0a\x20abc"  # field 1 announces 32 bytes, 3 follow
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel, \
                caplog.at_level(logging.INFO):
            calls = {"GetLeaf": channel.unary_unary("/ovt.v1.Claims/GetLeaf"),
                     "GetCheckpoint": lambda data, timeout: list(channel.unary_stream(
                         "/ovt.v1.Claims/GetCheckpoint")(data, timeout=timeout)),
                     "SubmitStream": lambda data, timeout: channel.stream_unary(
                         "/ovt.v1.Trainer/SubmitStream")(iter([data]), timeout=timeout)}
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as refused:
                    call(garbled, timeout=10)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert f"{name}: the request does not decode" in refused.value.details()
            good = ovt_pb2.StepRef(job_id=bytes(32), step=1).SerializeToString()
            with pytest.raises(grpc.RpcError) as unknown:  # decodes: the servicer answers
                calls["GetLeaf"](good, timeout=10)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(grace=None)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
