"""Fixtures shared by the engine's tests."""

import pytest

from protocol.engine import fused


@pytest.fixture(params=["kernel", "torch"])
def bound_arithmetic(request, monkeypatch):
    """The bound rules' own arithmetic both ways: the C++ kernels (`fused.computes_bounds`,
    where the library is built) and torch ops."""
    if request.param == "kernel":
        if fused.MISSING is not None:
            pytest.skip(f"the fused library is not built: {fused.MISSING}")
    else:
        monkeypatch.setattr(fused, "computes_bounds", lambda t: False)
    return request.param
