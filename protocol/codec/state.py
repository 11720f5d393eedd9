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

Two decoders take a state from untrusted bytes: `decode_state` (the canonical encoding) and
`load_safetensors` (a checkpoint, an S_0, evidence). Both build every tensor through one
function, `_tensor`, so both refuse the same things with a `StateFormatError` before torch sees
them: a dtype outside `DTYPES`, a shape torch cannot hold, a byte count that does not fit the
shape, bool bytes other than 0 and 1. `safetensors_file_digest` hashes the state in a
safetensors file without loading it (a submitted S_0, where it lies on disk): the same
checks, on the same header parse, one chunk in memory at a time.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import safetensors
import torch

from protocol.codec.dtypes import DTYPES, SAFETENSORS_DTYPES
from protocol.errors import StateFormatError

MAGIC = b"OVTS"
VERSION = 1
FILE_CHUNK_BYTES = 1 << 20  # what `safetensors_file_digest` reads at a time

_NAMES = {v: k for k, v in DTYPES.items()}
# numpy cannot hold bfloat16: its bytes travel as int16 of the same width.
_BYTE_VIEW = {torch.bfloat16: torch.int16}
# Equality is on bits: NaN payloads and the sign of zero count (torch.equal says -0.0 == 0.0).
_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}
# torch counts a tensor's elements, and each dimension, in an int64: it multiplies the
# dimensions in order and refuses an overflow even when a later dimension is 0.
MAX_ELEMENTS = 2**63 - 1

if sys.byteorder != "little":  # raw tensor bytes are hashed as they sit in memory
    raise ImportError("ovt's canonical state encoding needs a little-endian machine")

State = Mapping[str, torch.Tensor]


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of `t` in logical row-major order, zero-copy on CPU."""
    t = t.detach().to("cpu").contiguous().reshape(-1)  # 1-D: memoryview cannot cast (0, 7)
    t = t.view(_BYTE_VIEW.get(t.dtype, t.dtype))
    return t.numpy().data.cast("B")


def _chunks(state: State) -> Iterator[bytes | memoryview]:
    yield _encoding_head(len(state))
    for name in sorted(state):
        t = state[name]
        if t.dtype not in _NAMES:
            raise TypeError(f"state tensor {name!r} has unsupported dtype {t.dtype}")
        data = tensor_bytes(t)
        yield _tensor_head(name, t.dtype, list(t.shape), data.nbytes)
        yield data


def _encoding_head(count: int) -> bytes:
    """The encoding's first bytes: magic, version, tensor count."""
    return MAGIC + struct.pack("<BI", VERSION, count)


def _tensor_head(name: str, dtype: torch.dtype, shape: list[int], nbytes: int) -> bytes:
    """The bytes before one tensor's raw bytes: name, dtype, shape, byte count. Raises
    StateFormatError for a name or a shape the encoding cannot hold."""
    name_b, dtype_b = name.encode("utf-8"), _NAMES[dtype].encode("ascii")
    _require_encodable(name, len(name_b), len(shape))
    return (struct.pack("<H", len(name_b)) + name_b + struct.pack("<B", len(dtype_b)) + dtype_b
            + struct.pack(f"<B{len(shape)}Q", len(shape), *shape) + struct.pack("<Q", nbytes))


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
    """Inverse of `encode_state`; strict, so a decoded state re-encodes to exactly `data`:
    bad magic, truncation, unsorted names, an unknown dtype, an impossible shape, a byte count
    that does not fit the shape, bool bytes other than 0 and 1, or trailing bytes raise
    `StateFormatError`, and nothing else does. Never unpickles anything (SPEC §4)."""
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
        state[name] = _tensor(name, bytearray(take(nbytes)), dtype, list(shape))
        previous = name
    if pos != len(view):
        raise StateFormatError(f"{len(view) - pos} trailing bytes after the state encoding")
    return state


def load_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    """A state from safetensors bytes (a peer's S_0 or S_t, a stored checkpoint, evidence),
    strictly and without pickle (SPEC §4): the safetensors parser reads the header and slices
    the data, and every tensor is then built by `_tensor`, only in a dtype of `DTYPES`.

    The one way ovt reads safetensors it did not just write: torch itself would answer a U16,
    C64 or F8 tensor, or a shape such as (0, 2**64 - 1), with its own TypeError, KeyError or
    RuntimeError. Raises StateFormatError for malformed or truncated bytes, a dtype outside
    `DTYPES`, or any tensor `_tensor` refuses; never anything else.
    """
    try:
        views = safetensors.deserialize(bytes(data))
    except safetensors.SafetensorError as err:
        raise StateFormatError(f"not a safetensors state: {err}") from None
    state: dict[str, torch.Tensor] = {}
    for name, view in views:
        dtype = _safetensors_dtype(name, view["dtype"])
        _require_encodable(name, len(name.encode("utf-8")), len(view["shape"]))
        state[name] = _tensor(name, view["data"], dtype, view["shape"])
    return state


def safetensors_file_digest(path: str | Path) -> bytes:
    """h_t of the state in the safetensors file at `path`, read FILE_CHUNK_BYTES at a time,
    never whole: `state_digest(load_safetensors(data))` for the file's bytes `data`, and
    refusing exactly what `load_safetensors` refuses (how a trainer checks a submitted S_0
    against h_0 where it lies on disk, however large).

    The safetensors parser checks the header, as it does for `load_safetensors` (`safe_open`
    and `deserialize` run the same header check: size, JSON, offsets covering the data
    exactly); each tensor's dtype, name, shape and byte count pass the same checks as there,
    and bool bytes are 0 or 1. Raises StateFormatError for anything else, OSError as the file
    does.
    """
    try:
        with safetensors.safe_open(str(path), framework="numpy") as checked:
            parsed = {name: (checked.get_slice(name).get_dtype(),
                             checked.get_slice(name).get_shape()) for name in checked.keys()}
    except safetensors.SafetensorError as err:
        raise StateFormatError(f"not a safetensors state: {err}") from None
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        entries = _offsets(f.read(header_size), parsed)
        h = hashlib.sha256(_encoding_head(len(entries)))
        for name in sorted(entries):
            dtype, shape = _safetensors_dtype(name, parsed[name][0]), parsed[name][1]
            begin, end = entries[name]
            _require_layout(name, end - begin, dtype, shape)
            h.update(_tensor_head(name, dtype, shape, end - begin))
            f.seek(8 + header_size + begin)
            for offset in range(begin, end, FILE_CHUNK_BYTES):
                raw = f.read(min(FILE_CHUNK_BYTES, end - offset))
                if dtype == torch.bool:
                    _require_bool_bytes(name, raw)
                h.update(raw)
    return h.digest()


def _offsets(header: bytes, parsed: dict[str, tuple[str, list[int]]]) -> dict[str, list[int]]:
    """Each tensor's (begin, end) data offsets from a safetensors header that the safetensors
    parser has checked and read as `parsed` (name: dtype, shape), which does not give them.
    Raises StateFormatError should this JSON read differently here (names, dtypes, shapes)."""
    try:
        entries = json.loads(header)
        entries.pop("__metadata__", None)
        if {name: (e["dtype"], e["shape"]) for name, e in entries.items()} == parsed:
            return {name: e["data_offsets"] for name, e in entries.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    raise StateFormatError("the safetensors header reads differently as JSON than in the "
                           "safetensors parser")


def _safetensors_dtype(name: str, dtype: str) -> torch.dtype:
    """The dtype of a safetensors tensor; StateFormatError for one outside `DTYPES`."""
    if dtype not in SAFETENSORS_DTYPES:
        raise StateFormatError(f"safetensors tensor {name!r} has dtype {dtype!r}, not one of "
                               f"{', '.join(SAFETENSORS_DTYPES)}")
    return SAFETENSORS_DTYPES[dtype]


def _require_encodable(name: str, name_bytes: int, ndim: int) -> None:
    """The canonical encoding holds a name of at most 65535 bytes (u16) and at most 255
    dimensions (u8): anything larger has no h_t, so it is not a state (StateFormatError)."""
    if name_bytes > 0xFFFF:
        raise StateFormatError(f"state tensor name {name[:40]!r}… is {name_bytes} bytes long, "
                               f"over the 65535 the encoding holds")
    if ndim > 0xFF:
        raise StateFormatError(f"state tensor {name[:40]!r} has {ndim} dimensions, over the 255 "
                               f"the encoding holds")


def _tensor(name: str, raw: bytearray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` whose little-endian row-major bytes are `raw` (which
    becomes its memory). Raises StateFormatError as `_require_layout` and, for bool,
    `_require_bool_bytes`."""
    _require_layout(name, len(raw), dtype, shape)
    if dtype == torch.bool:
        _require_bool_bytes(name, raw)
    storage = _BYTE_VIEW.get(dtype, dtype)
    flat = torch.frombuffer(raw, dtype=storage) if raw else torch.empty(0, dtype=storage)
    return flat.view(dtype).reshape(shape)


def _require_layout(name: str, nbytes: int, dtype: torch.dtype, shape: list[int]) -> None:
    """Raises StateFormatError for a shape torch cannot hold (a dimension or the product of the
    non-zero dimensions over MAX_ELEMENTS) or a byte count other than the shape's."""
    numel = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise StateFormatError(f"state tensor {name!r} has a bad shape")
        numel *= max(dim, 1)
        if numel > MAX_ELEMENTS:
            raise StateFormatError(f"state tensor {name!r}: shape {tuple(shape)} is beyond what "
                                   f"torch holds (non-zero dimensions multiply past 2**63 - 1)")
    numel = numel if all(shape) else 0
    if nbytes != numel * dtype.itemsize:
        raise StateFormatError(f"state tensor {name!r}: {nbytes} bytes for shape "
                               f"{tuple(shape)} of {dtype}")


def _require_bool_bytes(name: str, raw: bytes | bytearray) -> None:
    """Raises StateFormatError for a bool byte other than 0 and 1 (another byte string for
    the same value)."""
    if raw.translate(None, b"\x00\x01"):
        raise StateFormatError(f"state tensor {name!r}: a bool byte other than 0 or 1")


def states_equal(a: State, b: State) -> bool:
    """Bit-exact equality of two states (same names, dtypes, shapes and bits)."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].cpu().view(_BITS.get(a[k].dtype, a[k].dtype)),
                        b[k].cpu().view(_BITS.get(b[k].dtype, b[k].dtype)))
        for k in a)
