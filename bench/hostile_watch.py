"""Issue 10's criterion for finding 1, against real daemon processes: Health.Watch storms.

Starts `ovt-trainer serve` and `ovt-auditor serve` as processes on 127.0.0.1 (`python -m
trainer_node.cli serve`, `python -m auditor_node.cli serve`, default limits), each over a store
holding one finished tiny job, and against each in turn:

1. `--cycles` (default 10,000) Health.Watch open/cancel cycles from `--clients` (16) threads,
   one channel each: open a Watch, read its first report, cancel it. A watch beyond the
   daemon's stream slots is refused at once (RESOURCE_EXHAUSTED); every outcome is counted;
2. `--probes` honest GetLeaf calls (step 1 with its proof), each on a fresh channel, its connect
   included, with a 1 s deadline: their median and worst latency;
3. SIGTERM, and the seconds until the process has exited.

Prints one block per daemon and PASS/MISS against the issue's bounds (GetLeaf under 1 s, stop
within 5 s); exits 1 on a miss. Before issue 10 the first daemon hung within 2 s of the storm.

    python bench/hostile_watch.py [--cycles 10000] [--clients 16] [--probes 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto import ovt_pb2, ovt_pb2_grpc
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from protocol.job.run import run_job
from protocol.job.store import JobStore

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
ANSWER_S, STOP_S = 1.0, 5.0  # the bounds
START_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 10.0
MODULES = {"trainer": "trainer_node.cli", "auditor": "auditor_node.cli"}


def finished_job(root: Path) -> bytes:
    """Train and commit a 4-step tiny job into the store under `root`; its job id."""
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=4, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=2,
                             commit_interval=2)
    store = JobStore(root, spec)
    store.put_initial(state0)
    run_job(store, KeyPair.generate(), profile=Profile.parse("cpu-1t"))
    store.close()
    return spec.job_id


def launch(kind: str, store: Path, work: Path) -> tuple[subprocess.Popen, str]:
    """Start one daemon; (process, address) once it has written its port."""
    key, port_file, log = work / f"{kind}.key", work / f"{kind}.port", work / f"{kind}.log"
    KeyPair.generate().save(key)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULES[kind], "serve", "--listen", "127.0.0.1:0",
             "--store", str(store), "--key", str(key), "--profile", "cpu-1t",
             "--port-file", str(port_file)], stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{kind} did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    return proc, f"127.0.0.1:{int(port_file.read_text())}"


def storm(address: str, cycles: int, clients: int) -> tuple[float, Counter]:
    """`cycles` Watch open/cancel cycles from `clients` threads: (seconds, outcome counts)."""
    outcomes: Counter = Counter()
    left, lock = [cycles], threading.Lock()

    def client() -> None:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                with lock:
                    if not left[0]:
                        return
                    left[0] -= 1
                call = stub.Watch(health_pb2.HealthCheckRequest(service=""),
                                  timeout=CALL_TIMEOUT_S)
                try:
                    outcome = health_pb2.HealthCheckResponse.ServingStatus.Name(
                        next(call).status)
                except grpc.RpcError as err:
                    outcome = err.code().name
                finally:
                    call.cancel()
                with lock:
                    outcomes[outcome] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()  # every call has a deadline, so every thread ends
    return time.monotonic() - started, outcomes


def get_leaf_seconds(address: str, job_id: bytes) -> float:
    """One honest GetLeaf on a fresh channel (connect included); infinity past ANSWER_S."""
    started = time.monotonic()
    try:
        with grpc.insecure_channel(address) as channel:
            ovt_pb2_grpc.ClaimsStub(channel).GetLeaf(ovt_pb2.StepRef(job_id=job_id, step=1),
                                                     timeout=ANSWER_S)
    except grpc.RpcError:
        return float("inf")
    return time.monotonic() - started


def sigterm_seconds(proc: subprocess.Popen) -> tuple[float, int | None]:
    """SIGTERM, then (seconds until exit, exit code); (infinity, None) if not within 30 s."""
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        return float("inf"), None
    return time.monotonic() - started, rc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--probes", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    results, procs = {}, []
    with tempfile.TemporaryDirectory(prefix="ovt-hostile-watch-") as tmp:
        work = Path(tmp)
        job_id = finished_job(work / "trainer-store")
        shutil.copytree(work / "trainer-store", work / "auditor-store")
        try:
            for kind in MODULES:
                proc, address = launch(kind, work / f"{kind}-store", work)
                procs.append(proc)
                seconds, outcomes = storm(address, args.cycles, args.clients)
                leaf = [get_leaf_seconds(address, job_id) for _ in range(args.probes)]
                stop_s, rc = sigterm_seconds(proc)
                results[kind] = {"cycles": args.cycles, "clients": args.clients,
                                 "storm_s": seconds, "outcomes": dict(outcomes),
                                 "get_leaf_median_s": statistics.median(leaf),
                                 "get_leaf_max_s": max(leaf), "sigterm_stop_s": stop_s,
                                 "exit_code": rc}
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
    ok = True
    for kind, r in results.items():
        passed = r["get_leaf_max_s"] < ANSWER_S and r["sigterm_stop_s"] < STOP_S
        ok &= passed
        print(f"{kind}: {r['cycles']} Health.Watch open/cancel cycles from {r['clients']} "
              f"clients in {r['storm_s']:.1f} s ({r['cycles'] / r['storm_s']:.0f}/s); "
              f"outcomes {r['outcomes']}\n"
              f"  GetLeaf after the storm: median {r['get_leaf_median_s'] * 1e3:.1f} ms, "
              f"max {r['get_leaf_max_s'] * 1e3:.1f} ms over {args.probes} calls "
              f"(bound {ANSWER_S:g} s)\n"
              f"  SIGTERM to exit: {r['sigterm_stop_s']:.2f} s, exit code {r['exit_code']} "
              f"(bound {STOP_S:g} s)  {'PASS' if passed else 'MISS'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
