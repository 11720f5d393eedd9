"""glibc's malloc told to keep freed memory for reuse, in a process that trains (issue 13).

torch's CPU tensors come from malloc, and glibc hands a freed block back to the kernel where it
was mapped on its own (from `M_MMAP_THRESHOLD`, which glibc moves between 128 KiB and 32 MiB as
it goes) or where it lies at the top of the heap beyond `M_TRIM_THRESHOLD`. A training step
frees and allocates the same sizes every step, so the next tensor of that size takes fresh
pages, and the first touch of each page (a fault, the kernel zeroing it) can cost more than the
arithmetic on it. With blocks under `KEEP_BELOW` taken from the heap and the heap never
trimmed, measured here (bench/README.md): at
GPT-2 width a record step takes 3.82 s instead of 4.74 s, its replay 3.14 s instead of 3.94 s
and a plain float64 step 2.60 s instead of 3.32 s, for a record process's peak 5 % higher
(2,973 against 2,818 MiB: a freed block is reused where it lies, not unmapped); in a process
of one image-CNN executor a record step takes 160 ms instead of 196–240 ms and a plain float64
one 101 ms instead of 213–231 ms. Deployments otherwise get this from jemalloc or tcmalloc. It
changes no bits: allocation is not arithmetic.

ovt's own processes set it when they start (`protocol.cli.commands.run_command`, the
data-parallel worker); importing ovt as a library changes nothing. Where the C library is not
glibc, or glibc's own settings are given in the environment (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`, `GLIBC_TUNABLES`: a user's choice wins), nothing is set.
"""

from __future__ import annotations

import ctypes
import os
import platform

KEEP_BELOW = 1 << 30  # bytes: blocks under 1 GiB come from the heap, not mappings of their own
_NEVER = -1  # M_TRIM_THRESHOLD: the heap is never trimmed (mallopt(3): "disables trimming")

_M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
_M_MMAP_THRESHOLD = -3
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Set glibc's `M_MMAP_THRESHOLD` to `KEEP_BELOW` and turn its trimming off (module
    docstring), for the rest of the process. Returns whether both were set: False where the C
    library is not glibc, where the environment holds glibc's own malloc settings, or where
    glibc refused a value."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or \
            any(name in os.environ for name in _USER_SETTINGS):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW) == 1 and \
        libc.mallopt(_M_TRIM_THRESHOLD, _NEVER) == 1
