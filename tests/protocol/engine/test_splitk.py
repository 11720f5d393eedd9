"""protocol.engine.splitk: emulated accumulation order (the "another GPU" of the test profiles).

Closeness to the native op is checked with allclose: that is a claim about closeness, not about
exactness. The reordering itself is shown by bit differences in float32.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from protocol.engine.splitk import ORDERS, ReorderMode, SplitK, _permutation, _slices, combine

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
        ("mean-dim", aten.mean.dim, (s, [1]), {}),
        ("mean-dims-keepdim", aten.mean.dim, (s, [0, -1], True), {}),
        ("mean-all", aten.mean.default, (s,), {}),
    ]


def as_list(out) -> list[torch.Tensor | None]:
    return list(out) if isinstance(out, tuple | list) else [out]


NAMES = [c[0] for c in cases(torch.float64, 0)]
# One split-K per order, each with the chunk count of a preset using it (16 exceeds some of the
# reduced dimensions above: conv input channels 12, conv-backward batch 4 and out channels 8).
SPLITS = {"permuted": SplitK(seed=1), "pairwise": SplitK(seed=1, chunks=8, order="pairwise"),
          "reversed": SplitK(seed=1, chunks=16, order="reversed")}
OP_CASES = [(order, index) for order in SPLITS for index in range(len(NAMES))]
OP_IDS = [f"{order}-{NAMES[index]}" for order, index in OP_CASES]


@pytest.mark.parametrize("order, index", OP_CASES, ids=OP_IDS)
def test_close_to_native_in_float64(order, index):
    name, func, args, kwargs = cases(torch.float64, 10)[index]
    got = as_list(SPLITS[order](func, args, kwargs))
    expected = as_list(func(*args, **kwargs))
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        if e is None:
            assert g is None
            continue
        assert g.shape == e.shape and g.dtype == e.dtype
        assert torch.allclose(g, e, rtol=1e-12, atol=1e-12), name


@pytest.mark.parametrize("order, index", OP_CASES, ids=OP_IDS)
def test_reorders_in_float32(order, index):
    """Over a few random inputs, some result differs from native in its last bits."""
    differs = False
    for seed in range(0, 50, 10):
        name, func, args, kwargs = cases(torch.float32, seed)[index]
        got = as_list(SPLITS[order](func, args, kwargs))
        expected = as_list(func(*args, **kwargs))
        for g, e in zip(got, expected, strict=True):
            if e is None:
                continue
            assert torch.allclose(g, e, rtol=1e-4, atol=1e-4), name
            differs |= not torch.equal(g, e)
        if differs:
            break
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


@pytest.mark.parametrize("chunks", [1, 0, -3, 2.5, True])
def test_needs_an_integer_of_two_chunks_or_more(chunks):
    with pytest.raises(ValueError, match="at least two chunks"):
        SplitK(seed=0, chunks=chunks)


@pytest.mark.parametrize("order", ["", "random", "Pairwise", "tree"])
def test_unknown_order(order):
    with pytest.raises(ValueError, match="unknown split-K order"):
        SplitK(seed=0, order=order)
    with pytest.raises(ValueError, match="unknown split-K order"):
        combine([1.0, 2.0], order, seed=0)


class Sym:
    """A symbolic partial result: `+` builds the expression, so the tree shape can be read."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __add__(self, other: Sym) -> Sym:
        return Sym(f"({self.text}+{other.text})")


def syms(n: int) -> list[Sym]:
    return [Sym(f"p{i}") for i in range(n)]


@pytest.mark.parametrize("n, tree", [
    (1, "p0"),
    (2, "(p0+p1)"),
    (3, "((p0+p1)+p2)"),
    (4, "((p0+p1)+(p2+p3))"),
    (5, "(((p0+p1)+(p2+p3))+p4)"),
    (6, "(((p0+p1)+(p2+p3))+(p4+p5))"),
    (7, "(((p0+p1)+(p2+p3))+((p4+p5)+p6))"),
    (8, "(((p0+p1)+(p2+p3))+((p4+p5)+(p6+p7)))"),
])
def test_pairwise_is_a_balanced_tree(n, tree):
    assert combine(syms(n), "pairwise", seed=0).text == tree


def _depth(text: str) -> int:
    depth = deepest = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        deepest = max(deepest, depth)
    return deepest


@pytest.mark.parametrize("n", [9, 16, 17, 33])
def test_pairwise_depth_is_logarithmic(n):
    text = combine(syms(n), "pairwise", seed=0).text
    assert _depth(text) == (n - 1).bit_length()  # ceil(log2 n) levels of adds
    assert sorted(text.replace("(", "").replace(")", "").split("+")) == sorted(
        f"p{i}" for i in range(n))


def test_reversed_adds_the_last_chunk_first():
    assert combine(syms(4), "reversed", seed=0).text == "(((p3+p2)+p1)+p0)"


def test_permuted_adds_in_the_seeded_order():
    for seed in range(4):
        order = _permutation(seed, 6)
        assert sorted(order) == list(range(6))
        expected = f"p{order[0]}"
        for i in order[1:]:
            expected = f"({expected}+p{i})"
        assert combine(syms(6), "permuted", seed).text == expected


