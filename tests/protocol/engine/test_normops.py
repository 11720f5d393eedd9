"""ovt's normalisation ops (protocol/engine/normops.py; SPEC §3.2.1) and their fused C++ passes.

The claims under test: `normalize` and `normalize_backward` are fixed formulas, one IEEE
operation at a time in the compute dtype, so the fused passes that compute them straight from
float32 operands (`normops.fused_formula`, csrc/fused.cpp) give exactly the bits of the torch
ops on widened operands, for every layout they take (a layer norm's rows, a batch norm's
channels) and on hard values (zeros of both signs, subnormals, infinities, values near float32's
overflow); they decline every other layout; and a recorded step gives the same results and log
with the fused passes as without. (The statistics' bounds are tested against exact references
in test_norm_stats_bounds.py; the decompositions through the interceptor in
test_interceptor.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from protocol.engine import fused, normops
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.rounding import SiteRecorder

POLICY = PrecisionPolicy()
needs_fused = pytest.mark.skipif(fused.MISSING is not None,
                                 reason=f"the fused passes are not built: {fused.MISSING}")


def hard(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """float32 values of every magnitude, with ±0, subnormals, ±inf and huge values."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    x = (rng.normal(size=n) * 10.0 ** rng.integers(-20, 20, size=n)).astype(np.float32)
    specials = np.array([0.0, -0.0, 2.0**-149, -(2.0**-140), np.inf, -np.inf, 3.4e38, -3.4e38],
                        dtype=np.float32)
    where = rng.choice(n, size=min(n, specials.size), replace=False)
    x[where] = specials[:where.size]
    return torch.from_numpy(x.reshape(shape))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (float32 or float64), except that any NaN equals any NaN (IEEE
    leaves payloads open)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = torch.int32 if a.dtype == torch.float32 else torch.int64
    nan = torch.isnan(a) & torch.isnan(b)
    return bool(((a.view(bits) == b.view(bits)) | nan).all())


def torch_path(func, args) -> torch.Tensor:
    """The op's torch ops on widened operands, rounded once: what the interceptor computes where
    the fused pass does not serve."""
    wide = [a.double() if isinstance(a, torch.Tensor) else a for a in args]
    return func(*wide).float()


# layer norm rows: x, mean/rstd shape, weight/bias shape
ROWS = [((6, 16), (6, 1), (16,)), ((2, 5, 8), (2, 5, 1), (8,)), ((2, 5, 8), (2, 1, 1), (5, 8)),
        ((7,), (1,), (7,))]
# batch norm channels: x, mean/rstd shape, weight/bias shape (as the decompositions pass them)
CHANNELS = [((4, 3, 5, 5), (1, 3, 1, 1), (3, 1, 1)), ((8, 6), (1, 6), (6,)),
            ((2, 3, 4, 2, 3), (1, 3, 1, 1, 1), (3, 1, 1, 1)), ((4, 3, 5, 5), (1, 3, 1, 1), None)]


@needs_fused
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("case", ROWS + CHANNELS)
def test_fused_normalize_gives_the_torch_ops_bits(case, affine):
    x_shape, stat_shape, param_shape = case
    x = hard(x_shape, 1)
    mean = torch.randn(stat_shape) * 3
    rstd = torch.rand(stat_shape) * 4
    weight = hard(param_shape, 2) if param_shape and affine in ("both", "weight") else None
    bias = hard(param_shape, 3) if param_shape and affine in ("both", "bias") else None
    args = (x, mean, rstd, weight, bias)
    run = normops.fused_formula(normops.NORMALIZE, args)
    assert run is not None
    assert same_bits(run(), torch_path(normops.NORMALIZE, args))


@needs_fused
@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("case", CHANNELS[:3])
def test_fused_normalize_backward_gives_the_torch_ops_bits(case, weighted):
    x_shape, stat_shape, _ = case
    g, x = hard(x_shape, 4), torch.randn(x_shape) * 5
    mean, rstd = torch.randn(stat_shape), torch.rand(stat_shape) * 3
    sums = [hard(stat_shape, 5), torch.randn(stat_shape) * 1e3]
    weight = torch.randn(stat_shape) if weighted else None
    count = x.numel() // x.shape[1]
    args = (g, x, mean, rstd, weight, *sums, count)
    run = normops.fused_formula(normops.NORMALIZE_BACKWARD, args)
    assert run is not None
    assert same_bits(run(), torch_path(normops.NORMALIZE_BACKWARD, args))


def test_fused_formula_declines_what_it_does_not_take(monkeypatch):
    x, mean, rstd = torch.randn(6, 16), torch.randn(6, 1), torch.rand(6, 1)
    weight = torch.randn(16)
    take = normops.fused_formula
    assert take(normops.NORMALIZE, (x.t().contiguous().t(), mean, rstd, weight, None)) is None
    assert take(normops.NORMALIZE, (x.double(), mean, rstd, weight, None)) is None
    assert take(normops.NORMALIZE, (x, torch.randn(1, 16), rstd, weight, None)) is None  # per col
    assert take(normops.NORMALIZE, (x, mean, rstd, torch.randn(6, 16), None)) is None
    assert take(normops.NORMALIZE, (x[:0], mean[:0], rstd[:0], weight, None)) is None
    assert take(normops.NORM_STATS, (x, [1], 1e-5)) is None  # not a formula
    rows_backward = (x, x, mean, rstd, None, mean, mean, 16)  # a layer norm's layout
    assert take(normops.NORMALIZE_BACKWARD, rows_backward) is None
    monkeypatch.setattr(fused, "ENABLED", False)
    assert take(normops.NORMALIZE, (x, mean, rstd, weight, None)) is None


