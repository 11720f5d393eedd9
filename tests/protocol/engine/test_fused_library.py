"""Which builds of the fused library ovt uses (protocol/engine/fused.py `_load`).

A library linked with its own copy of the C++ standard library formats a failing check's
message with that copy's streams over a locale the process's own libstdc++ set up: on one
machine (GCC 13's static libstdc++ in a process running GCC 14's) that crashed the process
instead of raising. The library says whether its calls reach such a copy
(`OWN_STANDARD_LIBRARY`, from `dladdr`), and ovt refuses it then, falling back to torch ops.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from protocol.engine import fused

ROOT = Path(__file__).resolve().parents[3]
SOURCE = hashlib.sha256((ROOT / "protocol/engine/csrc/fused.cpp").read_bytes()).hexdigest()


def load_with(monkeypatch, library: types.ModuleType):
    """`fused._load()` where importing the library gives `library`."""
    real = importlib.import_module

    def fake(name, package=None):
        return library if name == "protocol.engine._fused" else real(name, package)

    monkeypatch.setattr(fused.importlib, "import_module", fake)
    return fused._load()


def library(**attributes) -> types.ModuleType:
    module = types.ModuleType("_fused")
    module.__dict__.update(attributes)
    return module


def test_a_library_on_the_standard_library_of_the_process_is_used(monkeypatch):
    got, why = load_with(monkeypatch, library(SOURCE=SOURCE, OWN_STANDARD_LIBRARY=0))
    assert why is None and got is not None


def test_a_library_with_its_own_standard_library_is_refused(monkeypatch):
    got, why = load_with(monkeypatch, library(SOURCE=SOURCE, OWN_STANDARD_LIBRARY=1))
    assert got is None and "its own copy of the C++ standard library" in why


def test_the_installed_library_calls_the_standard_library_of_the_process():
    """Skipped only where no library is built at all (a refused one fails here)."""
    try:
        _fused = importlib.import_module("protocol.engine._fused")
    except (ImportError, OSError) as exc:
        pytest.skip(f"the library is not built here: {exc}")
    assert _fused.OWN_STANDARD_LIBRARY == 0


@pytest.mark.slow  # (builds the library twice, about a minute on 2 cores)
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="no C++ compiler")
@pytest.mark.parametrize("flags,own", [("", 0), ("-static-libstdc++ -Wl,-Bsymbolic-functions", 1)])
def test_the_library_tells_a_static_standard_library_apart(tmp_path, flags, own):
    """Built here once as setup.py builds it and once with libstdc++ linked in statically (what
    a compiler with no libstdc++.so does) and its calls bound inside the library (as one
    distribution's Python links extensions), each loaded in a process of its own."""
    for name in ("setup.py", "pyproject.toml", "README.md", "protocol/engine/csrc/fused.cpp"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    env = {**os.environ, "LDFLAGS": flags}
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    built = list((tmp_path / "protocol/engine").glob("_fused*.so"))
    assert build.returncode == 0 and len(built) == 1, build.stderr[-2000:]
    probe = ("import importlib.util, sys, torch\n"
             "spec = importlib.util.spec_from_file_location('_fused', sys.argv[1])\n"
             "module = importlib.util.module_from_spec(spec)\n"
             "spec.loader.exec_module(module)\n"
             "print(module.OWN_STANDARD_LIBRARY)\n")
    out = subprocess.run([sys.executable, "-c", probe, str(built[0])], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert int(out.strip().splitlines()[-1]) == own
