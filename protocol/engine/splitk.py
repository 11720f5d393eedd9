"""Emulated hardware: re-ordered accumulation for matmuls, convolutions and sums.

Two GPUs (or a GPU and a CPU) give different bits mainly because their kernels sum products in
different orders and blockings. `SplitK` reproduces that on one CPU: it splits the reduced
dimension of each mm / addmm / bmm / convolution (forward and backward) / sum into chunks,
reduces each chunk with the native kernel, and adds the partial results in a permuted order keyed
by the profile's seed. The arithmetic is the op's own dtype, so in plain float32 training the
divergence is as large as a different GPU's, while under ovt's wide compute it stays far below
one target ULP and the rounding log absorbs it.

Ops it does not know run natively; so does any op whose reduced dimension is too short to split.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from protocol.engine.rng import RandomStream

aten = torch.ops.aten


@lru_cache(maxsize=256)
def _order(seed: int, n: int) -> tuple[int, ...]:
    return tuple(int(i) for i in RandomStream(seed, "splitk-order", n).permutation(n))


def _slices(length: int, chunks: int) -> list[slice]:
    n = min(chunks, length)
    bounds = [length * i // n for i in range(n + 1)]
    return [slice(bounds[i], bounds[i + 1]) for i in range(n)]


class SplitK:
    """A `compute` function for `RoundingMode` (and the plain-float `ReorderMode`)."""

    def __init__(self, seed: int, chunks: int = 3) -> None:
        if chunks < 2:
            raise ValueError("split-K needs at least two chunks")
        self.seed, self.chunks = seed, chunks
        self._handlers: dict[object, Callable[..., Any]] = {
            aten.mm.default: self._mm, aten.addmm.default: self._addmm,
            aten.bmm.default: self._bmm, aten.convolution.default: self._convolution,
            aten.convolution_backward.default: self._convolution_backward,
            aten.sum.dim_IntList: self._sum_dim, aten.sum.default: self._sum_all,
        }

    def __call__(self, func, args: tuple, kwargs: dict):
        handler = self._handlers.get(func)
        if handler is None:
            return func(*args, **kwargs)
        return handler(func, *args, **kwargs)

    def _add_permuted(self, parts: list[torch.Tensor]) -> torch.Tensor:
        order = _order(self.seed, len(parts))
        total = parts[order[0]]
        for i in order[1:]:
            total = total + parts[i]
        return total

    def _mm(self, func, a, b):
        if a.shape[1] < 2:
            return func(a, b)
        return self._add_permuted([a[:, s].mm(b[s, :]) for s in _slices(a.shape[1], self.chunks)])

    def _addmm(self, func, bias, a, b, *, beta=1, alpha=1):
        if a.shape[1] < 2:
            return func(bias, a, b, beta=beta, alpha=alpha)
        product = self._mm(aten.mm.default, a, b)
        product = product if alpha == 1 else product * alpha
        return product if beta == 0 else product + (bias if beta == 1 else bias * beta)

    def _bmm(self, func, a, b):
        if a.shape[2] < 2:
            return func(a, b)
        return self._add_permuted(
            [a[:, :, s].bmm(b[:, s, :]) for s in _slices(a.shape[2], self.chunks)])

    def _convolution(self, func, x, w, bias, stride, padding, dilation, transposed,
                     output_padding, groups):
        if transposed or groups != 1 or x.shape[1] < 2:
            return func(x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
        parts = [func(x[:, s], w[:, s], None, stride, padding, dilation, False, output_padding, 1)
                 for s in _slices(x.shape[1], self.chunks)]
        out = self._add_permuted(parts)
        return out if bias is None else out + bias.view(1, -1, *([1] * (out.dim() - 2)))

    def _convolution_backward(self, func, grad_out, x, w, bias_sizes, stride, padding, dilation,
                              transposed, output_padding, groups, output_mask):
        conv = (stride, padding, dilation, transposed, output_padding, groups)
        if transposed or groups != 1 or x.shape[0] < 2 or w.shape[0] < 2:
            return func(grad_out, x, w, bias_sizes, *conv, output_mask)
        gi = gw = gb = None
        if output_mask[0]:  # grad_input: sum over output channels
            gi = self._add_permuted([
                func(grad_out[:, s], x, w[s], None, *conv, [True, False, False])[0]
                for s in _slices(w.shape[0], self.chunks)])
        if output_mask[1]:  # grad_weight: sum over the batch
            gw = self._add_permuted([
                func(grad_out[s], x[s], w, None, *conv, [False, True, False])[1]
                for s in _slices(x.shape[0], self.chunks)])
        if output_mask[2]:
            dims = [0, *range(2, grad_out.dim())]
            gb = self._add_permuted(
                [grad_out[s].sum(dims) for s in _slices(x.shape[0], self.chunks)])
        return gi, gw, gb

    def _sum_dim(self, func, x, dim, keepdim=False, *, dtype=None):
        dims = [d % x.dim() for d in dim] if dim else []
        if not dims or x.shape[dims[0]] < 2:
            return func(x, dim, keepdim, dtype=dtype)
        parts = [x.narrow(dims[0], s.start, s.stop - s.start).sum(dims, keepdim=True, dtype=dtype)
                 for s in _slices(x.shape[dims[0]], self.chunks)]
        total = self._add_permuted(parts)
        return total if keepdim else total.squeeze(tuple(dims))

    def _sum_all(self, func, x, *, dtype=None):
        flat = x.reshape(-1)
        if flat.numel() < 2:
            return func(x, dtype=dtype)
        return self._add_permuted([flat[s].sum(dtype=dtype)
                                   for s in _slices(flat.numel(), self.chunks)])


class ReorderMode(TorchDispatchMode):
    """Plain (unrounded) training under the emulated profile: every op through `SplitK`."""

    def __init__(self, splitk: SplitK) -> None:
        super().__init__()
        self.splitk = splitk

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.splitk(func, args, kwargs or {})
