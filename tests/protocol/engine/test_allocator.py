"""`allocator.keep_freed_memory`: glibc's malloc keeps large freed blocks in its heap, in every
thread and in the processes started after it. Process-wide and not undoable, so each check of
the real settings runs in a fresh interpreter."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from protocol.cli import commands
from protocol.engine import allocator

GLIBC = allocator._libc() is not None
ROOT = Path(__file__).resolve().parents[3]

# Run in a fresh interpreter: mallinfo2's counts around a malloc of `size` bytes, in the main
# thread or a new one; prints one JSON line per check.
_PROBE = textwrap.dedent('''
    import ctypes, json, subprocess, sys, threading
    import torch
    torch.ones(1 << 16).sum()  # (torch's own threads exist, as in any step)
    from protocol.engine import allocator

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        print(json.dumps({"skip": "no mallinfo2 (glibc < 2.33)"})); sys.exit(0)
    libc.mallinfo2.restype = Info
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def block(size):
        """(own mappings added while `size` bytes are held, free heap bytes once freed)"""
        before = libc.mallinfo2().hblks
        p = libc.malloc(size)
        assert p
        mapped = libc.mallinfo2().hblks - before
        libc.free(p)
        return mapped, libc.mallinfo2().fordblks

    def in_thread(size):
        out = []
        t = threading.Thread(target=lambda: out.append(block(size)))
        t.start(); t.join()
        return out[0]

    checks = {"default": block(256 << 20)}
    if sys.argv[1] == "keep":
        threshold = allocator.keep_freed_memory()
        size = min(256 << 20, (threshold or 0) // 2)
        checks.update(threshold=threshold, size=size, main=block(size),
                      thread=in_thread(size), environ={k: v for k, v in __import__("os")
                      .environ.items() if k.startswith("MALLOC_")})
        child = subprocess.run([sys.executable, "-c", sys.argv[2], "child"],
                               capture_output=True, text=True, timeout=120)  # (os.environ)
        assert child.returncode == 0, child.stderr[-2000:]
        checks["child"] = json.loads(child.stdout.strip().splitlines()[-1])
    else:  # a child: the settings come from the environment alone
        checks.update(again=allocator.keep_freed_memory(), main=block(256 << 20),
                      thread=in_thread(256 << 20))
    print(json.dumps(checks))
''')


@pytest.fixture(scope="module")
def kept() -> dict:
    """The probe's checks in a fresh interpreter with no malloc settings in its environment,
    which calls `keep_freed_memory` and then starts the probe again as its child."""
    if not GLIBC:
        pytest.skip("glibc's malloc only")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    run = subprocess.run([sys.executable, "-c", _PROBE, "keep", _PROBE], capture_output=True,
                         text=True, timeout=240, env=env | {"PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    return result


def test_large_blocks_come_from_the_heap_and_stay_there(kept):
    """With glibc's defaults a 256 MiB block is a mapping of its own (glibc's threshold never
    passes 32 MiB), unmapped when freed. After `keep_freed_memory` a large block comes from the
    heap, in the main thread and in a thread started later (which would otherwise get an arena
    of its own, whose heaps hold 64 MiB at most), and once freed its memory is free heap for
    the next allocation. (That trimming is turned off is the fake-libc tests' to check: a
    block that something allocated later pins stays in the heap either way.)"""
    assert kept["default"][0] == 1
    assert kept["threshold"] in (allocator.KEEP_BELOW, allocator.OLD_GLIBC_MAX)
    for where in ("main", "thread"):
        mapped, free_after = kept[where]
        assert mapped == 0, where
        assert free_after >= kept["size"], where
    assert kept["environ"] == {"MALLOC_MMAP_THRESHOLD_": str(kept["threshold"]),
                               "MALLOC_TRIM_THRESHOLD_": str(2**64 - 1),
                               "MALLOC_ARENA_MAX": "1"}


def test_a_process_it_starts_runs_under_the_same_settings(kept):
    """The probe's own child, started with the environment as the call left it: its 256 MiB
    blocks come from the heap in every thread (glibc read the settings at its start), and its
    own call sets nothing (the environment decides)."""
    if kept["threshold"] != allocator.KEEP_BELOW:
        pytest.skip("this glibc takes no mmap threshold above 32 MiB")
    child = kept["child"]
    assert child["default"][0] == 0 and child["main"][0] == 0 and child["thread"][0] == 0
    assert child["again"] is None


class _FakeLibc:
    def __init__(self, refuse: tuple[tuple[int, int], ...] = ()) -> None:
        self.calls: list[tuple[int, int]] = []
        self.refuse = refuse

    def mallopt(self, option: int, value: int) -> int:
        self.calls.append((option, value))
        return 0 if (option, value) in self.refuse else 1


@pytest.fixture
def fake_libc(monkeypatch):
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX",
                 "GLIBC_TUNABLES", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    libc = _FakeLibc()
    monkeypatch.setattr(allocator, "_libc", lambda: libc)
    monkeypatch.setattr(allocator.os, "environ", dict(os.environ))  # (the export stays here)
    return libc


@pytest.mark.parametrize("name, value", [
    ("MALLOC_MMAP_THRESHOLD_", "131072"), ("MALLOC_TRIM_THRESHOLD_", "131072"),
    ("MALLOC_ARENA_MAX", "4"), ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0"),
    ("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"),
])
def test_the_environments_own_settings_win(fake_libc, name, value):
    allocator.os.environ[name] = value
    assert allocator.keep_freed_memory() is None
    assert not fake_libc.calls


def test_an_unrelated_tunable_does_not_stop_it(fake_libc):
    allocator.os.environ["GLIBC_TUNABLES"] = "glibc.pthread.rseq=0"
    assert allocator.keep_freed_memory() == allocator.KEEP_BELOW
    assert fake_libc.calls == [(-8, 1), (-1, -1), (-3, allocator.KEEP_BELOW)]


def test_an_older_glibc_gets_its_largest_threshold(fake_libc):
    """glibc before 2.35 refuses an mmap threshold above 32 MiB: the rest is set all the same,
    with 32 MiB, and that is what the environment carries."""
    fake_libc.refuse = ((-3, allocator.KEEP_BELOW),)
    assert allocator.keep_freed_memory() == allocator.OLD_GLIBC_MAX
    assert fake_libc.calls == [(-8, 1), (-1, -1), (-3, allocator.KEEP_BELOW),
                               (-3, allocator.OLD_GLIBC_MAX)]
    assert allocator.os.environ["MALLOC_MMAP_THRESHOLD_"] == str(allocator.OLD_GLIBC_MAX)


def test_a_refused_setting_exports_nothing(fake_libc):
    fake_libc.refuse = ((-8, 1),)
    assert allocator.keep_freed_memory() is None
    assert "MALLOC_ARENA_MAX" not in allocator.os.environ


def test_nothing_is_set_where_the_c_library_is_not_glibc(monkeypatch):
    monkeypatch.setattr(allocator, "_libc", lambda: None)
    assert allocator.keep_freed_memory() is None
    allocator.release_freed_memory()  # (nothing to hand back: no error)


def test_every_command_runs_with_it(monkeypatch):
    """`run_command`, which all four command lines go through, sets it before the command."""
    order: list[str] = []
    monkeypatch.setattr(commands, "keep_freed_memory", lambda: order.append("malloc"))
    args = argparse.Namespace(run=lambda a: order.append("command") or 0)
    assert commands.run_command("ovt", args) == 0
    assert order == ["malloc", "command"]
