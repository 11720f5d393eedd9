"""ovt's own normalisation ops: a row's statistics and the normalize formula (SPEC §3.2.1).

Layer norm and batch norm (training) run as two sites each instead of their dozen primitives
(`decompositions`), and so does batch norm's backward in training:

- `torch.ops.ovt.norm_stats(x, dims, eps)` -> (mean, biased variance, rstd), each kept as a
  dimension of one over `dims`: the exact mean μ = Σ x / K, v = Σ (x − μ)² / K and
  ρ = (v + eps)^(−1/2) of every row of K elements, computed two-pass (the mean, then the squared
  deviations from the computed mean) in any summation order. It carries its own rule
  (`bounds`, "norm statistics"), which holds where the rows are not too ill-conditioned
  (`bounds.rule_of` decides from the inputs); elsewhere it runs as its decomposition, the
  two-pass variance's primitives each a site.
- `torch.ops.ovt.normalize(x, mean, rstd, weight, bias)` -> ((x − mean)·rstd)·weight + bias,
  broadcast, one IEEE operation at a time: a fixed formula, the same bits on every conforming
  machine (IEEE-754 §5.4.1), so e = 0 and nothing is ever logged. Its mean and rstd are the
  rounded statistics: target values, as every site's inputs are.
- `torch.ops.ovt.norm_backward_stats(grad, x, mean, dims)` -> (Σ g, Σ g·(x − mean)): two
  sums with the reduction rule (`bounds`), and `torch.ops.ovt.normalize_backward(...)`, the
  input gradient from those rounded sums: a fixed formula again.

All four are Python implementations over torch ops, registered with `torch.library` so that
the interceptor sees them as ops (one site each) and a profile can compute the statistics in
another conforming form (`splitk`); they run on any device. On the CPU the two formulas also
run as fused C++ passes straight from float32 operands, the same bits (`fused_formula`), and
the two statistics' sums as C++ passes of their own order (`rows_view`): a conforming form
like any other (their rules hold for every order), used wherever the library is loaded, so
that the fused and the torch-ops paths compute the same statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from protocol.engine import fused


@torch.library.custom_op("ovt::norm_stats", mutates_args=())
def norm_stats(x: torch.Tensor, dims: list[int], eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, biased variance, rstd) of `x` over `dims`, kept as dimensions of one: a sum
    divided by K, the squared deviations from that mean summed and divided by K, then
    rsqrt(variance + eps). The two sums in one C++ pass each where `rows_view` serves a
    float64 `x` (their own order: the rule holds for any), else torch's."""
    view = rows_view(x, dims) if x.dtype == torch.float64 else None
    if view is not None:
        return _kernel_stats(x, dims, eps, view)
    k = math.prod(x.shape[d] for d in dims)
    mean = x.sum(dims, keepdim=True).div_(k)
    deviation = x - mean
    var = deviation.mul_(deviation).sum(dims, keepdim=True).div_(k)
    return mean, var, (var + eps).rsqrt_()


