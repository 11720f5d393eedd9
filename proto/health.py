"""ovt's own `grpc.health.v1.Health` servicer (Check and Watch), which never blocks gRPC.

Why not grpcio-health-checking's `HealthServicer` (issue 10, finding 1): its sync `Watch` sends
while holding its lock, and the close callback of a cancelled watch waits for that lock on
gRPC's polling thread, so a few Watch open/cancel cycles (16 clients: within 2 s) leave a daemon
answering nothing, SIGTERM included (grpc/grpc pull request 43403). A daemon that cannot answer
loses its dispute by timeout (SPEC §5.2), so a hostile peer could make an honest trainer lose.

Here no lock is held while a response is sent or while anything waits on gRPC: `Watch` is a
generator on a worker thread that waits on a condition with a timeout (`WATCH_POLL_S`) for a
status change, checks `context.is_active()` and yields outside the lock. The only code run on
gRPC's polling thread is the call's close callback, which takes the condition's lock (held by
others only for a dict lookup or update, never across a send or a wait) to wake its watcher, so
a cancelled watch ends, and frees its worker thread, at once.

`enter_graceful_shutdown` turns every service NOT_SERVING for good; every watcher sends that and
ends its stream, so a daemon that stops is not held up by its watchers for the grace period.

    health = HealthServicer()
    health.set("ovt.v1.Claims", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    ...
    health.enter_graceful_shutdown()
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

WATCH_POLL_S = 1.0  # the longest a watcher sleeps between checks that its call is still open
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """The serving status of each named service ("" is the whole server). Thread-safe.

    Its statuses are those of the gRPC health protocol, not ovt's error table: Check of an
    unknown service is NOT_FOUND, Watch of one reports SERVICE_UNKNOWN until the service is set.
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()  # guards the fields below; never held to send
        self._statuses: dict[str, int] = {}
        self._shutting_down = False

    def set(self, service: str, status: int) -> None:
        """Record `service`'s status and wake its watchers; ignored once shutting down."""
        with self._changed:
            if not self._shutting_down:
                self._statuses[service] = status
                self._changed.notify_all()

    def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING from now on; watchers send it and end their streams."""
        with self._changed:
            self._shutting_down = True
            self._statuses = dict.fromkeys(self._statuses, NOT_SERVING)
            self._changed.notify_all()

    def Check(self, request, context):
        with self._changed:
            status = self._statuses.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(self, request, context) -> Iterator[health_pb2.HealthCheckResponse]:
        """The service's status now and on every change, until the client goes or the server
        shuts down (NOT_SERVING is sent first)."""
        closed = threading.Event()  # set by gRPC's callback once the call has ended

        def close() -> None:  # runs on gRPC's polling thread: a moment's lock, no waiting
            closed.set()
            with self._changed:
                self._changed.notify_all()

        if not context.add_callback(close):
            return  # the call has already ended
        sent: int | None = None  # the status last sent; None before the first

        def woken() -> bool:  # wait_for's predicate: reads `sent` as this generator last set it
            return (closed.is_set() or self._shutting_down
                    or self._status_of(request.service) != sent)

        while context.is_active():
            with self._changed:
                self._changed.wait_for(woken, WATCH_POLL_S)
                status, ending = self._status_of(request.service), self._shutting_down
            if closed.is_set():
                return
            if status != sent:
                yield health_pb2.HealthCheckResponse(status=status)
                sent = status
            if ending:
                return

    def _status_of(self, service: str) -> int:
        return self._statuses.get(service, SERVICE_UNKNOWN)
