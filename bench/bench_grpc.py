"""Checkpoint streaming over gRPC on loopback: ovt's chunk stream against a plain byte stream.

Serves one random payload (default 64 MiB, about a mid-sized model's S_t) from a real gRPC
server on 127.0.0.1 built by `proto.serving.build_server`, two ways:

- **ovt chunks**: the payload through `proto.claims.chunks` (1 MiB `Chunk` messages with
  offset, total size and the sha256 on the last one, hashed on the server for every call), and
  reassembled and checked by `proto.claims.join_chunks` on the client — what `GetCheckpoint`
  does minus reading the checkpoint file;
- **plain stream**: the same bytes as raw 1 MiB `bytes` messages, no framing, no hash, joined on
  the client.

Each is timed `--repeats` times after one warm-up; prints the median MiB/s of each and their
ratio (ovt / plain).

    python bench/bench_grpc.py [--mib 64] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import grpc

from proto import ovt_pb2
from proto.claims import CHUNK_BYTES, chunks, join_chunks
from proto.serving import build_server, make_channel

SERVICE = "ovtbench.Stream"


def _identity(data: bytes) -> bytes:
    return data


def _add_bench_service(payload: bytes):
    def chunked(request, context):
        yield from chunks(payload)

    def raw(request, context):
        for offset in range(0, len(payload), CHUNK_BYTES):
            yield payload[offset:offset + CHUNK_BYTES]

    handlers = {
        "Chunks": grpc.unary_stream_rpc_method_handler(
            chunked, request_deserializer=_identity,
            response_serializer=ovt_pb2.Chunk.SerializeToString),
        "Raw": grpc.unary_stream_rpc_method_handler(
            raw, request_deserializer=_identity, response_serializer=_identity),
    }
    return lambda server: server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _timed(fn) -> tuple[bytes, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def bench(mib: int, repeats: int) -> dict:
    payload = os.urandom(mib << 20)
    server, port = build_server("127.0.0.1:0", [_add_bench_service(payload)], tls_cert=None,
                                tls_key=None, allow_remote_plaintext=False)
    server.start()
    try:
        with make_channel(f"127.0.0.1:{port}", tls_ca=None) as channel:
            get_chunks = channel.unary_stream(f"/{SERVICE}/Chunks",
                                              request_serializer=_identity,
                                              response_deserializer=ovt_pb2.Chunk.FromString)
            raw = channel.unary_stream(f"/{SERVICE}/Raw", request_serializer=_identity,
                                       response_deserializer=_identity)
            ways = {"ovt_chunks": lambda: join_chunks(get_chunks(b"", timeout=600),
                                                      len(payload)),
                    "plain_stream": lambda: b"".join(raw(b"", timeout=600))}
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            for i in range(repeats + 1):
                for name, fetch in ways.items():  # interleaved: load hits both alike
                    out, dt = _timed(fetch)
                    if out != payload:
                        raise SystemExit(f"{name} returned other bytes than were served")
                    if i:  # the first round warms up
                        seconds[name].append(dt)
    finally:
        server.stop(grace=None)
    result = {name: mib / statistics.median(times) for name, times in seconds.items()}
    return {"mib": mib, "repeats": repeats, "mib_per_s": result,
            "ratio_ovt_over_plain": result["ovt_chunks"] / result["plain_stream"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="payload size (default: 64)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (default: 5)")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    out = bench(args.mib, args.repeats)
    print(f"checkpoint streaming over loopback, {args.mib} MiB, median of {args.repeats}")
    for name, rate in out["mib_per_s"].items():
        print(f"  {name:14} {rate:8.1f} MiB/s")
    print(f"  ovt / plain    {out['ratio_ovt_over_plain']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
