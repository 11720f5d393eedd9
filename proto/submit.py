"""Submitting a job to a trainer daemon: the spec, then S_0 streamed in chunks.

`SubmitStream` carries S_0 as `GetCheckpoint` carries a state (bounded chunks, the last with the
sha256 of the whole), so S_0 is bounded by the trainer's `--max-state-mb` and what is left of its
in-flight budget (`--max-inflight-mb`), not by the gRPC message size. The trainer checks the spec
and its program before it accepts a byte of S_0, and writes S_0 to disk as it arrives
(`proto.claims.receive_chunks`).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import CHUNK_BYTES, chunks


def submit_parts(spec: bytes, initial_state: bytes,
                 chunk_bytes: int = CHUNK_BYTES) -> Iterator[ovt_pb2.SubmitPart]:
    """The SubmitStream request stream: the spec alone, then S_0's chunks."""
    yield ovt_pb2.SubmitPart(spec=spec)
    for chunk in chunks(initial_state, chunk_bytes):
        yield ovt_pb2.SubmitPart(initial_state=chunk)


def submit_job(channel: grpc.Channel, spec: bytes, initial_state: bytes, *, timeout: float,
               chunk_bytes: int = CHUNK_BYTES) -> bytes:
    """Submit (spec, S_0) to the trainer on `channel`; returns the job id. Raises
    grpc.RpcError as the trainer answers."""
    reply = ovt_pb2_grpc.TrainerStub(channel).SubmitStream(
        submit_parts(spec, initial_state, chunk_bytes), timeout=timeout)
    return reply.job_id
