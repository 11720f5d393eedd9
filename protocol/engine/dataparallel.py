"""Data-parallel steps: a job's micro-batches computed by several processes (SPEC §3.5).

A job with k micro-batches may have them computed by W <= k processes of one party: rank 0 (the
node itself, which owns the executor's state, the store and the service) and W - 1 workers it
starts on this machine (`protocol.engine.worker`), joined by a gloo process group over 127.0.0.1
(rendezvous through a file, so nothing listens beyond the loopback). Micro-batch i goes to rank
i mod W. Per step, rank 0 sends each worker S_{t-1}'s model tensors and buffers, its
micro-batches' examples and, in replay, their parts of L_t; the worker computes each
micro-batch alone, from those tensors, with a rounder of its own (`Executor.part`), and sends
back the rounded gradients, the buffers the forward pass left, the loss and, in record mode,
the part's log. Rank 0 then runs the step's tail (the gradient sum, one reduction site with a
certified band, and the update) alone. So a worker holds nothing between steps that a
commitment depends on, and the step's bits do not depend on W.

A worker that dies or stops answering raises `WorkerError` at rank 0, which kills the group
and runs the step again from S_{t-1} with new workers (`Executor.step`): no leaf changes. A
worker whose micro-batch fails for a reason of its own (a log that does not replay, a program
that raises) sends the error back, and rank 0 raises it as if it had run the micro-batch
itself; that is never retried. A worker whose rank 0 is gone exits: its connection closes, and
it also watches its parent process.

Messages are a msgpack header and one byte blob of tensors, each tensor named in the header by
name, dtype, shape and offset. No pickle is involved: the peers are this party's own
processes, but a byte string is all either side ever decodes.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, cast

import msgpack
import torch
from torch.distributed import FileStore, ProcessGroupGloo

from protocol.codec.dtypes import DTYPES, dtype_name
from protocol.codec.roundinglog import RoundingLog, decode_log, encode_log
from protocol.errors import (
    ConfigError,
    DeterminismError,
    LogFormatError,
    LogMismatchError,
    LogViolationError,
    OvtError,
    ProgramError,
    WorkerError,
)
from protocol.files import atomic_write

if TYPE_CHECKING:
    from protocol.engine.executor import Executor

DEFAULT_TIMEOUT_S = 3600.0  # the longest a rank waits for one message: one micro-batch's work
JOIN_TIMEOUT_S = 60.0  # the longest joining the group may take once every worker is ready
_ALIGN = 8  # every tensor starts at a multiple of this in a blob, so any dtype can view it
# errors of a micro-batch that a worker sends back for rank 0 to raise as they are; any other
# exception it meets comes back as a ProgramError naming it
_STEP_ERRORS: dict[str, type[OvtError]] = {
    cls.__name__: cls for cls in (ConfigError, ProgramError, LogFormatError, LogMismatchError,
                                  DeterminismError)}


def require_world(world: int, micro_batches: int, what: str = "the process count") -> None:
    """Raise ConfigError unless 1 <= `world` <= `micro_batches` (SPEC §3.5: a process computes
    whole micro-batches); `what` names the option in the message."""
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= micro_batches:
        raise ConfigError(f"{what} must lie in 1..{micro_batches}, the job's micro-batches: a "
                          f"process computes whole micro-batches (got {world!r})")


class _Pairs(Protocol):
    """The point-to-point half of a gloo process group (torch's stubs omit it)."""

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int): ...

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int): ...


