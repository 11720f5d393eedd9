"""Turning an untrusted config mapping into a program's frozen config dataclass.

Built-in programs share this: unknown keys, wrong types and non-finite numbers are `ConfigError`
with the program name in the message; range checks live in each dataclass's `__post_init__`
(through `require`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from protocol.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def config_from_mapping(cls: type[C], mapping: Mapping[str, Any] | None, program: str) -> C:
    """Build `cls` (a dataclass with int/float/str fields) from `mapping`, checking every value.

    Ints are accepted for float fields (and converted); bools are never accepted as numbers.
    Raises ConfigError for a non-mapping, an unknown key, a wrong type or a failed range check.
    """
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{program}: config must be a mapping, got {type(mapping).__name__}")
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in mapping if k not in known)
    if unknown:
        raise ConfigError(f"{program}: unknown config key(s) {', '.join(unknown)}; "
                          f"known keys: {', '.join(known)}")
    values = {name: _check_type(program, name, value, hints[name])
              for name, value in mapping.items()}
    return cls(**values)


def require(condition: bool, program: str, message: str) -> None:
    """Raise ConfigError(`program: message`) unless `condition` holds."""
    if not condition:
        raise ConfigError(f"{program}: {message}")


def _check_type(program: str, name: str, value: Any, expected: type) -> Any:
    if expected is float and isinstance(value, int | float) and not isinstance(value, bool):
        require(math.isfinite(value), program, f"{name} must be finite, got {value!r}")
        return float(value)
    if expected is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if expected is str and isinstance(value, str):
        return value
    raise ConfigError(f"{program}: {name} must be {expected.__name__}, "
                      f"got {type(value).__name__} {value!r}")