def _by_hand_f32(order: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """The order's float32 sum written out explicitly, for 4 parts."""
    p0, p1, p2, p3 = parts
    if order == "pairwise":
        return (p0 + p1) + (p2 + p3)
    if order == "reversed":
        return ((p3 + p2) + p1) + p0
    q = [parts[i] for i in _permutation(7, 4)]
    return ((q[0] + q[1]) + q[2]) + q[3]


@pytest.mark.parametrize("order", ORDERS)
def test_mm_and_sum_equal_the_explicit_float32_combination(order):
    sk = SplitK(seed=7, chunks=4, order=order)
    a, b = rnd(9, 103, seed=1, dtype=torch.float32), rnd(103, 6, seed=2, dtype=torch.float32)
    mm_parts = [a[:, s] @ b[s, :] for s in _slices(103, 4)]
    assert torch.equal(sk(aten.mm.default, (a, b), {}), _by_hand_f32(order, mm_parts))
    x = rnd(1001, seed=3, dtype=torch.float32)
    sum_parts = [x[s].sum() for s in _slices(1001, 4)]
    assert torch.equal(sk(aten.sum.default, (x,), {}), _by_hand_f32(order, sum_parts))
    assert torch.equal(sk(aten.mean.default, (x,), {}), _by_hand_f32(order, sum_parts) / 1001)


def test_the_orders_differ_from_each_other_in_float32():
    a, b = rnd(16, 300, seed=3, dtype=torch.float32), rnd(300, 16, seed=4, dtype=torch.float32)
    results = [SplitK(seed=0, chunks=8, order=o)(aten.mm.default, (a, b), {}) for o in ORDERS]
    assert not any(torch.equal(x, y) for i, x in enumerate(results) for y in results[i + 1:])


@pytest.mark.parametrize("order", ORDERS)
def test_more_chunks_than_the_dimension(order):
    """Each element becomes its own chunk; the result still matches native (float64)."""
    sk = SplitK(seed=2, chunks=64, order=order)
    a, b = rnd(4, 5, seed=1), rnd(5, 3, seed=2)
    assert torch.allclose(sk(aten.mm.default, (a, b), {}), a @ b, rtol=1e-12, atol=1e-12)
    ab = rnd(2, 4, 3, seed=3), rnd(2, 3, 5, seed=4)
    assert torch.allclose(sk(aten.bmm.default, ab, {}), torch.bmm(*ab), rtol=1e-12, atol=1e-12)
    x, w = rnd(3, 2, 5, 5, seed=5), rnd(4, 2, 3, 3, seed=6)
    assert torch.allclose(sk(aten.convolution.default, (x, w, None, *CONV), {}),
                          aten.convolution.default(x, w, None, *CONV), rtol=1e-12, atol=1e-12)
    s = rnd(3, 7, seed=7)
    for func, args in [(aten.sum.default, (s,)), (aten.sum.dim_IntList, (s, [0])),
                       (aten.mean.dim, (s, [1])), (aten.mean.default, (s,))]:
        assert torch.allclose(sk(func, args, {}), func(*args), rtol=1e-12, atol=1e-12)
    # and with one chunk per element the tree is over the elements themselves
    parts = list(s[:, 0])
    assert torch.equal(sk(aten.sum.dim_IntList, (s[:, :1], [0]), {}).reshape(()),
                       combine(parts, order, seed=2))


def test_mean_edge_cases_run_like_native():
    sk = SplitK(seed=1, chunks=4, order="pairwise")
    s = rnd(6, 5, seed=1)
    ints = torch.arange(12).reshape(3, 4)
    got = sk(aten.mean.dim, (ints, [1]), {"dtype": torch.float64})
    assert torch.allclose(got, ints.double().mean(1), rtol=1e-12, atol=0)
    with pytest.raises(RuntimeError):  # native refuses an integer mean; so does the split one
        sk(aten.mean.dim, (ints, [1]), {})
    assert torch.equal(sk(aten.mean.dim, (s, None), {}), aten.mean.dim(s, None))
    assert torch.equal(sk(aten.mean.dim, (s[:1], [0], True), {}), s[:1].mean(0, keepdim=True))


def test_zero_dim_sums_run_natively():
    sk, x = SplitK(seed=1), torch.tensor(2.5)
    for dim in ([0], [-1]):
        assert torch.equal(sk(aten.sum.dim_IntList, (x, dim), {}), aten.sum.dim_IntList(x, dim))
        assert torch.equal(sk(aten.mean.dim, (x, dim), {}), aten.mean.dim(x, dim))


def _train_plain(reorder: SplitK | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data, target = rnd(16, 3, 8, 8, seed=5, dtype=torch.float32), torch.arange(16) % 4
    for _ in range(3):
        with ReorderMode(reorder) if reorder else contextlib.nullcontext():
            opt.zero_grad()
            nn.functional.cross_entropy(model(data), target).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def native_training() -> list[torch.Tensor]:
    return _train_plain(None)


def test_plain_float32_training_is_deterministic(native_training):
    assert all(torch.equal(x, y) for x, y in zip(native_training, _train_plain(None), strict=True))


@pytest.mark.parametrize("order", ORDERS)
def test_reorder_mode_makes_plain_float32_training_diverge(native_training, order):
    native, reordered = native_training, _train_plain(SPLITS[order])
    assert not all(torch.equal(x, y) for x, y in zip(native, reordered, strict=True))
    assert all(torch.allclose(x, y, rtol=1e-3, atol=1e-4)
               for x, y in zip(native, reordered, strict=True))
