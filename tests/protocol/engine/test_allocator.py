"""`allocator.keep_freed_memory`: glibc's malloc keeps large freed blocks in its heap."""

from __future__ import annotations

import ctypes
import platform

import pytest

from protocol.engine import allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc():
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):  # (glibc >= 2.33)
        pytest.skip("this glibc has no mallinfo2")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_large_block_comes_from_the_heap_and_stays_there(monkeypatch):
    """With glibc's defaults a 256 MiB block is a mapping of its own (its threshold never
    passes 32 MiB), unmapped when freed; once the thresholds are set it comes from the heap,
    and when freed its memory stays there for the next allocation."""
    for name in allocator._USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    libc = _libc()
    assert allocator.keep_freed_memory()
    size = 256 << 20
    before = libc.mallinfo2()
    block = libc.malloc(size)
    assert block
    try:
        held = libc.mallinfo2()
        assert held.hblks == before.hblks  # no mapping of its own
        assert held.uordblks >= before.uordblks + size
    finally:
        libc.free(block)
    freed = libc.mallinfo2()
    assert freed.fordblks >= size  # kept in the heap, not trimmed
    assert freed.arena >= size


@pytest.mark.parametrize("name", allocator._USER_SETTINGS)
def test_glibcs_own_settings_in_the_environment_win(monkeypatch, name):
    monkeypatch.setenv(name, "131072")
    calls = []
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda *a: calls.append(a))
    assert not allocator.keep_freed_memory()
    assert not calls


def test_nothing_is_set_where_the_c_library_is_not_glibc(monkeypatch):
    for name in allocator._USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda *a, **k: ("musl", "1.2"))
    calls = []
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda *a: calls.append(a))
    assert not allocator.keep_freed_memory()
    assert not calls
