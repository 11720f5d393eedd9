"""gRPC servers and channels for the ovt daemons: limits, health, TLS, and the loopback rule.

Every ovt daemon builds its server here, so all of them share one policy (issue 4):
- message sizes are bounded both ways (`max_message_bytes`); a bigger message is refused by gRPC
  with RESOURCE_EXHAUSTED before any servicer sees it;
- streaming calls share a bounded number of slots, fewer than the worker threads, so a peer
  holding streams open (or stalling them) never takes the threads unary calls such as GetLeaf
  need (`ServerLimits`, enforced by `StreamSlots` before any servicer runs);
- the standard health service (`grpc.health.v1.Health`, ovt's own servicer in `proto.health`)
  answers SERVING for "" and for every named service while the server runs; a daemon that passes
  its own `make_health()` switches it to NOT_SERVING (`enter_graceful_shutdown`) when it starts
  to shut down, so a client watching health (a load balancer, a peer's Health.Watch) hears
  before the port closes;
- TLS when a certificate and key are given; plaintext only on a loopback address (127.0.0.0/8,
  ::1, localhost) unless the caller passes `allow_remote_plaintext` (the CLI's explicitly named
  `--insecure-allow-remote-plaintext`); anything else is a `ConfigError`.

    server, port = build_server("127.0.0.1:0", [add_claims], service_names=["ovt.v1.Claims"],
                                tls_cert=None, tls_key=None, allow_remote_plaintext=False)
    server.start()
    channel = make_channel(f"127.0.0.1:{port}", tls_ca=None)

`make_self_signed_cert` writes a certificate and key for local TLS use (tests, a laptop):
its certificate is its own CA, so a client passes the same cert.pem as `tls_ca`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import inspect
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.health import HealthServicer
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

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
HEALTH_SERVICE = "grpc.health.v1.Health"

AddServicer = Callable[[grpc.Server], None]
T = TypeVar("T")


def split_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` → (host, port). Raises ConfigError if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"bad address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:0")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (no name resolution beyond 'localhost')."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def message_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


# --- how many threads a server has and how many of them streams may hold (issue 10, finding 5)

DEFAULT_WORKERS = 16
DEFAULT_MAX_STREAMS = 8
DEFAULT_STREAM_IDLE_S = 30.0


@dataclass(frozen=True)
class ServerLimits:
    """A server's worker threads and the share of them that streaming calls may hold.

    gRPC runs every call on one of `workers` threads, and a streaming call holds its thread for
    as long as it lasts. Every RPC with a stream on either side (Trainer.Watch and SubmitStream,
    Auditor.WatchAudit, Claims.GetCheckpoint and GetLeaves, Health.Watch) takes one of
    `max_streams` slots, strictly fewer than `workers`, so at least `workers - max_streams`
    threads are always free for unary calls: GetLeaf above all, which a party must answer
    within the arbiter's per-move deadline or lose its dispute (SPEC §5.2). A stream beyond the
    limit is refused at once with RESOURCE_EXHAUSTED, before its servicer runs. A stream whose
    peer keeps one message waiting longer than `stream_idle_s` (sends no next request, or reads
    no sent response) is cancelled, which frees its slot and its thread.
    """

    workers: int = DEFAULT_WORKERS
    max_streams: int = DEFAULT_MAX_STREAMS
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S

    def __post_init__(self) -> None:
        """Raises ConfigError unless 1 <= max_streams < workers and stream_idle_s > 0."""
        if not 1 <= self.max_streams < self.workers:
            raise ConfigError(f"the stream slots ({self.max_streams}) must be at least 1 and "
                              f"fewer than the worker threads ({self.workers}), so unary calls "
                              f"always have a thread")
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
    parser.add_argument("--stream-idle-s", type=float, default=DEFAULT_STREAM_IDLE_S,
                        help="cancel a stream whose peer sends no next message, or reads no "
                             "sent one, for this many seconds (default: %(default)s)")


def limits_of(args: argparse.Namespace) -> ServerLimits:
    """The `ServerLimits` given by `add_limit_options`' options. Raises ConfigError."""
    return ServerLimits(workers=args.workers, max_streams=args.max_streams,
                        stream_idle_s=args.stream_idle_s)


