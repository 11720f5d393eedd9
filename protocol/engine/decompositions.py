"""Decompositions of ops without a bound rule into ops that have one (SPEC §3.2.1).

Softmax, normalisations, losses, GELU and their backwards have no bound rule of their own: the
interceptor runs their decomposition instead, under the same dispatch mode, so each primitive
inside is computed wide and rounded as its own site with its own rule. The decomposition is the
same Python code on every device, so a CPU and a GPU execute the same algorithm and only the
primitives' reductions differ in order — which their bounds cover.

The decompositions are PyTorch's own (`torch._decomp`, what `torch.compile` lowers through), and
a few written here where PyTorch's would reach a primitive without a rule (its variance is the
fused `prims.var`) or has none (softmax.int, which SDPA's math kernel calls; `_foreach_norm`,
which gradient clipping calls).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch._decomp import decomposition_table

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
