"""gRPC servers and channels for the ovt daemons: limits, health, TLS, and the loopback rule.

Every ovt daemon builds its server here, so all of them share one policy (issue 4):
- message sizes are bounded both ways (`max_message_bytes`); a bigger message is refused by gRPC
  with RESOURCE_EXHAUSTED before any servicer sees it;
- a request that is not its RPC's protobuf message is INVALID_ARGUMENT, with no log line
  (`proto.status.DecodedRequests`), where grpcio would answer INTERNAL and log a traceback;
- streaming calls share a bounded number of slots, fewer than the worker threads, and one
  peer may hold only its share of them, so a peer holding streams open (or stalling them)
  never takes the threads unary calls such as GetLeaf need, nor every other peer's streams
  (`ServerLimits`, enforced by `StreamSlots` before any servicer runs);
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

import datetime
import ipaddress
import os
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.health import HealthServicer
from proto.limits import ServerLimits, StreamSlots
from proto.status import DecodedRequests
from protocol.errors import (
    ConfigError,
)

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
HEALTH_SERVICE = "grpc.health.v1.Health"

AddServicer = Callable[[grpc.Server], None]


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
                         interceptors=[DecodedRequests(), StreamSlots(limits)])
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


