"""Adjudication time for an n-step job (default 1,000), split into bisection and re-execution,
and the bytes moved between the arbiter and each node.

A trainer trains a tiny CNN job for n steps on cpu-2t with one injected fault at step k
(default: it swaps in a checkpoint one ULP off at k = 0.737 n, so the arbiter really re-executes
the step and finds another state; `--fault skip-step` is caught by the log instead). An auditor
replays it on emulated-gpu up to its divergence at k and files its challenge. Both stores are
served by the Claims service on 127.0.0.1, and the arbiter adjudicates over gRPC, re-executing
on cpu-1t. Printed side by side from the same run: the adjudication's phases, the auditor's own
replay (what re-executing the whole job instead of one step would cost: per step times n), and
their ratio.

    python bench/bench_arbiter.py [--steps 1000] [--fault KIND] [--fault-step K] [--json F]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import torch

from arbiter.adjudicate import adjudicate
from arbiter.parties import RemoteParty
from auditor_node.audit import leaf_claim, own_claim
from proto import ovt_pb2_grpc
from proto.claims import ClaimsServicer, StoreDirectory
from protocol.commit.keys import KeyPair
from protocol.dispute.challenge import Challenge
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.profiles import Profile
from protocol.job.create import build_job
from protocol.job.faults import parse_fault
from protocol.job.run import StoreSource, replay_job, run_job
from protocol.job.store import JobStore
from trainer_node.faults import TrainerFaults

TINY = {"image_size": 8, "channels": 4, "batch_size": 8, "dataset_size": 64}


def serve(root: Path) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    ovt_pb2_grpc.add_ClaimsServicer_to_server(ClaimsServicer(StoreDirectory(root)), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--fault", default="swap-checkpoint",
                        help="the trainer's training fault (default: %(default)s)")
    parser.add_argument("--fault-step", type=int, default=None,
                        help="the step of the fault (default: 0.737 * steps)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    n = args.steps
    k = args.fault_step or max(1, round(0.737 * n))
    torch.set_num_threads(2)
    spec, state0 = build_job(program="image-cnn", config=TINY, preset=None, steps=n, seed=0,
                             init_seed=1, policy=PrecisionPolicy(), checkpoint_interval=50,
                             commit_interval=n)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        print(f"training {n} steps (fault {args.fault} at step {k}) …", flush=True)
        trainer = JobStore(root / "trainer", spec)
        trainer.put_initial(state0)
        t0 = time.perf_counter()
        run_job(trainer, KeyPair.generate(), profile=Profile.parse("cpu-2t"),
                hooks=TrainerFaults([parse_fault(f"{args.fault}:{k}")]))
        train_s = time.perf_counter() - t0

        print("auditing on emulated-gpu up to the divergence …", flush=True)
        auditor = JobStore(root / "auditor", spec)
        t0 = time.perf_counter()
        outcome = replay_job(auditor, StoreSource(trainer), KeyPair.generate(),
                             profile=Profile.parse("emulated-gpu"))
        audit_s = time.perf_counter() - t0
        j = outcome.first_divergent_step
        assert j is not None and j == k, f"the audit diverged at {j}, not at the fault's step {k}"
        challenge = Challenge(spec.job_id, j, outcome.reason or "", outcome.trainer_commitment,
                              leaf_claim(trainer, j, outcome.trainer_commitment),
                              outcome.commitment, own_claim(auditor, j, outcome.commitment),
                              leaf_claim(trainer, 0, outcome.trainer_commitment),
                              leaf_claim(auditor, 0, outcome.commitment))
        trainer.close()
        auditor.close()

        servers = [serve(root / "trainer"), serve(root / "auditor")]
        try:
            with grpc.insecure_channel(servers[0][1]) as tc, \
                    grpc.insecure_channel(servers[1][1]) as ac:
                t0 = time.perf_counter()
                result = adjudicate(spec, challenge, RemoteParty("trainer", tc, spec),
                                    RemoteParty("auditor", ac, spec), key=KeyPair.generate(),
                                    profile=Profile.parse("cpu-1t"))
                wall_s = time.perf_counter() - t0
        finally:
            for server, _ in servers:
                server.stop(None)

    v = result.verdict
    per_step = audit_s / j
    full_replay_s = per_step * n
    verdict_bytes = len(v.to_bytes())
    print()
    print(f"verdict: {v.fault} at fault at step {v.step} ({v.finding}); bisection rounds "
          f"{v.rounds} (ceil(log2 {n}) = {math.ceil(math.log2(n))})")
    print(f"{'phase':<34}{'seconds':>10}")
    for name in ("bisection_s", "evidence_s", "reexecution_s", "total_s"):
        print(f"{name.removesuffix('_s'):<34}{v.timings[name]:>10.3f}")
    print(f"{'adjudicate() wall clock':<34}{wall_s:>10.3f}")
    print(f"{'auditor replay, mean per step':<34}{per_step:>10.4f}")
    print(f"{'re-executing all n steps instead':<34}{full_replay_s:>10.3f}")
    print(f"adjudication / full re-execution: {v.timings['total_s'] / full_replay_s:.4f}x")
    print(f"bytes moved: trainer -> arbiter {v.bytes_moved['trainer']:,}, auditor -> arbiter "
          f"{v.bytes_moved['auditor']:,}; verdict file {verdict_bytes:,} bytes")
    print(f"(training took {train_s:.1f} s, the audit {audit_s:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps({
            "steps": n, "injected": args.fault, "fault_step": k, "fault": v.fault,
            "step": v.step, "rounds": v.rounds,
            "timings": v.timings, "wall_s": wall_s, "bytes_moved": v.bytes_moved,
            "verdict_bytes": verdict_bytes, "replay_per_step_s": per_step,
            "full_replay_s": full_replay_s, "train_s": train_s, "audit_s": audit_s}, indent=2))


if __name__ == "__main__":
    main()
