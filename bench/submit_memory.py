"""What concurrent S_0 submissions cost a trainer daemon in memory (issue 10, finding 6).

Starts a real `ovt-trainer serve` process on 127.0.0.1 for each stream count asked for, submits
that many jobs at once through SubmitStream, each with an S_0 of `--mib` MiB, and prints the
daemon's peak resident memory (VmHWM from /proc/PID/status) next to the sizes submitted and the
documented memory budget of submissions: one gRPC message (`--max-message-mb`) per stream in
flight, for S_0 streams to disk and is hashed there, never held whole (README, "Daemons").

The jobs are one built-in char-transformer whose layer count gives an S_0 of about `--mib` MiB,
under different data seeds: different job ids, the same S_0. So that the measurement is the
submissions' alone, the daemon is first given a tiny long job (one training thread): its runner
trains that while the big jobs are received, checked and stored, and they only wait in the queue.
The baseline is VmHWM once the tiny job trains; the daemon is stopped after each count.

    python bench/submit_memory.py                          # 3 streams of 1 GiB, then 1 stream
    python bench/submit_memory.py --mib 256 --streams 3    # quicker
    python bench/submit_memory.py --json out.json          # also write every figure as JSON

Exit 0 when every peak's rise over its baseline stays under that budget, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import safetensors.torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.submit import submit_job
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.programs import char_transformer
from protocol.job.create import DEFAULT_MAX_PARAMS, build_job
from protocol.job.spec import JobSpec

ROOT = Path(__file__).resolve().parents[1]
TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}
START_TIMEOUT_S = 120.0
SUBMIT_TIMEOUT_S = 3600.0


def big_job(mib: int) -> tuple[JobSpec, bytes]:
    """A char-transformer job whose S_0 (its float32 parameters) is about `mib` MiB: the
    smallest d_model of 128, 256, ... for which a layer count of at most 64 reaches it."""
    target = mib * 2**20 // 4
    for d_model in (128, 256, 512, 1024, 2048, 4096, 8192):
        layers = round(target / (12 * d_model * d_model + 13 * d_model))
        if layers <= 64:
            break
    config = {"d_model": d_model, "n_heads": 4, "n_layers": max(1, layers)}
    spec, state0 = build_job(program=char_transformer.NAME, config=config, preset="test",
                             steps=10, seed=0, init_seed=1, policy=PrecisionPolicy(),
                             checkpoint_interval=10, commit_interval=10)
    return spec, safetensors.torch.save(state0)


def tiny_job() -> tuple[JobSpec, bytes]:
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=10**6, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=10**6,
                             commit_interval=10**6)
    return spec, safetensors.torch.save(state0)


def memory_mib(pid: int, field: str) -> float:
    """A `/proc/PID/status` memory field (VmHWM: peak resident set; VmRSS: now), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def start_trainer(work: Path, inflight_mb: int, message_mb: int,
                  max_params: int) -> tuple[subprocess.Popen, int]:
    key, port_file = work / "trainer.key", work / "port"
    KeyPair.generate().save(key)
    with open(work / "serve.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer_node.cli", "serve", "--listen", "127.0.0.1:0",
             "--store", str(work / "store"), "--key", str(key), "--profile", "cpu-1t",
             "--max-inflight-mb", str(inflight_mb), "--max-message-mb", str(message_mb),
             "--max-params", str(max_params),
             "--port-file", str(port_file)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the trainer did not start:\n{(work / 'serve.log').read_text()}")
        time.sleep(0.05)
    return proc, int(port_file.read_text())


def wait_training(channel: grpc.Channel, job_id: bytes) -> None:
    """Until the tiny job has trained a step (the runner is busy with it)."""
    stub, deadline = ovt_pb2_grpc.TrainerStub(channel), time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        status = stub.Status(ovt_pb2.JobRef(job_id=job_id), timeout=30)
        if status.state == "running" and status.step >= 1:
            return
        if status.state == "failed":
            raise RuntimeError(f"the tiny job failed: {status.error}")
        time.sleep(0.1)
    raise RuntimeError("the tiny job did not start training")


def measure(streams: int, spec: JobSpec, state0: bytes, inflight_mb: int, message_mb: int,
            max_params: int, tiny: tuple[JobSpec, bytes]) -> dict:
    """One fresh daemon, `streams` concurrent submissions of `state0`; its memory figures."""
    with tempfile.TemporaryDirectory(prefix="ovt-submit-memory-") as tmp:
        proc, port = start_trainer(Path(tmp), inflight_mb, message_mb, max_params)
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                tiny_spec, tiny_state = tiny
                submit_job(channel, tiny_spec.to_bytes(), tiny_state, timeout=60)
                wait_training(channel, tiny_spec.job_id)
                baseline = memory_mib(proc.pid, "VmHWM")
                specs = [dataclasses.replace(spec, seed=seed) for seed in range(streams)]
                errors: list[str] = []

                def submit(one: JobSpec) -> None:
                    try:
                        if submit_job(channel, one.to_bytes(), state0,
                                      timeout=SUBMIT_TIMEOUT_S) != one.job_id:
                            errors.append("the trainer answered another job id")
                    except grpc.RpcError as err:
                        errors.append(f"{err.code().name}: {err.details()}")

                threads = [threading.Thread(target=submit, args=(one,)) for one in specs]
                start = time.perf_counter()
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                seconds = time.perf_counter() - start
                if errors:
                    raise RuntimeError(f"a submission failed: {errors[0]}")
                peak = memory_mib(proc.pid, "VmHWM")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    budget = streams * message_mb
    return {"streams": streams, "s0_mib": len(state0) / 2**20,
            "submitted_mib": streams * len(state0) / 2**20, "budget_mib": budget,
            "inflight_mib": inflight_mb, "baseline_vmhwm_mib": baseline,
            "peak_vmhwm_mib": peak, "seconds": seconds, "under_budget": peak - baseline < budget}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=1024, help="S_0 size of each job, MiB "
                                                              "(default: %(default)s)")
    parser.add_argument("--streams", default="3,1",
                        help="concurrent submissions, one daemon per count, comma-separated "
                             "(default: %(default)s)")
    parser.add_argument("--max-inflight-mb", type=int, default=8192,
                        help="the daemon's in-flight (disk) budget, MiB (default: %(default)s, "
                             "the trainer's default)")
    parser.add_argument("--max-message-mb", type=int, default=64,
                        help="the daemon's largest gRPC message, MiB; the memory budget is one "
                             "per stream (default: %(default)s, the trainer's default)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.streams.split(",")]

    print(f"building a job with an S_0 of about {args.mib} MiB ...", flush=True)
    spec, state0 = big_job(args.mib)
    params = char_transformer.parameter_count(spec.config)
    max_params = max(DEFAULT_MAX_PARAMS, params)
    tiny = tiny_job()
    rows = [measure(n, spec, state0, args.max_inflight_mb, args.max_message_mb, max_params,
                    tiny) for n in counts]

    print(f"\nchar-transformer d_model {spec.config['d_model']}, {spec.config['n_layers']} "
          f"layers: {params} parameters, S_0 {len(state0) / 2**20:.0f} MiB; in-flight (disk) "
          f"budget {args.max_inflight_mb} MiB; memory budget {args.max_message_mb} MiB per "
          f"stream")
    print(f"{'streams':>7} {'submitted MiB':>13} {'baseline VmHWM':>14} {'peak VmHWM':>10} "
          f"{'peak - base':>11} {'budget':>6} {'seconds':>7}  peak - base < budget")
    for row in rows:
        print(f"{row['streams']:>7} {row['submitted_mib']:>13.0f} "
              f"{row['baseline_vmhwm_mib']:>14.0f} {row['peak_vmhwm_mib']:>10.0f} "
              f"{row['peak_vmhwm_mib'] - row['baseline_vmhwm_mib']:>11.0f} "
              f"{row['budget_mib']:>6} {row['seconds']:>7.1f}  "
              f"{'PASS' if row['under_budget'] else 'MISS'}")
    if args.json is not None:
        args.json.write_text(json.dumps({"parameters": params, "rows": rows}, indent=2))
    return 0 if all(row["under_budget"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
