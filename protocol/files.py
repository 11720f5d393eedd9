"""The one way ovt writes a file that must survive a crash (SPEC §4 "nothing lost on a crash"),
and the one spelling of its temporary files.

`atomic_write` writes to a fresh temporary file beside the target, fsyncs it, moves it into
place and fsyncs the directory, so the target holds either its old content or all of the new
one, and a half-written file never carries a trusted name; `atomic_move` does the same for a
file written elsewhere. The temporary file is removed on
every failure. `temporary_file` is a scratch file (a submitted S_0 as it streams in) removed when
its block ends. Both are named `.NAME.XXXXXXXX.tmp`; a kill can still leave one behind, which
`remove_stale_temp_files` deletes when a daemon starts on its store.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

# Read once, at import: reading the umask means setting it, which is not thread-safe later.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_DEFAULT_MODE = 0o666 & ~_UMASK
_TEMP_SUFFIX = ".tmp"
# mkstemp names: the prefix, 8 characters of [a-z0-9_], the suffix; or the old `.NAME.tmpPID`.
_TEMP_NAME = re.compile(r"\..+\.(?:[a-z0-9_]{8}\.tmp|tmp[0-9]+)")


def atomic_write(path: str | os.PathLike[str], data: bytes, *, mode: int | None = None,
                 overwrite: bool = True) -> None:
    """Write `data` to `path` atomically and durably.

    `mode`: the file's permission bits (0o600 for a private key), set before any byte is
    written; None gives what `open(path, "w")` would (0o666 less the umask). Without
    `overwrite` the move is a hard link, which fails with FileExistsError if `path` exists
    (also if it appeared meanwhile); filesystems without hard links fall back to a checked
    replace. Raises OSError as the filesystem does.
    """
    path = Path(path)
    fd, tmp = _mkstemp(path.parent, path.name)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _DEFAULT_MODE if mode is None else mode)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _move(tmp, path, overwrite)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _fsync_dir(path.parent)


def atomic_move(source: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Move the finished file `source` to `path` (on the same filesystem) durably, as
    `atomic_write` moves its temporary file: `source` fsynced first, then renamed over `path`,
    then the directory fsynced. For a file written elsewhere (a submitted S_0, streamed to a
    `temporary_file` and checked there). Raises OSError as the filesystem does."""
    path = Path(path)
    fd = os.open(source, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(source, path)
    _fsync_dir(path.parent)


@contextmanager
def temporary_file(directory: str | os.PathLike[str],
                   name: str) -> Iterator[tuple[BinaryIO, Path]]:
    """A new, empty file `.NAME.XXXXXXXX.tmp` in `directory`, open for writing, and its path;
    the file is removed when the block ends, however it ends. Raises OSError as the
    filesystem does."""
    fd, tmp = _mkstemp(Path(directory), name)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f, Path(tmp)
    finally:
        Path(tmp).unlink(missing_ok=True)


def remove_stale_temp_files(root: str | os.PathLike[str]) -> int:
    """Delete every temporary file ovt made under `root` (`.NAME.XXXXXXXX.tmp`, and the
    `.NAME.tmpPID` an earlier ovt wrote), at any depth, and return how many there were; another
    dotfile ending in `.tmp` is left alone. Call it only before anything writes under `root`
    (a daemon's start): a temporary file there was left by a killed process, never holds a
    trusted name and is never read. Symbolic links are not followed. Raises OSError as the
    filesystem does."""
    removed = 0
    for directory, _, names in os.walk(root):
        for name in names:
            path = Path(directory, name)
            if _TEMP_NAME.fullmatch(name) and not path.is_symlink():
                path.unlink(missing_ok=True)
                removed += 1
    return removed


def _mkstemp(directory: Path, name: str) -> tuple[int, str]:
    return tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=_TEMP_SUFFIX)


def _move(tmp: str, path: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError:
        if path.exists():
            raise FileExistsError(path) from None
        os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
