"""Time from job end to audit verdict, for the default job (the README's main job).

Trains the default job (char-transformer, test preset, 50 steps) into a trainer store, serves
it with the Claims service on 127.0.0.1, and times `auditor_node.audit.run_audit` on the
emulated-GPU profile from the first request to the signed verdict, with the median time per
replayed step. Prints the verdict, the times and the trainer's own training time for scale.

    python bench/bench_audit.py [--steps 50]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

from auditor_node.audit import run_audit
from proto import ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from protocol.job.run import run_job
from protocol.job.store import JobStore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(2)
    spec, state0 = build_job(program="char-transformer", config={}, preset="test",
                             steps=args.steps, seed=0, init_seed=1, policy=PrecisionPolicy(),
                             checkpoint_interval=50, commit_interval=args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trainer = JobStore(root / "trainer", spec)
        trainer.put_initial(state0)
        start = time.perf_counter()
        run_job(trainer, KeyPair.generate(), profile=Profile.parse("cpu-2t"))
        train_s = time.perf_counter() - start

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        ovt_pb2_grpc.add_ClaimsServicer_to_server(ClaimsServicer(StoreDirectory(root / "trainer")),
                                                  server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        replay_s: list[float] = []
        last = [time.perf_counter()]

        def progress(step: int, steps: int) -> None:
            now = time.perf_counter()
            replay_s.append(now - last[0])
            last[0] = now

        try:
            start = last[0] = time.perf_counter()
            record = run_audit(f"127.0.0.1:{port}", spec.job_id, root / "auditor",
                               KeyPair.generate(), Profile.parse("emulated-gpu"),
                               progress=progress)
            verdict_s = time.perf_counter() - start
        finally:
            server.stop(grace=None)
    print(f"default job: char-transformer (test preset), {args.steps} steps")
    print(f"  trainer: training {train_s:.2f} s")
    print(f"  auditor verdict: {record.state} after {verdict_s:.2f} s from the first request "
          f"({verdict_s / train_s:.2f}x the training time)")
    print(f"    median step (fetch and verify leaf and log, replay, store): "
          f"{1e3 * statistics.median(replay_s[1:]):.1f} ms; first step, with the spec and S_0 "
          f"fetches: {1e3 * replay_s[0]:.1f} ms")


if __name__ == "__main__":
    main()
