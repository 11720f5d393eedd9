"""protocol.files.atomic_write: all or nothing, never a temp file left, no-overwrite is atomic."""

from __future__ import annotations

import os
import stat

import pytest

from protocol.files import atomic_write


def _leftovers(directory) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_writes_and_replaces(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, b"one")
    atomic_write(path, b"two")
    assert path.read_bytes() == b"two"
    assert _leftovers(tmp_path) == []


def test_without_overwrite_an_existing_file_is_kept(tmp_path):
    path = tmp_path / "key.pem"
    atomic_write(path, b"first", overwrite=False)
    with pytest.raises(FileExistsError):
        atomic_write(path, b"second", overwrite=False)
    assert path.read_bytes() == b"first"
    assert _leftovers(tmp_path) == []


def test_mode_is_set_before_the_file_has_its_name(tmp_path):
    path = tmp_path / "key.pem"
    atomic_write(path, b"secret", mode=0o600)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_a_failed_write_leaves_the_old_content_and_no_temp_file(tmp_path, monkeypatch):
    # Regression: the store's old helper never removed its temp file when the write failed.
    path = tmp_path / "log.z"
    atomic_write(path, b"old")

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert _leftovers(tmp_path) == []
