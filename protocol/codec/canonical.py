"""The one canonical encoding of every hashed or signed object (SPEC §2: one byte string per value).

Values form a small, closed data model, checked by *exact* type:

    None, bool, int (-2**63 .. 2**64-1), float (not NaN), str, bytes,
    list or tuple (an array; decoded as list), dict with str keys (a map).

Subclasses (IntEnum, StrEnum, numpy scalars, OrderedDict...) are rejected, not silently
converted: convert them first. The bytes are msgpack (`use_bin_type=True`), with three rules that
make them canonical:

- map keys sorted by their UTF-8 bytes;
- ints in msgpack's minimal form (fixint, else the narrowest uint8..uint64 for a non-negative
  value, the narrowest int8..int64 for a negative one);
- floats always as float64 (0xcb), never float32; NaN is rejected (it has many bit patterns),
  while ±inf and -0.0 are ordinary values.

`decode` is strict: it rejects ext types (the msgpack timestamp included), non-str map keys,
invalid UTF-8, trailing bytes, input over `max_bytes`, nesting deeper than `MAX_DEPTH`, and then
re-encodes what it read and requires the very same bytes. That last check rejects every other
non-canonical form at once (a non-minimal int, a float32, unsorted or duplicate keys, a long
header for a short string...). Every failure on untrusted bytes is an `EncodingError`.

>>> encode({"b": 1, "a": [True, None]}).hex()
'82a16192c3c0a16201'
>>> decode(bytes.fromhex("82a16192c3c0a16201"))
{'a': [True, None], 'b': 1}

The same map with its keys unsorted is rejected:

>>> decode(bytes.fromhex("82a16201a16192c3c0"))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
protocol.errors.EncodingError: non-canonical encoding: ... differs at byte 2 ...
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import TypeVar

import msgpack

from protocol.errors import EncodingError

# The version of the protocol every signed or hashed object is made under (SPEC §2); an object
# made under another version is refused.
PROTOCOL_VERSION = 3  # 2: micro-batches, data files, schedules, RNG keys per micro-batch;
# 3: micro-batch parts in the log, each micro-batch from the step's buffers (SPEC §3.5)
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1
MAX_DEPTH = 64  # nesting of arrays and maps; ovt's objects are a few levels deep
DEFAULT_MAX_BYTES = 64 * 2**20

_SCALARS = (type(None), bool, str, bytes)

T = TypeVar("T")


def encode(value: object) -> bytes:
    """The canonical bytes of `value` (rules in the module docstring).

    Raises TypeError for a value outside the data model (a type not listed, a subclass, a non-str
    map key) and ValueError for an allowed type with a forbidden value (int out of range, NaN,
    a str that is not valid Unicode, nesting deeper than MAX_DEPTH).
    """
    return msgpack.packb(_canonical(value, 0), use_bin_type=True, use_single_float=False,
                         strict_types=True)


def digest(value: object) -> bytes:
    """SHA-256 of `encode(value)`: the hash of an object (SPEC §2). Raises as `encode`."""
    return hashlib.sha256(encode(value)).digest()


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> object:
    """The value whose canonical encoding is exactly `data`.

    `data` is bytes, bytearray or memoryview (anything else is a TypeError: a programming error).
    Raises EncodingError for input that is empty, over `max_bytes`, malformed, truncated, followed
    by trailing bytes, outside the data model, or not in canonical form.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"decode takes bytes, not {type(data).__name__}")
    data = bytes(data)
    if len(data) > max_bytes:
        raise EncodingError(f"encoded object of {len(data)} bytes exceeds the limit of "
                            f"{max_bytes} bytes")
    if not data:
        raise EncodingError("empty input: no encoded value")
    value = _unpack(data)
    try:
        canonical = encode(value)
    except (TypeError, ValueError) as exc:
        raise EncodingError(f"decoded value is outside the data model: {exc}") from exc
    if canonical != data:
        raise EncodingError(f"non-canonical encoding: re-encoding the decoded value differs at "
                            f"byte {_first_difference(data, canonical)} ({len(data)} bytes in, "
                            f"{len(canonical)} bytes canonical)")
    return value


def decode_object(data: bytes, build: Callable[[object], T], reencode: Callable[[T], bytes], *,
                  what: str, max_bytes: int = DEFAULT_MAX_BYTES) -> T:
    """The object whose encoding is exactly `data`: `build` (decoded value → object) applied to
    `decode(data)`, accepted only if `reencode(object)` gives back `data` byte for byte.

    This is the one strictness rule every decoder of untrusted bytes applies (SPEC §2: one byte
    string per value). `decode` alone makes the *value* canonical, but an object can still be
    built from a value that is not its own: `True` or `1.0` where an int belongs compares equal
    to 1, so without this check two byte strings (two hashes, two ids) would decode to one
    object. `build` raises EncodingError for a value of the wrong shape. Raises EncodingError
    as `decode` does, and when the object re-encodes to other bytes.
    """
    obj = build(decode(data, max_bytes=max_bytes))
    if reencode(obj) != bytes(data):
        raise EncodingError(f"{what} does not re-encode to its own bytes (a field holds an alias "
                            f"of its value, e.g. true or 1.0 for 1)")
    return obj


def _unpack(data: bytes) -> object:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True,
                               ext_hook=_reject_ext)
    except EncodingError:
        raise
    except msgpack.ExtraData as exc:
        raise EncodingError(f"trailing bytes after the encoded value ({len(exc.extra)} "
                            f"bytes)") from exc
    except Exception as exc:  # untrusted bytes: every msgpack failure is an EncodingError
        detail = str(exc) or "invalid type byte"
        raise EncodingError(f"malformed msgpack: {type(exc).__name__}: {detail}") from exc


def _reject_ext(code: int, payload: bytes) -> object:
    raise EncodingError(f"msgpack ext type {code} is not part of the data model")


def _canonical(value: object, depth: int) -> object:
    """`value` rebuilt with plain lists and key-sorted dicts, every element checked."""
    kind = type(value)
    if kind in _SCALARS:
        if type(value) is str:
            value.encode("utf-8")  # raises UnicodeEncodeError (a ValueError) on a lone surrogate
        return value
    if type(value) is int:
        if not INT_MIN <= value <= INT_MAX:
            raise ValueError(f"int {value} is outside the encodable range [-2**63, 2**64-1]")
        return value
    if type(value) is float:
        if math.isnan(value):
            raise ValueError("NaN cannot be encoded (it has no single canonical form)")
        return value
    if type(value) is list or type(value) is tuple or type(value) is dict:
        if depth >= MAX_DEPTH:
            raise ValueError(f"value nested deeper than {MAX_DEPTH} levels")
        if type(value) is dict:
            return _canonical_map(value, depth)
        return [_canonical(item, depth + 1) for item in value]
    raise TypeError(f"cannot encode a {kind.__name__}: allowed are None, bool, int, float, str, "
                    f"bytes, list, tuple and dict with str keys (exact types, no subclasses)")


def _canonical_map(value: dict, depth: int) -> dict:
    items = []
    for key, item in value.items():
        if type(key) is not str:
            raise TypeError(f"map keys must be str, not {type(key).__name__} ({key!r})")
        items.append((key.encode("utf-8"), key, _canonical(item, depth + 1)))
    items.sort(key=lambda entry: entry[0])
    return {key: item for _, key, item in items}


def _first_difference(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))
