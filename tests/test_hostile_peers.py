"""Hostile peers against real daemons (issue 10, findings 1 and 5): Health.Watch open/cancel
storms and stalled streams must never keep an honest GetLeaf from answering within a second
(a party that cannot answer loses its dispute by timeout, SPEC §5.2), nor a daemon from stopping.

The daemons are in-process `TrainerNode`s and `AuditorNode`s on 127.0.0.1 (ephemeral ports),
each with a finished tiny job in its store so GetLeaf has something to answer. Every wait is
bounded, and every thread, channel and node a test starts is stopped before it ends.
`bench/hostile_watch.py` runs the issue's full criterion (10,000 cycles, real processes).
"""

from __future__ import annotations

import hashlib
import itertools
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import msgpack
import pytest
import safetensors.torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arbiter.adjudicate import adjudicate
from arbiter.parties import RemoteParty
from auditor_node.cli import main as auditor_main
from auditor_node.server import AuditorNode
from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory
from proto.limits import DEFAULT_MAX_STREAMS, DEFAULT_MAX_STREAMS_PER_PEER, ServerLimits
from proto.serving import build_server
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.errors import ConfigError
from protocol.job.create import build_job
from protocol.job.run import StepHooks, run_job
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore
from trainer_node.cli import main as trainer_main
from trainer_node.server import TrainerConfig, TrainerNode

pytestmark = pytest.mark.network

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
STEPS = 4
CLIENTS = 16
STORM_CYCLES = 500
ANSWER_S = 1.0  # an honest unary call answers within this (the criterion)
STOP_S = 5.0  # and a daemon stops within this
BOUND_S = 60.0  # no test waits longer than this for anything
SERVING = health_pb2.HealthCheckResponse.SERVING


def _job(init_seed: int) -> tuple[JobSpec, dict]:
    return build_job(program="image-cnn", config=TINY, preset=None, steps=STEPS, seed=0,
                     init_seed=init_seed, policy=PrecisionPolicy(), checkpoint_interval=2,
                     commit_interval=2)


def _queued(daemon, init_seed: int) -> JobSpec:
    """A job submitted to a trainer daemon whose runner is not started: it stays queued."""
    queued, state0 = _job(init_seed=init_seed)
    with grpc.insecure_channel(daemon.address) as channel:
        ovt_pb2_grpc.TrainerStub(channel).Submit(ovt_pb2.SubmitRequest(
            spec=queued.to_bytes(), initial_state=safetensors.torch.save(state0)),
            timeout=BOUND_S)
    return queued


