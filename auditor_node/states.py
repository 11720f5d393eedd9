"""What an audit interval's worker reads from the trainer: its checkpoints S_c and its logs.

`RemoteStates` is the `protocol.job.intervals.StateSources` of a remote audit: it holds only how
to reach the trainer (so it pickles into a worker process) and, there, opens a channel of its
own and returns a `TrainerStates`. Nothing it returns is trusted: `replay_interval` checks S_c
against the trainer's signed h_c and each log against its signed ℓ_t before using them. States
travel as safetensors (`load_safetensors`, never unpickled), in bounded chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from proto import ovt_pb2
from proto.claims import DEFAULT_DEADLINE_S, RemoteClaims, join_chunks
from proto.serving import make_channel
from protocol.codec.state import load_safetensors
from protocol.errors import PeerError, StateFormatError
from protocol.job.spec import JobSpec

MAX_STATE_BYTES = 1 << 31


@dataclass(frozen=True)
class RemoteStates:
    """Opens a `TrainerStates` on the trainer at `address` (see `proto.serving.make_channel`
    for `tls_ca` and `allow_remote_plaintext`)."""

    address: str
    tls_ca: Path | None = None
    allow_remote_plaintext: bool = False
    deadline_s: float = DEFAULT_DEADLINE_S

    def __call__(self, spec: JobSpec) -> TrainerStates:
        """Raises ConfigError for a malformed address or refused plaintext."""
        channel = make_channel(self.address, tls_ca=self.tls_ca,
                               allow_remote_plaintext=self.allow_remote_plaintext)
        return TrainerStates(channel, spec, self.deadline_s)


class TrainerStates:
    """A `protocol.job.intervals.StateSource` over the trainer's Claims service; owns `channel`."""

    def __init__(self, channel: grpc.Channel, spec: JobSpec, deadline_s: float) -> None:
        self.channel, self.spec, self.deadline_s = channel, spec, deadline_s
        self._claims = RemoteClaims(channel, spec, deadline_s=deadline_s)

    def state(self, step: int) -> dict[str, torch.Tensor]:
        """The trainer's S_step (GetCheckpoint; it regenerates one it did not store). Raises
        PeerError for a failed call, a broken stream or bytes that are not a state."""
        stub = self._claims.stub
        try:
            payload = join_chunks(stub.GetCheckpoint(
                ovt_pb2.StepRef(job_id=self.spec.job_id, step=step), timeout=self.deadline_s),
                MAX_STATE_BYTES)
        except grpc.RpcError as err:
            raise PeerError(f"trainer GetCheckpoint {step} failed: {err.code().name}: "
                            f"{err.details()}") from None
        try:
            return load_safetensors(payload)
        except StateFormatError as err:
            raise PeerError(f"the trainer sent an S_{step} that is not a safetensors state: "
                            f"{err}") from None

    def log_bytes(self, step: int) -> bytes:
        """The trainer's L_step's bytes (GetLog). Raises PeerError."""
        return self._claims.log_bytes(step)

    def close(self) -> None:
        self.channel.close()
