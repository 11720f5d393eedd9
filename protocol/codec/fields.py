"""Field checks for objects decoded from canonical bytes (SPEC §2: objects built from the wire
validate themselves on construction).

Each check raises EncodingError naming the field and describing what it got (never echoing a
peer's bytes), so every wire object reports a bad field the same way.
"""

from __future__ import annotations

from typing import Any

from protocol.codec.canonical import PROTOCOL_VERSION
from protocol.errors import EncodingError

MAX_UINT = 2**63 - 1  # every count, step and size fits a signed 64-bit integer (SQLite, msgpack)


def require_bytes(name: str, value: object, size: int) -> None:
    """`value` is a bytes object of exactly `size` bytes."""
    if type(value) is not bytes or len(value) != size:
        raise EncodingError(f"{name} must be {size} bytes, got {describe(value)}")


def require_uint(name: str, value: object, minimum: int = 0, maximum: int = MAX_UINT) -> None:
    """`value` is an int (not a bool, not a float) in [minimum, maximum]."""
    if type(value) is not int or not minimum <= value <= maximum:
        raise EncodingError(f"{name} must be an integer in [{minimum}, {maximum}], "
                            f"got {describe(value)}")


def require_version(what: str, value: object) -> None:
    """`value` is PROTOCOL_VERSION as an int: never `True` or `1.0`, which compare equal to it
    but are other bytes (SPEC §2)."""
    if type(value) is not int or value != PROTOCOL_VERSION:
        raise EncodingError(f"{what} has protocol version {describe(value)}, this ovt speaks "
                            f"{PROTOCOL_VERSION}")


def require_fields(what: str, body: object, fields: tuple[str, ...]) -> dict[str, Any]:
    """`body` is a map with exactly `fields` as keys; returns it typed as such."""
    if not isinstance(body, dict):
        raise EncodingError(f"{what} must be a map, got {describe(body)}")
    if set(body) != set(fields):
        missing, extra = sorted(set(fields) - set(body)), sorted(set(body) - set(fields), key=str)
        raise EncodingError(f"{what} has the wrong fields (missing {missing}, unexpected {extra})")
    return body


def describe(value: object) -> str:
    """A short description of a value for an error message: its type, and a scalar's value."""
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    if isinstance(value, int | float | bool) or value is None:
        return f"{type(value).__name__} {value!r}"
    return type(value).__name__


def abbrev(digest: bytes) -> str:
    """The first 16 hex digits of a hash, for a readable message."""
    return digest.hex()[:16] + "…"


def hex_or_repr(value: object) -> str:
    """A bytes value in hex, anything else as its repr (for a field that may be None)."""
    return value.hex() if isinstance(value, bytes) else repr(value)