@dataclass(frozen=True)
class Finished:
    spec: JobSpec
    root: Path  # a store root holding the job, trained and committed


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Finished:
    spec, state0 = _job(init_seed=1)
    root = tmp_path_factory.mktemp("finished")
    store = JobStore(root, spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-1t"))
    store.close()
    return Finished(spec, root)


class Daemon:
    """A node over a copy of the finished job's store; `stop` is bounded and runs once.

    It listens on 127.0.0.1 (`address`) and on a Unix socket (`local`, a path in
    `socket_dir`): two peers (`ipv4:127.0.0.1`, `unix:`) for the per-peer stream limit."""

    def __init__(self, kind: str, tmp_path: Path, finished: Finished, limits: ServerLimits,
                 socket_dir: Path, start_runner: bool = True) -> None:
        root = tmp_path / kind
        shutil.copytree(finished.root, root)
        self.job_id = finished.spec.job_id
        if kind == "trainer":
            self.node: TrainerNode | AuditorNode = TrainerNode(TrainerConfig(
                listen="127.0.0.1:0", store=root, key=KeyPair.generate(),
                profile=Profile.parse("cpu-1t"), limits=limits))
        else:
            self.node = AuditorNode(root, KeyPair.generate(), Profile.parse("cpu-1t"),
                                    listen="127.0.0.1:0", limits=limits)
        self.local = f"unix:{socket_dir / kind}"  # a short path: sockets' are at most 107 bytes
        self.node.server.add_insecure_port(self.local)
        if start_runner:
            self.port = self.node.start()
        else:  # serve only: a submitted job stays queued, so its Watch streams stay open
            self.node.server.start()
            self.port = self.node.port
        self.address = f"127.0.0.1:{self.port}"
        self._stopper: threading.Thread | None = None

    def stop(self, within: float = BOUND_S) -> float:
        """Stop the node; the seconds it took, or infinity if it has not stopped `within`
        seconds (a later call waits for the same stop)."""
        started = time.monotonic()
        if self._stopper is None:  # a daemon thread: a hung node cannot hang pytest
            self._stopper = threading.Thread(target=self.node.stop, name="stop-node",
                                             daemon=True)
            self._stopper.start()
        self._stopper.join(within)
        return float("inf") if self._stopper.is_alive() else time.monotonic() - started


@pytest.fixture
def daemons(tmp_path, finished):
    """Makes `Daemon`s (kind, limits=...), stopped after the test."""
    made: list[Daemon] = []
    sockets = tempfile.TemporaryDirectory(prefix="ovt-")

    def make(kind: str, limits: ServerLimits | None = None, job: Finished | None = None,
             **kwargs) -> Daemon:
        """A daemon over a copy of `job`'s store (default: the module's finished job)."""
        made.append(Daemon(kind, tmp_path, job or finished, limits or ServerLimits(),
                           Path(sockets.name), **kwargs))
        return made[-1]

    try:
        yield make
    finally:
        for daemon in made:
            daemon.stop()
        sockets.cleanup()


def _get_leaf_seconds(daemon: Daemon, address: str | None = None) -> float:
    """How long an honest GetLeaf (step 1, with its proof) takes on a fresh channel to
    `address` (default: the daemon's TCP one), connecting included; fails the test if it does
    not answer within ANSWER_S."""
    started = time.monotonic()
    with grpc.insecure_channel(address or daemon.address) as channel:
        reply = ovt_pb2_grpc.ClaimsStub(channel).GetLeaf(
            ovt_pb2.StepRef(job_id=daemon.job_id, step=1), timeout=ANSWER_S)
        seconds = time.monotonic() - started
    assert reply.step == 1
    return seconds


def _watch_health(stub: health_pb2_grpc.HealthStub) -> grpc.StatusCode | None:
    """Open a Health.Watch, read its first report, cancel it: None if it reported SERVING,
    else the status code it ended with."""
    call = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    try:
        return None if next(call).status == SERVING else grpc.StatusCode.UNKNOWN
    except grpc.RpcError as err:
        return err.code()
    finally:
        call.cancel()


def health_watch_storm(address: str, cycles: int, clients: int = CLIENTS) -> Counter:
    """`cycles` Health.Watch open/cancel cycles from `clients` threads (one channel each);
    the count of each outcome: "serving", or the name of the status a call ended with.
    Every thread ends within BOUND_S (each call has a deadline)."""
    outcomes: Counter = Counter()
    left = [cycles]
    lock = threading.Lock()

    def client() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                with lock:
                    if left[0] == 0:
                        return
                    left[0] -= 1
                code = _watch_health(stub)
                with lock:
                    outcomes["serving" if code is None else code.name] += 1

    threads = [threading.Thread(target=client, name=f"storm-{n}", daemon=True)
               for n in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + BOUND_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), f"storm hung: {outcomes}"
    return outcomes


@pytest.mark.parametrize("kind", ["trainer", "auditor"])
def test_health_watch_cancel_storm_leaves_get_leaf_answering_and_the_daemon_stopping(
        daemons, kind):
    """Finding 1: grpc_health's servicer hung the daemon within 2 s of such a storm."""
    daemon = daemons(kind)
    outcomes = health_watch_storm(daemon.address, STORM_CYCLES)
    # a watch beyond the stream slots is refused at once; nothing else may happen
    assert set(outcomes) <= {"serving", "RESOURCE_EXHAUSTED"}, outcomes
    assert outcomes["serving"] >= DEFAULT_MAX_STREAMS_PER_PEER, outcomes
    assert _get_leaf_seconds(daemon) < ANSWER_S
    assert daemon.stop(within=STOP_S) < STOP_S


class _Stalled:
    """Streams a test opens and leaves stalled; `close` cancels them and ends their threads."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.release = threading.Event()  # ends every stalled request stream
        self.calls: list = []

    def submit_spec_only(self, spec: bytes, timeout: float = BOUND_S):
        """A SubmitStream that sends the spec and then nothing; its future."""
        def parts() -> Iterator[ovt_pb2.SubmitPart]:
            yield ovt_pb2.SubmitPart(spec=spec)
            self.release.wait(BOUND_S)

        call = ovt_pb2_grpc.TrainerStub(self.channel).SubmitStream.future(parts(),
                                                                           timeout=timeout)
        self.calls.append(call)
        return call

    def watch(self, job_id: bytes):
        """A Trainer.Watch left open after its first report; the call."""
        call = ovt_pb2_grpc.TrainerStub(self.channel).Watch(ovt_pb2.JobRef(job_id=job_id),
                                                            timeout=BOUND_S)
        self.calls.append(call)
        return call

    def close(self) -> None:
        for call in self.calls:
            call.cancel()
        self.release.set()
        self.channel.close()


@pytest.fixture
def stalled():
    opened: list[_Stalled] = []

    def open_on(daemon: Daemon) -> _Stalled:
        opened.append(_Stalled(daemon.address))
        return opened[-1]

    try:
        yield open_on
    finally:
        for streams in opened:
            streams.close()


def _first_reports(streams: list) -> Counter:
    """For each response stream: "open" once it has sent its first message, else the name of
    the status it ended with (each within its own deadline)."""
    outcomes: Counter = Counter()
    for stream in streams:
        try:
            next(stream)
            outcomes["open"] += 1
        except grpc.RpcError as err:
            outcomes[err.code().name] += 1
    return outcomes


def _unary_outcomes(calls: list, settle_s: float) -> Counter:
    """For each call with a unary response: "open" if it is still running `settle_s` seconds
    from now, "OK", or the name of the status it ended with."""
    deadline = time.monotonic() + settle_s
    outcomes: Counter = Counter()
    for call in calls:
        try:
            call.result(timeout=max(0.0, deadline - time.monotonic()))
            outcomes["OK"] += 1
        except grpc.FutureTimeoutError:
            outcomes["open"] += 1
        except grpc.RpcError as err:
            outcomes[err.code().name] += 1
    return outcomes


def test_16_stalled_streams_leave_get_leaf_answering(daemons, stalled):
    """Finding 5: 8 SubmitStreams sending a spec and then nothing, and 8 Watch streams left
    open, took every worker thread of the trainer, and GetLeaf timed out. From one peer, only
    its share of the stream slots is taken."""
    daemon = daemons("trainer", start_runner=False)
    queued = _queued(daemon, init_seed=2)
    streams = stalled(daemon)
    watches = [streams.watch(queued.job_id) for _ in range(CLIENTS // 2)]
    submits = [streams.submit_spec_only(queued.to_bytes()) for _ in range(CLIENTS // 2)]
    outcomes = _first_reports(watches) + _unary_outcomes(submits, settle_s=2.0)
    assert _get_leaf_seconds(daemon) < ANSWER_S
    assert outcomes == {"open": DEFAULT_MAX_STREAMS_PER_PEER,  # the others are refused at once
                        "RESOURCE_EXHAUSTED": CLIENTS - DEFAULT_MAX_STREAMS_PER_PEER}, outcomes


def test_8_watches_from_one_peer_leave_another_peers_watch_and_get_leaf_answering(daemons,
                                                                                 stalled):
    """Finding 5's per-peer limit: 8 `ovt-trainer status --watch` from one client took every
    stream slot of the trainer, so no other peer could open a stream."""
    daemon = daemons("trainer", start_runner=False)
    queued = _queued(daemon, init_seed=4)
    streams = stalled(daemon)
    outcomes = _first_reports([streams.watch(queued.job_id) for _ in range(DEFAULT_MAX_STREAMS)])
    assert outcomes == {"open": DEFAULT_MAX_STREAMS_PER_PEER, "RESOURCE_EXHAUSTED":
                        DEFAULT_MAX_STREAMS - DEFAULT_MAX_STREAMS_PER_PEER}, outcomes
    other = _Stalled(daemon.local)  # another peer: its own share of the slots
    try:
        assert _first_reports([other.watch(queued.job_id)]) == {"open": 1}
        assert _get_leaf_seconds(daemon, daemon.local) < ANSWER_S
    finally:
        other.close()


@pytest.mark.parametrize("kind", ["trainer", "auditor"])
def test_16_health_watches_left_open_leave_get_leaf_answering(daemons, kind):
    daemon = daemons(kind)
    with grpc.insecure_channel(daemon.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        calls = [stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=BOUND_S)
                 for _ in range(CLIENTS)]
        try:
            outcomes = _first_reports(calls)
            assert _get_leaf_seconds(daemon) < ANSWER_S
            assert outcomes == {"open": DEFAULT_MAX_STREAMS_PER_PEER, "RESOURCE_EXHAUSTED":
                                CLIENTS - DEFAULT_MAX_STREAMS_PER_PEER}, outcomes
        finally:
            for call in calls:
                call.cancel()


def test_stalled_submit_stream_ends_by_the_idle_timeout_and_frees_its_slot(daemons,
                                                                           stalled):
    idle_s = 0.5
    daemon = daemons("trainer", ServerLimits(workers=2, max_streams=1, stream_idle_s=idle_s))
    started = time.monotonic()
    submit = stalled(daemon).submit_spec_only(_job(init_seed=3)[0].to_bytes(), timeout=10)
    assert _unary_outcomes([submit], settle_s=BOUND_S) == {"RESOURCE_EXHAUSTED": 1}
    assert "sent or took nothing for 0.5 s" in submit.exception().details()
    assert idle_s <= time.monotonic() - started < idle_s + 5
    with grpc.insecure_channel(daemon.address) as channel:  # the one slot is free again
        assert _watch_health(health_pb2_grpc.HealthStub(channel)) is None


class _Flood(ClaimsServicer):
    """Claims whose GetCheckpoint streams 1 MiB chunks without end: more than a client
    buffers, so gRPC's send waits on a client that does not read."""

    def GetCheckpoint(self, request, context):
        while True:
            yield ovt_pb2.Chunk(data=bytes(1 << 20))


def test_response_stream_whose_client_stops_reading_ends_by_the_idle_timeout(tmp_path):
    flood = _Flood(StoreDirectory(tmp_path))
    server, port = build_server(
        "127.0.0.1:0", [lambda s: ovt_pb2_grpc.add_ClaimsServicer_to_server(flood, s)],
        tls_cert=None, tls_key=None, allow_remote_plaintext=False,
        limits=ServerLimits(workers=2, max_streams=1, stream_idle_s=0.5))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = ovt_pb2_grpc.ClaimsStub(channel)
            ref = ovt_pb2.StepRef(job_id=bytes(32), step=0)
            unread = stub.GetCheckpoint(ref, timeout=BOUND_S)
            time.sleep(2.0)  # not reading: the server's send waits, then gives up
            with pytest.raises(grpc.RpcError) as ended:
                list(itertools.islice(unread, 64))  # what was buffered, then the end
            assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "sent or took nothing for 0.5 s" in ended.value.details()
            reader = stub.GetCheckpoint(ref, timeout=BOUND_S)  # the one slot is free again
            assert len(next(reader).data) == 1 << 20
            reader.cancel()
    finally:
        server.stop(grace=None).wait(BOUND_S)


@pytest.mark.parametrize("workers,streams,idle_s", [(8, 8, 30.0), (8, 0, 30.0), (16, 8, 0.0)])
def test_stream_slots_leave_threads_for_unary_calls(workers, streams, idle_s):
    with pytest.raises(ConfigError):
        ServerLimits(workers=workers, max_streams=streams, stream_idle_s=idle_s)


def test_the_limits_are_options_of_both_serve_commands(capsys):
    for main in (trainer_main, auditor_main):
        with pytest.raises(SystemExit):
            main(["serve", "--help"])
        text = capsys.readouterr().out
        assert all(option in text for option in ("--max-streams", "--max-streams-per-peer",
                                                 "--stream-idle-s", "--workers"))


def test_serve_refuses_stream_slots_that_leave_no_thread(tmp_path, capsys):
    key = tmp_path / "key"
    KeyPair.generate().save(key)
    assert trainer_main(["serve", "--listen", "127.0.0.1:0", "--store", str(tmp_path / "s"),
                         "--key", str(key), "--workers", "8", "--max-streams", "8"]) == 2
    assert "fewer than the worker threads" in capsys.readouterr().err


# -- every streaming RPC left unread, from two peers -------------------------------------------

def _unread_streams(daemon: Daemon, address: str, rpc: str, job_id: bytes) -> list:
    """CLIENTS calls of `rpc` to `address`, none of them read: each holds its stream (a slot)
    for as long as the server has something to send or waits; the calls, to cancel."""
    channel = grpc.insecure_channel(address)
    claims, trainer = ovt_pb2_grpc.ClaimsStub(channel), ovt_pb2_grpc.TrainerStub(channel)
    auditor, health = ovt_pb2_grpc.AuditorStub(channel), health_pb2_grpc.HealthStub(channel)
    open_call = {
        "Claims.GetCheckpoint": lambda: claims.GetCheckpoint(
            ovt_pb2.StepRef(job_id=daemon.job_id, step=STEPS), timeout=BOUND_S),
        "Claims.GetLeaves": lambda: claims.GetLeaves(
            ovt_pb2.StepRange(job_id=daemon.job_id, first=0, last=STEPS), timeout=BOUND_S),
        "Health.Watch": lambda: health.Watch(health_pb2.HealthCheckRequest(service=""),
                                             timeout=BOUND_S),
        "Trainer.Watch": lambda: trainer.Watch(ovt_pb2.JobRef(job_id=job_id), timeout=BOUND_S),
        "Auditor.WatchAudit": lambda: auditor.WatchAudit(ovt_pb2.JobRef(job_id=job_id),
                                                         timeout=BOUND_S),
    }[rpc]
    calls = [open_call() for _ in range(CLIENTS)]
    calls.append(channel)  # closed with them
    return calls


STREAMING_RPCS = [("trainer", "Claims.GetCheckpoint"), ("trainer", "Claims.GetLeaves"),
                  ("trainer", "Health.Watch"), ("trainer", "Trainer.Watch"),
                  ("auditor", "Claims.GetCheckpoint"), ("auditor", "Claims.GetLeaves"),
                  ("auditor", "Health.Watch"), ("auditor", "Auditor.WatchAudit")]


@pytest.mark.parametrize("kind,rpc", STREAMING_RPCS)
def test_unread_streams_of_every_streaming_rpc_from_two_peers_leave_get_leaf_answering(
        daemons, kind, rpc):
    """Finding 5 on every streaming RPC (SubmitStream: the stalled-stream tests above): 16
    calls left unread from each of two peers. A queued job (a queued audit) keeps Watch
    (WatchAudit) open: the daemon serves without training or auditing."""
    daemon = daemons(kind, start_runner=False)
    if kind == "trainer":
        queued = _queued(daemon, init_seed=5)
    else:
        queued, _ = _job(init_seed=5)
        with grpc.insecure_channel(daemon.address) as channel:
            ovt_pb2_grpc.AuditorStub(channel).Audit(ovt_pb2.AuditRequest(
                job_id=queued.job_id, trainer_address="127.0.0.1:9"), timeout=BOUND_S)
    calls = []
    try:
        for address in (daemon.address, daemon.local):
            calls += _unread_streams(daemon, address, rpc, queued.job_id)
            time.sleep(0.2)  # the server has taken them in
            assert _get_leaf_seconds(daemon) < ANSWER_S
            assert _get_leaf_seconds(daemon, daemon.local) < ANSWER_S
    finally:
        for call in calls:
            (call.close if isinstance(call, grpc.Channel) else call.cancel)()
    assert daemon.stop(within=STOP_S) < STOP_S


# -- oversized and undecodable requests ----------------------------------------------------------

@pytest.mark.parametrize("kind", ["trainer", "auditor"])
def test_oversized_and_undecodable_requests_are_refused_and_get_leaf_still_answers(daemons,
                                                                                   kind):
    daemon = daemons(kind)
    with grpc.insecure_channel(daemon.address,
                               options=[("grpc.max_send_message_length", 128 << 20)]) as channel:
        with pytest.raises(grpc.RpcError) as oversized:
            ovt_pb2_grpc.ClaimsStub(channel).GetSpec(ovt_pb2.JobRef(job_id=bytes(65 << 20)),
                                                     timeout=BOUND_S)
        assert oversized.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        full = ovt_pb2.StepRef(job_id=daemon.job_id, step=1).SerializeToString()
        for cut in (1, 2, len(full) - 1):  # truncated: a field's length runs past the end
            with pytest.raises(grpc.RpcError) as truncated:
                channel.unary_unary("/ovt.v1.Claims/GetLeaf")(full[:cut], timeout=BOUND_S)
            assert truncated.value.code() == grpc.StatusCode.INVALID_ARGUMENT, cut
    assert _get_leaf_seconds(daemon) < ANSWER_S


# -- the aliased spec ------------------------------------------------------------------------------

def _aliased(spec: JobSpec) -> bytes:
    """The spec's bytes with protocol_version 1 written as True: another job id X, decoding
    (before issue 10) to the real job."""
    body = msgpack.unpackb(spec.to_bytes(), raw=False, strict_map_key=False)
    body["protocol_version"] = True
    return msgpack.packb(body, use_bin_type=True)


class _AliasServer(ClaimsServicer):
    """A hostile trainer: GetSpec of the alias's job id answers the alias's bytes."""

    def __init__(self, stores: StoreDirectory, alias: bytes) -> None:
        super().__init__(stores)
        self.alias = alias

    def GetSpec(self, request, context):
        return ovt_pb2.SpecReply(spec=self.alias)


def test_an_aliased_spec_is_refused_and_the_real_jobs_store_is_untouched(daemons, finished):
    """Finding 3: an auditor asked to audit X at a trainer serving the alias replayed into
    Y's store and deleted Y's challenge."""
    auditor = daemons("auditor")  # holds the real job Y, audited
    alias = _aliased(finished.spec)
    alias_id = hashlib.sha256(alias).digest()
    assert alias_id != finished.spec.job_id
    before = sorted((p, p.stat().st_mtime_ns) for p in Path(auditor.node.runner.store_root)
                    .rglob("*") if p.is_file())
    hostile = _AliasServer(StoreDirectory(finished.root), alias)
    server, port = build_server(
        "127.0.0.1:0", [lambda s: ovt_pb2_grpc.add_ClaimsServicer_to_server(hostile, s)],
        tls_cert=None, tls_key=None, allow_remote_plaintext=False)
    server.start()
    try:
        with grpc.insecure_channel(auditor.address) as channel:
            stub = ovt_pb2_grpc.AuditorStub(channel)
            stub.Audit(ovt_pb2.AuditRequest(job_id=alias_id,
                                            trainer_address=f"127.0.0.1:{port}"),
                       timeout=BOUND_S)
            report = list(stub.WatchAudit(ovt_pb2.JobRef(job_id=alias_id), timeout=BOUND_S))[-1]
    finally:
        server.stop(grace=None).wait(BOUND_S)
    assert report.state == "failed" and "spec" in report.error, report
    after = sorted((p, p.stat().st_mtime_ns) for p in Path(auditor.node.runner.store_root)
                   .rglob("*") if p.is_file())
    assert after == before
    assert _get_leaf_seconds(auditor) < ANSWER_S


# -- the undecodable log -----------------------------------------------------------------------

class _UndecodableLog(StepHooks):
    """A trainer that commits to a rounding log that does not decode at one step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after(self, t, ex, log):
        return ex.state(), (b"not a rounding log" if t == self.step else log)


def test_an_undecodable_log_is_challenged_by_the_auditor_daemon_and_ruled_invalid_log(
        daemons, tmp_path_factory):
    """Finding 2, against real daemons: the audit ended FAILED with no challenge, so the
    cheat escaped although the arbiter would rule invalid-log."""
    cheat_step = 3
    spec, state0 = _job(init_seed=6)
    root = tmp_path_factory.mktemp("cheater")
    store = JobStore(root, spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-1t"),
            hooks=_UndecodableLog(cheat_step))
    store.close()
    trainer = daemons("trainer", job=Finished(spec, root))
    auditor = AuditorNode(tmp_path_factory.mktemp("auditor"), KeyPair.generate(),
                          Profile.parse("emulated-gpu"), listen="127.0.0.1:0")
    auditor_port = auditor.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{auditor_port}") as a_channel, \
                grpc.insecure_channel(trainer.address) as t_channel:
            stub = ovt_pb2_grpc.AuditorStub(a_channel)
            stub.Audit(ovt_pb2.AuditRequest(job_id=spec.job_id,
                                            trainer_address=trainer.address), timeout=BOUND_S)
            report = list(stub.WatchAudit(ovt_pb2.JobRef(job_id=spec.job_id),
                                          timeout=BOUND_S))[-1]
            assert (report.state, report.divergent_step) == ("diverged", cheat_step), report
            challenge = Challenge.from_bytes(stub.GetChallenge(
                ovt_pb2.JobRef(job_id=spec.job_id), timeout=BOUND_S).challenge)
            verdict = adjudicate(spec, challenge, RemoteParty("trainer", t_channel, spec),
                                 RemoteParty("auditor", a_channel, spec), key=KeyPair.generate(),
                                 profile=Profile.parse("cpu-1t"), deadline_s=5.0).verdict
        assert (verdict.fault, verdict.finding, verdict.step) == \
            ("trainer", "invalid-log", cheat_step)
        assert _get_leaf_seconds(trainer) < ANSWER_S
    finally:
        auditor.stop(grace_s=0)
