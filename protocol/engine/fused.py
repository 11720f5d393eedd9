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
"""

from __future__ import annotations

import hashlib
import importlib
import os
import warnings
from pathlib import Path
from types import ModuleType

import torch

_SOURCE = Path(__file__).with_name("csrc") / "fused.cpp"


def _load() -> tuple[ModuleType | None, str | None]:
    """Load the library: (it, None), or (None, why it cannot be used)."""
    try:  # loading it registers torch.ops.ovt
        library = importlib.import_module("protocol.engine._fused")
    except (ImportError, OSError, RuntimeError) as exc:  # not built, or not loadable here
        return None, str(exc)
    if _SOURCE.exists() and getattr(library, "SOURCE", None) != \
            hashlib.sha256(_SOURCE.read_bytes()).hexdigest():
        return None, f"the library was built from another version of {_SOURCE.name}"
    if getattr(library, "OWN_STANDARD_LIBRARY", 1):
        return None, ("the library was linked with its own copy of the C++ standard library, "
                      "as a compiler that finds libstdc++.a and no libstdc++.so does (install "
                      "its libstdc++ development package): a failing check's message would "
                      "crash the process")
    return library, None


_LIBRARY, MISSING = _load()
if MISSING is not None:
    warnings.warn(f"ovt: the fused passes are not used ({MISSING}); using torch ops instead: "
                  f"the same bits, but record steps are slower. Reinstalling (pip install -e .) "
                  f"with a C++ compiler and its libstdc++ development files present builds "
                  f"them.", RuntimeWarning, stacklevel=1)

# Whether the fused operators are used where they apply (a switch for comparisons).
ENABLED = MISSING is None and os.environ.get("OVT_FUSED") != "0"


def serves(t: torch.Tensor) -> bool:
    """Whether a fused operator runs on `t`: enabled, and `t` on the CPU."""
    return ENABLED and t.is_cpu


def own_arithmetic(t: torch.Tensor) -> bool:
    """Whether ovt's own C++ arithmetic runs on `t`: the library loaded, and `t` on the CPU.
    That is the bound rules' sums (`torch.ops.ovt.sum_bound`, `embedding_backward_bound`,
    `norms`, `channel_sums`, `window_norms`, `layer_norm_backward_bound`,
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
