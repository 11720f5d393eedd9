"""Audit wall time: one sequential replay, the intervals in worker processes, and a sample.

Trains one job into a trainer store (the default job's program, char-transformer at its test
preset, for 200 steps with a checkpoint every 25: 8 intervals; `--program image-cnn` is a
smaller CNN, quicker per step, so worker start-up weighs more), serves it with the Claims
service on 127.0.0.1, and times four audits with `auditor_node.audit.run_audit` on the
emulated-GPU profile, each from the first request to its record, into fresh auditor stores,
one after the other: **sequential** (one process, the path `--processes 1` takes, on the
profile's 2 threads), **sequential 1 thread** (the same on one thread, what each of 2 workers
gets on 2 cores: it separates the gain of running processes side by side from that of running
each on fewer threads), **parallel** (`--processes` worker processes, default 2, each on
cores / P threads) and **sampled** (`--sample` F = 0.25 of the intervals, in the same worker
processes). Prints them side by side with their ratios to the sequential time and the steps
each replayed, and whether the signed roots of the full audits are byte-identical (they must
be: the command exits 1 otherwise, or if an audit of this honest job does not match, or a
sampled one does not say "sampled, not verified").

    python bench/bench_audit.py [--steps 200] [--checkpoint-interval 25] [--processes 2]
        [--sample 0.25] [--program image-cnn] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

from auditor_node.audit import MATCHED, SAMPLED, AuditRecord, run_audit
from proto import ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory
from protocol.commit.keys import KeyPair
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from protocol.job.run import run_job
from protocol.job.store import JobStore

SMALL_CNN = {"image_size": 8, "channels": 8, "batch_size": 16, "dataset_size": 512}
JOBS = {"image-cnn": (SMALL_CNN, None), "char-transformer": ({}, "test")}
AUDITOR = Profile.parse("emulated-gpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", choices=JOBS, default="char-transformer")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-interval", type=int, default=25)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--sample", type=float, default=0.25)
    parser.add_argument("--json", type=Path, help="also write every number here")
    args = parser.parse_args()
    torch.set_num_threads(2)
    config, preset = JOBS[args.program]
    spec, state0 = build_job(program=args.program, config=config, preset=preset,
                             steps=args.steps, seed=0, init_seed=1, policy=PrecisionPolicy(),
                             checkpoint_interval=args.checkpoint_interval,
                             commit_interval=args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        trainer = JobStore(root / "trainer", spec)
        trainer.put_initial(state0)
        start = time.perf_counter()
        run_job(trainer, KeyPair.generate(), profile=Profile.parse("cpu-2t"))
        train_s = time.perf_counter() - start
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        ovt_pb2_grpc.add_ClaimsServicer_to_server(
            ClaimsServicer(StoreDirectory(root / "trainer")), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        key = KeyPair.generate()
        try:
            runs = {name: _timed(f"127.0.0.1:{port}", spec.job_id, root / name, key, profile,
                                 **options)
                    for name, profile, options in (
                        ("sequential", AUDITOR, {}),
                        ("sequential-1t", dataclasses.replace(AUDITOR, threads=1), {}),
                        ("parallel", AUDITOR, {"processes": args.processes}),
                        ("sampled", AUDITOR,
                         {"processes": args.processes, "sample": args.sample}))}
        finally:
            server.stop(grace=None)
    return _report(args, spec.steps, train_s, runs)


def _timed(address: str, job_id: bytes, store: Path, key: KeyPair, profile: Profile,
           **options) -> tuple[AuditRecord, float]:
    start = time.perf_counter()
    record = run_audit(address, job_id, store, key, profile, **options)
    return record, time.perf_counter() - start


def _report(args, steps: int, train_s: float, runs: dict[str, tuple[AuditRecord, float]]
            ) -> int:
    full = [runs[name][0] for name in ("sequential", "sequential-1t", "parallel")]
    seq_s, sam = runs["sequential"][1], runs["sampled"][0]
    roots = {None if r.auditor_commitment is None else r.auditor_commitment.commitment.root
             for r in full}
    same_root = len(roots) == 1 and None not in roots
    cores = len(os.sched_getaffinity(0))
    print(f"job: {args.program}, {steps} steps, a checkpoint every {args.checkpoint_interval} "
          f"({-(-steps // args.checkpoint_interval)} intervals); trainer {train_s:.2f} s on "
          f"cpu-2t; auditor profile {AUDITOR.name}, {cores} cores; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'audit':<36}{'state':>10}{'steps':>8}{'wall s':>9}{'/ seq':>8}")
    for label, (record, seconds) in zip(
            ("sequential (1 process)", "sequential (1 process, 1 thread)",
             f"parallel ({args.processes} processes)",
             f"sampled F={args.sample} ({args.processes} processes)"), runs.values(),
            strict=True):
        print(f"{label:<36}{record.state:>10}{record.replayed:>8}{seconds:>9.2f}"
              f"{seconds / seq_s:>8.2f}")
    print(f"signed roots of the 3 full audits byte-identical: {same_root} "
          f"({', '.join(sorted(root.hex()[:16] for root in roots if root))})")
    print(f"sampled: {sam.reason}")
    if args.json:
        args.json.write_text(json.dumps({
            "steps": steps, "train_s": train_s, "same_root": same_root,
            "audits": {name: {"state": record.state, "replayed": record.replayed,
                              "wall_s": seconds} for name, (record, seconds) in runs.items()},
            "sample_reason": sam.reason}, indent=2))
    ok = same_root and all(r.state == MATCHED for r in full) and sam.state == SAMPLED and \
        (sam.reason or "").startswith("sampled, not verified")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
