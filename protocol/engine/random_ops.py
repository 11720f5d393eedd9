"""Every random op inside a step, served by the portable generator (SPEC §3.4).

Device RNGs (torch's default generator, CUDA's) never decide a value inside a step. Each step gets
a `StepRandomness`: the k-th draw of micro-batch i (0 without micro-batches), counted in program
order over everything below (one counter for all ops), reads `RandomStream(job seed, "random",
t, i, k)` (`protocol.engine.rng`). The call order is a property of the program, so every machine
sees the same keys; the values are made
on the CPU by numpy and moved to the op's device, so they are the same bits on every profile,
device and thread count. An op's `generator=` argument is ignored: the portable stream
replaces it (so do `pin_memory=` requests, which change no value).

Function level, `PortableRandomFunctions` (a TorchFunctionMode, in every executor mode):
`F.dropout`, `F.dropout1d/2d/3d`, `F.alpha_dropout`, `F.feature_alpha_dropout` and their
`torch.dropout`/`feature_dropout`/`alpha_dropout`/`feature_alpha_dropout` forms (and `_`
variants), and `F.scaled_dot_product_attention` with `dropout_p > 0`. They are served above
autograd because below it CPU's `at::dropout` decomposes into bernoulli_/div_/mul while CUDA
calls native_dropout, so the site sequences (SPEC §3.3) would differ; here every device runs the
same ops. With a keep mask drawn with probability 1 - p (per element, or per (sample, channel)
for the feature forms), torch's formulas (aten/src/ATen/native/Dropout.cpp):
dropout `where(keep, x * (1 / (1 - p)), 0)`; alpha dropout, with alpha = 1.7580993408473766 and
a = 1 / sqrt((alpha² p + 1)(1 - p)), `where(keep, a x + alpha a p, -alpha a (1 - p))`; p = 1
gives `x * 0`. SDPA draws the mask in the attention weights' shape (q's and k's batch dims
broadcast, k's heads repeated under enable_gqa, × L × S) and runs
`aten._scaled_dot_product_attention_math` with it as `dropout_mask` (which scales the values by
1 / (1 - p)); a boolean attn_mask is first turned into 0 / -inf, as SDPA itself does.

Dispatch level, `serve_random_op` (called by `RoundingMode` in "ovt" mode and by
`PortableRandomOps` in the plain modes), aten's RNG ops:
- bernoulli (every overload; scalar or per-element p): True where word < p · 2**32, exactly;
  P(1) lies within 2**-32 above p (`RandomStream.keep_mask`). native_dropout: as F.dropout.
- uniform_, uniform, rand, rand_like: u on the grid k · 2**-24, low + (high - low) · u rounded
  once to float32 (for wide bounds that rounding may reach `high`).
- normal_, normal, randn, randn_like: Irwin–Hall, the sum of 12 grid uniforms minus 6 — mean 0,
  variance 1, but bounded by ±6 with lighter tails than a Gaussian (exact sampling needs
  log/sqrt/cos, whose last bits differ between libm builds). Tensor mean or std: z drawn so,
  then `z * std + mean` as ordinary (rounded) ops.
- randint, randint_like, random_ / random: integers in [low, high) from 64-bit draws, relative
  bias below (high - low) · 2**-64 (`RandomStream.integers`); random_ without `to` spans
  [from, 2**digits] for float dtypes and [from, max] for integer ones, as torch documents.
- randperm: stable argsort of 64-bit keys (`RandomStream.permutation`).
Drawn values must be exact in the result dtype: float draws (float32 values) are served into
float32 and float64 only (a bfloat16 or float16 result would round them: draw float32 and
convert), integer draws only where the dtype holds the whole range. Served values are exact, not
rounding sites; only the arithmetic a served op does on its inputs (dropout's scaling,
`z * std + mean`) runs through the interceptor like any other op.

Limitation: a dropout that C++ code calls inside another op (nn.LSTM / nn.GRU with `dropout=`)
never reaches the function level; it arrives as bernoulli_ / div_ / mul on the CPU and as
native_dropout on CUDA. Both are served with the same masks, but the two devices then run
different sites, so such a job replays across CPU profiles, not between CPU and CUDA.

Every other RANDOM op of `optable` (exponential_, geometric_, log_normal_, cauchy_, poisson,
binomial, multinomial, rrelu_with_noise, _standard_gamma, _sample_dirichlet, _fused_dropout...)
is refused with a DeterminismError naming it and what to use instead.

    >>> randomness = StepRandomness(seed=0, step=1)
    >>> with PortableRandomFunctions(randomness), PortableRandomOps(randomness):
    ...     mask = torch.bernoulli(torch.full((4,), 0.5))
    ...     x = torch.nn.functional.dropout(torch.ones(4), 0.5)
    >>> randomness.calls
    2
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from protocol.engine.optable import OpKind, op_kind, op_name
from protocol.engine.rng import RandomStream
from protocol.errors import ConfigError, DeterminismError

PURPOSE = "random"  # draw k of micro-batch i of step t: RandomStream(seed, PURPOSE, t, i, k)
SELU_ALPHA = 1.7580993408473766  # alpha dropout's alpha (torch's Dropout.cpp)
# Significand bits: a float dtype holds every integer of magnitude up to 2**digits exactly.
_DIGITS = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}

# torch warns once per process that an SDPA dropout mask is "for testing purposes": passing the
# mask is exactly how SDPA's dropout is served here. The warning surfaces only when control
# returns to the program's own call, so it is filtered by its text, not around the call.
warnings.filterwarnings("ignore", message="Dropout mask should only be used for testing purposes")


class StepRandomness:
    """The random draws of step `step` of a job with seed `seed`, numbered in program order
    within each micro-batch (SPEC §3.5: the micro-batch is the unit a trainer may compute
    anywhere, so its draws must not depend on the parts before it)."""

    def __init__(self, seed: int, step: int) -> None:
        self.seed, self.step, self.micro_batch, self.calls = seed, step, 0, 0

    def begin_micro_batch(self, index: int) -> None:
        """Draw from micro-batch `index`'s streams from now on, its first draw next."""
        self.micro_batch, self.calls = index, 0

    def next_stream(self) -> RandomStream:
        """The stream of the next draw, RandomStream(seed, "random", step, micro-batch,
        calls); counts it."""
        stream = RandomStream(self.seed, PURPOSE, self.step, self.micro_batch, self.calls)
        self.calls += 1
        return stream

    def keep_mask(self, shape: Sequence[int], keep_prob: float,
                  device: torch.device) -> torch.Tensor:
        """The next draw as a bool mask, True with probability keep_prob, on `device`."""
        return self.next_stream().keep_mask(tuple(shape), keep_prob).to(device)


# -- function level ------------------------------------------------------------------------------


class PortableRandomFunctions(TorchFunctionMode):
    """Serves the dropouts and SDPA's attention dropout from `randomness` (see the module
    docstring); every other function runs untouched."""

    def __init__(self, randomness: StepRandomness) -> None:
        super().__init__()
        self.randomness = randomness

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        serve = _FUNCTIONS.get(func)
        if serve is None:
            return func(*args, **kwargs)
        return serve(self.randomness, *args, **kwargs)


def _check_probability(p: float) -> None:
    if not 0.0 <= p <= 1.0:  # NaN fails too
        raise ConfigError(f"dropout probability must be in [0, 1], got {p}")


def _dropout(r: StepRandomness, x: torch.Tensor, p: float, train: bool, inplace: bool, *,
             lead: int | None = None, alpha: bool = False) -> torch.Tensor:
    """torch's _dropout_impl with the keep mask from `r`. `lead`: None draws per element; 1 or
    2 draw one value per index of the first `lead` dims (feature dropout: per (N, C), or per C
    of an unbatched input), broadcast over the rest."""
    _check_probability(p)
    if p == 0 or not train or x.numel() == 0:
        return x
    if p == 1:
        out = x * 0.0
    else:
        keep = r.keep_mask(_noise_shape(x, lead), 1.0 - p, x.device)
        if alpha:
            a = 1.0 / math.sqrt((SELU_ALPHA * SELU_ALPHA * p + 1.0) * (1.0 - p))
            out = torch.where(keep, x * a + SELU_ALPHA * a * p, -SELU_ALPHA * a * (1.0 - p))
        else:
            out = _scaled(x, keep, p)
    return x.copy_(out) if inplace else out


