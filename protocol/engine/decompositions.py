"""Decompositions of ops without a bound rule into ops that have one (SPEC §3.2.1).

Softmax, normalisations, losses, GELU and their backwards have no bound rule of their own: the
interceptor runs their decomposition instead, under the same dispatch mode, so each primitive
inside is computed wide and rounded as its own site with its own rule. The decomposition is the
same Python code on every device, so a CPU and a GPU execute the same algorithm and only the
primitives' reductions differ in order — which their bounds cover.

The decompositions are PyTorch's own (`torch._decomp`, what `torch.compile` lowers through), and
a few written here where PyTorch's would reach a primitive without a rule (its variance is the
fused `prims.var`) or has none (softmax.int, which SDPA's math kernel calls; `_foreach_norm`,
which gradient clipping calls). Layer norm and batch norm (training) decompose into ovt's own
ops (`normops`): their statistics, with an own rule, and the normalize formula; batch norm's
backward likewise into its two sums and the input gradient's formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch._decomp import decomposition_table

from protocol.engine import normops

aten = torch.ops.aten


def _reduced_dims(x: torch.Tensor, dim) -> list[int]:
    if dim is None:
        return list(range(x.dim()))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return [d % x.dim() for d in dims] if x.dim() else []


def var_mean(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-pass variance: mean, deviations, sum of squares, divided by (n - correction).
    Each step is a site with a rule (mean and sum: reductions; sub, mul: exact IEEE; div)."""
    dims = _reduced_dims(x, dim)
    n = math.prod(x.shape[d] for d in dims)
    divisor = n - (1 if correction is None else correction)
    mean = aten.mean.dim(x, dims, True)
    deviation = aten.sub.Tensor(x, mean)
    squares = aten.sum.dim_IntList(aten.mul.Tensor(deviation, deviation), dims, keepdim)
    var = aten.div.Scalar(squares, max(divisor, 0))
    return var, (mean if keepdim else aten.squeeze.dims(mean, dims))


def var(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False) -> torch.Tensor:
    return var_mean(x, dim, correction=correction, keepdim=keepdim)[0]


def std(x: torch.Tensor, dim=None, *, correction=None, keepdim: bool = False) -> torch.Tensor:
    return aten.sqrt.default(var(x, dim, correction=correction, keepdim=keepdim))