@dataclass
class PartResult:
    """What one micro-batch of a step leaves (SPEC §3.5): each trainable parameter's rounded
    gradient (None where it got none), every buffer after the forward pass, the loss, and the
    part's rounding log (record mode; None in replay)."""

    grads: list[torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    loss: float
    log: RoundingLog | None


@dataclass(frozen=True)
class Recipe:
    """How a worker builds its executor: `builder` ("module:function") called with `args` (JSON
    values) returns an `Executor` for the same program, seed, policy, profile and micro-batch
    count as rank 0's. It names this project's own code, never a peer's."""

    builder: str
    args: dict

    def build(self) -> Executor:
        module, _, function = self.builder.partition(":")
        return getattr(importlib.import_module(module), function)(self.args)


# ---------------------------------------------------------------------------------------------
# Messages


def _gloo_reason(err: RuntimeError) -> str:
    """gloo's message without its source path and advice: 'Connection closed by peer ...'."""
    line = str(err).splitlines()[0] if str(err) else type(err).__name__
    return re.sub(r"^\[[^\]]*\]\s*", "", line).split(". ")[0]


def _send(group: _Pairs, peer: int, header: dict, tensors: dict[str, torch.Tensor],
          timeout_s: float) -> int:
    """Send `header` and `tensors` to rank `peer`: sizes, header bytes, then one byte blob.
    Returns the bytes sent. Raises WorkerError if the connection fails or times out."""
    layout, pieces, offset = [], [], 0
    for name, t in tensors.items():
        data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        pad = -data.numel() % _ALIGN
        layout.append([name, dtype_name(t.dtype), list(t.shape), offset])
        pieces.append(data)
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8))
        offset += data.numel() + pad
    head = msgpack.packb({**header, "tensors": layout})
    sizes = torch.tensor([len(head), offset], dtype=torch.int64)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        group.send([sizes], peer, 0).wait(timeout)
        group.send([torch.frombuffer(bytearray(head), dtype=torch.uint8)], peer, 0).wait(timeout)
        if offset:
            group.send([torch.cat(pieces)], peer, 0).wait(timeout)
    except RuntimeError as err:
        raise WorkerError(f"sending to rank {peer} failed: {_gloo_reason(err)}") from None
    return sizes.numel() * 8 + len(head) + offset


def _recv(group: _Pairs, peer: int, timeout_s: float
          ) -> tuple[dict, dict[str, torch.Tensor], int]:
    """Receive one message `_send` sent from rank `peer`: (header, tensors by name, bytes).
    Raises WorkerError if the connection fails or times out."""
    sizes = torch.zeros(2, dtype=torch.int64)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        group.recv([sizes], peer, 0).wait(timeout)
        head = torch.empty(int(sizes[0]), dtype=torch.uint8)
        group.recv([head], peer, 0).wait(timeout)
        blob = torch.empty(int(sizes[1]), dtype=torch.uint8)
        if blob.numel():
            group.recv([blob], peer, 0).wait(timeout)
    except RuntimeError as err:
        raise WorkerError(f"receiving from rank {peer} failed: {_gloo_reason(err)}") from None
    header = msgpack.unpackb(head.numpy().tobytes(), strict_map_key=True)
    tensors = {}
    for name, dtype, shape, offset in header.pop("tensors"):
        kind = DTYPES[dtype]
        count = int(torch.Size(shape).numel()) * torch.empty(0, dtype=kind).element_size()
        tensors[name] = blob[offset:offset + count].view(kind).reshape(shape).clone()
    return header, tensors, sizes.numel() * 8 + head.numel() + blob.numel()


def _log_tensor(log: RoundingLog) -> torch.Tensor:
    return torch.frombuffer(bytearray(encode_log(log)), dtype=torch.uint8)


def _log_of(t: torch.Tensor) -> RoundingLog:
    return decode_log(t.numpy().tobytes())


def _part_tensors(index: int, part: PartResult) -> tuple[dict, dict[str, torch.Tensor]]:
    """A part's result as message fields: (its header entry, its tensors)."""
    tensors = {f"{index}.grad.{j}": g for j, g in enumerate(part.grads) if g is not None}
    tensors.update({f"{index}.buffer.{name}": b for name, b in part.buffers.items()})
    if part.log is not None:
        tensors[f"{index}.log"] = _log_tensor(part.log)
    entry = {"index": index, "loss": part.loss, "grads": [g is not None for g in part.grads],
             "buffers": list(part.buffers)}
    return entry, tensors


def _part_of(entry: dict, tensors: dict[str, torch.Tensor], device: torch.device) -> PartResult:
    """The PartResult `_part_tensors` made, its tensors moved to `device`."""
    i = entry["index"]
    grads = [tensors[f"{i}.grad.{j}"].to(device) if present else None
             for j, present in enumerate(entry["grads"])]
    buffers = {name: tensors[f"{i}.buffer.{name}"].to(device) for name in entry["buffers"]}
    log = _log_of(tensors[f"{i}.log"]) if f"{i}.log" in tensors else None
    return PartResult(grads, buffers, entry["loss"], log)


def _error_header(err: Exception) -> dict:
    """An error a worker met, as a message, for rank 0 to raise again (`_raised`)."""
    if isinstance(err, LogViolationError):
        return {"error": "LogViolationError", "fields": [
            err.step, err.site, err.op, err.index, err.distance, err.bound, err.note]}
    return {"error": type(err).__name__, "message": str(err)}