class StreamSlots(grpc.ServerInterceptor):
    """Enforces one server's `ServerLimits` on its streaming calls (every service, health too).

    A unary call passes untouched. A streaming call takes a slot when its thread starts it
    (none free: RESOURCE_EXHAUSTED, `ResourceLimitError`) and gives it back when the call's
    handler returns, fails or is closed; every wait on the peer for one message is bounded by
    `_IdleWatch`. A request stream that breaks off (cancelled by its client or by the idle
    watch) reaches the servicer as a `RequestError`, so it is no internal error in the log.
    """

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.max_streams)
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

    def _take(self, method: str, context: grpc.ServicerContext) -> None:
        """Take a slot, or abort the call with RESOURCE_EXHAUSTED when none is free."""
        if not self._slots.acquire(blocking=False):
            _abort(ResourceLimitError(f"{self.limits.max_streams} streaming calls are already "
                                      f"being served; try again later"), context, method)

    def _unary_response(self, method: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        def limited(requests, context):
            self._take(method, context)
            try:
                return behavior(self._received(method, requests, context), context)
            finally:
                self._slots.release()
        return limited

    def _stream_response(self, method: str, behavior: Callable[..., Any], *,
                         requests: bool) -> Callable[..., Any]:
        def limited(request, context):
            self._take(method, context)
            try:
                if requests:
                    request = self._received(method, request, context)
                for response in behavior(request, context):
                    with self._idle.waiting(method, context):  # gRPC sends it meanwhile
                        yield response
            finally:
                self._slots.release()
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
    """Cancels a call that has waited on its peer for one message longer than `idle_s`.

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
            _log.warning("%s: the peer sent or took nothing for %g s; call cancelled", method,
                         self.idle_s)
            context.cancel()

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


def build_server(listen: str, servicers: Sequence[AddServicer], *, tls_cert: Path | None,
                 tls_key: Path | None, allow_remote_plaintext: bool,
                 service_names: Sequence[str] = (),
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 limits: ServerLimits | None = None, health: HealthServicer | None = None
                 ) -> tuple[grpc.Server, int]:
    """A bound, not yet started server with the given servicers and the health service.

    `servicers` are functions adding one servicer each (e.g. a lambda over
    `ovt_pb2_grpc.add_ClaimsServicer_to_server`); `service_names` are reported SERVING by the
    health service, `health` (default: a new one) if the caller keeps it to report shutdown;
    `limits` (default: `ServerLimits()`) sets the worker threads and the stream slots.
    Returns (server, bound port); port 0 in `listen` binds an ephemeral port.
    Raises ConfigError for a malformed address, half a TLS pair, unreadable TLS files,
    plaintext on a non-loopback address without `allow_remote_plaintext`, or a failed bind.
    """
    host, _ = split_address(listen)
    credentials = _server_credentials(tls_cert, tls_key)
    if credentials is None and not is_loopback(host) and not allow_remote_plaintext:
        raise ConfigError(f"refusing plaintext gRPC on non-loopback address {listen}: give "
                          f"--tls-cert and --tls-key, or insist with "
                          f"--insecure-allow-remote-plaintext")
    limits = limits or ServerLimits()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=limits.workers,
                                                    thread_name_prefix="grpc"),
                         options=message_options(max_message_bytes),
                         interceptors=[StreamSlots(limits)])
    for add in servicers:
        add(server)
    health = health or make_health()
    for name in ("", *service_names):
        health.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    try:
        port = (server.add_secure_port(listen, credentials) if credentials is not None
                else server.add_insecure_port(listen))
    except RuntimeError as err:
        raise ConfigError(f"cannot listen on {listen}: {err}") from None
    if port == 0:
        raise ConfigError(f"cannot listen on {listen}")
    return server, port


def make_health() -> HealthServicer:
    """A health servicer for `build_server`, kept by a daemon to report its shutdown."""
    return HealthServicer()


def _server_credentials(tls_cert: Path | None, tls_key: Path | None):
    if tls_cert is None and tls_key is None:
        return None
    if tls_cert is None or tls_key is None:
        raise ConfigError("TLS needs both a certificate and a key (--tls-cert and --tls-key)")
    cert, key = _read(tls_cert, "TLS certificate"), _read(tls_key, "TLS key")
    return grpc.ssl_server_credentials([(key, cert)])


def make_channel(address: str, *, tls_ca: Path | None, allow_remote_plaintext: bool = False,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A channel to an ovt daemon: TLS checked against `tls_ca` (a CA or self-signed cert),
    else plaintext, which only a loopback address gets unless `allow_remote_plaintext`.
    Raises ConfigError for a malformed address, an unreadable CA file or refused plaintext."""
    host, _ = split_address(address)
    options = message_options(max_message_bytes)
    if tls_ca is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca, "TLS CA"))
        return grpc.secure_channel(address, credentials, options=options)
    if not is_loopback(host) and not allow_remote_plaintext:
        raise ConfigError(f"refusing plaintext gRPC to non-loopback address {address}: give "
                          f"--tls-ca, or insist with --insecure-allow-remote-plaintext")
    return grpc.insecure_channel(address, options=options)


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read {what} {path}: {err.strerror}") from None


def make_self_signed_cert(out_dir: Path, hostname: str = "localhost", *,
                          days: int = 365) -> tuple[Path, Path]:
    """Write `cert.pem` and `key.pem` (mode 0600) into `out_dir` for local TLS.

    The certificate (ECDSA P-256) names `hostname`, localhost, 127.0.0.1 and ::1, and is its own
    CA: clients pass cert.pem as their trust root. Returns (cert path, key path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    dns = dict.fromkeys([hostname, "localhost"])
    sans = [x509.DNSName(h) for h in dns if not _is_ip(h)] + \
        [x509.IPAddress(ipaddress.ip_address(h)) for h in dns if _is_ip(h)] + \
        [x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
         x509.IPAddress(ipaddress.ip_address("::1"))]
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = out / "cert.pem", out / "key.pem"
    key_bytes = key.private_bytes(serialization.Encoding.PEM,
                                  serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


# --- the one table from ovt's errors to gRPC status codes (SPEC §6: a peer's bad request is
# answered with a status that says what was wrong, never UNKNOWN) ---------------------------

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
                _abort(err, context, method.__name__)
        return stream

    @functools.wraps(method)
    def unary(self, request, context):
        try:
            return method(self, request, context)
        except Exception as err:  # noqa: BLE001 - mapped or logged, never lost
            _abort(err, context, method.__name__)
    return unary


def _abort(err: Exception, context: grpc.ServicerContext, rpc: str) -> None:
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