def _scaled(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout: kept elements scaled by 1 / (1 - p), the others 0."""
    return torch.where(keep, x * (1.0 / (1.0 - p)), 0.0)


def _noise_shape(x: torch.Tensor, lead: int | None) -> tuple[int, ...]:
    if lead is None:
        return tuple(x.shape)
    if x.dim() < lead:
        raise ConfigError(f"feature dropout needs at least {lead} dimensions, got a "
                          f"{x.dim()}-D input")
    return tuple(x.shape[:lead]) + (1,) * (x.dim() - lead)


def _f_dropout(r, input, p=0.5, training=True, inplace=False):
    return _dropout(r, input, p, training, inplace)


def _f_alpha_dropout(r, input, p=0.5, training=False, inplace=False):
    return _dropout(r, input, p, training, inplace, alpha=True)


def _f_feature_alpha_dropout(r, input, p=0.5, training=False, inplace=False):
    return _dropout(r, input, p, training, inplace, lead=2, alpha=True)


def _f_dropout1d(r, input, p=0.5, training=True, inplace=False):
    if input.dim() not in (2, 3):
        raise ConfigError(f"dropout1d expects a 2-D (C, L) or 3-D (N, C, L) input, got "
                          f"{input.dim()}-D")
    return _dropout(r, input, p, training, inplace, lead=input.dim() - 1)


def _f_dropout2d(r, input, p=0.5, training=True, inplace=False):
    # as torch: the input is read as (N, C, ...) whatever its rank (a 3-D one as (N, C, L))
    return _dropout(r, input, p, training, inplace, lead=2)


def _f_dropout3d(r, input, p=0.5, training=True, inplace=False):
    # as torch: a 5-D input is (N, C, D, H, W); any other is unbatched (C, ...)
    return _dropout(r, input, p, training, inplace, lead=2 if input.dim() == 5 else 1)


def _vf(lead: int | None, alpha: bool, inplace: bool) -> Callable:
    """torch.dropout and its kin: (input, p, train)."""
    def serve(r, input, p, train):
        return _dropout(r, input, p, train, inplace, lead=lead, alpha=alpha)
    return serve


def _f_sdpa(r, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False):
    if dropout_p == 0.0:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if not 0.0 < dropout_p < 1.0:
        raise ConfigError(f"scaled_dot_product_attention needs dropout_p in [0, 1), got "
                          f"{dropout_p}")
    key_batch = tuple(key.shape[:-2])
    if enable_gqa and key.dim() >= 3:  # k's heads are repeated to q's
        key_batch = key_batch[:-1] + (query.shape[-3],)
    weights = torch.broadcast_shapes(tuple(query.shape[:-2]), key_batch) + (
        query.shape[-2], key.shape[-2])  # (..., L, S)
    keep = r.keep_mask(weights, 1.0 - dropout_p, query.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # SDPA's own conversion
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=attn_mask.device) \
            .masked_fill(attn_mask.logical_not(), -math.inf)
    # torch warns once per process that dropout_mask "should only be used for testing
    # purposes" (its own fused kernels' tests); the warning is raised after this function
    # returns, past any filter set here, and is harmless.
    return torch.ops.aten._scaled_dot_product_attention_math(
        query, key, value, attn_mask, dropout_p, is_causal, keep, scale=scale,
        enable_gqa=enable_gqa)[0]


_FUNCTIONS: dict[Callable, Callable] = {
    F.dropout: _f_dropout, F.alpha_dropout: _f_alpha_dropout,
    F.feature_alpha_dropout: _f_feature_alpha_dropout, F.dropout1d: _f_dropout1d,
    F.dropout2d: _f_dropout2d, F.dropout3d: _f_dropout3d,
    F.scaled_dot_product_attention: _f_sdpa,
    torch.dropout: _vf(None, False, False), torch.dropout_: _vf(None, False, True),
    torch.feature_dropout: _vf(2, False, False), torch.feature_dropout_: _vf(2, False, True),
    torch.alpha_dropout: _vf(None, True, False), torch.alpha_dropout_: _vf(None, True, True),
    torch.feature_alpha_dropout: _vf(2, True, False),
    torch.feature_alpha_dropout_: _vf(2, True, True),
}


# -- dispatch level ------------------------------------------------------------------------------


class PortableRandomOps(TorchDispatchMode):
    """The plain modes' dispatch level: serves aten RNG ops from `randomness` (or refuses them)
    and runs every other op untouched."""

    def __init__(self, randomness: StepRandomness) -> None:
        super().__init__()
        self.randomness = randomness

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if op_kind(func) is OpKind.RANDOM:
            return serve_random_op(func, args, kwargs, self.randomness)
        return func(*args, **kwargs)


def serve_random_op(func: torch._ops.OpOverload, args: tuple, kwargs: dict,
                    randomness: StepRandomness | None) -> Any:
    """Run RANDOM op `func` with values from `randomness` (see the module docstring).

    Called from a dispatch mode's handler; whatever the op computes besides drawing (copies,
    dropout's scaling) dispatches to the modes in effect. Raises DeterminismError, naming the op,
    for one it does not serve, a result dtype that cannot hold the drawn values exactly, a
    non-strided layout or named dimensions, and when `randomness` is None (no step to draw
    for); ConfigError for bad arguments (a probability outside [0, 1], low >= high, ...).
    """
    serve = _SERVED.get(func.overloadpacket.__name__)
    if serve is None:
        raise DeterminismError(
            f"{op_name(func)} draws from a device random number generator, and ovt has no "
            f"portable version of it (SPEC §3.4); instead, {_instead(func)}")
    if randomness is None:
        raise DeterminismError(
            f"{op_name(func)} draws random numbers, but no step randomness was given to serve "
            f"it from (SPEC §3.4); random ops run inside Executor.step")
    bound = _bind(func, args, kwargs)
    if bound.get("layout") not in (None, torch.strided) or bound.get("names") is not None:
        raise DeterminismError(f"{op_name(func)}: ovt serves random ops on strided tensors "
                               f"without named dimensions only")
    return serve(randomness, func, bound)


def _bind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The op's arguments by schema name; a missing one takes its schema default (dtype: None,
    since the schema spells randint's int64 default as a number)."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(func._schema.arguments):
        if not arg.kwarg_only and i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value() and arg.name != "dtype":
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


def _deliver(func, values: torch.Tensor, dtype: torch.dtype, device, *,
             into: torch.Tensor | None = None, like: torch.Tensor | None = None,
             memory_format: torch.memory_format | None = None,
             span: tuple[int, int] | None = None) -> torch.Tensor:
    """The drawn CPU `values` as the op's result: copied into `into` (in-place and out= ops; its
    dtype and device win), else a new tensor of `dtype` on `device`, laid out like `like`.
    `span`: integer values lie in [low, high)."""
    if into is not None:
        dtype, device = into.dtype, into.device
    _require_exact(func, values.dtype, dtype, span)
    values = values.to(dtype)  # exact, checked above: no rounding anywhere
    if into is not None:
        if into.shape != values.shape:  # an out= tensor of another size, resized as torch does
            into.resize_(values.shape)
        return into.copy_(values)
    if like is not None:
        return torch.empty_like(like, dtype=dtype, device=device,
                                memory_format=memory_format or torch.preserve_format) \
            .copy_(values)
    return values.to(device)


def _require_exact(func, drawn: torch.dtype, dtype: torch.dtype,
                   span: tuple[int, int] | None) -> None:
    """Refuse a result dtype that cannot hold every value the draw can make exactly."""
    if drawn == torch.bool:
        values, ok = "0 and 1", not dtype.is_complex
    elif drawn == torch.float32:
        values, ok = "float32 values", dtype in (torch.float32, torch.float64)
    else:
        assert span is not None  # integer draws always state their range
        low, high = span
        values = f"integers in [{low}, {high})"
        if dtype.is_floating_point or dtype.is_complex:
            limit = 2 ** _DIGITS.get(dtype, 0)
            ok = dtype in _DIGITS and -limit <= low and high - 1 <= limit
        elif dtype == torch.bool:
            ok = 0 <= low and high <= 2
        else:
            info = torch.iinfo(dtype)
            ok = info.min <= low and high - 1 <= info.max
    if not ok:
        raise DeterminismError(
            f"{op_name(func)} would round: ovt's portable generator draws {values}, which "
            f"{dtype} cannot hold exactly (SPEC §3.4); draw in float32 or int64 and convert")


def _probabilities(p: torch.Tensor) -> np.ndarray:
    return p.detach().to(device="cpu", dtype=torch.float64).numpy()


def _bernoulli(r: StepRandomness, func, a: dict) -> torch.Tensor:
    x = a["self"]
    p = a.get("p", x)  # bernoulli(self): self holds the probabilities
    values = r.next_stream().keep_mask(tuple(x.shape), _probabilities(p)
                                       if isinstance(p, torch.Tensor) else p)
    into = x if func.overloadpacket.__name__ == "bernoulli_" else a.get("out")
    return _deliver(func, values, x.dtype, x.device, into=into)


def _native_dropout(r: StepRandomness, func, a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    x, p = a["input"], a["p"]
    if a["train"] is False:  # None means training, as in torch
        out, keep = x.clone(), torch.ones_like(x, dtype=torch.bool)
    else:
        _check_probability(p)
        keep = r.keep_mask(x.shape, 1.0 - p, x.device)
        out = x * 0.0 if p == 1 else _scaled(x, keep, p)
    if a.get("out0") is not None:
        return _deliver(func, out, x.dtype, x.device, into=a["out0"]), \
            _deliver(func, keep, torch.bool, x.device, into=a["out1"])
    return out, keep


def _inplace_or_out(func, a: dict) -> torch.Tensor | None:
    """Where a `self`-shaped draw goes: `self` for the in-place form (name ends in _), else
    the out= tensor if any."""
    return a["self"] if func.overloadpacket.__name__.endswith("_") else a.get("out")


def _uniform(r: StepRandomness, func, a: dict) -> torch.Tensor:
    x = a["self"]
    values = r.next_stream().uniform(tuple(x.shape), a["from"], a["to"])
    return _deliver(func, values, x.dtype, x.device, into=_inplace_or_out(func, a), like=x)


def _normal(r: StepRandomness, func, a: dict) -> torch.Tensor:
    if "self" in a:  # normal_, normal_functional, normal.out: self's shape, scalar mean, std
        x = a["self"]
        values = r.next_stream().normal(tuple(x.shape), a["mean"], a["std"])
        return _deliver(func, values, x.dtype, x.device, into=_inplace_or_out(func, a), like=x)
    mean, std = a["mean"], a["std"]
    if "size" in a:  # normal.float_float
        values = r.next_stream().normal(a["size"], mean, std)
        return _deliver(func, values, a.get("dtype") or torch.get_default_dtype(),
                        a.get("device") or "cpu", into=a.get("out"))
    tensors = [t for t in (mean, std) if isinstance(t, torch.Tensor)]
    if bool((std < 0).any()) if isinstance(std, torch.Tensor) else std < 0:
        raise ConfigError(f"{op_name(func)} needs std >= 0")
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    dtype = tensors[0].dtype if len(tensors) == 1 else \
        torch.promote_types(mean.dtype, std.dtype)
    z = _deliver(func, r.next_stream().normal(tuple(shape)), dtype, tensors[0].device)
    out = z * std + mean  # ordinary ops: rounded sites under the interceptor
    into = a.get("out")
    return out if into is None else _deliver(func, out, out.dtype, out.device, into=into)


def _rand(r: StepRandomness, func, a: dict) -> torch.Tensor:
    """rand, randn, rand_like, randn_like (and their out= forms)."""
    stream = r.next_stream()
    draw = stream.uniform if func.overloadpacket.__name__ in ("rand", "rand_like") else \
        stream.normal
    x = a.get("self")
    if x is None:
        return _deliver(func, draw(a["size"]), a.get("dtype") or torch.get_default_dtype(),
                        a.get("device") or "cpu", into=a.get("out"))
    return _deliver(func, draw(tuple(x.shape)), a.get("dtype") or x.dtype,
                    a.get("device") or x.device, into=a.get("out"), like=x,
                    memory_format=a.get("memory_format"))


def _integers(r: StepRandomness, func, a: dict, shape, low: int, high: int, *, dtype, device,
              like=None, into=None) -> torch.Tensor:
    values = torch.from_numpy(r.next_stream().integers(tuple(shape), low, high))
    return _deliver(func, values, dtype, device, into=into, like=like,
                    memory_format=a.get("memory_format"), span=(low, high))


def _randint(r: StepRandomness, func, a: dict) -> torch.Tensor:
    x = a.get("self")  # randint_like
    high = a["high"]
    high = int(high.item()) if isinstance(high, torch.Tensor) else high
    low = a.get("low", 0)
    if x is None:
        return _integers(r, func, a, a["size"], low, high, dtype=a.get("dtype") or torch.int64,
                         device=a.get("device") or "cpu", into=a.get("out"))
    return _integers(r, func, a, x.shape, low, high, dtype=a.get("dtype") or x.dtype,
                     device=a.get("device") or x.device, like=x, into=a.get("out"))


def _random(r: StepRandomness, func, a: dict) -> torch.Tensor:
    x = a["self"]
    low, high = a.get("from", 0), a.get("to")
    if high is None:  # torch: up to 2**digits (float dtypes) or the dtype's max, inclusive
        high = _largest(func, x.dtype) + 1
    return _integers(r, func, a, x.shape, low, high, dtype=x.dtype, device=x.device, like=x,
                     into=_inplace_or_out(func, a))


def _largest(func, dtype: torch.dtype) -> int:
    """The largest value random_ makes without `to`: 2**digits for a float dtype (the largest
    of its consecutive integers), else the dtype's maximum."""
    if dtype.is_floating_point and dtype in _DIGITS:
        return 2 ** _DIGITS[dtype]
    if dtype == torch.bool:
        return 1
    if dtype.is_floating_point or dtype.is_complex:
        raise DeterminismError(f"{op_name(func)} on {dtype} is not served")
    return int(torch.iinfo(dtype).max)


