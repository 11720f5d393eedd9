"""The one table from ovt's errors to gRPC status codes, applied at the servicers' edge
(SPEC §6: a peer's bad request gets a status that says what was wrong, never UNKNOWN).

Servicers raise `protocol.errors` classes, never a status code; `rpc_errors` on a servicer
class maps them (`STATUS_OF`) and answers a bug with INTERNAL and one log line. The stream
limits (`proto.limits`) end calls through the same table: `abort_call` in a handler's thread,
`cancel_call` from outside it. `DecodedRequests`, a server interceptor, answers a request that
is not its RPC's protobuf message as the peer's bad request (`RequestError`), before anything
else runs.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from protocol.commit.hashing import HASH_SIZE
from protocol.errors import (
    ConfigError,
    NotFoundError,
    OutOfRangeError,
    OvtError,
    ProgramError,
    RefusedError,
    RequestError,
    ResourceLimitError,
    StoreError,
    UnavailableError,
)

T = TypeVar("T")


# A servicer wraps what it decodes from a request in RequestError; any other OvtError reaching
# the edge is this party's own failure (a damaged store, a program that no longer loads): the
# peer is told so, and the operator gets a log line.
STATUS_OF: dict[type[OvtError], grpc.StatusCode] = {
    RequestError: grpc.StatusCode.INVALID_ARGUMENT,
    ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    OutOfRangeError: grpc.StatusCode.OUT_OF_RANGE,
    RefusedError: grpc.StatusCode.FAILED_PRECONDITION,
    ProgramError: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceLimitError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
    StoreError: grpc.StatusCode.DATA_LOSS,
    OvtError: grpc.StatusCode.INTERNAL,
}
_OWN_FAILURES = (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.INTERNAL)

_log = logging.getLogger("ovt.rpc")


def job_id_of(data: bytes) -> bytes:
    """A request's job id field, checked to be a job id (RequestError otherwise)."""
    if len(data) != HASH_SIZE:
        raise RequestError(f"job_id must be {HASH_SIZE} bytes, got {len(data)}")
    return data


def status_of(err: OvtError) -> grpc.StatusCode:
    """The status for `err`: that of its nearest class in STATUS_OF."""
    return next(STATUS_OF[c] for c in type(err).__mro__ if c in STATUS_OF)


def rpc_errors(servicer: type[T]) -> type[T]:
    """Class decorator for a servicer: every RPC method (a public method whose name starts with
    a capital, as gRPC names them) answers an `OvtError` with `status_of(err)` and its one-line
    message, and an unexpected exception (a bug) with INTERNAL and one log line with the
    traceback. A status the method set itself with `context.abort` passes through unchanged."""
    for name, method in list(vars(servicer).items()):
        if name[:1].isupper() and callable(method):
            setattr(servicer, name, _mapped(method))
    return servicer


def _mapped(method: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isgeneratorfunction(method):
        @functools.wraps(method)
        def stream(self, request, context):
            try:
                yield from method(self, request, context)
            except Exception as err:  # noqa: BLE001 - mapped or logged, never lost
                abort_call(err, context, method.__name__)
        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as err:  # noqa: BLE001 - mapped or logged, never lost
            abort_call(err, context, method.__name__)
    return unary


def abort_call(err: Exception, context: grpc.ServicerContext, rpc: str) -> None:
    """Abort the call for `err` (re-raise it when the method already aborted the call)."""
    if context.code() is not None:  # context.abort ran: its status stands
        raise err
    if isinstance(err, OvtError):
        status, line = status_of(err), _message(err, rpc)
        if status in _OWN_FAILURES:
            _log.error("%s: %s", rpc, line)
        context.abort(status, line)
    _log.error("%s: internal error", rpc, exc_info=err)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {rpc} ({type(err).__name__})")


def cancel_call(err: OvtError, context: grpc.ServicerContext) -> None:
    """End a call from outside its handler, with `status_of(err)` and `err`'s message: how the
    stream idle watch (`proto.limits`) ends a call whose handler is blocked on its peer,
    waiting for a request or for a sent response to be taken.

    grpcio's public `ServicerContext.cancel()` ends a call with a bare CANCELLED, whatever
    `set_code`/`set_details` said: those only fill the status the handler returns, and a handler
    blocked on its peer returns nothing. The core call's cancel with a status
    (`grpc_call_cancel_with_status`) sends that status and message as the call's trailers;
    grpcio reaches it only through the context's private `_rpc_event.call` (grpcio 1.85,
    `tests/proto/test_status.py` checks that the peer sees the message). Without it (another
    grpcio) the call is cancelled plainly: the peer sees CANCELLED and the caller's log says
    why."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is None:
        context.cancel()
        return
    call.cancel(status_of(err).value[0], _message(err, type(err).__name__))


def _message(err: OvtError, fallback: str) -> str:
    """The status message for `err`: its first line, at most 1000 characters (`fallback`
    when it has none)."""
    text = str(err)
    return text.splitlines()[0][:1000] if text else fallback


class DecodedRequests(grpc.ServerInterceptor):
    """Every request that does not decode as its RPC's protobuf message is the peer's bad
    request: INVALID_ARGUMENT (`RequestError`) with one line naming the RPC, and no log line.

    grpcio itself answers it INTERNAL ("Exception deserializing request!", which this table
    keeps for this party's own failures) and logs the full traceback for each one (issue 10,
    finding 9: 509 KB of log in a fuzz run). Here the decoder hands such a request on as
    `_Undecodable` instead of raising, and the call is refused before its handler runs; in a
    request stream, the servicer's iterator raises `RequestError` when it comes to one.
    """

    def intercept_service(self, continuation, handler_call_details):
        """Runs on gRPC's polling thread: it only wraps the handler."""
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method, decode = handler_call_details.method, handler.request_deserializer

        def tolerant(data: bytes) -> object:
            try:
                return decode(data)
            except DecodeError as err:
                return _Undecodable(f"{method}: the request does not decode ({err})")

        codec = {"request_deserializer": tolerant,
                 "response_serializer": handler.response_serializer}
        if handler.request_streaming:
            behavior = handler.stream_stream or handler.stream_unary
            make = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                    else grpc.stream_unary_rpc_method_handler)
            return make(lambda requests, context: behavior(_decoded(requests), context), **codec)
        behavior = handler.unary_stream or handler.unary_unary
        make = (grpc.unary_stream_rpc_method_handler if handler.response_streaming
                else grpc.unary_unary_rpc_method_handler)

        def checked(request, context):
            if isinstance(request, _Undecodable):
                abort_call(RequestError(request.reason), context, method)
            return behavior(request, context)
        return make(checked, **codec)


class _Undecodable:
    """A request that did not decode, in place of its message (`DecodedRequests`)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _decoded(requests: Iterator[Any]) -> Iterator[Any]:
    """`requests`, raising RequestError at one that did not decode."""
    for request in requests:
        if isinstance(request, _Undecodable):
            raise RequestError(request.reason)
        yield request
