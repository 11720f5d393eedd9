"""Turning an untrusted config mapping into a program's frozen config dataclass.

Built-in programs share this: unknown keys, wrong types and non-finite numbers are `ConfigError`
with the program name in the message; range checks live in each dataclass's `__post_init__`
(through `require`). A dict-typed field takes a mapping of plain values (what the canonical
encoding holds: None, bool, int, finite float, str, lists and str-keyed maps of those), copied.
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

# The most elements one tensor of a built-in program may have: its dataset, or one activation of
# one step (the batch times the per-example size of its widest layer). A peer's config must not
# make a node allocate what it likes before a step says so; 2**30 elements is 8 GiB in float64,
# the compute dtype — room for GPT-2 small's logits at batch 8 × 1024 positions (2**28.6).
MAX_TENSOR_ELEMENTS = 2**30


def config_from_mapping(cls: type[C], mapping: Mapping[str, Any] | None, program: str) -> C:
    """Build `cls` (a dataclass with int/float/str/dict fields) from `mapping`, checking every
    value.

    Ints are accepted for float fields (and converted); bools are never accepted as numbers. A
    dict field's value is deep-copied into plain dicts and lists (see the module docstring).
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


def require_tensor_size(elements: int, program: str, what: str) -> None:
    """Raise ConfigError unless a tensor of `elements` fits MAX_TENSOR_ELEMENTS; `what` names
    it (and the config keys it comes from)."""
    require(elements <= MAX_TENSOR_ELEMENTS, program,
            f"{what} would have {elements:,} elements, more than the {MAX_TENSOR_ELEMENTS:,} a "
            f"built-in may allocate")


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
    if typing.get_origin(expected) is dict or expected is dict:
        require(isinstance(value, Mapping), program,
                f"{name} must be a mapping, got {type(value).__name__} {value!r}")
        return _plain(program, name, value)
    raise ConfigError(f"{program}: {name} must be {expected.__name__}, "
                      f"got {type(value).__name__} {value!r}")


def _plain(program: str, where: str, value: Any) -> Any:
    """A deep copy of `value` as plain dicts, lists and scalars; ConfigError naming the first
    place holding anything else (a non-str key, a NaN or infinity, an object)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        require(-(2**63) <= value < 2**64, program, f"{where} is out of range: {value!r}")
        return int(value)
    if isinstance(value, float):
        require(math.isfinite(value), program, f"{where} must be finite, got {value!r}")
        return float(value)
    if isinstance(value, list | tuple):
        return [_plain(program, f"{where}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        require(not bad, program, f"{where} has a key that is not a string: {bad[:1]!r}")
        return {k: _plain(program, f"{where}.{k}", v) for k, v in value.items()}
    raise ConfigError(f"{program}: {where} holds a {type(value).__name__}, not a plain value "
                      f"(None, bool, int, float, str, list or mapping)")
