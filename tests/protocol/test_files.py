"""protocol.files.atomic_write: all or nothing, never a temp file left, no-overwrite is atomic."""

from __future__ import annotations

import os
import stat

import pytest

from protocol.files import atomic_write, remove_stale_temp_files, temporary_file


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


def test_a_temporary_file_is_removed_however_its_block_ends(tmp_path):
    with temporary_file(tmp_path, "s0") as (out, path):
        out.write(b"data")
        assert path.parent == tmp_path and path.name.startswith(".s0.")
    assert _leftovers(tmp_path) == []
    with pytest.raises(RuntimeError), temporary_file(tmp_path, "s0") as (out, path):
        raise RuntimeError("the peer went away")
    assert _leftovers(tmp_path) == []


def test_finding_9_stale_temp_files_are_removed_at_any_depth(tmp_path):
    """Issue 10, finding 9: a kill between a temporary file's creation and its move leaves it
    behind; a daemon removes those when it starts. Only temporary files go, and nothing outside
    the root (symbolic links are not followed)."""
    root, outside = tmp_path / "store", tmp_path / "outside"
    (root / "job" / "logs").mkdir(parents=True)
    outside.mkdir()
    stale = [root / ".submitted-s0.k2j4h1xq.tmp", root / "job" / ".spec.ovtjob.abcdefgh.tmp",
             root / "job" / "logs" / ".000000007.ovtl.z.0a1b2c3d.tmp",
             root / "job" / ".leaves.sqlite.tmp4242"]  # what an earlier ovt left
    kept = [root / "job" / "spec.ovtjob", root / "job" / "logs" / "000000007.ovtl.z",
            outside / ".elsewhere.abcdefgh.tmp",
            root / ".notes.tmp", root / "job" / ".draft.TMPNAME1.tmp"]  # not ovt's
    for path in stale + kept:
        path.write_bytes(b"x")
    (root / "link").symlink_to(outside, target_is_directory=True)
    assert remove_stale_temp_files(root) == len(stale)
    assert [p for p in stale if p.exists()] == [] and all(p.exists() for p in kept)
    assert remove_stale_temp_files(root) == 0
