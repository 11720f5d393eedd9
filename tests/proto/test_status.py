"""proto.status: the one table from ovt's errors to gRPC status codes, applied at
the servicers' edge; a bug is INTERNAL with one log line, never UNKNOWN."""

from __future__ import annotations

import logging

import grpc
import pytest

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
