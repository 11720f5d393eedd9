"""How many threads a daemon's gRPC server has, and how many of them streams may hold, in all
and per peer (issue 10, finding 5; SPEC §5.2: a party that cannot answer a bisection query in
time loses).

`ServerLimits` are the numbers (`--workers`, `--max-streams`, `--max-streams-per-peer`,
`--stream-idle-s` on both `serve` commands); `StreamSlots`, a server interceptor that
`proto.serving.build_server` installs, enforces them before any servicer runs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from proto.status import abort_call, cancel_call
from protocol.errors import (
    ConfigError,
    RequestError,
    ResourceLimitError,
)

_log = logging.getLogger("ovt.rpc")
DEFAULT_WORKERS = 16
DEFAULT_MAX_STREAMS = 8
DEFAULT_MAX_STREAMS_PER_PEER = 4
DEFAULT_STREAM_IDLE_S = 30.0


@dataclass(frozen=True)
class ServerLimits:
    """A server's worker threads and the share of them that streaming calls may hold.

    gRPC runs every call on one of `workers` threads, and a streaming call holds its thread for
    as long as it lasts. Every RPC with a stream on either side (Trainer.Watch and SubmitStream,
    Auditor.WatchAudit, Claims.GetCheckpoint and GetLeaves, Health.Watch) takes one of
    `max_streams` slots, strictly fewer than `workers`, so at least `workers - max_streams`
    threads are always free for unary calls: GetLeaf above all, which a party must answer
    within the arbiter's per-move deadline or lose its dispute (SPEC §5.2). One peer (one
    address, its port left out: `peer_host`) holds at most `max_streams_per_peer` of the slots,
    so one client — 8 `ovt-trainer status --watch`, say — cannot take them all and lock every
    other peer's streams out; a cap above `max_streams` is no tighter than `max_streams`. A
    stream beyond either limit is refused at once with RESOURCE_EXHAUSTED, before its servicer
    runs. A stream whose peer keeps one message waiting longer than `stream_idle_s` (sends no
    next request, or reads no sent response) is ended with RESOURCE_EXHAUSTED, saying so, which
    frees its slot and its thread.

    The per-peer cap counts addresses: a peer with many addresses (an IPv6 prefix, say) gets a
    share per address, but never more than `max_streams` in all, so unary calls still answer.
    """

    workers: int = DEFAULT_WORKERS
    max_streams: int = DEFAULT_MAX_STREAMS
    max_streams_per_peer: int = DEFAULT_MAX_STREAMS_PER_PEER
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S

    def __post_init__(self) -> None:
        """Raises ConfigError unless 1 <= max_streams < workers, max_streams_per_peer >= 1 and
        stream_idle_s > 0."""
        if not 1 <= self.max_streams < self.workers:
            raise ConfigError(f"the stream slots ({self.max_streams}) must be at least 1 and "
                              f"fewer than the worker threads ({self.workers}), so unary calls "
                              f"always have a thread")
        if not self.max_streams_per_peer >= 1:
            raise ConfigError(f"the stream slots of one peer must be at least 1, got "
                              f"{self.max_streams_per_peer}")
        if not self.stream_idle_s > 0:
            raise ConfigError(f"the stream idle timeout must be positive, got "
                              f"{self.stream_idle_s}")


def add_limit_options(parser: argparse.ArgumentParser) -> None:
    """The options of a daemon's `serve` that set its `ServerLimits` (read by `limits_of`)."""
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                        help="gRPC worker threads (default: %(default)s)")
    parser.add_argument("--max-streams", type=int, default=DEFAULT_MAX_STREAMS,
                        help="streaming calls (Watch, SubmitStream, WatchAudit, GetCheckpoint, "
                             "GetLeaves, Health.Watch) served at once; one more is refused "
                             "with RESOURCE_EXHAUSTED. Fewer than --workers, so the other "
                             "threads always answer unary calls such as GetLeaf (default: "
                             "%(default)s)")
    parser.add_argument("--max-streams-per-peer", type=int,
                        default=DEFAULT_MAX_STREAMS_PER_PEER,
                        help="of those, how many one peer (one address, any port) may hold; "
                             "one more from it is refused with RESOURCE_EXHAUSTED, so one "
                             "client cannot lock the others' streams out (default: "
                             "%(default)s)")
    parser.add_argument("--stream-idle-s", type=float, default=DEFAULT_STREAM_IDLE_S,
                        help="end a stream whose peer sends no next message, or reads no "
                             "sent one, for this many seconds (default: %(default)s)")


def limits_of(args: argparse.Namespace) -> ServerLimits:
    """The `ServerLimits` given by `add_limit_options`' options. Raises ConfigError."""
    return ServerLimits(workers=args.workers, max_streams=args.max_streams,
                        max_streams_per_peer=args.max_streams_per_peer,
                        stream_idle_s=args.stream_idle_s)


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string, the port left out: what `StreamSlots` counts a
    peer's streams by (a client opens a new port per connection, so ports tell nothing).

    `ipv4:127.0.0.1:5000` gives `ipv4:127.0.0.1`, `ipv6:%5B::1%5D:5000` (grpc's spelling)
    gives `ipv6:[::1]`; any other peer (`unix:…`, or none) is itself."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6") and ":" in rest:
        return f"{scheme}:{urllib.parse.unquote(rest.rsplit(':', 1)[0])}"
    return peer


