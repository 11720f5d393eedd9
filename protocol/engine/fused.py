"""The fused passes of the rounding engine: C++ operators in `csrc/fused.cpp`, built by
`pip install` with the machine's compiler (setup.py), registered as `torch.ops.ovt.*`.

Each computes what a sequence of torch ops computes — the same bits, checked by
tests/protocol/engine/test_bandpass.py and test_pointwise.py — in one read of its input, on the
CPU: `round_band`, a site's band pass (`bandpass`); `apply_entries`, the replayer's check and
application of a result's log entries (`bandpass.apply_entries`); and `pointwise`, an
elementwise op with e = 0 computed from float32 inputs to float32 results (`pointwise`), and
`pointwise_list`, its foreach form. Eleven more compute bound rules' own sums and extremes and
the normalisation statistics, in their own order, not a torch sequence's bits
(`own_arithmetic`). Where the extension is missing (no
compiler when ovt was installed) ovt says so once, loudly, and uses the torch ops. The
environment variable `OVT_FUSED=0` asks for the torch ops (comparisons, `bench/bench_step.py`
does both).

The band passes — `round_band`, `nearest` and `apply_entries` — also run on CUDA devices, as
kernels (`csrc/fused_cuda.cu`, the same element arithmetic as the CPU's: `csrc/band.h`) in a
module of their own, `_fused_cuda`, where it was built (`CUDA_KERNELS`: nvcc and a CUDA build
of torch at install); elsewhere a CUDA site takes the torch ops (`band_pass_serves`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import warnings
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

_SOURCES = Path(__file__).with_name("csrc")


@cache
def _digest() -> str | None:
    """The sha256 of the library's sources as setup.py takes it (every .cpp, .cu and .h file of
    csrc, by name), or None where they are not installed beside this module; read once (both
    modules are checked against it)."""
    files = sorted(p for p in _SOURCES.glob("*") if p.is_file() and
                   p.suffix in (".cpp", ".cu", ".h")) if _SOURCES.is_dir() else []
    if not files:
        return None
    return hashlib.sha256(b"".join(p.read_bytes() for p in files)).hexdigest()


def _load(name: str = "_fused") -> tuple[ModuleType | None, str | None]:
    """Load a module of the library (`_fused`, the CPU passes, or `_fused_cuda`, their CUDA
    kernels, which importing registers): (it, None), or (None, why it cannot be used). A module
    built from other sources is refused before it is loaded: loading registers its operators,
    which aborts the process where one's signature has changed since."""
    spec = importlib.util.find_spec(f"protocol.engine.{name}")
    if spec is None or spec.origin is None:
        return None, f"protocol.engine.{name} is not built"
    digest = _digest()
    if digest is not None and not _built_from(spec.origin, digest):
        return None, f"{name} was built from another version of its sources ({_SOURCES})"
    try:
        library = importlib.import_module(f"protocol.engine.{name}")
    except (ImportError, OSError, RuntimeError) as exc:  # not loadable here
        return None, str(exc)
    if getattr(library, "OWN_STANDARD_LIBRARY", 1):
        return None, (f"{name} was linked with its own copy of the C++ standard library, "
                      "as a compiler that finds libstdc++.a and no libstdc++.so does (install "
                      "its libstdc++ development package): a failing check's message would "
                      "crash the process")
    return library, None


def _built_from(path: str, digest: str) -> bool:
    """Whether the built module at `path` carries the sources' hash `digest` (setup.py writes
    it into each module as a string: its `SOURCE`), read from the file, unloaded."""
    return digest.encode() in Path(path).read_bytes()


def _load_cuda_kernels() -> bool:
    """Whether the band passes' CUDA kernels are loaded (after the CPU passes, whose operators
    they implement): not where they were not built (a CPU build of torch, no nvcc), and not,
    with a warning, where the module is there but cannot be used."""
    if _LIBRARY is None or importlib.util.find_spec("protocol.engine._fused_cuda") is None:
        return False
    kernels, why = _load("_fused_cuda")
    if kernels is None:
        warnings.warn(f"ovt: the fused passes' CUDA kernels are not used ({why}); CUDA sites "
                      f"take torch ops instead: the same bits, slower steps. Reinstalling "
                      f"(pip install -e .) with nvcc present builds them.", RuntimeWarning,
                      stacklevel=2)
    return kernels is not None


_LIBRARY, MISSING = _load()
if MISSING is not None:
    warnings.warn(f"ovt: the fused passes are not used ({MISSING}); using torch ops instead: "
                  f"the same bits, but record steps are slower. Reinstalling (pip install -e .) "
                  f"with a C++ compiler and its libstdc++ development files present builds "
                  f"them.", RuntimeWarning, stacklevel=1)

# Whether the fused operators are used where they apply (a switch for comparisons).
ENABLED = MISSING is None and os.environ.get("OVT_FUSED") != "0"
# Whether the band passes' CUDA kernels are loaded (module docstring).
CUDA_KERNELS = _load_cuda_kernels()


def serves(t: torch.Tensor) -> bool:
    """Whether a fused operator runs on `t`: enabled, and `t` on the CPU."""
    return ENABLED and t.is_cpu


def band_pass_serves(t: torch.Tensor) -> bool:
    """Whether the band passes (`round_band`, `nearest`, `apply_entries`) run on `t`: enabled,
    and `t` on the CPU, or on a CUDA device where the library has their kernels."""
    return ENABLED and (t.is_cpu or (t.is_cuda and CUDA_KERNELS))


def own_arithmetic(t: torch.Tensor) -> bool:
    """Whether ovt's own C++ arithmetic runs on `t`: the library loaded, and `t` on the CPU.
    That is the bound rules' sums (`torch.ops.ovt.sum_bound`, `embedding_backward_bound`,
    `norms`, `channel_sums`, `window_norms`, `window_norms_at`, `layer_norm_backward_bound`,
    `softmax_backward_bound`, `log_softmax_backward_bound`, `row_extremes`) and the
    normalisation statistics (`row_stats`, `row_backward_sums`: `normops`). Not `ENABLED`'s
    switch: these have no torch twin giving the same bits (a bound's sums, and the statistics'
    sums, may run in any order: `bounds.SAFETY`, and the statistics' own rules), so both the
    fused and the torch-ops path use them, and give the same values and bounds, hence the
    same logs."""
    return MISSING is None and t.is_cpu


def philox(key: tuple[int, int], first_block: int, blocks: int) -> bytearray | None:
    """The words of blocks first_block .. first_block + blocks - 1 of the Philox stream keyed
    `key`, four uint32 words per block in native byte order (`rng.RandomStream.words`), or None
    where the fused passes are not used (then numpy computes them). Raises ValueError unless
    the key words are uint32 and 0 <= first_block, 0 <= blocks, first_block + blocks <= 2**64
    (the C++ function reads them as unsigned 64-bit integers, which would wrap)."""
    if not ENABLED or _LIBRARY is None:
        return None
    if not (all(0 <= k < 2**32 for k in key) and 0 <= first_block and 0 <= blocks
            and first_block + blocks <= 2**64):
        raise ValueError(f"philox: bad key {key} or blocks [{first_block}, +{blocks})")
    return _LIBRARY.philox(key[0], key[1], first_block, blocks)