def torch_stats(x: torch.Tensor, dims: list[int], eps: float) -> list[torch.Tensor]:
    """norm_stats's torch form: the sums in torch's order."""
    k = int(np.prod([x.shape[d] for d in dims]))
    mean = x.sum(dims, keepdim=True) / k
    var = ((x - mean) * (x - mean)).sum(dims, keepdim=True) / k
    return [mean, var, (var + eps).rsqrt()]


def kernel_stats(x: torch.Tensor, dims: list[int], eps: float) -> list[torch.Tensor]:
    """norm_stats's C++ form, called directly."""
    view = normops.rows_view(x, dims)
    assert view is not None
    kept = normops.kept_shape(x, dims)
    mean, var = (t.reshape(kept) for t in torch.ops.ovt.row_stats(x, *view))
    return [mean, var, (var + eps).rsqrt()]


# (shape, dims): a layer norm's rows, a batch norm's channels (the last two of each large
# enough to be split between threads), and reductions the C++ statistics decline (middle
# dimensions, a leading one of a 3-D tensor)
STATS_TAKEN = [((6, 130), [1]), ((3, 5, 8), [1, 2]), ((4, 3, 7, 5), [0, 2, 3]), ((9, 4), [0]),
               ((2, 3, 4, 2, 3), [0, 2, 3, 4]), ((1, 1), [-1]), ((1024, 129), [1]),
               ((16, 8, 40, 40), [0, 2, 3])]
STATS_DECLINED = [((3, 5, 8), [1]), ((4, 3, 7), [0]), ((4, 3, 7), [0, 1])]


@needs_fused
@pytest.mark.parametrize("case", STATS_TAKEN + STATS_DECLINED)
def test_the_statistics_run_in_their_kernel_where_it_serves(case, monkeypatch):
    """norm_stats and norm_backward_stats of float64 rows or channels are the C++ kernels'
    results, bit for bit, else (another reduction, a float32 or non-contiguous input, the
    library off: `fused.own_arithmetic`) torch's; the C++ sums' order is fixed, so one
    thread and two give the same bits."""
    shape, dims = case
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen, dtype=torch.float64) * 3 + 1
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    taken = case in STATS_TAKEN
    assert (normops.rows_view(x, dims) is not None) == taken
    got = normops.norm_stats(x, dims, 1e-5)
    want = kernel_stats(x, dims, 1e-5) if taken else torch_stats(x, dims, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    mean = got[0]
    got_backward = normops.norm_backward_stats(g, x, mean, dims)
    if taken:
        kept = normops.kept_shape(x, dims)
        want_backward = [t.reshape(kept) for t in torch.ops.ovt.row_backward_sums(
            g, x, mean.contiguous(), *normops.rows_view(x, dims))]
    else:
        want_backward = [g.sum(dims, keepdim=True), ((x - mean) * g).sum(dims, keepdim=True)]
    assert all(torch.equal(a, b) for a, b in zip(got_backward, want_backward, strict=True))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = normops.norm_stats(x, dims, 1e-5), normops.norm_backward_stats(g, x, mean, dims)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip([*alone[0], *alone[1]],
                                                 [*got, *got_backward], strict=True))
    narrow = x.float()  # (float32: the ops take their torch form; the narrow path the kernels)
    assert (normops.rows_view(narrow, dims) is not None) == taken
    assert all(torch.equal(a, b) for a, b in zip(normops.norm_stats(narrow, dims, 1e-5),
                                                 torch_stats(narrow, dims, 1e-5), strict=True))
    # the interceptor's narrow path: from float32 operands, the bits of the op on their widening
    narrow_g, narrow_mean = g.float(), mean.float().contiguous()
    for func, operands in ((normops.NORM_STATS, (narrow, dims, 1e-5)),
                           (normops.NORM_BACKWARD_STATS, (narrow_g, narrow, narrow_mean, dims))):
        run = normops.narrow_statistics(func, operands)
        assert (run is not None) == taken, func
        if run is not None:
            widened = [a.double() if isinstance(a, torch.Tensor) else a for a in operands]
            assert all(torch.equal(a, b) for a, b in zip(run(), func(*widened), strict=True))
    strided = x.transpose(0, -1).contiguous().transpose(0, -1)
    assert strided.is_contiguous() or normops.rows_view(strided, dims) is None
    monkeypatch.setattr(fused, "own_arithmetic", lambda t: False)
    assert normops.rows_view(x, dims) is None
    assert all(torch.equal(a, b) for a, b in zip(normops.norm_stats(x, dims, 1e-5),
                                                 torch_stats(x, dims, 1e-5), strict=True))


