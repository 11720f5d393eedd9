"""Training state S_t: its canonical encoding and its hash h_t (SPEC §2 "State").

S_t is a flat mapping of names to tensors: `model.<state_dict key>` for parameters and buffers,
`optim.<parameter name>.<state key>` for optimizer state, and `step` (int64 scalar). The canonical
encoding sorts names and writes each tensor as (name, dtype, shape, little-endian raw bytes in
logical row-major order):

    b"OVTS" u8 version=1 u32 count
    per tensor: u16 len(name) name(utf-8) u8 len(dtype) dtype(ascii) u8 ndim u64*ndim shape
                u64 nbytes raw bytes

All integers little-endian. `h_t = sha256(encoding)`. The hash streams the same chunks the
encoder joins (one definition, so the two cannot drift) and hashes tensor memory through a numpy
view, without copying it into Python bytes.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from protocol.codec.dtypes import DTYPES
from protocol.errors import StateFormatError

MAGIC = b"OVTS"
VERSION = 1

_NAMES = {v: k for k, v in DTYPES.items()}
# numpy cannot hold bfloat16: its bytes travel as int16 of the same width.
_BYTE_VIEW = {torch.bfloat16: torch.int16}
# Equality is on bits: NaN payloads and the sign of zero count (torch.equal says -0.0 == 0.0).
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}

if sys.byteorder != "little":  # raw tensor bytes are hashed as they sit in memory
    raise ImportError("ovt's canonical state encoding needs a little-endian machine")

State = Mapping[str, torch.Tensor]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of `t` in logical row-major order, zero-copy on CPU."""
    t = t.detach().to("cpu").contiguous().reshape(-1)  # 1-D: memoryview cannot cast (0, 7)
    t = t.view(_BYTE_VIEW.get(t.dtype, t.dtype))
    return t.numpy().data.cast("B")


def _chunks(state: State) -> Iterator[bytes | memoryview]:
    yield MAGIC + struct.pack("<BI", VERSION, len(state))
    for name in sorted(state):
        t = state[name]
        if t.dtype not in _NAMES:
            raise TypeError(f"state tensor {name!r} has unsupported dtype {t.dtype}")
        name_b, dtype_b = name.encode("utf-8"), _NAMES[t.dtype].encode("ascii")
        data = tensor_bytes(t)
        yield (struct.pack("<H", len(name_b)) + name_b + struct.pack("<B", len(dtype_b)) + dtype_b
               + struct.pack(f"<B{t.dim()}Q", t.dim(), *t.shape) + struct.pack("<Q", data.nbytes))
        yield data


def state_digest(state: State) -> bytes:
    """h_t: sha256 of the canonical encoding of `state`."""
    h = hashlib.sha256()
    for chunk in _chunks(state):
        h.update(chunk)
    return h.digest()


def encode_state(state: State) -> bytes:
    """The canonical encoding of `state` (the bytes `state_digest` hashes)."""
    return b"".join(bytes(c) for c in _chunks(state))


def decode_state(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `encode_state`; strict: bad magic, truncation, unsorted names or trailing bytes
    raise `StateFormatError`. Never unpickles anything (SPEC §4)."""
    view, pos = memoryview(data), 0

    def take(n: int) -> memoryview:
        nonlocal pos
        if n < 0 or pos + n > len(view):
            raise StateFormatError(f"state encoding truncated at byte {pos} (needs {n} more)")
        pos += n
        return view[pos - n:pos]

    if bytes(take(4)) != MAGIC:
        raise StateFormatError("not an ovt state encoding (bad magic)")
    version, count = struct.unpack("<BI", take(5))
    if version != VERSION:
        raise StateFormatError(f"unsupported state encoding version {version}")
    state: dict[str, torch.Tensor] = {}
    previous = None
    for _ in range(count):
        (n,) = struct.unpack("<H", take(2))
        try:
            name = bytes(take(n)).decode("utf-8", errors="strict")
        except UnicodeDecodeError:
            raise StateFormatError(f"state tensor name at byte {pos - n} is not UTF-8") from None
        if previous is not None and name <= previous:
            raise StateFormatError(f"state names not strictly sorted at {name!r}")
        (n,) = struct.unpack("<B", take(1))
        dtype = DTYPES.get(bytes(take(n)).decode("ascii", errors="replace"))
        if dtype is None:
            raise StateFormatError(f"state tensor {name!r} has an unknown dtype")
        (ndim,) = struct.unpack("<B", take(1))
        shape = struct.unpack(f"<{ndim}Q", take(8 * ndim))
        (nbytes,) = struct.unpack("<Q", take(8))
        numel = int(np.prod(shape, dtype=object)) if shape else 1
        if nbytes != numel * dtype.itemsize:
            raise StateFormatError(f"state tensor {name!r}: {nbytes} bytes for shape {shape}")
        raw = bytearray(take(nbytes))
        flat = torch.frombuffer(raw, dtype=_BYTE_VIEW.get(dtype, dtype)) if nbytes else \
            torch.empty(0, dtype=_BYTE_VIEW.get(dtype, dtype))
        state[name] = flat.view(dtype).reshape(shape)
        previous = name
    if pos != len(view):
        raise StateFormatError(f"{len(view) - pos} trailing bytes after the state encoding")
    return state


def states_equal(a: State, b: State) -> bool:
    """Bit-exact equality of two states (same names, dtypes, shapes and bits)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].cpu().view(_BITS.get(a[k].dtype, a[k].dtype)),
                        b[k].cpu().view(_BITS.get(b[k].dtype, b[k].dtype)))
        for k in a)
