"""Both daemons report NOT_SERVING on the standard health service as they begin to shut down,
so a client watching health hears it before the port closes, and then end the watch, so an open
watch does not hold the daemon up for its grace period (in-process nodes, 127.0.0.1)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from auditor_node.server import AuditorNode
from protocol.commit.keys import KeyPair
from protocol.engine.profiles import Profile
from trainer_node.server import TrainerConfig, TrainerNode

pytestmark = pytest.mark.network
STOP_S = 5.0  # the node's grace period: a watch left open would make the stop take that long
SERVING, NOT_SERVING = (health_pb2.HealthCheckResponse.SERVING,
                        health_pb2.HealthCheckResponse.NOT_SERVING)


def _trainer(tmp_path):
    return TrainerNode(TrainerConfig(listen="127.0.0.1:0", store=tmp_path, key=KeyPair.generate(),
                                     profile=Profile.parse("cpu-1t")))


def _auditor(tmp_path):
    return AuditorNode(tmp_path, KeyPair.generate(), Profile.parse("cpu-1t"),
                       listen="127.0.0.1:0")


@pytest.mark.parametrize("make", [_trainer, _auditor], ids=["trainer", "auditor"])
def test_health_turns_not_serving_when_the_daemon_stops(tmp_path, make):
    node = make(tmp_path)
    port = node.start()
    stopper = threading.Thread(target=node.stop)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert next(stream).status == SERVING
            started = time.monotonic()
            stopper.start()
            assert next(stream).status == NOT_SERVING
            assert next(stream, None) is None  # the watch ends with the daemon
            stopper.join(60)
            assert time.monotonic() - started < STOP_S
    finally:
        if not stopper.is_alive() and stopper.ident is None:
            node.stop()
        stopper.join(60)
    assert not stopper.is_alive()
