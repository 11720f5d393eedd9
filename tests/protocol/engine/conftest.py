"""Fixtures shared by the engine's tests."""

import pytest

from protocol.engine import fused


@pytest.fixture(params=["kernel", "torch"])
def own_arithmetic(request, monkeypatch):
    """ovt's own arithmetic — the bound rules' sums and the normalisation statistics — both
    ways: the C++ kernels (`fused.own_arithmetic`, where the library is built) and torch ops."""
    if request.param == "kernel":
        if fused.MISSING is not None:
            pytest.skip(f"the fused library is not built: {fused.MISSING}")
    else:
        monkeypatch.setattr(fused, "own_arithmetic", lambda t: False)
    return request.param
