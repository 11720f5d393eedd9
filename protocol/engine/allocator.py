"""glibc's malloc told to keep freed memory for reuse, in a process that trains (issue 13).

torch's CPU tensors come from malloc, and glibc hands a freed block back to the kernel where it
was mapped on its own (from `M_MMAP_THRESHOLD`, which glibc moves between 128 KiB and 32 MiB as
it goes; in a thread's own arena, from the arena's 64 MiB heap size whatever the threshold) or
where it lies at the top of the heap beyond `M_TRIM_THRESHOLD`. A training step frees and
allocates the same sizes every step, so the next tensor of that size takes fresh pages, and the
first touch of each page (a fault, the kernel zeroing it) can cost more than the arithmetic on
it. `keep_freed_memory` makes every thread started after it allocate from the main heap
(`M_ARENA_MAX` 1: a thread already on an arena of its own keeps it, so call it first), takes
blocks under `KEEP_BELOW` from it (`OLD_GLIBC_MAX` before glibc 2.35) and never trims it, so a
freed block is reused where it lies.
Measured here (bench/README.md, issue 13's fifth round): at GPT-2 width a record step takes
3.31 s instead of 5.64 s and a plain float64 one 2.50 s instead of 3.36 s, a record process
peaking at 3,011 MiB instead of 2,819; in a process of one image-CNN executor a record step
takes 157 ms instead of 234 and a plain float64 one 104 ms instead of 208. Deployments
otherwise get this from jemalloc or tcmalloc. It changes no bits: allocation is not arithmetic.

ovt's own processes set it when they start (`protocol.cli.commands.run_command`), and the
settings also go into the environment as glibc's own variables, so that every process they
start (data-parallel and audit workers, a replay check's other side) runs under the same ones.
Where the C library is not glibc, or the environment already holds glibc malloc settings (a
user's choice, or a parent's) or preloads another malloc, nothing is set; importing ovt as a
library sets nothing either. Within a job the heap stays at the job's peak; the daemons' job
runner (`JobQueue`) hands the free part back between jobs (`release_freed_memory`), so that an
idle daemon does not hold its last job's peak.
"""

from __future__ import annotations

import ctypes
import functools
import os

KEEP_BELOW = 1 << 30  # bytes: blocks under 1 GiB come from the heap, not mappings of their own
OLD_GLIBC_MAX = 32 << 20  # the largest M_MMAP_THRESHOLD glibc took before 2.35

# glibc's <malloc.h> parameter numbers
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_TRIM_NEVER = -1  # mallopt(3): "Setting M_TRIM_THRESHOLD to -1 disables trimming completely"
_SIZE_MAX = ctypes.c_size_t(-1).value  # the same in the environment, where it is a size_t

_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


def keep_freed_memory() -> int | None:
    """Set glibc's `M_ARENA_MAX` to 1, `M_MMAP_THRESHOLD` to `KEEP_BELOW` (`OLD_GLIBC_MAX`
    where glibc takes no more) and turn trimming off, for the rest of the process, and put the
    same settings in `os.environ` for the processes it starts (module docstring); call it
    before other threads allocate. Returns the mmap threshold set, or None where nothing was
    exported: the C library is not glibc, the environment decides (`environment_decides`), or
    glibc refused a setting (those before it stay set; glibc refuses none of them but an mmap
    threshold it finds too large, and then takes `OLD_GLIBC_MAX`)."""
    libc = _libc()
    if libc is None or environment_decides():
        return None
    if libc.mallopt(_M_ARENA_MAX, 1) != 1 or libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_NEVER) != 1:
        return None
    threshold = next((value for value in (KEEP_BELOW, OLD_GLIBC_MAX)
                      if libc.mallopt(_M_MMAP_THRESHOLD, value) == 1), None)
    if threshold is None:
        return None
    os.environ.update({"MALLOC_MMAP_THRESHOLD_": str(threshold),
                       "MALLOC_TRIM_THRESHOLD_": str(_SIZE_MAX), "MALLOC_ARENA_MAX": "1"})
    return threshold


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the kernel (`malloc_trim(0)`), for a daemon between
    jobs; nothing where the C library is not glibc. Costs the next job its first step's page
    faults, nothing else."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def environment_decides() -> bool:
    """Whether the environment already decides malloc's settings: one of the glibc variables
    set here (a user's own, or inherited from an ovt process), a `glibc.malloc.` tunable, or a
    preloaded malloc (jemalloc, tcmalloc, mimalloc: their names end in "malloc")."""
    return any(name in os.environ for name in _ENVIRONMENT) or \
        "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or \
        "malloc" in os.environ.get("LD_PRELOAD", "")


def describe(kept: int | None) -> str:
    """What a benchmark's header says of its malloc, given what `keep_freed_memory` returned."""
    if kept:
        return "freed memory kept (allocator.py)"
    return "the environment's settings" if environment_decides() else "glibc's defaults"


@functools.cache
def _libc():
    """glibc, with the two functions used here declared; None where it is not the C library
    (the running process's, as `confstr` reports it)."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
        libc = ctypes.CDLL("libc.so.6") if version and version.startswith("glibc") else None
    except (ValueError, OSError):  # (no such name here; no libc.so.6)
        return None
    if libc is None:
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc
