"""protocol.engine.splitk: emulated accumulation order (the "another GPU" of the test profiles).

Closeness to the native op is checked with allclose: that is a claim about closeness, not about
exactness. The reordering itself is shown by bit differences in float32.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from protocol.engine.splitk import ReorderMode, SplitK, _slices

aten = torch.ops.aten


def rnd(*shape, seed=0, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


CONV = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)  # stride, padding, dilation, transposed, ...


def cases(dtype: torch.dtype, seed: int):
    """(name, func, args, kwargs) for every op SplitK re-orders."""
    a, b = rnd(7, 96, seed=seed, dtype=dtype), rnd(96, 5, seed=seed + 1, dtype=dtype)
    bias = rnd(5, seed=seed + 2, dtype=dtype)
    x, w = rnd(4, 12, 6, 6, seed=seed + 3, dtype=dtype), rnd(8, 12, 3, 3, seed=seed + 4,
                                                              dtype=dtype)
    cb = rnd(8, seed=seed + 5, dtype=dtype)
    gout = rnd(4, 8, 6, 6, seed=seed + 6, dtype=dtype)
    s = rnd(6, 50, 7, seed=seed + 7, dtype=dtype)
    return [
        ("mm", aten.mm.default, (a, b), {}),
        ("addmm", aten.addmm.default, (bias, a, b), {}),
        ("addmm-beta-alpha", aten.addmm.default, (bias, a, b), {"beta": 0.5, "alpha": 2.0}),
        ("addmm-beta0", aten.addmm.default, (bias, a, b), {"beta": 0}),
        ("bmm", aten.bmm.default, (rnd(3, 4, 64, seed=seed + 8, dtype=dtype),
                                   rnd(3, 64, 5, seed=seed + 9, dtype=dtype)), {}),
        ("conv", aten.convolution.default, (x, w, cb, *CONV), {}),
        ("conv-nobias", aten.convolution.default, (x, w, None, *CONV), {}),
        ("conv-backward", aten.convolution_backward.default,
         (gout, x, w, [8], *CONV, [True, True, True]), {}),
        ("conv-backward-weight-only", aten.convolution_backward.default,
         (gout, x, w, None, *CONV, [False, True, False]), {}),
        ("sum-dim", aten.sum.dim_IntList, (s, [1]), {}),
        ("sum-dims-keepdim", aten.sum.dim_IntList, (s, [1, -1], True), {}),
        ("sum-dims", aten.sum.dim_IntList, (s, [0, 2]), {}),
        ("sum-all", aten.sum.default, (s,), {}),
    ]


def as_list(out) -> list[torch.Tensor | None]:
    return list(out) if isinstance(out, tuple | list) else [out]


NAMES = [c[0] for c in cases(torch.float64, 0)]


@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_close_to_native_in_float64(index):
    name, func, args, kwargs = cases(torch.float64, 10)[index]
    got, expected = as_list(SplitK(seed=1)(func, args, kwargs)), as_list(func(*args, **kwargs))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        if e is None:
            assert g is None
            continue
        assert g.shape == e.shape and g.dtype == e.dtype
        assert torch.allclose(g, e, rtol=1e-12, atol=1e-12), name


@pytest.mark.parametrize("index", range(len(NAMES)), ids=NAMES)
def test_reorders_in_float32(index):
    """Over a few random inputs, some result differs from native in its last bits."""
    differs = False
    for seed in range(0, 50, 10):
        name, func, args, kwargs = cases(torch.float32, seed)[index]
        got, expected = as_list(SplitK(seed=1)(func, args, kwargs)), as_list(func(*args, **kwargs))
        for g, e in zip(got, expected, strict=True):
            if e is None:
                continue
            assert torch.allclose(g, e, rtol=1e-4, atol=1e-4), name
            differs |= not torch.equal(g, e)
    assert differs


def test_order_depends_on_the_seed():
    a, b = rnd(16, 300, seed=3, dtype=torch.float32), rnd(300, 16, seed=4, dtype=torch.float32)
    results = [SplitK(seed=s, chunks=5)(aten.mm.default, (a, b), {}) for s in range(6)]
    assert any(not torch.equal(results[0], r) for r in results[1:])
    # and it is deterministic for one seed
    assert torch.equal(results[0], SplitK(seed=0, chunks=5)(aten.mm.default, (a, b), {}))


def test_short_reductions_and_unknown_ops_run_natively():
    sk = SplitK(seed=1)
    a, b = rnd(3, 1, dtype=torch.float32), rnd(1, 4, dtype=torch.float32)
    assert torch.equal(sk(aten.mm.default, (a, b), {}), a @ b)
    x = rnd(5, dtype=torch.float32)
    assert torch.equal(sk(aten.exp.default, (x,), {}), torch.exp(x))
    assert torch.equal(sk(aten.sum.default, (x[:1],), {}), x[:1].sum())


def test_slices_cover_the_dimension():
    for length in (1, 2, 3, 7, 100):
        for chunks in (2, 3, 8):
            parts = _slices(length, chunks)
            assert parts[0].start == 0 and parts[-1].stop == length
            assert all(p.stop == q.start for p, q in zip(parts, parts[1:], strict=False))
            assert all(p.stop > p.start for p in parts)


def test_needs_two_chunks():
    with pytest.raises(ValueError):
        SplitK(seed=0, chunks=1)


def _train_plain(reorder: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, target = rnd(16, 3, 8, 8, seed=5, dtype=torch.float32), torch.arange(16) % 4
    for _ in range(3):
        with ReorderMode(SplitK(seed=1)) if reorder else contextlib.nullcontext():
            opt.zero_grad()
            nn.functional.cross_entropy(model(data), target).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_reorder_mode_makes_plain_float32_training_diverge():
    native, reordered, native_again = _train_plain(False), _train_plain(True), _train_plain(False)
    assert all(torch.equal(x, y) for x, y in zip(native, native_again, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(native, reordered, strict=True))
    assert all(torch.allclose(x, y, rtol=1e-3, atol=1e-4)
               for x, y in zip(native, reordered, strict=True))
