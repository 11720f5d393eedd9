"""The one table from ovt's errors to gRPC status codes, applied at the servicers' edge
(SPEC §6: a peer's bad request gets a status that says what was wrong, never UNKNOWN).

Servicers raise `protocol.errors` classes, never a status code; `rpc_errors` on a servicer
class maps them (`STATUS_OF`) and answers a bug with INTERNAL and one log line.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

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
        status, line = status_of(err), str(err).splitlines()[0][:1000] if str(err) else rpc
        if status in _OWN_FAILURES:
            _log.error("%s: %s", rpc, line)
        context.abort(status, line)
    _log.error("%s: internal error", rpc, exc_info=err)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {rpc} ({type(err).__name__})")