def _raised(header: dict, rank: int) -> OvtError:
    """The error a worker sent (`_error_header`): the micro-batch's own class, or a
    ProgramError naming any other (a bug in the program, or the worker's)."""
    if header["error"] == "LogViolationError":
        return LogViolationError(*header["fields"])
    cls = _STEP_ERRORS.get(header["error"])
    if cls is None:
        return ProgramError(f"worker {rank} raised {header['error']}: {header['message']}")
    return cls(header["message"])


def _connect(store_path: Path, rank: int, world: int) -> _Pairs:
    """This process's gloo group: rendezvous through the file within JOIN_TIMEOUT_S, pairs over
    127.0.0.1 only (each message then waits its own timeout). Raises RuntimeError."""
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return cast(_Pairs, ProcessGroupGloo(FileStore(str(store_path), world), rank, world, options))


# ---------------------------------------------------------------------------------------------
# Rank 0


class WorkerGroup:
    """Rank 0's handle on W - 1 worker processes on this machine (module docstring).

    Start it with `start()` (or as a context manager), give it to `Executor.use_workers`, and
    `close()` it: that kills the workers, by pid (they hold nothing to save). Raises
    ConfigError for a world size below 2.
    """

    def __init__(self, world: int, recipe: Recipe, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 stderr=None) -> None:
        if world < 2:
            raise ConfigError(f"a worker group has at least 2 processes (rank 0 and a worker), "
                              f"got {world}")
        self.world, self.recipe, self.timeout_s, self.stderr = world, recipe, timeout_s, stderr
        self.processes: list[subprocess.Popen] = []
        self.bytes_exchanged = 0  # sent and received by rank 0 in `parts`, over all steps
        self._group: _Pairs | None = None
        self._dir: Path | None = None

    def __enter__(self) -> WorkerGroup:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def start(self) -> None:
        """Start new workers (killing any before) and join them. Raises the error a worker
        met building its executor (ConfigError, ProgramError), or WorkerError if one died or
        the group could not be joined."""
        self.close()
        self._dir = Path(tempfile.mkdtemp(prefix="ovt-workers-"))
        store = self._dir / "rendezvous"
        recipe = json.dumps({"builder": self.recipe.builder, "args": self.recipe.args})
        for rank in range(1, self.world):
            self.processes.append(subprocess.Popen(
                [sys.executable, "-m", "protocol.engine.worker", "--rank", str(rank),
                 "--world", str(self.world), "--rendezvous", str(store),
                 "--timeout-s", str(self.timeout_s), "--recipe", recipe],
                stdin=subprocess.DEVNULL, stderr=self.stderr))
        try:
            self._await_ready()
            self._group = _connect(store, 0, self.world)
        except RuntimeError as err:
            self.close()
            raise WorkerError(f"the {self.world - 1} workers did not join: "
                              f"{_gloo_reason(err)}") from None
        except BaseException:
            self.close()
            raise

    def _await_ready(self) -> None:
        """Wait until every worker has built its executor (its ready file), so that joining
        the group cannot wait on a worker that is gone. Raises the error a worker wrote before
        it exited, or WorkerError."""
        assert self._dir is not None
        deadline = time.monotonic() + self.timeout_s
        while True:
            missing = [rank for rank in range(1, self.world)
                       if not (self._dir / f"ready.{rank}").exists()]
            if not missing:
                return
            for rank in missing:
                process = self.processes[rank - 1]
                if process.poll() is not None:
                    failure = self._dir / f"error.{rank}"
                    if failure.exists():
                        raise _raised(json.loads(failure.read_text()), rank)
                    raise WorkerError(f"worker {rank} (pid {process.pid}) exited with "
                                      f"{process.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise WorkerError(f"worker {missing[0]} was not ready in {self.timeout_s:g} s")
            time.sleep(0.05)

    def close(self) -> None:
        """Kill every worker (SIGTERM, SIGKILL after 5 s) and forget the group. No message is
        sent: a worker may be blocked sending its own, and nothing it holds needs saving."""
        self._group = None
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.processes = []
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def parts(self, ex: Executor, t: int, micro: list[dict[str, torch.Tensor]],
              log: RoundingLog | None, buffers: dict[str, torch.Tensor]) -> list[PartResult]:
        """Every micro-batch of step t (its examples `micro[i]`, its part of `log` in replay):
        the workers' computed by them, rank 0's here, each from `ex`'s parameters and the
        step's `buffers` (S_{t-1}'s, which `ex` holds when this is called).

        Raises WorkerError if a worker dies, does not answer in time or answers out of step
        (the group is then unusable until `start()`), or the micro-batch's own error
        (LogViolationError, ProgramError, ...) of the lowest micro-batch that met one.
        """
        if self._group is None:
            raise WorkerError("the worker group is not started")
        group, k = self._group, len(micro)
        self._group = None  # unusable unless this step's exchange completes
        start = {**ex.model_tensors(), **dict(ex.model.named_buffers())}  # every rank's
        model = {f"model.{n}": v for n, v in start.items()}
        try:
            for rank in range(1, self.world):
                mine = range(rank, k, self.world)
                tensors = dict(model)
                for i in mine:
                    tensors.update({f"{i}.example.{n}": v for n, v in micro[i].items()})
                    if log is not None:
                        tensors[f"{i}.log"] = _log_tensor(log.part(i))
                self.bytes_exchanged += _send(group, rank, {"kind": "step", "step": t, "parts": [
                    {"index": i, "first_site": log.first_site(i) if log is not None else 0}
                    for i in mine]}, tensors, self.timeout_s)
            results: dict[int, PartResult] = {}
            errors: dict[int, OvtError] = {}
            for i in range(0, k, self.world):
                try:
                    results[i] = ex.part(t, i, micro[i], None if log is None else log.part(i),
                                         buffers, first_site=0 if log is None else
                                         log.first_site(i))
                except OvtError as err:
                    errors[i] = err
            for rank in range(1, self.world):
                reply, tensors, size = _recv(group, rank, self.timeout_s)
                self.bytes_exchanged += size
                if reply.get("step") != t:
                    raise WorkerError(f"worker {rank} answered for step {reply.get('step')}, "
                                      f"not {t}")
                if "error" in reply:
                    errors[reply["index"]] = _raised(reply, rank)
                    continue
                for entry in reply["parts"]:
                    results[entry["index"]] = _part_of(entry, tensors, ex.device)
        except WorkerError as err:
            dead = [p.pid for p in self.processes if p.poll() is not None]
            raise WorkerError(f"step {t}: {err}"
                              + (f" (worker pid {', '.join(map(str, dead))} exited)"
                                 if dead else "")) from None
        self._group = group
        if errors:
            raise errors[min(errors)]
        return [results[i] for i in range(k)]


# ---------------------------------------------------------------------------------------------
# Workers


def _exit_with_parent() -> None:
    """End this worker as soon as the process that started it is gone (rank 0 killed while
    the worker waits to join, or computes)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="ovt-worker-parent-watch", daemon=True).start()


def serve(rank: int, world: int, rendezvous: Path, recipe: Recipe, timeout_s: float) -> int:
    """A worker's life: build the executor, join the group, then compute the micro-batches
    rank 0 sends, step after step, until its connection closes (exit 1) or it is killed."""
    _exit_with_parent()
    try:
        ex = recipe.build()
    except Exception as err:  # reported to rank 0, which raises it: not this process's trace
        atomic_write(rendezvous.parent / f"error.{rank}", json.dumps(_error_header(err)).encode())
        return 2
    atomic_write(rendezvous.parent / f"ready.{rank}", b"")
    try:
        group = _connect(rendezvous, rank, world)
    except RuntimeError:
        return 1  # rank 0 gave up on the group
    while True:
        try:
            header, tensors, _ = _recv(group, 0, timeout_s)
        except WorkerError:
            return 1  # rank 0 is gone
        t = header["step"]
        model = {n.removeprefix("model."): v.to(ex.device) for n, v in tensors.items()
                 if n.startswith("model.")}
        reply: dict = {"step": t, "parts": []}
        out: dict[str, torch.Tensor] = {}
        for entry in header["parts"]:
            i = entry["index"]
            examples = {n.removeprefix(f"{i}.example."): v.to(ex.device)
                        for n, v in tensors.items() if n.startswith(f"{i}.example.")}
            part_log = _log_of(tensors[f"{i}.log"]) if f"{i}.log" in tensors else None
            try:
                part = ex.part(t, i, examples, part_log, model, first_site=entry["first_site"])
            except Exception as err:  # the micro-batch's own failure: rank 0 raises it
                reply, out = {**_error_header(err), "step": t, "index": i}, {}
                break
            fields, part_tensors = _part_tensors(i, part)
            reply["parts"].append(fields)
            out.update(part_tensors)
        try:
            _send(group, 0, reply, out, timeout_s)
        except WorkerError:
            return 1
