"""proto.serving: health, message limits, TLS with a self-signed cert, the loopback rule."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory
from proto.serving import (
    build_server,
    is_loopback,
    make_channel,
    make_self_signed_cert,
    split_address,
)
from protocol.errors import ConfigError

pytestmark = pytest.mark.network


def _claims(tmp_path):
    servicer = ClaimsServicer(StoreDirectory(tmp_path))
    return lambda server: ovt_pb2_grpc.add_ClaimsServicer_to_server(servicer, server)


def _serve(tmp_path, **kwargs):
    options = {"tls_cert": None, "tls_key": None, "allow_remote_plaintext": False} | kwargs
    server, port = build_server("127.0.0.1:0", [_claims(tmp_path)],
                                service_names=["ovt.v1.Claims"], **options)
    server.start()
    return server, port


def _health(channel, service=""):
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_plaintext_loopback_health_and_not_found(tmp_path):
    server, port = _serve(tmp_path)
    try:
        with make_channel(f"127.0.0.1:{port}", tls_ca=None) as channel:
            assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
            assert _health(channel, "ovt.v1.Claims") == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                ovt_pb2_grpc.ClaimsStub(channel).GetSpec(ovt_pb2.JobRef(job_id=b"\0" * 32),
                                                         timeout=10)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        server.stop(grace=None)


def test_tls_with_self_signed_cert(tmp_path):
    cert, key = make_self_signed_cert(tmp_path / "tls")
    assert oct(key.stat().st_mode & 0o777) == "0o600"
    server, port = _serve(tmp_path, tls_cert=cert, tls_key=key)
    try:
        for host in ("127.0.0.1", "localhost"):
            with make_channel(f"{host}:{port}", tls_ca=cert) as channel:
                assert _health(channel, "ovt.v1.Claims") == \
                    health_pb2.HealthCheckResponse.SERVING
        with make_channel(f"127.0.0.1:{port}", tls_ca=None) as channel:  # plaintext to TLS
            with pytest.raises(grpc.RpcError):
                _health(channel)
        other, _ = make_self_signed_cert(tmp_path / "other")
        with make_channel(f"127.0.0.1:{port}", tls_ca=other) as channel:  # untrusted cert
            with pytest.raises(grpc.RpcError) as err:
                _health(channel)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace=None)


def test_oversized_message_is_resource_exhausted_and_server_keeps_serving(tmp_path):
    server, port = _serve(tmp_path, max_message_bytes=1 << 20)
    try:
        with make_channel(f"127.0.0.1:{port}", tls_ca=None, max_message_bytes=8 << 20) as ch:
            stub = ovt_pb2_grpc.ClaimsStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetSpec(ovt_pb2.JobRef(job_id=b"\0" * (2 << 20)), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert _health(ch) == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(grace=None)


def test_plaintext_refused_off_loopback(tmp_path):
    with pytest.raises(ConfigError, match="insecure-allow-remote-plaintext"):
        build_server("0.0.0.0:0", [], tls_cert=None, tls_key=None,
                     allow_remote_plaintext=False)
    with pytest.raises(ConfigError, match="both"):
        build_server("127.0.0.1:0", [], tls_cert=tmp_path / "c.pem", tls_key=None,
                     allow_remote_plaintext=False)
    with pytest.raises(ConfigError, match="cannot read"):
        build_server("127.0.0.1:0", [], tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "k",
                     allow_remote_plaintext=False)
    with pytest.raises(ConfigError):
        make_channel("192.0.2.1:443", tls_ca=None)
    server, port = build_server("0.0.0.0:0", [], tls_cert=None, tls_key=None,
                                allow_remote_plaintext=True)
    assert port > 0
    server.stop(grace=None)


@pytest.mark.parametrize("host,expected", [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("localhost", True),
    ("LOCALHOST", True), ("0.0.0.0", False), ("::", False), ("10.0.0.1", False),
    ("example.com", False)])
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


@pytest.mark.parametrize("address", ["127.0.0.1", ":80", "host:", "host:x", "h:70000", ""])
def test_bad_addresses(address):
    with pytest.raises(ConfigError):
        split_address(address)


def test_ipv6_address():
    assert split_address("[::1]:50051") == ("::1", 50051)