def norm_stats(x: torch.Tensor, dims: list[int], eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`normops.norm_stats` where its own rule does not hold (`bounds.rule_of`): the two-pass
    variance's primitives, the sum with eps and the rsqrt, each a site."""
    var, mean = var_mean(x, dims, correction=0, keepdim=True)
    return mean, var, aten.rsqrt.default(aten.add.Tensor(var, eps))


def norm_backward_stats(grad: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                        dims: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`normops.norm_backward_stats` where its own rule does not hold (`bounds.rule_of`): the
    sum of g, and the deviations, their products with g and their sum, each a site."""
    return (aten.sum.dim_IntList(grad, dims, True),
            aten.sum.dim_IntList(aten.mul.Tensor(aten.sub.Tensor(x, mean), grad), dims, True))


def native_layer_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor | None,
                      bias: torch.Tensor | None, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer norm as two sites (bound rules version 4): the rows' statistics over the last
    len(normalized_shape) dimensions, then the normalize formula on their rounded mean and
    rstd (`normops`). Raises ValueError where the shapes do not fit (ATen's checks, which the
    decomposition replaces)."""
    shape = tuple(normalized_shape)
    if not shape or tuple(x.shape[x.dim() - len(shape):]) != shape or \
            any(t is not None and tuple(t.shape) != shape for t in (weight, bias)):
        raise ValueError(f"layer norm over {list(shape)} of a {list(x.shape)} input with "
                         f"weight {None if weight is None else list(weight.shape)} and bias "
                         f"{None if bias is None else list(bias.shape)}: the shapes do not fit")
    dims = list(range(x.dim() - len(shape), x.dim()))
    mean, _, rstd = normops.NORM_STATS(x, dims, eps)
    return normops.NORMALIZE(x, mean, rstd, weight, bias), mean, rstd


def native_batch_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                      running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                      training: bool, momentum: float, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch norm in training as two sites (bound rules version 4): each channel's statistics
    over the batch and spatial dimensions, then the normalize formula (`normops`); the running
    mean and variance are updated as PyTorch's decomposition updates them (its ops, each a
    site, on the rounded statistics). In evaluation PyTorch's decomposition runs as it is."""
    if not training or x.dim() < 2:
        return decomposition_table[aten.native_batch_norm.default](
            x, weight, bias, running_mean, running_var, training, momentum, eps)
    dims = [0, *range(2, x.dim())]
    channel = (x.shape[1],) + (1,) * (x.dim() - 2)
    mean, var, rstd = normops.NORM_STATS(x, dims, eps)
    out = normops.NORMALIZE(x, mean, rstd,
                            None if weight is None else weight.reshape(channel),
                            None if bias is None else bias.reshape(channel))
    save_mean, save_rstd = mean.reshape(x.shape[1]), rstd.reshape(x.shape[1])
    if running_mean is not None:
        running_mean.copy_(momentum * save_mean + (1 - momentum) * running_mean)
    if running_var is not None:
        n = x.numel() / x.shape[1]
        unbiased = var.reshape(x.shape[1]) * (n / (n - 1))
        running_var.copy_(momentum * unbiased + (1 - momentum) * running_var)
    return out, save_mean, save_rstd


def native_batch_norm_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                               running_mean: torch.Tensor | None,
                               running_var: torch.Tensor | None, save_mean: torch.Tensor | None,
                               save_invstd: torch.Tensor | None, train: bool, eps: float,
                               output_mask: list[bool]
                               ) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                          torch.Tensor | None]:
    """Batch norm's backward in training as two sites and a product (bound rules version 4):
    each channel's Σ g and Σ g·(x − mean) (`normops.norm_backward_stats`, the reduction
    rule), the input gradient from them (`normops.normalize_backward`, a fixed formula), and
    the weight's gradient Σ g·(x − mean)·rstd; the bias's is Σ g. In evaluation PyTorch's
    decomposition runs as it is."""
    if not train or x.dim() < 2 or save_mean is None or save_invstd is None:
        return decomposition_table[aten.native_batch_norm_backward.default](
            grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
            output_mask)
    channels = x.shape[1]
    dims = [0, *range(2, x.dim())]
    kept = (1, channels) + (1,) * (x.dim() - 2)
    mean, rstd = save_mean.reshape(kept), save_invstd.reshape(kept)
    sum_grad, sum_product = normops.NORM_BACKWARD_STATS(grad, x, mean, dims)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        grad_input = normops.NORMALIZE_BACKWARD(
            grad, x, mean, rstd, None if weight is None else weight.reshape(kept), sum_grad,
            sum_product, x.numel() // channels)
    if output_mask[1]:
        grad_weight = aten.mul.Tensor(sum_product, rstd).reshape(channels)
    if output_mask[2]:
        grad_bias = sum_grad.reshape(channels)
    return grad_input, grad_weight, grad_bias


def softmax(x: torch.Tensor, dim: int, dtype=None) -> torch.Tensor:
    """softmax.int, as SDPA's math kernel calls it below autograd: the `_softmax` primitive
    (itself decomposed), after the requested dtype conversion."""
    return aten._softmax.default(x if dtype is None else x.to(dtype), dim, False)


def log_softmax(x: torch.Tensor, dim: int, dtype=None) -> torch.Tensor:
    """log_softmax.int: likewise through `_log_softmax`."""
    return aten._log_softmax.default(x if dtype is None else x.to(dtype), dim, False)


def foreach_norm(tensors: list[torch.Tensor], ord=2, dtype=None) -> list[torch.Tensor]:
    """_foreach_norm (what `clip_grad_norm_` calls): one `linalg_vector_norm` per tensor, each
    decomposed in turn (for the 2-norm: |x|, squares, a sum, a square root)."""
    return [aten.linalg_vector_norm.default(t, ord, dtype=dtype) for t in tensors]


def native_dropout_backward(grad: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The backward of a direct native_dropout call (served by `random_ops`): grad * scale
    where the mask kept, else 0 (PyTorch's own goes through `type_as`, which has no rule)."""
    return aten.where.ScalarOther(mask, aten.mul.Tensor(grad, scale), 0.0)


def _unbiased(fn: Callable) -> tuple[Callable, Callable]:
    """The `unbiased=` overloads (.default and .dim) of var_mean, var and std, through `fn`."""
    def default(x, unbiased: bool = True):
        return fn(x, None, correction=1 if unbiased else 0)

    def by_dim(x, dim, unbiased: bool = True, keepdim: bool = False):
        return fn(x, dim, correction=1 if unbiased else 0, keepdim=keepdim)
    return default, by_dim


_OWN: dict[torch._ops.OpOverload, Callable] = {
    normops.NORM_STATS: norm_stats,
    normops.NORM_BACKWARD_STATS: norm_backward_stats,
    aten.native_layer_norm.default: native_layer_norm,
    aten.native_batch_norm.default: native_batch_norm,
    aten.native_batch_norm_backward.default: native_batch_norm_backward,
    aten.softmax.int: softmax,
    aten.log_softmax.int: log_softmax,
    aten.native_dropout_backward.default: native_dropout_backward,
    aten._foreach_norm.Scalar: foreach_norm,
}
for _packet, _fn in ((aten.var_mean, var_mean), (aten.var, var), (aten.std, std)):
    _OWN[_packet.correction] = _fn
    _OWN[_packet.default], _OWN[_packet.dim] = _unbiased(_fn)


def decomposition_of(func: torch._ops.OpOverload) -> Callable | None:
    """The decomposition the interceptor runs for `func`, or None (then it is refused)."""
    own = _OWN.get(func)
    return own if own is not None else decomposition_table.get(func)
