"""User data: a job's dataset read from a file, committed per example like a built-in's (SPEC §2.1).

Two kinds of file, each an `ExampleSource`:

- "tokens" (`TokenFile`): a flat file of token ids as nanoGPT writes them, `.bin` (raw
  little-endian ids of the dtype given, uint16 or int32) or `.npy` (1-D, uint16 or int32 by its
  header). It is memory-mapped, never read whole. Example i is the window
  {"tokens": int64 tokens[i*window : i*window + window + 1]}: non-overlapping windows of
  `window + 1` tokens at stride `window`, the field and layout of the built-in language models
  ("char-transformer", "token-lm"), so they train on a user's tokens.
- "tensors" (`TensorFile`): a safetensors file of named tensors that share their first
  dimension N >= 1 (e.g. "image" (N, C, H, W) float32, "label" (N,) int64); example i is
  {name: t[i]}. It is read whole, through `protocol.codec.state.load_safetensors`, ovt's one
  reader of safetensors (never pickle), so only the dtypes every example hash can encode pass.

A job names its file with a `DataFile` (part of the job spec): a relative path, resolved inside
one directory — the job file's at creation, the one a node's operator offers on a node
(`--data-dir`). `resolve_data_path` refuses a path that leaves it, by `..`, by being absolute or
through a symbolic link, so a peer's spec can never make a node read a file its operator did
not offer. A party that does not read the file (the arbiter, which takes each batch's examples
from the parties with inclusion proofs, SPEC §5.3) stands in `AbsentExamples`.

Every problem with a file is a ConfigError that names the file and the problem.

    >>> DataFile("tokens", "data/train.bin", "uint16", 256).to_body()["window"]
    256
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch

from protocol.codec.dtypes import dtype_name
from protocol.codec.fields import describe, require_fields, require_uint
from protocol.codec.state import load_safetensors
from protocol.commit.data import DataCommitment, ExampleSource, commit_dataset
from protocol.commit.merkle import MerkleTree
from protocol.errors import ConfigError, EncodingError, StateFormatError

TOKENS, TENSORS = "tokens", "tensors"
KINDS = (TOKENS, TENSORS)
TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "int32": np.dtype("<i4")}
TOKEN_SUFFIXES = (".bin", ".npy")
TOKEN_FIELD = "tokens"
MAX_PATH_CHARS = 1024
MAX_WINDOW = 2**31
_FIELDS = {TOKENS: ("kind", "path", "dtype", "window"), TENSORS: ("kind", "path")}
_SCAN_TOKENS = 1 << 22  # tokens checked for negative ids at a time (16 MiB of int32)
_CACHED_COMMITMENTS = 4


@dataclass(frozen=True)
class DataFile:
    """Which file a job's examples come from, and how they are cut (in the job spec).

    kind: "tokens" or "tensors". path: relative, in POSIX normal form ("data/train.bin": no
    "..", ".", empty or absolute parts, no backslash). dtype and window: a token file's id dtype
    ("uint16" or "int32") and window (each example holds window + 1 tokens); None for tensors.
    Raises ConfigError for anything else.
    """

    kind: str
    path: str
    dtype: str | None = None
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"data kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        require_relative_path(self.path)
        if self.kind == TENSORS:
            if self.dtype is not None or self.window is not None:
                raise ConfigError("a tensors data file takes no dtype or window")
            return
        if self.dtype not in TOKEN_DTYPES:
            raise ConfigError(f"a token file's dtype must be one of {', '.join(TOKEN_DTYPES)}, "
                              f"got {self.dtype!r}")
        if type(self.window) is not int or not 1 <= self.window <= MAX_WINDOW:
            raise ConfigError(f"a token file's window must be an integer in [1, {MAX_WINDOW}], "
                              f"got {self.window!r}")
        if PurePosixPath(self.path).suffix not in TOKEN_SUFFIXES:
            raise ConfigError(f"a token file is a .bin or a .npy file, not {self.path!r}")

    def describe(self) -> str:
        """How messages name the file: "data file 'data/train.bin'"."""
        return f"data file {self.path!r}"

    def to_body(self) -> dict:
        """The canonical body in the job spec: exactly the fields of its kind."""
        if self.kind == TENSORS:
            return {"kind": self.kind, "path": self.path}
        return {"kind": self.kind, "path": self.path, "dtype": self.dtype, "window": self.window}

    @classmethod
    def from_body(cls, body: object) -> DataFile:
        """The descriptor a decoded body holds, strictly: exactly its kind's fields, each of its
        exact type (no alias: `True` is no window). Raises EncodingError."""
        if not isinstance(body, dict) or body.get("kind") not in KINDS:
            raise EncodingError(f"a data file must be a map with a kind in {', '.join(KINDS)}")
        kind = body["kind"]
        require_fields(f"a {kind} data file", body, _FIELDS[kind])
        for name in ("path", "dtype") if kind == TOKENS else ("path",):
            if type(body[name]) is not str:
                raise EncodingError(f"data file {name} must be a str, got {describe(body[name])}")
        if kind == TOKENS:
            require_uint("data file window", body["window"], 1, MAX_WINDOW)
        try:
            return cls(**body)
        except ConfigError as err:
            raise EncodingError(f"not a valid data file: {err}") from None


def require_relative_path(path: object) -> str:
    """`path` if it is a relative path in POSIX normal form inside its directory. Raises
    ConfigError for anything else: absolute, with "..", "." or empty parts, a backslash, NUL,
    or over MAX_PATH_CHARS characters."""
    if type(path) is not str or not path or len(path) > MAX_PATH_CHARS:
        raise ConfigError(f"a data file path must be a non-empty str of at most "
                          f"{MAX_PATH_CHARS} characters, got {describe(path)}")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise ConfigError(f"data file path {path!r} must be relative (to the data directory)")
    if "\\" in path or "\0" in path:
        raise ConfigError(f"data file path {path!r} may not hold a backslash or NUL (it names "
                          f"the same file on every machine: '/' separates its parts)")
    if ".." in pure.parts or pure.as_posix() != path or path == ".":
        raise ConfigError(f"data file path {path!r} must be in normal form inside its directory "
                          f"(no '..', '.', empty parts or trailing '/')")
    return path


def normal_path(path: object) -> str:
    """A job file's path in normal form ("./data//x.bin" -> "data/x.bin"), then checked by
    `require_relative_path`. Raises ConfigError."""
    if type(path) is not str or not path:
        raise ConfigError(f"[data] path must be a non-empty string, got {describe(path)}")
    return require_relative_path(PurePosixPath(path).as_posix())


def resolve_data_path(directory: Path, path: str) -> Path:
    """Where `path` (a `DataFile.path`) lies inside `directory`, every symbolic link followed.
    Raises ConfigError when the directory cannot be read or the path leads outside it."""
    require_relative_path(path)
    try:
        root = Path(directory).resolve(strict=True)
        target = (root / path).resolve()
    except (OSError, RuntimeError) as err:  # RuntimeError: a symlink loop
        raise ConfigError(f"data file {path!r}: cannot resolve it in the data directory "
                          f"{directory}: {err}") from None
    if not root.is_dir():
        raise ConfigError(f"the data directory {directory} is not a directory")
    if not target.is_relative_to(root):
        raise ConfigError(f"data file {path!r} leads outside the data directory {directory} "
                          f"(through a symbolic link): refused")
    return target


def npy_token_dtype(path: Path, shown: str) -> str:
    """The token dtype named by the header of the .npy file at `path` ("uint16" or "int32").
    Raises ConfigError as `TokenFile` does for a bad file."""
    return _dtype_name(_map_npy(path, shown).dtype, shown)


def open_data_file(data_file: DataFile, directory: Path) -> TokenFile | TensorFile:
    """The examples of `data_file` inside `directory`. Raises ConfigError for a path that
    leaves the directory, a missing or unreadable file, or any problem of its contents."""
    path = resolve_data_path(directory, data_file.path)
    shown = f"{data_file.describe()} ({path})"
    if data_file.kind == TENSORS:
        return TensorFile(path, shown)
    assert data_file.dtype is not None and data_file.window is not None  # DataFile checked it
    return TokenFile(path, data_file.dtype, data_file.window, shown)


# ---- the two kinds ----------------------------------------------------------------------------


class TokenFile:
    """Non-overlapping windows {"tokens": (window + 1,) int64} over a memory-mapped token file
    (stride `window`; the last partial window is dropped).

    Raises ConfigError for a missing or unreadable file, a .bin whose size is not a whole number
    of ids, a .npy with a bad header, another dtype than `dtype` or not 1-D, fewer tokens than
    one window, or a negative int32 id. Ids beyond a vocabulary are the program's to refuse.
    """

    def __init__(self, path: Path, dtype: str, window: int, shown: str) -> None:
        self.path, self.dtype, self.window, self.shown = path, dtype, window, shown
        if path.suffix == ".npy":
            tokens = _map_npy(path, shown)
            if _dtype_name(tokens.dtype, shown) != dtype:
                raise ConfigError(f"{shown} holds {_dtype_name(tokens.dtype, shown)} token ids, "
                                  f"not the {dtype} this job names")
        else:
            tokens = _map_bin(path, dtype, window, shown)
        if len(tokens) < window + 1:
            raise ConfigError(f"{shown} holds {len(tokens)} tokens, fewer than one window of "
                              f"{window + 1}")
        if dtype == "int32":
            _require_non_negative(tokens, shown)
        self._tokens = tokens  # (n,) memory-mapped

    def __len__(self) -> int:
        return (len(self._tokens) - 1) // self.window

    def example(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"example {index} out of range [0, {len(self)})")
        start = index * self.window
        window = np.asarray(self._tokens[start:start + self.window + 1], dtype=np.int64)
        return {TOKEN_FIELD: torch.from_numpy(window.copy())}  # (window + 1,)


class TensorFile:
    """Example i = {name: t[i]} for each tensor of a safetensors file (read whole).

    Raises ConfigError for a missing or unreadable file, bytes that are not safetensors (a bad
    header, truncated data), a dtype outside ovt's table, no tensors, a scalar tensor, tensors
    whose first dimensions differ, or zero examples.
    """

    def __init__(self, path: Path, shown: str) -> None:
        self.path, self.shown = path, shown
        _file_size(path, shown)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ConfigError(f"{shown} cannot be read: {err.strerror or err}") from None
        try:
            tensors = load_safetensors(data)
        except StateFormatError as err:
            raise ConfigError(f"{shown} is not a usable safetensors file: {err}") from None
        del data
        if not tensors:
            raise ConfigError(f"{shown} holds no tensors")
        scalars = sorted(name for name, t in tensors.items() if t.dim() == 0)
        if scalars:
            raise ConfigError(f"{shown}: tensor {scalars[0]!r} is a scalar; every tensor needs "
                              f"a first dimension, one entry per example")
        firsts = {name: int(t.shape[0]) for name, t in sorted(tensors.items())}
        if len(set(firsts.values())) > 1:
            sizes = ", ".join(f"{name} {n}" for name, n in firsts.items())
            raise ConfigError(f"{shown}: the tensors disagree on the number of examples (their "
                              f"first dimensions: {sizes})")
        self._count = next(iter(firsts.values()))
        if self._count == 0:
            raise ConfigError(f"{shown} holds 0 examples (first dimension 0)")
        self._tensors = dict(sorted(tensors.items()))

    def __len__(self) -> int:
        return self._count

    def example(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if not 0 <= index < self._count:
            raise IndexError(f"example {index} out of range [0, {self._count})")
        return {name: t[index].clone() for name, t in self._tensors.items()}


class AbsentExamples:
    """A data file's place where it is not read: `count` examples, none of which can be had
    here. The arbiter needs no dataset (it takes each batch's examples from the parties, each
    checked against the data commitment, SPEC §2.1, §5.3); reading one is a ConfigError."""

    def __init__(self, data_file: DataFile, count: int) -> None:
        self.data_file, self.count = data_file, count

    def __len__(self) -> int:
        return self.count

    def example(self, index: int) -> dict[str, torch.Tensor]:
        raise ConfigError(f"{self.data_file.describe()} is not read here: this party takes a "
                          f"batch's examples from the parties, with their inclusion proofs")


# ---- checks -----------------------------------------------------------------------------------


def require_same_fields(source: ExampleSource, reference: ExampleSource, shown: str) -> None:
    """Example 0 of `source` has the field names, dtypes and shapes of `reference`'s (a
    program's own dataset), so the program's loss reads it as it reads its own. Nothing to
    compare when `reference` is empty. Raises ConfigError naming the first field that differs."""
    if len(reference) == 0:
        return
    want = reference.example(0)
    if isinstance(source, TokenFile) and TOKEN_FIELD in want and \
            (source.window + 1,) != tuple(want[TOKEN_FIELD].shape):  # before reading a window
        raise ConfigError(f"{shown}: field {TOKEN_FIELD!r} has shape ({source.window + 1},) per "
                          f"example; the program's examples have "
                          f"{tuple(want[TOKEN_FIELD].shape)} (set the file's window or the "
                          f"program's config to match)")
    got = source.example(0)
    if set(got) != set(want):
        raise ConfigError(f"{shown} has the fields {sorted(got)}; the program's examples have "
                          f"{sorted(want)}")
    for name in sorted(want):
        a, b = got[name], want[name]
        if a.dtype != b.dtype:
            raise ConfigError(f"{shown}: field {name!r} is {dtype_name(a.dtype)}; the program's "
                              f"examples have {dtype_name(b.dtype)}")
        if a.shape != b.shape:
            raise ConfigError(f"{shown}: field {name!r} has shape {tuple(a.shape)} per example; "
                              f"the program's examples have {tuple(b.shape)} (set the file's "
                              f"window or the program's config to match)")


def commit_examples(source: ExampleSource, identity: tuple | None = None
                    ) -> tuple[DataCommitment, MerkleTree]:
    """`commit_dataset(source)`, remembered for a file that has not changed since (its path,
    device, inode, size and modification time), or for a source the caller names by an
    `identity` that fixes its examples (a built-in program's own dataset: its name, source and
    config); at most _CACHED_COMMITMENTS sources, the least recently used forgotten first. A
    node loads a job again for every state it regenerates, batch it serves and interval it
    escalates, and would hash every example again each time."""
    if identity is not None:
        key: tuple = ("identity", *identity)
    elif isinstance(source, TokenFile | TensorFile):
        key = _identity(source)
    else:
        return commit_dataset(source)
    with _cache_lock:
        if key in _commitments:
            _commitments.move_to_end(key)
            return _commitments[key]
    committed = commit_dataset(source)
    with _cache_lock:
        _commitments[key] = committed
        while len(_commitments) > _CACHED_COMMITMENTS:
            _commitments.popitem(last=False)
    return committed


_commitments: OrderedDict[tuple, tuple[DataCommitment, MerkleTree]] = OrderedDict()
_cache_lock = threading.Lock()


def _identity(source: TokenFile | TensorFile) -> tuple:
    try:
        st = source.path.stat()
    except OSError as err:
        raise ConfigError(f"{source.shown} cannot be read: {err.strerror or err}") from None
    cut = (source.dtype, source.window) if isinstance(source, TokenFile) else ()
    return (str(source.path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, *cut)


# ---- reading token files ----------------------------------------------------------------------


def _map_bin(path: Path, name: str, window: int, shown: str) -> np.ndarray:
    size, dtype = _file_size(path, shown), TOKEN_DTYPES[name]
    if size % dtype.itemsize:
        raise ConfigError(f"{shown} is truncated: {size} bytes is not a whole number of "
                          f"{name} token ids ({dtype.itemsize} bytes each)")
    count = size // dtype.itemsize
    if count < window + 1:  # also keeps an empty file from np.memmap, which refuses it
        raise ConfigError(f"{shown} holds {count} tokens, fewer than one window of {window + 1}")
    try:
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{shown} cannot be read: {err}") from None


def _map_npy(path: Path, shown: str) -> np.ndarray:
    _file_size(path, shown)
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError, TypeError, SyntaxError) as err:
        # numpy's header parser answers garbage and truncation with any of these
        raise ConfigError(f"{shown} is not a valid .npy file (bad header or truncated): "
                          f"{err}") from None
    if not isinstance(array, np.ndarray):  # an .npz archive under a .npy name
        close = getattr(array, "close", None)
        if close is not None:
            close()
        raise ConfigError(f"{shown} is not a .npy array file")
    if array.ndim != 1:
        raise ConfigError(f"{shown} holds an array of shape {array.shape}; a token file is 1-D")
    return array


def _file_size(path: Path, shown: str) -> int:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{shown} does not exist") from None
    except OSError as err:
        raise ConfigError(f"{shown} cannot be read: {err.strerror or err}") from None
    if not path.is_file():
        raise ConfigError(f"{shown} is not a regular file")
    return st.st_size


def _dtype_name(dtype: np.dtype, shown: str) -> str:
    for name, allowed in TOKEN_DTYPES.items():
        if dtype == allowed:
            return name
    raise ConfigError(f"{shown} holds token ids of dtype {dtype.str!r}; a token file holds "
                      f"little-endian {' or '.join(TOKEN_DTYPES)}")


def require_token_ids_below(source: ExampleSource, limit: int, shown: str) -> None:
    """Every token id of a token file is below `limit` (the program's vocabulary size),
    checked a slice at a time. Raises ConfigError naming the first id out of range."""
    if not isinstance(source, TokenFile):
        return
    tokens = source._tokens
    for start in range(0, len(tokens), _SCAN_TOKENS):
        chunk = np.asarray(tokens[start:start + _SCAN_TOKENS])
        if chunk.size and int(chunk.max()) >= limit:
            at = start + int(np.argmax(chunk >= limit))
            raise ConfigError(f"{shown}: token id {int(tokens[at])} at position {at} is beyond "
                              f"the program's vocabulary of {limit}")


def _require_non_negative(tokens: np.ndarray, shown: str) -> None:
    """No int32 id below 0 (no vocabulary holds one), checked a slice at a time."""
    for start in range(0, len(tokens), _SCAN_TOKENS):
        chunk = np.asarray(tokens[start:start + _SCAN_TOKENS])
        if chunk.min() < 0:
            at = start + int(np.argmax(chunk < 0))
            raise ConfigError(f"{shown}: token id {int(tokens[at])} at position {at} is "
                              f"negative")
