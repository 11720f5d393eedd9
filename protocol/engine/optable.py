"""Which aten ops are rounding sites, which are exact, and which draw random numbers (SPEC §3.2,
§3.4).

The step interceptor sits below autograd, so it sees every op of the forward pass, the backward
pass and the optimizer alike. An op is classified once, by its schema and name:

- EXACT: the result is bit-identical in any precision (views, copies, comparisons, max, relu,
  indexing, constant factories...). These run untouched on target-dtype tensors: no site.
- RANDOM: draws from a device RNG, which never decides a value inside a step (SPEC §3.4): the
  interceptor serves these from the portable generator, or refuses them (`random_ops`).
- FLOAT: everything else. Computed in the compute dtype and rounded: one site per execution.

FLOAT ops get a certified error bound from their rule (`bounds`), or are decomposed into ops
that have one (`decompositions`), or are refused.

Classifying an unknown op as FLOAT is always safe (it then needs a rule, else it is refused;
rounding an exact result changes nothing); classifying a non-exact op as EXACT would leave
hardware nondeterminism unrounded, so the EXACT list only names ops whose outputs are selections
or copies of their inputs.
"""

from __future__ import annotations

import enum
from functools import cache

import torch


class OpKind(enum.Enum):
    EXACT = "exact"
    RANDOM = "random"
    FLOAT = "float"


_EXACT = frozenset("""
    clone copy copy_ _foreach_copy_ contiguous detach detach_ lift_fresh lift_fresh_copy alias
    _unsafe_view view
    reshape resize_ set_ t t_ transpose_ squeeze_ unsqueeze_ as_strided_ _reshape_alias
    cat stack index index_select gather masked_select take scatter scatter_ index_put index_put_
    select_scatter slice_scatter diagonal_scatter as_strided_scatter masked_scatter masked_scatter_
    masked_fill masked_fill_ where flip roll repeat expand_copy constant_pad_nd tril triu tril_
    triu_ embedding sort topk nonzero unique _unique2 argmax argmin max min amax amin maximum
    minimum max_pool2d_with_indices max_pool1d_with_indices clamp clamp_ clamp_min clamp_min_
    clamp_max clamp_max_ hardtanh hardtanh_ relu relu_ threshold threshold_backward abs abs_ neg
    neg_ sign sgn floor ceil round trunc floor_ ceil_ round_ trunc_ eq ne lt le gt ge eq_ ne_ lt_
    le_ gt_ ge_ isnan isinf isfinite isneginf isposinf logical_and logical_or logical_not
    logical_xor bitwise_and bitwise_or bitwise_not bitwise_xor any all
    zeros zeros_like ones ones_like empty empty_like empty_strided full full_like scalar_tensor
    new_zeros new_ones new_empty new_empty_strided new_full fill fill_ zero_ _local_scalar_dense
    _foreach_zero_ _to_copy _has_compatible_shallow_copy_type _fused_sdp_choice is_same_size
    is_nonzero _assert_async equal allclose isclose sym_size sym_stride sym_numel sym_storage_offset
""".split())

# Device random number generators (SPEC §3.4): served by `random_ops`, or refused. The
# functional forms (uniform, normal_functional, ...) are what functionalization makes of the
# in-place ones.
_RANDOM = frozenset("""
    bernoulli bernoulli_ native_dropout _fused_dropout normal normal_ uniform_ rand rand_like
    randn randn_like randint randint_like randperm multinomial exponential_ geometric_
    log_normal_ cauchy_ random_ poisson rrelu_with_noise rrelu_with_noise_ _standard_gamma
    binomial _sample_dirichlet
    uniform normal_functional random exponential geometric log_normal cauchy
    rrelu_with_noise_functional
""".split())


@cache
def op_kind(func: torch._ops.OpOverload) -> OpKind:
    name = func.overloadpacket.__name__
    if name in _RANDOM:
        return OpKind.RANDOM
    if func._overloadname in _ACCUMULATING_OVERLOADS.get(name, ()):
        return OpKind.FLOAT
    if name in _EXACT or _is_view(func):
        return OpKind.EXACT
    return OpKind.FLOAT


# Overloads of otherwise exact ops that add values together (scatter with a reduction).
_ACCUMULATING_OVERLOADS = {
    "scatter": ("reduce", "value_reduce"), "scatter_": ("reduce", "value_reduce")}


def accumulates(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """index_put with accumulate=True sums into the destination: a rounding site, not exact."""
    if func.overloadpacket.__name__ not in ("index_put", "index_put_"):
        return False
    return bool(kwargs.get("accumulate", args[3] if len(args) > 3 else False))


@cache
def op_name(func: torch._ops.OpOverload) -> str:
    """'aten.mm.default': the name sites and reports use."""
    return str(func)


def _is_view(func: torch._ops.OpOverload) -> bool:
    """Ops returning an alias of an input without writing it (view, transpose, split...)."""
    returns = func._schema.returns
    return bool(returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in returns)


@cache
def mutated_args(func: torch._ops.OpOverload) -> tuple[frozenset[int], frozenset[str]]:
    """Positions and names of the arguments the op writes to (in-place and out= ops)."""
    positions: set[int] = set()
    names: set[str] = set()
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            names.add(arg.name)
            if not arg.kwarg_only:
                positions.add(i)
    return frozenset(positions), frozenset(names)