class StreamSlots(grpc.ServerInterceptor):
    """Enforces one server's `ServerLimits` on its streaming calls (every service, health too).

    A unary call passes untouched. A streaming call takes a slot when its thread starts it
    (none free, or its peer holding `max_streams_per_peer` already: RESOURCE_EXHAUSTED,
    `ResourceLimitError`) and gives it back when the call's handler returns, fails or is
    closed; every wait on the peer for one message is bounded by `_IdleWatch`. A request stream
    that breaks off (cancelled by its client or by the idle watch) reaches the servicer as a
    `RequestError`, so it is no internal error in the log.
    """

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()  # streams per peer (`peer_host`); none: no key
        self._idle = _IdleWatch(limits.stream_idle_s)

    def intercept_service(self, continuation, handler_call_details):
        """Runs on gRPC's polling thread, so it only wraps the handler and never waits."""
        handler = continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        method = handler_call_details.method
        codec = {"request_deserializer": handler.request_deserializer,
                 "response_serializer": handler.response_serializer}
        if not handler.response_streaming:
            return grpc.stream_unary_rpc_method_handler(
                self._unary_response(method, handler.stream_unary), **codec)
        if not handler.request_streaming:
            return grpc.unary_stream_rpc_method_handler(
                self._stream_response(method, handler.unary_stream, requests=False), **codec)
        return grpc.stream_stream_rpc_method_handler(
            self._stream_response(method, handler.stream_stream, requests=True), **codec)

    @contextlib.contextmanager
    def _slot(self, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Hold a slot for the body, or abort the call with RESOURCE_EXHAUSTED when none is
        free or its peer holds `max_streams_per_peer` already."""
        peer = peer_host(context.peer())
        with self._lock:
            refusal = self._refusal(peer)
            if refusal is None:
                self._held[peer] += 1
        if refusal is not None:
            abort_call(ResourceLimitError(refusal), context, method)
        try:
            yield
        finally:
            with self._lock:
                self._held[peer] -= 1
                if not self._held[peer]:
                    del self._held[peer]  # the table holds only peers with a stream open

    def _refusal(self, peer: str) -> str | None:
        """Why `peer` may not open one more stream now (None: it may); under `_lock`."""
        limits = self.limits
        if self._held.total() >= limits.max_streams:
            return (f"{limits.max_streams} streaming calls are already being served "
                    f"(--max-streams); try again later")
        if self._held[peer] >= limits.max_streams_per_peer:
            return (f"{peer} already holds {self._held[peer]} streaming calls, as many as one "
                    f"peer may (--max-streams-per-peer); end one first")
        return None

    def _unary_response(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def limited(requests, context):
            with self._slot(method, context):
                return behavior(self._received(method, requests, context), context)
        return limited

    def _stream_response(self, method: str, behavior: Callable[..., Any], *,
                         requests: bool) -> Callable[..., Any]:
        def limited(request, context):
            with self._slot(method, context):
                if requests:
                    request = self._received(method, request, context)
                for response in behavior(request, context):
                    with self._idle.waiting(method, context):  # gRPC sends it meanwhile
                        yield response
        return limited

    def _received(self, method: str, requests: Iterator[Any],
                  context: grpc.ServicerContext) -> Iterator[Any]:
        """`requests`, each waited for at most `stream_idle_s`. Raises RequestError when the
        stream breaks off before its end."""
        while True:
            with self._idle.waiting(method, context):
                try:
                    request = next(requests)
                except StopIteration:
                    return
                except grpc.RpcError:  # the call was cancelled: by its client or the idle watch
                    raise RequestError(f"the request stream of {method} broke off") from None
            yield request


class _IdleWatch:
    """Ends a call that has waited on its peer for one message longer than `idle_s`, with
    RESOURCE_EXHAUSTED and a message saying so (`proto.status.cancel_call`).

    One thread sleeps until the earliest deadline; it starts with the first wait and ends once
    it wakes to find no wait left (at most `idle_s` after the last one). Every wait lasts
    `idle_s`, so the waits, kept in insertion order, are in deadline order.
    """

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._lock = threading.Condition()
        self._waits: dict[object, tuple[float, str, grpc.ServicerContext]] = {}
        self._running = False

    @contextlib.contextmanager
    def waiting(self, method: str, context: grpc.ServicerContext) -> Iterator[None]:
        """The body waits on the peer (for a request, or for a response to be taken)."""
        key = object()
        with self._lock:
            self._waits[key] = (time.monotonic() + self.idle_s, method, context)
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="ovt-stream-idle", daemon=True).start()
        try:
            yield
        finally:
            with self._lock:
                self._waits.pop(key, None)

    def _run(self) -> None:
        while (expired := self._next_expired()) is not None:
            method, context = expired
            reason = (f"{method}: the peer sent or took nothing for {self.idle_s:g} s "
                      f"(--stream-idle-s); the stream is ended")
            _log.warning("%s (peer %s)", reason, peer_host(context.peer()))
            cancel_call(ResourceLimitError(reason), context)

    def _next_expired(self) -> tuple[str, grpc.ServicerContext] | None:
        """The next wait past its deadline, removed; None (the thread ends) when none is left."""
        with self._lock:
            while self._waits:
                key, (deadline, method, context) = next(iter(self._waits.items()))
                left = deadline - time.monotonic()
                if left <= 0:
                    del self._waits[key]
                    return method, context
                self._lock.wait(left)
            self._running = False
            return None