@needs_fused
@pytest.mark.parametrize("shape, dims", [((6, 3, 40), [2]), ((5, 4, 6, 7), [0, 2, 3])])
def test_the_narrow_statistics_are_the_widened_bits_on_hard_values(shape, dims):
    """From float32 operands with zeros of both signs, subnormals, infinities and values near
    float32's overflow (infinite and NaN statistics in places), the narrow path's
    statistics and backward sums are those of the op on the widened operands, bit for bit."""
    x, g = hard(shape, 5), hard(shape, 6)
    kept = normops.kept_shape(x, dims)
    mean = hard(tuple(kept), 7)
    for func, operands in ((normops.NORM_STATS, (x, dims, 1e-5)),
                           (normops.NORM_BACKWARD_STATS, (g, x, mean, dims))):
        run = normops.narrow_statistics(func, operands)
        assert run is not None, func
        widened = [a.double() if isinstance(a, torch.Tensor) else a for a in operands]
        got, want = run(), func(*widened)
        assert all(same_bits(a, b) for a, b in zip(got, want, strict=True)), func
        assert not all(bool(torch.isfinite(t).all()) for t in got), func  # (specials reached)


def test_the_kernels_decline_dimensions_out_of_range_and_misshapen_means():
    """A dimension out of range is torch's error, not another reduction; a mean of one value per
    row in another shape than the kept one is broadcast as torch broadcasts it."""
    x = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    with pytest.raises(IndexError):
        normops.norm_stats(x, [5], 0.0)
    mean = torch.tensor([[0.0, 10.0, 20.0, 30.0]], dtype=torch.float64)  # (1, 4), dims [1]
    sum_grad, sum_product = normops.norm_backward_stats(torch.ones_like(x), x, mean, [1])
    assert torch.equal(sum_product, ((x - mean) * 1.0).sum(1, keepdim=True))


def _record(step, fused_on: bool, monkeypatch) -> tuple[list[torch.Tensor], list]:
    monkeypatch.setattr(fused, "ENABLED", fused_on and fused.MISSING is None)
    rec = SiteRecorder(POLICY)
    with RoundingMode(POLICY, rec):
        outs = step()
    return outs, rec.log().sites


@needs_fused
def test_a_recorded_step_is_the_same_with_and_without_the_fused_passes(monkeypatch):
    """Layer norm and batch norm, forward and backward, recorded twice: the same results and
    the same log. With the fused passes the statistics are computed straight from float32
    operands (`normops.narrow_statistics`): both layer norms' and batch norm's statistics and
    batch norm's backward sums are (and the second layer norm's rows are split between the
    threads: 320 rows of 129)."""
    gen = torch.Generator().manual_seed(7)
    x_ln, x_bn = torch.randn(5, 3, 16, generator=gen) * 2 + 1, torch.randn(8, 4, 6, 6,
                                                                            generator=gen)
    x_wide = torch.randn(320, 129, generator=gen) * 3 - 2
    w_ln, w_bn = torch.randn(16, generator=gen), torch.randn(4, generator=gen)
    g_ln, g_bn = torch.randn(5, 3, 16, generator=gen), torch.randn(8, 4, 6, 6, generator=gen)
    g_wide = torch.randn(320, 129, generator=gen)

    def step() -> list[torch.Tensor]:
        a, wa = x_ln.clone().requires_grad_(), w_ln.clone().requires_grad_()
        b, wb = x_bn.clone().requires_grad_(), w_bn.clone().requires_grad_()
        c = x_wide.clone().requires_grad_()
        y_ln = F.layer_norm(a, (16,), wa, None, 1e-5)
        y_bn = F.batch_norm(b, torch.zeros(4), torch.ones(4), wb, None, training=True)
        y_wide = F.layer_norm(c, (129,), None, None, 1e-3)
        torch.autograd.backward([y_ln, y_bn, y_wide], [g_ln, g_bn, g_wide])
        return [y_ln.detach(), y_bn.detach(), y_wide.detach(), a.grad, wa.grad, b.grad,
                wb.grad, c.grad]

    served = []
    narrow = normops.narrow_statistics

    def counted(func, args):
        run = narrow(func, args)
        if run is not None:
            served.append(func)
        return run

    monkeypatch.setattr(normops, "narrow_statistics", counted)
    fused_outs, fused_log = _record(step, True, monkeypatch)
    assert sorted(map(str, served)) == sorted(map(str, [normops.NORM_STATS] * 3 +
                                                      [normops.NORM_BACKWARD_STATS]))
    torch_outs, torch_log = _record(step, False, monkeypatch)
    assert len(served) == 4  # (none with the fused passes off)
    for a, b in zip(fused_outs, torch_outs, strict=True):
        assert same_bits(a, b)
    assert len(fused_log) == len(torch_log)
    for a, b in zip(fused_log, torch_log, strict=True):
        assert a.numel == b.numel
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.up, b.up)
        assert np.array_equal(a.value_indices, b.value_indices)
        assert np.array_equal(a.values, b.values)
