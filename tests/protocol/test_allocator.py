"""ovt's commands and daemons start with PyTorch's huge-page allocator on (protocol/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ENTRY_POINTS = ["protocol.cli.main", "trainer_node.cli", "auditor_node.cli", "arbiter.cli"]
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _run(code: str, env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, check=True).stdout.strip()


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}, **extra}


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_each_entry_point_sets_the_default_before_torch_allocates(module):
    """In a fresh interpreter: the default is set on importing the entry point, no tensor was
    made before it was (torch reads the variable at its first allocation), and a user's own
    setting stands."""
    code = (f"import {module}, os, torch; "
            f"print(os.environ.get('THP_MEM_ALLOC_ENABLE'))")
    assert _run(code, _env()) == "1"
    assert _run(code, _env(THP_MEM_ALLOC_ENABLE="0")) == "0"


_FAULTS = ("import {module}, resource, torch\n"
           "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
           "torch.ones(1 << 23, dtype=torch.float64)\n"  # 64 MB, touched
           "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n")


@pytest.mark.skipif(not (_THP.exists() and ("[always]" in _THP.read_text()
                                           or "[madvise]" in _THP.read_text())),
                    reason="the kernel offers no transparent huge pages")
def test_torch_honours_it_a_fresh_64_mb_tensor_takes_far_fewer_page_faults():
    """With huge pages a fresh 64 MB tensor takes ~32 faults instead of ~16,000 (4 KB pages);
    where the kernel could not give every huge page, still far fewer."""
    module = ENTRY_POINTS[0]
    on = int(_run(_FAULTS.format(module=module), _env()))
    off = int(_run(_FAULTS.format(module=module), _env(THP_MEM_ALLOC_ENABLE="0")))
    assert off > 10_000 and on < off / 4, (on, off)
