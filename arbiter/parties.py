"""The two parties as the arbiter sees them: what it may ask each one, and nothing it believes.

A `Party` answers five questions about a job: its signed commitment (which names its key), leaf
t with its inclusion proof (the bisection's question, SPEC §5.2), S_t, the examples of B_t with
their data proofs, and L_t (the evidence of SPEC §5.3). Nothing a party returns is trusted
here: leaves go to `protocol.dispute.game` as raw bytes, evidence is checked against what both
parties signed before it is used.

`RemoteParty` asks a node's Claims service over gRPC and counts the bytes it receives (the
benchmark's "bytes moved"); `StoreParty` answers from a local `JobStore`, for tests and for
adjudicating stores copied from both nodes. Every failure to answer is a `NoAnswer`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import grpc
import torch

from proto import ovt_pb2, ovt_pb2_grpc
from proto.claims import join_chunks
from protocol.codec.state import decode_state, load_safetensors
from protocol.commit.commitments import Claim, SignedCommitment
from protocol.commit.data import ProvenExample, prove_examples
from protocol.engine.batches import batch_indices
from protocol.engine.profiles import Profile
from protocol.errors import EncodingError, NoAnswer, OvtError, StateFormatError
from protocol.job.create import commit_job_examples, job_executor, load_job_program
from protocol.job.spec import JobSpec
from protocol.job.store import JobStore

MAX_STATE_BYTES = 1 << 31
_REGENERATE = Profile("regenerate")  # a party regenerating its own S_t: its own hardware


class Party(Protocol):
    role: str
    bytes_received: int

    def commitment(self, n: int, timeout_s: float) -> SignedCommitment:
        """The party's signed commitment over n steps (n = 0: its latest; unverified)."""

    def leaf(self, step: int, timeout_s: float) -> bytes:
        """Leaf `step` as canonical claim bytes (unverified). NoAnswer when none came."""

    def state(self, step: int, timeout_s: float) -> dict[str, torch.Tensor]:
        """S_`step` (unverified). NoAnswer when none came."""

    def batch(self, step: int, timeout_s: float) -> list[ProvenExample]:
        """The examples of B_`step` with their data proofs (unverified)."""

    def log(self, step: int, timeout_s: float) -> bytes:
        """The canonical bytes of L_`step` (unverified)."""


class RemoteParty:
    """A party's Claims service over a gRPC channel."""

    def __init__(self, role: str, channel: grpc.Channel, spec: JobSpec) -> None:
        self.role, self.spec = role, spec
        self.stub = ovt_pb2_grpc.ClaimsStub(channel)
        self.bytes_received = 0

    def _call(self, name: str, request, timeout_s: float):
        try:
            reply = getattr(self.stub, name)(request, timeout=max(timeout_s, 0.001))
        except grpc.RpcError as err:
            raise NoAnswer(f"{self.role} {name}: {err.code().name}: {err.details()}") from None
        self.bytes_received += reply.ByteSize()
        return reply

    def _ref(self, step: int) -> ovt_pb2.StepRef:
        return ovt_pb2.StepRef(job_id=self.spec.job_id, step=step)

    def commitment(self, n: int, timeout_s: float) -> SignedCommitment:
        reply = self._call("GetCommitment", ovt_pb2.CommitmentRequest(
            job_id=self.spec.job_id, n=n), timeout_s)
        try:
            return SignedCommitment.from_bytes(reply.signed_commitment)
        except EncodingError as err:
            raise NoAnswer(f"{self.role} sent a commitment that does not decode: {err}") \
                from None

    def leaf(self, step: int, timeout_s: float) -> bytes:
        reply = self._call("GetLeaf", self._ref(step), timeout_s)
        try:
            return Claim(self.spec.job_id, reply.step, bytes(reply.state_hash),
                         bytes(reply.log_hash), tuple(bytes(p) for p in reply.proof),
                         reply.tree_size).to_bytes()
        except EncodingError:
            return reply.SerializeToString()  # not a claim: the game rules it malformed

    def state(self, step: int, timeout_s: float) -> dict[str, torch.Tensor]:
        try:
            chunks = self.stub.GetCheckpoint(self._ref(step), timeout=timeout_s)
            payload = join_chunks(_counted(chunks, self), MAX_STATE_BYTES)
        except grpc.RpcError as err:
            raise NoAnswer(f"{self.role} GetCheckpoint: {err.code().name}: "
                           f"{err.details()}") from None
        except OvtError as err:
            raise NoAnswer(f"{self.role} GetCheckpoint: {err}") from None
        try:
            return load_safetensors(payload)
        except StateFormatError as err:
            raise NoAnswer(f"{self.role} sent an S_{step} that is not a safetensors state: "
                           f"{err}") from None

    def batch(self, step: int, timeout_s: float) -> list[ProvenExample]:
        reply = self._call("GetBatch", self._ref(step), timeout_s)
        try:
            return [ProvenExample(int(e.index), decode_state(e.tensors),
                                  [bytes(p) for p in e.proof]) for e in reply.examples]
        except OvtError as err:
            raise NoAnswer(f"{self.role} sent a batch that does not decode: {err}") from None

    def log(self, step: int, timeout_s: float) -> bytes:
        return bytes(self._call("GetLog", self._ref(step), timeout_s).log)


def _counted(chunks, party: RemoteParty):
    for chunk in chunks:
        party.bytes_received += chunk.ByteSize()
        yield chunk


class StoreParty:
    """A party answering from its `JobStore` under its latest commitment (no network); a job's
    data file, to serve batches and regenerate states, is read inside `data_dir`."""

    def __init__(self, role: str, store: JobStore, data_dir: Path | None = None) -> None:
        self.role, self.store, self.data_dir = role, store, data_dir
        self.bytes_received = 0

    def commitment(self, n: int, timeout_s: float) -> SignedCommitment:
        signed = self.store.commitment(n or None)
        if signed is None:
            raise NoAnswer(f"the {self.role} has no commitment over {n or 'any'} steps")
        return signed

    def leaf(self, step: int, timeout_s: float) -> bytes:
        signed = self.store.commitment()
        if signed is None:
            raise NoAnswer(f"the {self.role} has no commitment")
        n = signed.commitment.n
        if step > n:
            raise NoAnswer(f"the {self.role} committed to {n} steps, not {step}")
        leaf = self.store.leaf(step)
        return Claim(self.store.spec.job_id, step, leaf.state_hash, leaf.log_hash,
                     tuple(self.store.tree(n).proof(step)), n + 1).to_bytes()

    def state(self, step: int, timeout_s: float) -> dict[str, torch.Tensor]:
        spec = self.store.spec
        ex = job_executor(spec, _REGENERATE, self.data_dir)
        try:
            return self.store.state_at(step, ex)
        except OvtError as err:
            raise NoAnswer(f"the {self.role} cannot produce S_{step}: {err}") from None

    def batch(self, step: int, timeout_s: float) -> list[ProvenExample]:
        spec = self.store.spec
        program = load_job_program(spec, self.data_dir)
        _, tree = commit_job_examples(spec, program)
        indices = batch_indices(spec.seed, len(program.dataset), program.batch_size, step)
        return prove_examples(program.dataset, tree, indices)

    def log(self, step: int, timeout_s: float) -> bytes:
        try:
            return self.store.log_bytes(step)
        except OvtError as err:
            raise NoAnswer(f"the {self.role} cannot serve L_{step}: {err}") from None