def _randperm(r: StepRandomness, func, a: dict) -> torch.Tensor:
    n = a["n"]
    values = torch.from_numpy(r.next_stream().permutation(n))
    return _deliver(func, values, a.get("dtype") or torch.int64, a.get("device") or "cpu",
                    into=a.get("out"), span=(0, max(n, 1)))


_SERVED: dict[str, Callable[[StepRandomness, Any, dict], Any]] = {
    "bernoulli": _bernoulli, "bernoulli_": _bernoulli, "native_dropout": _native_dropout,
    "uniform_": _uniform, "uniform": _uniform,
    "normal_": _normal, "normal_functional": _normal, "normal": _normal,
    "rand": _rand, "randn": _rand, "rand_like": _rand, "randn_like": _rand,
    "randint": _randint, "randint_like": _randint, "randperm": _randperm,
    "random_": _random, "random": _random,
}

_FROM_RAND = "build it from torch.rand_like(x) = u"
_INSTEAD = {
    "exponential": f"{_FROM_RAND}, e.g. -torch.log1p(-u) / lambd",
    "geometric": f"{_FROM_RAND}, e.g. torch.floor(torch.log1p(-u) / math.log1p(-p)) + 1",
    "log_normal": "build it from torch.randn_like(x), e.g. torch.exp(mean + std * z)",
    "cauchy": f"{_FROM_RAND}, e.g. median + sigma * torch.tan(math.pi * (u - 0.5))",
    "multinomial": "sample by inverse CDF from torch.rand, e.g. "
                   "(probs.cumsum(-1) <= u * probs.sum(-1, keepdim=True)).sum(-1)",
    "rrelu_with_noise": "use F.leaky_relu with a fixed slope, or draw the slopes with torch.rand",
    "_fused_dropout": "use F.dropout",
}


def _instead(func: torch._ops.OpOverload) -> str:
    name = func.overloadpacket.__name__.removesuffix("_").removesuffix("_functional")
    return _INSTEAD.get(name, "draw from an op ovt serves (torch.rand, torch.randn, "
                              "torch.randint, torch.bernoulli, torch.randperm) and transform "
                              "the values explicitly")
