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

Both are Python implementations over torch ops, registered with `torch.library` so that the
interceptor sees them as ops (one site each) and a profile can compute them in another
conforming form (`splitk`). They run on any device.
"""

from __future__ import annotations

import math

import torch


@torch.library.custom_op("ovt::norm_stats", mutates_args=())
def norm_stats(x: torch.Tensor, dims: list[int], eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean, biased variance, rstd) of `x` over `dims`, kept as dimensions of one: a sum
    divided by K, the squared deviations from that mean summed and divided by K, then
    rsqrt(variance + eps)."""
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
    normalisation's backward needs (batch norm's bias gradient, and with rstd its weight's)."""
    return grad.sum(dims, keepdim=True), (x - mean).mul_(grad).sum(dims, keepdim=True)


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
