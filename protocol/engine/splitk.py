"""Emulated hardware: re-ordered accumulation for matmuls, convolutions, sums and means.

Two GPUs (or a GPU and a CPU) give different bits mainly because their kernels sum products in
different orders and blockings. `SplitK` reproduces that on one CPU: it splits the reduced
dimension of each mm / addmm / bmm / convolution (forward and backward) / sum / mean (and the
row sums of the softmax family and of the norm statistics, computed in another conforming form,
as GELU is) into `chunks` pieces, reduces each piece with the native kernel, and combines the
partial results in one of three orders (`ORDERS`), each the shape of a real kernel family:

- "permuted": sequential adds in an order permuted by the profile's seed (a split-K GEMM whose
  workers finish in an arbitrary but fixed order and accumulate into one buffer);
- "pairwise": a balanced binary tree, (p0+p1)+(p2+p3), then those sums pairwise, an odd one
  out carried up a level (the shape of a GPU's tree reduction across threads or blocks);
- "reversed": sequential adds, last chunk first (a kernel that walks K downwards).

The arithmetic is the op's own dtype, so in plain float32 training the divergence is as large
as a different GPU's, while under ovt's wide compute it stays far below one target ULP and the
rounding log absorbs it.

Ops it does not know run natively; so does any op whose reduced dimension is too short to split.
A chunk count larger than the reduced dimension gives one chunk per element.

    >>> a, b = torch.ones(2, 6), torch.ones(6, 2)
    >>> SplitK(seed=0, chunks=4, order="pairwise")(aten.mm.default, (a, b), {}).tolist()
    [[6.0, 6.0], [6.0, 6.0]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from math import prod
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from protocol.engine import normops
from protocol.engine.rng import RandomStream

aten = torch.ops.aten

ORDERS = ("permuted", "pairwise", "reversed")


@lru_cache(maxsize=256)
def _permutation(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(i) for i in RandomStream(seed, "splitk-order", n).permutation(n))


def _slices(length: int, chunks: int) -> list[slice]:
    n = min(chunks, length)
    bounds = [length * i // n for i in range(n + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(n)]


def combine(parts: Sequence[Any], order: str, seed: int) -> Any:
    """Add the partial results `parts` (at least one) in `order`, with `+` alone.

    Only `+` is used, so a test can pass symbolic values and read the tree back. Raises
    ValueError for an order not in `ORDERS`.
    """
    if order == "permuted":
        return _sequential([parts[i] for i in _permutation(seed, len(parts))])
    if order == "reversed":
        return _sequential(list(reversed(parts)))
    if order == "pairwise":
        level = list(parts)
        while len(level) > 1:  # one tree level: neighbours paired, an odd last one carried up
            paired = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
            level = paired + level[len(paired) * 2:]
        return level[0]
    raise ValueError(f"unknown split-K order {order!r}; choose one of {', '.join(ORDERS)}")


def _sequential(parts: list[Any]) -> Any:
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


class SplitK:
    """A `compute` function for `RoundingMode` (and the plain-float `ReorderMode`).

    `seed` keys the "permuted" order (the other orders ignore it); `chunks` (>= 2) is how many
    pieces the reduced dimension is cut into; `order` is one of `ORDERS`. Raises ValueError for
    fewer than two chunks or an unknown order.
    """

    def __init__(self, seed: int, chunks: int = 3, order: str = "permuted") -> None:
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 2:
            raise ValueError(f"split-K needs an integer of at least two chunks, not {chunks!r}")
        if order not in ORDERS:
            raise ValueError(f"unknown split-K order {order!r}; choose one of {', '.join(ORDERS)}")
        self.seed, self.chunks, self.order = seed, chunks, order
        self._handlers: dict[object, Callable[..., Any]] = {
            aten.mm.default: self._mm, aten.addmm.default: self._addmm,
            aten.bmm.default: self._bmm, aten.convolution.default: self._convolution,
            aten.convolution_backward.default: self._convolution_backward,
            aten.sum.dim_IntList: self._sum_dim, aten.sum.default: self._sum_all,
            aten.mean.dim: self._mean_dim, aten.mean.default: self._mean_all,
            aten._softmax.default: self._softmax,
            aten._log_softmax.default: self._log_softmax,
            aten._softmax_backward_data.default: self._softmax_backward,
            aten._log_softmax_backward_data.default: self._log_softmax_backward,
            aten.gelu.default: self._gelu, aten.gelu_backward.default: self._gelu_backward,
            aten.native_layer_norm_backward.default: self._layer_norm_backward,
            normops.NORM_STATS: self._norm_stats,
            normops.NORM_BACKWARD_STATS: self._norm_backward_stats,
        }

    def __repr__(self) -> str:
        return f"SplitK(seed={self.seed}, chunks={self.chunks}, order={self.order!r})"

    def __call__(self, func, args: tuple, kwargs: dict):
        handler = self._handlers.get(func)
        if handler is None:
            return func(*args, **kwargs)
        return handler(func, *args, **kwargs)

    def _combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return combine(parts, self.order, self.seed)

    def _mm(self, func, a, b):
        if a.shape[1] < 2:
            return func(a, b)
        return self._combine([a[:, s].mm(b[s, :]) for s in _slices(a.shape[1], self.chunks)])

    def _addmm(self, func, bias, a, b, *, beta=1, alpha=1):
        if a.shape[1] < 2:
            return func(bias, a, b, beta=beta, alpha=alpha)
        product = self._mm(aten.mm.default, a, b)
        product = product if alpha == 1 else product * alpha
        return product if beta == 0 else product + (bias if beta == 1 else bias * beta)

    def _bmm(self, func, a, b):
        if a.shape[2] < 2:
            return func(a, b)
        return self._combine(
            [a[:, :, s].bmm(b[:, s, :]) for s in _slices(a.shape[2], self.chunks)])

    def _convolution(self, func, x, w, bias, stride, padding, dilation, transposed,
                     output_padding, groups):
        if transposed or groups != 1 or x.shape[1] < 2:
            return func(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
        parts = [func(x[:, s], w[:, s], None, stride, padding, dilation, False, output_padding, 1)
                 for s in _slices(x.shape[1], self.chunks)]
        out = self._combine(parts)
        return out if bias is None else out + bias.view(1, -1, *([1] * (out.dim() - 2)))

    def _convolution_backward(self, func, grad_out, x, w, bias_sizes, stride, padding, dilation,
                              transposed, output_padding, groups, output_mask):
        conv = (stride, padding, dilation, transposed, output_padding, groups)
        if transposed or groups != 1 or x.shape[0] < 2 or w.shape[0] < 2:
            return func(grad_out, x, w, bias_sizes, *conv, output_mask)
        gi = gw = gb = None
        if output_mask[0]:  # grad_input: sum over output channels
            gi = self._combine([
                func(grad_out[:, s], x, w[s], None, *conv, [True, False, False])[0]
                for s in _slices(w.shape[0], self.chunks)])
        if output_mask[1]:  # grad_weight: sum over the batch
            gw = self._combine([
                func(grad_out[s], x[s], w, None, *conv, [False, True, False])[1]
                for s in _slices(x.shape[0], self.chunks)])
        if output_mask[2]:
            dims = [0, *range(2, grad_out.dim())]
            gb = self._combine(
                [grad_out[s].sum(dims) for s in _slices(x.shape[0], self.chunks)])
        return gi, gw, gb

    def _sum_dim(self, func, x, dim, keepdim=False, *, dtype=None):
        dims = [d % x.dim() for d in dim] if dim and x.dim() else []
        if not dims or x.shape[dims[0]] < 2:
            return func(x, dim, keepdim, dtype=dtype)
        parts = [x.narrow(dims[0], s.start, s.stop - s.start).sum(dims, keepdim=True, dtype=dtype)
                 for s in _slices(x.shape[dims[0]], self.chunks)]
        total = self._combine(parts)
        return total if keepdim else total.squeeze(tuple(dims))

    def _sum_all(self, func, x, *, dtype=None):
        flat = x.reshape(-1)
        if flat.numel() < 2:
            return func(x, dtype=dtype)
        return self._combine([flat[s].sum(dtype=dtype)
                              for s in _slices(flat.numel(), self.chunks)])

    def _mean_dim(self, func, x, dim, keepdim=False, *, dtype=None):
        """The split sum over `dim`, then one division by the count (as ATen's CPU mean does)."""
        dims = [d % x.dim() for d in dim] if dim and x.dim() else []
        if not dims or x.shape[dims[0]] < 2 or not (dtype or x.dtype).is_floating_point:
            return func(x, dim, keepdim, dtype=dtype)
        total = self._sum_dim(aten.sum.dim_IntList, x, dims, keepdim, dtype=dtype)
        return total / prod(x.shape[d] for d in set(dims))

    def _mean_all(self, func, x, *, dtype=None):
        if x.numel() < 2 or not (dtype or x.dtype).is_floating_point:
            return func(x, dtype=dtype)
        return self._sum_all(aten.sum.default, x, dtype=dtype) / x.numel()

    # The softmax family, as another machine's kernels compute it: two-pass, the row sums split
    # and combined in this profile's order, and the other form of each where there is one
    # (t · (1/s), x − (M + log s), g·y − y·s): algorithms its bound rules cover
    # (protocol.engine.bounds, "composite ops"). A 0-d or empty input runs natively.

    def _row_sum(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return self._sum_dim(aten.sum.dim_IntList, t, [dim], True)

    def _softmax(self, func, x, dim, half_to_float):
        if not x.numel() or not x.dim() or half_to_float:
            return func(x, dim, half_to_float)
        t = (x - x.amax(dim, keepdim=True)).exp_()
        return t.mul_(self._row_sum(t, dim).reciprocal())

    def _log_softmax(self, func, x, dim, half_to_float):
        if not x.numel() or not x.dim() or half_to_float:
            return func(x, dim, half_to_float)
        top = x.amax(dim, keepdim=True)
        return x - (top + self._row_sum((x - top).exp_(), dim).log())

    def _softmax_backward(self, func, grad, y, dim, input_dtype):
        if not y.numel() or not y.dim() or input_dtype != grad.dtype:
            return func(grad, y, dim, input_dtype)
        product = grad * y
        return product.sub_(y * self._row_sum(product, dim))

    def _log_softmax_backward(self, func, grad, y, dim, input_dtype):
        if not y.numel() or not y.dim() or input_dtype != grad.dtype:
            return func(grad, y, dim, input_dtype)
        return grad - y.exp().mul_(self._row_sum(grad, dim))

    # GELU (the exact form) through erfc, as a math library accurate in the tail computes it,
    # and its backward with exp(−(x/√2)²): forms its bound rules cover.

    def _gelu(self, func, x, *, approximate="none"):
        if approximate != "none":
            return func(x, approximate=approximate)
        return x * (0.5 * torch.special.erfc(x * -_SQRT_HALF))

    def _gelu_backward(self, func, grad, x, *, approximate="none"):
        if approximate != "none":
            return func(grad, x, approximate=approximate)
        t = x * _SQRT_HALF
        return grad * (0.5 * torch.special.erfc(-t) + x * ((-(t * t)).exp() * _INV_SQRT_2PI))

    def _layer_norm_backward(self, func, grad, x, shape, mean, rstd, weight, bias, mask):
        """The decomposition's form (CUDA's too), (ρ/N)·((N·g·w − Σ g·w) − x̂·Σ g·w·x̂) with
        x̂ = (x − μ)·ρ, its row sums and the weight's and bias's sums over the rows split."""
        n = prod(shape)
        if n < 2 or not x.numel():
            return func(grad, x, shape, mean, rstd, weight, bias, mask)
        m = x.numel() // n
        g2, x2 = grad.reshape(m, n), x.reshape(m, n)
        rho = rstd.reshape(m, 1)
        x_hat = (x2 - mean.reshape(m, 1)) * rho
        gw = g2 * weight.reshape(1, n) if weight is not None else g2
        dx = dw = db = None
        if mask[0]:
            inner = gw * n - self._row_sum(gw, 1) - x_hat * self._row_sum(gw * x_hat, 1)
            dx = ((rho / n) * inner).reshape(x.shape)
        if mask[1] and weight is not None:
            dw = self._sum_dim(aten.sum.dim_IntList, g2 * x_hat, [0]).reshape(weight.shape)
        if mask[2] and bias is not None:
            db = self._sum_dim(aten.sum.dim_IntList, g2, [0]).reshape(bias.shape)
        return dx, dw, db

    def _norm_stats(self, func, x, dims, eps):
        """Another form its rule covers (`bounds._norm_stats_rule`): the sums split and
        combined in this profile's order, each multiplied by a rounded 1/K instead of divided
        by K, and rstd as 1/sqrt."""
        k = prod(x.shape[d] for d in dims)
        if not x.numel():
            return func(x, dims, eps)
        mean = self._sum_dim(aten.sum.dim_IntList, x, dims, True) * (1 / k)
        deviation = x - mean
        var = self._sum_dim(aten.sum.dim_IntList, deviation * deviation, dims, True) * (1 / k)
        return mean, var, 1 / (var + eps).sqrt()

    def _norm_backward_stats(self, func, grad, x, mean, dims):
        """Its two sums split and combined in this profile's order."""
        if not x.numel():
            return func(grad, x, mean, dims)
        return (self._sum_dim(aten.sum.dim_IntList, grad, dims, True),
                self._sum_dim(aten.sum.dim_IntList, grad * (x - mean), dims, True))


_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)


class ReorderMode(TorchDispatchMode):
    """Plain (unrounded) training under the emulated profile: every op through `SplitK`."""

    def __init__(self, splitk: SplitK) -> None:
        super().__init__()
        self.splitk = splitk

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.splitk(func, args, kwargs or {})
