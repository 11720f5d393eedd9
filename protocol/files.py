"""The one way ovt writes a file that must survive a crash (SPEC §4 "nothing lost on a crash").

`atomic_write` writes to a fresh temporary file beside the target, fsyncs it, moves it into
place and fsyncs the directory, so the target holds either its old content or all of the new
one, and a half-written file never carries a trusted name. The temporary file is removed on
every failure.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Read once, at import: reading the umask means setting it, which is not thread-safe later.
_UMASK = os.umask(0o022)
os.umask(_UMASK)
_DEFAULT_MODE = 0o666 & ~_UMASK


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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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