@torch.library.custom_op("ovt::normalize", mutates_args=())
def normalize(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
              weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """((x − mean)·rstd)·weight + bias, each operation rounded once (no FMA: four separate
    kernels); a missing weight or bias is left out. mean, rstd, weight and bias broadcast to
    `x`'s shape (the decompositions shape them so)."""
    y = (x - mean).mul_(rstd)
    if weight is not None:
        y.mul_(weight)
    if bias is not None:
        y.add_(bias)
    return y


@torch.library.custom_op("ovt::norm_backward_stats", mutates_args=())
def norm_backward_stats(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                        dims: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ g, Σ g·(x − mean)) over `dims`, kept as dimensions of one: the two sums a
    normalisation's backward needs (batch norm's bias gradient, and with rstd its weight's).
    Both in one C++ pass where `rows_view` serves a float64 `x` (their own order), else
    torch's."""
    view = _backward_view(grad, x, mean, dims) if x.dtype == torch.float64 else None
    if view is not None:
        return _kernel_backward_sums(grad, x, mean, dims, view)
    return grad.sum(dims, keepdim=True), (x - mean).mul_(grad).sum(dims, keepdim=True)


def rows_view(x: torch.Tensor, dims: list[int]) -> tuple[int, int, int] | None:
    """(A, B, C): `x` viewed as B rows, each reduced over A and C, as the C++ statistics
    (`row_stats`, `row_backward_sums` and their rules' `row_extremes` in `csrc/fused.cpp`) read
    it — a layer norm's rows over the trailing dimensions (1, rows, K), or a batch norm's
    channels over all other dimensions (samples, channels, positions); None where they do not
    serve: the library not loaded or not for `x`'s device (`fused.own_arithmetic`), `x` not a
    nonempty contiguous float64 or float32 tensor of one or more dimensions (the ops take
    float64 only, their rules' extremes and the interceptor's `narrow_statistics` float32
    too), a dimension out of range, or another reduction."""
    nd = x.dim()
    if not (fused.own_arithmetic(x) and x.dtype in (torch.float64, torch.float32)
            and x.is_contiguous() and x.numel() and nd and all(-nd <= d < nd for d in dims)):
        return None
    reduced = sorted({d % nd for d in dims})
    if not reduced or len(reduced) != len(dims):
        return None
    if reduced == list(range(nd - len(reduced), nd)):
        k = math.prod(x.shape[d] for d in reduced)
        return 1, x.numel() // k, k
    if nd >= 2 and reduced == [0, *range(2, nd)]:
        return x.shape[0], x.shape[1], x.numel() // (x.shape[0] * x.shape[1])
    return None


def kept_shape(x: torch.Tensor, dims: list[int]) -> list[int]:
    """`x`'s shape with `dims` kept as dimensions of one."""
    reduced = {d % x.dim() for d in dims}
    return [1 if d in reduced else n for d, n in enumerate(x.shape)]


def _backward_view(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, dims: list[int]
                   ) -> tuple[int, int, int] | None:
    """`rows_view` for norm_backward_stats: also `grad` of `x`'s shape and dtype and `mean`
    one value per row (`x`'s shape with `dims` kept as ones), both contiguous; else None."""
    view = rows_view(x, dims)
    if view is None or grad.shape != x.shape or grad.dtype != x.dtype or \
            not grad.is_contiguous() or mean.dtype != x.dtype or not mean.is_contiguous() or \
            list(mean.shape) != kept_shape(x, dims):
        return None
    return view


def _kernel_stats(x: torch.Tensor, dims: list[int], eps: float, view: tuple[int, int, int]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """norm_stats by `torch.ops.ovt.row_stats` (float64 results from float64 or float32 `x`)."""
    mean, var = (t.reshape(kept_shape(x, dims)) for t in torch.ops.ovt.row_stats(x, *view))
    return mean, var, (var + eps).rsqrt_()


def _kernel_backward_sums(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                          dims: list[int], view: tuple[int, int, int]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """norm_backward_stats by `torch.ops.ovt.row_backward_sums` (float64 results)."""
    kept = kept_shape(x, dims)
    sum_grad, sum_product = torch.ops.ovt.row_backward_sums(grad, x, mean, *view)
    return sum_grad.reshape(kept), sum_product.reshape(kept)


@torch.library.custom_op("ovt::normalize_backward", mutates_args=())
def normalize_backward(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                       rstd: torch.Tensor, weight: torch.Tensor | None, sum_grad: torch.Tensor,
                       sum_product: torch.Tensor, count: int) -> torch.Tensor:
    """The input gradient of `normalize` in training, from the rounded sums of
    `norm_backward_stats` over `count` elements a row, in PyTorch's decomposition's order:
    ((g − (x − mean)·((Σ g·(x − mean)·(1/K))·(rstd·rstd))) − (Σ g)·(1/K))·(rstd·weight), each
    operation rounded once."""
    norm = 1.0 / count
    slope = (sum_product * norm).mul_(rstd * rstd)
    scale = rstd * weight if weight is not None else rstd
    return (grad - (x - mean).mul_(slope)).sub_(sum_grad * norm).mul_(scale)


NORM_STATS = torch.ops.ovt.norm_stats.default
NORMALIZE = torch.ops.ovt.normalize.default
NORM_BACKWARD_STATS = torch.ops.ovt.norm_backward_stats.default
NORMALIZE_BACKWARD = torch.ops.ovt.normalize_backward.default
FORMULAS = frozenset({NORMALIZE, NORMALIZE_BACKWARD})
STATISTICS = frozenset({NORM_STATS, NORM_BACKWARD_STATS})


def narrow_statistics(func: torch._ops.OpOverload, args: tuple
                      ) -> Callable[[], tuple[torch.Tensor, ...]] | None:
    """norm_stats's or norm_backward_stats's float64 results computed by the C++ kernels
    straight from its float32 operands `args` (a Python float among them already rounded as
    the op reads it, SPEC §3.3), as a function to call: the kernels widen each element exactly
    as they read it and sum in the order they sum float64 operands in, so these are the bits
    of the op on the widened operands, without the widened copies. None where the kernels do
    not serve these operands (`rows_view` of a float32 `x`; a gradient and a mean that do not
    fit, `_backward_view`) or the fused passes are off (`fused.serves`: this is one, the same
    bits as the widened path); then the interceptor widens them, as for any op."""
    if not fused.serves(args[0]):
        return None
    if func == NORM_STATS:
        x, dims, eps = args
        view = rows_view(x, dims) if x.dtype == torch.float32 else None
        if view is None:
            return None
        return partial(_kernel_stats, x, dims, eps, view)
    if func == NORM_BACKWARD_STATS:
        grad, x, mean, dims = args
        view = _backward_view(grad, x, mean, dims) if x.dtype == torch.float32 else None
        if view is None:
            return None
        return partial(_kernel_backward_sums, grad, x, mean, dims, view)
    return None


def fused_formula(func: torch._ops.OpOverload, args: tuple
                  ) -> Callable[[], torch.Tensor] | None:
    """`normalize`'s or `normalize_backward`'s float32 result computed in one C++ pass from the
    float32 operands `args` (the same bits as its torch ops on widened operands: they are IEEE
    operations alone; `csrc/fused.cpp`), as a function to call; or None where that pass does
    not serve these operands (then the interceptor widens them, as for any op): the fused
    passes off or not built, an operand that is not a contiguous float32 CPU tensor, or a
    layout other than a layer norm's rows or a batch norm's channels (`_layout`)."""
    if func == NORMALIZE:
        x, mean, rstd, weight, bias = args
        operands, grads = [x, mean, rstd, weight, bias], []
    elif func == NORMALIZE_BACKWARD:
        g, x, mean, rstd, weight, sum_grad, sum_product, count = args
        operands, grads = [g, x, mean, rstd, weight, sum_grad, sum_product], [g]
    else:
        return None
    if not fused.serves(x) or not x.numel() or not all(
            t is None or (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and
                          t.is_cpu and t.is_contiguous()) for t in operands):
        return None
    layout = _layout(x, mean, [weight] if func == NORMALIZE_BACKWARD else [weight, bias])
    stats = [rstd] if func == NORMALIZE else [rstd, sum_grad, sum_product]
    if layout is None or any(t.shape != mean.shape for t in stats) or \
            any(t.shape != x.shape for t in grads):
        return None
    outer, channels, inner, rows = layout
    if func == NORMALIZE:
        def run() -> torch.Tensor:
            out = torch.empty_like(x)
            torch.ops.ovt.fused_normalize(x, mean, rstd, weight, bias, out, outer, channels,
                                          inner, rows)
            return out
        return run
    if rows:  # (the backward's layout is a batch norm's)
        return None

    def run_backward() -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.ovt.fused_normalize_backward(g, x, mean, rstd, weight, sum_grad, sum_product,
                                               out, outer, channels, inner, count)
        return out
    return run_backward


def _layout(x: torch.Tensor, mean: torch.Tensor, params: list[torch.Tensor | None]
            ) -> tuple[int, int, int, bool] | None:
    """(outer, channels, inner, rows) as the C++ passes read `x`: a layer norm's rows, the mean
    one value per row over the last dimensions and each parameter the shape of those dimensions
    (rows True, channels 1); or a batch norm's channels, the mean and every parameter one value
    per channel (dimension 1). None for anything else."""
    shape, nd = tuple(x.shape), x.dim()
    for a in range(nd):
        if tuple(mean.shape) == shape[:a] + (1,) * (nd - a) and \
                all(p is None or tuple(p.shape) == shape[a:] for p in params):
            return math.prod(shape[:a]), 1, math.prod(shape[a:]), True
    if nd >= 2:
        kept = (1, shape[1]) + (1,) * (nd - 2)
        if tuple(mean.shape) == kept and \
                all(p is None or tuple(p.shape) in (kept, kept[1:]) for p in params):
            return shape[0], shape[1], math.prod(shape[2:]), False
    return None
