"""Finding a training program from a reference string, and the source bytes a job spec hashes.

A reference is one of
- a built-in name: "image-cnn", "char-transformer", "token-lm", "hf-causal-lm" (the last needs
  the optional `hf` extra, transformers, which its module imports only when it builds);
- "package.module:function", imported with importlib;
- "path/to/file.py:function", loaded from that file.

The function is a `ProgramFactory`: config mapping -> `TrainingProgram`.

    >>> program = load_program("image-cnn", {"channels": 8}, preset="test")
    >>> program.config["channels"]
    8
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from protocol.engine.programs import char_transformer, hf_causal_lm, image_cnn, token_lm
from protocol.engine.programs.base import ProgramFactory, TrainingProgram
from protocol.errors import ConfigError, OvtError, ProgramError

BUILTIN: dict[str, ProgramFactory] = {
    image_cnn.NAME: image_cnn.build,
    char_transformer.NAME: char_transformer.build,
    token_lm.NAME: token_lm.build,
    hf_causal_lm.NAME: hf_causal_lm.build,
}
_BUILTIN_MODULES: dict[str, ModuleType] = {
    image_cnn.NAME: image_cnn,
    char_transformer.NAME: char_transformer,
    token_lm.NAME: token_lm,
    hf_causal_lm.NAME: hf_causal_lm,
}
_PARAMETER_COUNTS: dict[str, Callable[[Mapping[str, Any] | None], int]] = {
    image_cnn.NAME: image_cnn.parameter_count,
    char_transformer.NAME: char_transformer.parameter_count,
    token_lm.NAME: token_lm.parameter_count,
    hf_causal_lm.NAME: hf_causal_lm.parameter_count,
}


def load_program(ref: str, config: Mapping[str, Any] | None = None,
                 preset: str | None = None) -> TrainingProgram:
    """Build the program `ref` names with `config` laid over the module's PRESETS[preset].

    Raises ProgramError if `ref` cannot be resolved or the factory fails or returns something
    other than a TrainingProgram; ConfigError for an unknown preset or a config the factory
    rejects.
    """
    module, factory = _resolve(ref)
    merged = {**_preset(module, ref, preset), **(config or {})}
    try:
        program = factory(merged)
    except OvtError:
        raise
    except Exception as exc:
        raise ProgramError(f"program {ref!r} failed to build: {type(exc).__name__}: {exc}") \
            from exc
    if not isinstance(program, TrainingProgram):
        raise ProgramError(f"program {ref!r} returned {type(program).__name__}, "
                           f"not a TrainingProgram")
    return program


def require_allowed(ref: str, allowed: Collection[str], node: str) -> None:
    """Refuse a program this node may not load. Loading a program imports its code here, so a
    node loads only the built-ins and the references its operator named (`--allow-program`),
    never one a peer chose. `node` names the node in the message. Raises ConfigError."""
    if ref not in BUILTIN and ref not in allowed:
        raise ConfigError(f"program {ref!r} is not allowed on this {node} (built-ins: "
                          f"{', '.join(sorted(BUILTIN))}; the operator allows others with "
                          f"--allow-program)")


def parameter_count(ref: str, config: Mapping[str, Any] | None) -> int | None:
    """How many parameters the built-in `ref` makes under `config`, from the config alone:
    nothing is built or allocated, so a node can bound the model a peer's spec asks for before
    it builds it. None for a program that is not built-in (only building it tells). Raises
    ConfigError for a config the built-in rejects."""
    count = _PARAMETER_COUNTS.get(ref)
    return None if count is None else count(config)


def program_source(ref: str) -> bytes:
    """The source bytes of the module `ref` names (a built-in's module, the module or the file).

    Only that one file: code it imports is not included. Does not import user modules (only
    their parent packages). Raises ProgramError if the source cannot be found or read.
    """
    if ref in _BUILTIN_MODULES:
        return _read(ref, _BUILTIN_MODULES[ref].__file__)
    target, _ = _split(ref)
    if _is_file(target):
        return _read(ref, target)
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError) as exc:
        raise ProgramError(f"program {ref!r}: cannot find module {target!r}: {exc}") from exc
    if spec is None or not spec.has_location or spec.origin is None:
        raise ProgramError(f"program {ref!r}: module {target!r} has no source file")
    return _read(ref, spec.origin)


def _resolve(ref: str) -> tuple[ModuleType, ProgramFactory]:
    if ref in BUILTIN:
        return _BUILTIN_MODULES[ref], BUILTIN[ref]
    target, function = _split(ref)
    module = _load_file(ref, target) if _is_file(target) else _import(ref, target)
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ProgramError(f"program {ref!r}: {target!r} has no function {function!r}")
    return module, factory


def _split(ref: str) -> tuple[str, str]:
    """'target:function' -> (target, function); anything else is an unknown program."""
    target, sep, function = ref.rpartition(":")
    if not sep or not target or not function.isidentifier():
        raise ProgramError(f"unknown program {ref!r}: expected a built-in name "
                           f"({', '.join(BUILTIN)}), 'package.module:function' or "
                           f"'path/to/file.py:function'")
    return target, function


def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _import(ref: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except Exception as exc:
        raise ProgramError(f"program {ref!r}: cannot import {name!r}: "
                           f"{type(exc).__name__}: {exc}") from exc


def _load_file(ref: str, path: str) -> ModuleType:
    """Execute the file as a module registered under a name derived from its resolved path."""
    resolved = Path(path).resolve()
    if not resolved.is_file():
        raise ProgramError(f"program {ref!r}: no such file {path!r}")
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:16]
    name = f"ovt_user_program_{digest}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ProgramError(f"program {ref!r}: cannot load {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ProgramError(f"program {ref!r}: error while loading {path!r}: "
                           f"{type(exc).__name__}: {exc}") from exc
    return module


def _preset(module: ModuleType, ref: str, preset: str | None) -> dict[str, Any]:
    if preset is None:
        return {}
    presets = getattr(module, "PRESETS", None)
    if not isinstance(presets, Mapping) or preset not in presets:
        known = ", ".join(presets) if isinstance(presets, Mapping) else "none"
        raise ConfigError(f"program {ref!r} has no preset {preset!r} (presets: {known})")
    return dict(presets[preset])


def _read(ref: str, path: str | None) -> bytes:
    if path is None:
        raise ProgramError(f"program {ref!r} has no source file")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ProgramError(f"program {ref!r}: cannot read source {path!r}: {exc}") from exc
