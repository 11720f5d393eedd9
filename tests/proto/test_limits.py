"""proto.limits: stream slots in all and per peer, and the idle watch's message (issue 10,
finding 5: one peer must not take every stream slot; a peer whose stream is ended is told why).

Two peers on one machine: TCP on 127.0.0.1 (peer `ipv4:127.0.0.1`) and a Unix socket (peer
`unix:`), both on one server, so no test needs IPv6 or a second host.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import ovt_pb2, ovt_pb2_grpc
from proto.limits import ServerLimits, peer_host
from proto.serving import build_server
from protocol.errors import ConfigError

pytestmark = pytest.mark.network

BOUND_S = 10.0  # no call in this module waits longer


@pytest.fixture
def two_peers(tmp_path):
    """Start a server with `limits` reachable as two peers; yields a function giving the two
    channels (TCP, Unix socket). Everything is closed after the test."""
    opened: list = []

    def serve(limits: ServerLimits) -> tuple[grpc.Channel, grpc.Channel]:
        server, port = build_server("127.0.0.1:0", [], tls_cert=None, tls_key=None,
                                    allow_remote_plaintext=False, limits=limits)
        socket = f"unix:{tmp_path / 'socket'}"
        server.add_insecure_port(socket)
        server.start()
        tcp, local = grpc.insecure_channel(f"127.0.0.1:{port}"), grpc.insecure_channel(socket)
        opened.append((server, tcp, local))
        return tcp, local

    try:
        yield serve
    finally:
        for server, *channels in opened:
            for channel in channels:
                channel.close()
            server.stop(grace=None).wait(BOUND_S)


def _watches(channel: grpc.Channel, count: int) -> tuple[list, list[grpc.RpcError]]:
    """Open `count` Health.Watch calls one after another: (those that sent their first report
    and stay open, the errors that refused the others)."""
    calls, refusals = [], []
    for _ in range(count):
        call = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=""), timeout=BOUND_S)
        try:
            next(call)
            calls.append(call)
        except grpc.RpcError as err:
            refusals.append(err)
    return calls, refusals


def test_one_peer_cannot_take_every_stream_slot(two_peers):
    """Finding 5's per-peer limit: 8 `Trainer.Watch` from one client took all 8 slots."""
    tcp, local = two_peers(ServerLimits(workers=8, max_streams=4, max_streams_per_peer=2))
    mine, (refused, *more) = _watches(tcp, 3)
    assert len(mine) == 2 and not more
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "ipv4:127.0.0.1 already holds 2" in refused.details()
    assert "--max-streams-per-peer" in refused.details()
    others, refusals = _watches(local, 2)  # the other peer still gets its share
    assert len(others) == 2 and not refusals, refusals
    for call in mine + others:
        call.cancel()


def test_every_slot_taken_refuses_any_peer_saying_so(two_peers):
    tcp, local = two_peers(ServerLimits(workers=8, max_streams=2, max_streams_per_peer=2))
    mine, refusals = _watches(tcp, 2)
    assert len(mine) == 2 and not refusals, refusals
    _, (refused,) = _watches(local, 1)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 streaming calls are already being served (--max-streams)" in refused.details()
    for call in mine:
        call.cancel()


def test_a_peers_slot_comes_back_when_its_stream_ends(two_peers):
    tcp, _ = two_peers(ServerLimits(workers=4, max_streams=2, max_streams_per_peer=1))
    (first,), (_refused,) = _watches(tcp, 2)
    first.cancel()
    deadline = time.monotonic() + BOUND_S  # the handler ends, and frees the slot, shortly after
    while not (again := _watches(tcp, 1)[0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(again) == 1
    again[0].cancel()


class _Drain(ovt_pb2_grpc.TrainerServicer):
    """A SubmitStream that reads every part its peer sends, and then answers."""

    def SubmitStream(self, request_iterator, context):
        for _ in request_iterator:
            pass
        return ovt_pb2.SubmitReply()


def test_a_stream_ended_by_the_idle_watch_says_it_was_idle(tmp_path):
    """The idle watch ended a stream with a bare CANCELLED: its peer could not tell why."""
    server, port = build_server(
        "127.0.0.1:0", [lambda s: ovt_pb2_grpc.add_TrainerServicer_to_server(_Drain(), s)],
        tls_cert=None, tls_key=None, allow_remote_plaintext=False,
        limits=ServerLimits(workers=2, max_streams=1, stream_idle_s=0.5))
    server.start()
    release = threading.Event()

    def parts():
        yield ovt_pb2.SubmitPart(spec=b"x")
        release.wait(BOUND_S)  # and then nothing

    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as ended:
                ovt_pb2_grpc.TrainerStub(channel).SubmitStream(parts(), timeout=BOUND_S)
            assert time.monotonic() - started < BOUND_S / 2
    finally:
        release.set()
        server.stop(grace=None).wait(BOUND_S)
    assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ended.value.details() == ("/ovt.v1.Trainer/SubmitStream: the peer sent or took "
                                     "nothing for 0.5 s (--stream-idle-s); the stream is ended")


@pytest.mark.parametrize("peer,host", [
    ("ipv4:127.0.0.1:50051", "ipv4:127.0.0.1"),
    ("ipv6:%5B::1%5D:34706", "ipv6:[::1]"),
    ("ipv6:[2001:db8::7]:443", "ipv6:[2001:db8::7]"),
    ("unix:", "unix:"),
    ("unix:/run/ovt.sock", "unix:/run/ovt.sock"),
    ("", "")])
def test_a_peer_is_its_address_without_the_port(peer, host):
    assert peer_host(peer) == host


def test_a_peer_needs_at_least_one_stream_slot():
    with pytest.raises(ConfigError, match="one peer must be at least 1"):
        ServerLimits(max_streams_per_peer=0)
