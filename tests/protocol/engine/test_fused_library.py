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
import importlib.util
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from protocol.engine import fused

ROOT = Path(__file__).resolve().parents[3]
SOURCES = ROOT / "protocol/engine/csrc"
SOURCE = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(SOURCES.iterdir())
                                 if p.is_file() and p.suffix in (".cpp", ".cu", ".h"))).hexdigest()


def built(monkeypatch, tmp_path, modules: dict) -> list[str]:
    """Have `fused` find and import `modules` (name, `_fused` or `_fused_cuda` -> a module, or
    None: not built) in place of the library's: each is a file under `tmp_path` holding its
    SOURCE, as setup.py writes the hash into a built module, and importing it gives the module.
    Returns the names of those imported, as they are."""
    imported: list[str] = []
    real_find, real_import = importlib.util.find_spec, importlib.import_module

    def find(name, package=None):
        short = name.rsplit(".", 1)[-1]
        if short not in modules:
            return real_find(name, package)
        if modules[short] is None:
            return None
        path = tmp_path / f"{short}.so"
        path.write_bytes(b"\x7fELF\0" + modules[short].SOURCE.encode() + b"\0")
        return types.SimpleNamespace(name=name, origin=str(path))

    def fake(name, package=None):
        short = name.rsplit(".", 1)[-1]
        if short in modules:
            imported.append(short)
            return modules[short]
        return real_import(name, package)

    monkeypatch.setattr(fused.importlib.util, "find_spec", find)
    monkeypatch.setattr(fused.importlib, "import_module", fake)
    return imported


def library(**attributes) -> types.ModuleType:
    module = types.ModuleType("_fused")
    module.__dict__.update(attributes)
    return module


def test_a_library_on_the_standard_library_of_the_process_is_used(monkeypatch, tmp_path):
    built(monkeypatch, tmp_path, {"_fused": library(SOURCE=SOURCE, OWN_STANDARD_LIBRARY=0)})
    got, why = fused._load()
    assert why is None and got is not None


def test_a_library_built_from_other_sources_is_refused_unloaded(monkeypatch, tmp_path):
    """The hash covers every source of the library (setup.py's), the shared header and the
    CUDA kernels' too: an edit to any of them that was not rebuilt is noticed, from the built
    file, before it is loaded (loading registers operators whose signatures may have changed,
    which aborts the process)."""
    assert fused._digest() == SOURCE
    imported = built(monkeypatch, tmp_path,
                     {"_fused": library(SOURCE="0" * 64, OWN_STANDARD_LIBRARY=0)})
    got, why = fused._load()
    assert got is None and "another version of its sources" in why and not imported


def test_a_library_with_its_own_standard_library_is_refused(monkeypatch, tmp_path):
    built(monkeypatch, tmp_path, {"_fused": library(SOURCE=SOURCE, OWN_STANDARD_LIBRARY=1)})
    got, why = fused._load()
    assert got is None and "its own copy of the C++ standard library" in why


def test_a_library_not_built_is_reported(monkeypatch, tmp_path):
    built(monkeypatch, tmp_path, {"_fused": None})
    got, why = fused._load()
    assert got is None and "not built" in why


def cuda_kernels_with(monkeypatch, tmp_path, kernels: types.ModuleType | None
                      ) -> tuple[bool, list[str]]:
    """`fused._load_cuda_kernels()` where `_fused` is loaded and `_fused_cuda` is `kernels`
    (None: not built), and whether it was imported."""
    monkeypatch.setattr(fused, "_LIBRARY", library(SOURCE=SOURCE, OWN_STANDARD_LIBRARY=0))
    imported = built(monkeypatch, tmp_path, {"_fused_cuda": kernels})
    return fused._load_cuda_kernels(), imported


def test_the_cuda_kernels_are_used_where_built_from_these_sources(monkeypatch, tmp_path,
                                                                 recwarn):
    assert cuda_kernels_with(monkeypatch, tmp_path,
                             library(SOURCE=SOURCE, OWN_STANDARD_LIBRARY=0)) == (True,
                                                                                 ["_fused_cuda"])
    # not built (a CPU torch, no nvcc): quietly
    assert cuda_kernels_with(monkeypatch, tmp_path, None) == (False, [])
    assert not recwarn.list
    with pytest.warns(RuntimeWarning, match="CUDA kernels are not used .*another version"):
        stale = library(SOURCE="0" * 64, OWN_STANDARD_LIBRARY=0)
        assert cuda_kernels_with(monkeypatch, tmp_path, stale) == (False, [])  # (unloaded)
    with pytest.warns(RuntimeWarning, match="its own copy of the C\\+\\+ standard library"):
        static = library(SOURCE=SOURCE, OWN_STANDARD_LIBRARY=1)
        assert not cuda_kernels_with(monkeypatch, tmp_path, static)[0]


def test_the_installed_library_calls_the_standard_library_of_the_process():
    """Skipped only where no library is built at all (a refused one fails here)."""
    try:
        _fused = importlib.import_module("protocol.engine._fused")
    except (ImportError, OSError) as exc:
        pytest.skip(f"the library is not built here: {exc}")
    assert _fused.OWN_STANDARD_LIBRARY == 0
    assert fused._built_from(_fused.__file__, SOURCE)  # (the hash as setup.py writes it)
    assert not fused._built_from(_fused.__file__, "0" * 64)


@pytest.mark.slow  # (builds the library twice, about a minute on 2 cores)
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="no C++ compiler")
@pytest.mark.parametrize("flags,own", [("", 0), ("-static-libstdc++ -Wl,-Bsymbolic-functions", 1)])
def test_the_library_tells_a_static_standard_library_apart(tmp_path, flags, own):
    """Built here once as setup.py builds it and once with libstdc++ linked in statically (what
    a compiler with no libstdc++.so does) and its calls bound inside the library (as one
    distribution's Python links extensions), each loaded in a process of its own."""
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(SOURCES, tmp_path / "protocol/engine/csrc")
    env = {**os.environ, "LDFLAGS": flags, "OVT_CUDA": "0"}
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
