"""Certified error bounds: one rule per primitive op (SPEC §3.2.1, bound rules version 5).

For each element `y` of a rounding site, the op's rule gives `e ≥ 0` such that *every*
conforming implementation of the op on the same (target-representable) inputs — any summation
order or blocking, FMA or not, any thread count, CPU or GPU — lands within `e / 2` of the exact
result. `e` is twice that proven bound (`SAFETY`): the factor covers the floating-point error of
computing the bound itself, so two parties' `e` for one element agree to far better than 2x,
and `e / 2` is what the bound adversary (profile `adversary`) may move a result by.
Two honest results are then within `e` of each other, and the rounding rule (SPEC §3.2) logs the
elements with `δ ≤ 2e`. The proofs assume IEEE-754 arithmetic in the compute dtype with
round-to-nearest: no flush-to-zero, no reduced-precision or emulated-FP64 GEMM modes (the
executor pins TF32 and reduced-precision reductions off).

The rules:
- **zero** (`e = 0`): one correctly rounded IEEE operation — add, subtract, multiply — on
  target-representable inputs. IEEE-754 §5.4.1 fixes its result bit for bit.
- **correctly rounding** (`e = 0`, version 5): square root and division of target-dtype
  inputs. The compute-dtype result may differ per machine (torch's CPU root is off by up to
  0.53 ULP, CUDA may divide as a reciprocal and a product), but no root of a target value lies
  within 4 compute ULPs (float64; 32 in float32) of a target rounding boundary, and no quotient
  in the normal range within 16 (128), so every machine within that rounds to the same target
  value and nothing is ever in the band (`SQRT_MARGIN_ULPS`, `QUOTIENT_MARGIN_ULPS`; quotients
  below 2^-125 keep the relative rule). Here e = 0 certifies the rounding, not the bits.
- **relative** (`e = 4·n·u·|y|`, u the compute unit roundoff): functions whose documented
  maximum error is `n` ULPs of their own result, `n` the larger of the CPU library's (glibc
  libm, whose x86-64 error table is the bound for SLEEF's `u10` kernels too) and the CUDA Math
  API's double-precision table (CUDA C Programming Guide, "Mathematical Functions", Table 13).
  One ULP of `y` is at most `2u·|y|`, so `n` ULPs is at most `e / 2`.
- **reductions** (`e = 2·γ_K·S`, `γ_K = K·u / (1 − K·u)`): a sum of `K` terms computed in any
  order or blocking, with or without FMA, is within `γ_K·Σ|terms|` of the exact sum (Higham,
  *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §3.1 and Lemma 3.1; §3.5 for
  inner products). `S` over-estimates `Σ|terms|` cheaply: by Cauchy–Schwarz (`‖a_i‖·‖b_j‖`)
  for the matmul family and convolutions, else by the same op on `|inputs|` (one extra pass).
- **own rules** for a few fused elementwise ops (axpy-style add, lerp with tensor weights),
  each a short rounding-error sum in the docstring; for composite ops (version 3: the softmax
  family, GELU, layer norm's backward); and for the norm statistics of ovt's own ops
  (version 4, `protocol.engine.normops`);
- **fixed formulas** (`e = 0`): addcmul, addcdiv and lerp with a scalar weight, which ovt
  computes as a fixed sequence of IEEE operations (`protocol.engine.pointwise`), and the
  normalize formulas of `normops`, so that every conforming machine gets the same bits
  (`FIXED_FORMULA`).

Every bound also carries an absolute floor of `K` (or `n`) compute-dtype subnormal units, for
results that underflow. Ops without a rule are decomposed into ops with one
(`protocol.engine.decompositions`) or refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from protocol.engine import fused, normops
from protocol.engine.precision import PrecisionPolicy, holds_integer, target_ulp

SAFETY = 2.0

aten = torch.ops.aten
prims = torch.ops.prims



@dataclass(frozen=True, eq=False)
class Affine:
    """A bound `e = base·scale + floor` left unevaluated, so that the recorder's fused band
    pass (`protocol.engine.fused`) computes it in its one read of the site's values instead of
    writing and reading a tensor of bounds. `base` is

    - `|y|` where `m` is None (the relative rules), plus `weight·|other|` where `other` is given:
      `other` a tensor of `y`'s shape, for the composite rules relative to their result and an
      operand (GELU's x, its backward's g), so that no tensor of bases is written;
    - `m`, broadcast to `y` (the reductions' `S`), plus `weight·|y|` where `weight` is not 0
      (log-softmax's row constant and its result, `_log_softmax`);
    - `m[..., i]·col[..., j] + add` for `y` viewed as (..., M, N), where `col` is given, M
      being `m`'s last dimension and N `col`'s: the Cauchy–Schwarz bound of the matmul family,
      `m` (..., M) and `col` (..., N) the norms, `add` (broadcast to (..., M, N), or None) the
      magnitudes of an added matrix (addmm's bias); and of a convolution, each (n, c) a row
      and N its spatial positions (`_windows_times_channels`).

    `dense` evaluates it with torch ops in the same order of operations as the fused pass, so
    both give the same bits.
    """

    scale: float
    floor: float
    m: torch.Tensor | None = None
    col: torch.Tensor | None = None
    add: torch.Tensor | None = None
    other: torch.Tensor | None = None
    weight: float = 0.0

    def dense(self, y: torch.Tensor) -> torch.Tensor:
        """e as a tensor broadcastable to `y` (the site values this bound belongs to)."""
        if self.m is None:
            base = y.abs()
            if self.other is not None:
                base = _f64(self.other).abs().mul_(self.weight).add_(base)
        elif self.col is None:
            base = self.m
            if self.weight:
                base = _f64(y).abs().mul_(self.weight).add_(base)
        else:
            base = self.m.unsqueeze(-1) * self.col.unsqueeze(-2)
            if self.add is not None:
                base = base + self.add
            base = base.reshape(y.shape)
        return base * self.scale + self.floor


# None: e = 0 (the op is correctly rounded); a tensor broadcastable to the result; one number
Bound = torch.Tensor | float | Affine | None


def dense_bound(bound: Bound, y: torch.Tensor) -> torch.Tensor | float | None:
    """`bound` with an `Affine` evaluated (for `y`), anything else as it is."""
    return bound.dense(y) if isinstance(bound, Affine) else bound

RuleFn = Callable[["BoundContext", torch._ops.OpOverload, tuple, dict, list[torch.Tensor]],
                  list[Bound]]


@dataclass(frozen=True)
class Rule:
    """A bound rule. `reads_inputs`: it needs the op's inputs as they were before the op ran
    (so an in-place op's written arguments are copied first); rules on `y` alone do not.
    `elementwise`: its ops compute each result element from the same element of their
    operands (where these have the result's shape) and its bound at an element reads nothing
    else, so that a result may be computed and rounded in parts (the relative and zero rules;
    `RoundingMode`'s parts path). `unsigned_zero`: the algorithms it covers may disagree on the
    sign of a zero result (y·(g − s) and g·y − y·s where y = 0) or of a result that rounds to
    zero (a tiny ±value), which no bound absorbs and no entry records, so the interceptor makes
    every rounded zero +0 (the composite ops). `at_positions`: it may compute its bounds at the
    positions where they are read alone (`bounds_for`'s `read_at`, the convolution's); the
    interceptor asks the rounder for them for such a rule only."""

    name: str
    fn: RuleFn
    reads_inputs: bool = True
    elementwise: bool = False
    unsigned_zero: bool = False
    at_positions: bool = False


class _MatrixNorms(NamedTuple):
    """A `BoundContext.norms` entry: both norms of the matrices of one view of the storage
    `source` refers to (its identity, without keeping its memory alive), made at `version`."""

    source: StorageWeakRef
    version: int
    rows: torch.Tensor  # (batch, rows): each row's norm over its columns
    cols: torch.Tensor  # (batch, cols): each column's norm over its rows


class BoundContext:
    """The compute dtype's constants a rule needs, and the matrix norms of one step's operands
    (`norms`)."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        self.policy = policy
        self.u = policy.unit_roundoff
        self.tiny = policy.tiny
        self.smallest_normal = float(torch.finfo(policy.compute).smallest_normal)
        self.ulp_factor = _FLOAT32_FACTOR if policy.compute == torch.float32 else 1.0
        self._matrices: dict[int, dict[tuple, _MatrixNorms]] = {}  # per storage address
        # the site positions at which the rounder reads the bounds being computed (`bounds_for`)
        self.read_at: torch.Tensor | None = None

    def norms(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """`_norms(x, dim)`, the same bits. A matmul reads each matrix a second time along its
        other dimension (a linear layer's backward: its weights, its input and its output's
        gradient), so for a matrix, or a batch of them, whose rows lie adjacent in memory
        (`_matrix_view`) both directions come from one read (`torch.ops.ovt.matrix_norms`, in
        the orders of `norms`), and the other is kept for that second read: where it is still
        the same storage at the same version (a write the interceptor executes bumps no
        version: it calls `forget`). A cache-cold operand's two reads cost twice its one
        (issue 13)."""
        view = _matrix_view(x.shape, x.stride(), dim) if fused.own_arithmetic(x) and \
            x.dtype in (torch.float64, torch.float32) and not x.is_inference() else None
        if view is None:  # (an inference tensor has no version to check an entry by)
            return _norms(x, dim)
        layout, along_columns, kept = view
        storage = x.untyped_storage()
        entries = self._matrices.setdefault(storage.data_ptr(), {})
        key = (x.dtype, x.storage_offset(), *layout)
        entry = entries.get(key)
        if entry is None or entry.version != x._version or \
                entry.source.cdata != storage._cdata:
            rows, cols = torch.ops.ovt.matrix_norms(x, *layout)
            entry = entries[key] = _MatrixNorms(StorageWeakRef(storage), x._version, rows, cols)
        return (entry.rows if along_columns else entry.cols).view(kept)

    def forget(self, written) -> None:
        """Drop the norms kept of the storage of `written` (a tensor or a list of them), which
        the interceptor is writing (`norms`)."""
        for t in written if isinstance(written, (list, tuple)) else (written,):
            if isinstance(t, torch.Tensor):
                self._matrices.pop(t.untyped_storage().data_ptr(), None)

    def gamma(self, k: int) -> float:
        """γ_K = K·u / (1 − K·u) (Higham, §3.1)."""
        ku = k * self.u
        if ku >= 0.5:
            raise ValueError(f"a reduction of {k} terms is beyond the compute dtype's bound")
        return ku / (1.0 - ku)

    def sum_factors(self, k: int) -> tuple[float, float]:
        """(scale, floor) of a K-term sum's bound e = Σ|terms|·scale + floor."""
        return SAFETY * self.gamma(k), SAFETY * k * self.tiny

    def sum_bound(self, k: int, s: torch.Tensor | float, col: torch.Tensor | None = None,
                  add: torch.Tensor | None = None) -> Affine | float:
        """e for a K-term sum whose Σ|terms| is at most `s` (or `s[..., i]·col[..., j] + add`,
        see `Affine`)."""
        scale, floor = self.sum_factors(k)
        if isinstance(s, torch.Tensor):
            return Affine(scale, floor, s, col, add)
        return scale * s + floor


def bounds_for(ctx: BoundContext, rule: Rule, func: torch._ops.OpOverload, args: tuple,
               kwargs: dict, ys: list[torch.Tensor], read_at: torch.Tensor | None = None
               ) -> list[Bound]:
    """The bounds of a site's values `ys` (outputs, then written arguments), one per tensor.
    `read_at`: the site positions (into the values of `ys` one after another, int64, in any
    order, repeats and positions past the site's end allowed: a log's) at which alone the
    caller reads them — a replayer, at its log's entries — or None for all of them. A rule
    that says so (`Rule.at_positions`) may then compute its bound at those positions only
    (`_convolution`): exact there, and
    elsewhere no larger than the bound, so that a read there by mistake can only reject an
    entry, never accept one."""
    ctx.read_at = read_at
    try:
        out = rule.fn(ctx, func, args, kwargs, ys)
    finally:
        ctx.read_at = None
    if len(out) != len(ys):  # a rule that does not fit its op: a bug here, not in the program
        raise AssertionError(f"bound rule {rule.name} gave {len(out)} bounds for {len(ys)} "
                             f"results of {func}")
    return out


# -- helpers -----------------------------------------------------------------------------------

def _arg(args: tuple, kwargs: dict, position: int, name: str, default):
    if position < len(args):
        return args[position]
    return kwargs.get(name, default)


def _abs(value):
    """|value| for a floating tensor or a float; anything else (dims, indices, sizes) as is."""
    if isinstance(value, torch.Tensor):
        return value.abs() if value.is_floating_point() else value
    if isinstance(value, float):
        return abs(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_abs(v) for v in value)
    return value


def _abs_keyword(value):
    """Keyword-only arguments are scalings (alpha, value), flags or dtypes: |numbers|."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return abs(value)
    return _abs(value)


def _norms(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Euclidean norms along `dim`, in float64 whatever the compute dtype: in float32 the
    squares of bfloat16 values would underflow or overflow; in float64 those of float32 values
    cannot. One term a norm: `vector_norm` (|x|). Where the library is loaded
    (`fused.own_arithmetic`), one C++ pass over a view of at most three dimensions
    (`torch.ops.ovt.norms`, no squared copy: a row adjacent in memory in float64 lanes, 1.1–1.4×
    `vector_norm`'s speed on float64 rows; along any other dimension, a transposed view's rows
    or a matrix's columns, the squares summed along `dim` into float64 accumulators, adjacent
    results together, in runs of 64 terms whose sums are added in order: the order
    `BoundContext.norms` keeps, reading both directions of a matrix at once). Else along a
    dimension adjacent in memory `vector_norm`; along any other the squares summed with torch
    ops — on the CPU from `_NORMS_BLOCKED` elements a block of `_NORM_BLOCK` at a time, the
    block sums added up, so that the squares stay in the cache. Any order of the sum is within
    the reduction rule's own error, which `SAFETY` covers."""
    if x.shape[dim] == 1:  # |x| (one term a norm: no pass of sums to make)
        return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float64)
    if fused.own_arithmetic(x) and x.dtype in (torch.float64, torch.float32):
        plan = _norms_layout(x.shape, x.stride(), dim)
        if plan is not None:
            layout, kept = plan
            return torch.ops.ovt.norms(x, *layout).view(kept)
    if x.stride(dim) == 1:
        return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float64)
    if x.numel() < _NORMS_BLOCKED or not x.is_cpu:  # (on CUDA: one kernel, not hundreds)
        wide = x.to(torch.float64)
        return (wide * wide).sum(dim).sqrt()
    length = x.shape[dim]
    step = max(1, _NORM_BLOCK * length // x.numel())
    total = None
    for start in range(0, length, step):
        block = x.narrow(dim, start, min(step, length - start)).to(torch.float64)
        part = (block * block).sum(dim)
        total = part if total is None else total.add_(part)
    assert total is not None
    return total.sqrt()


_NORMS_BLOCKED = 1 << 21
_NORM_BLOCK = 1 << 17

# `BoundContext.norms` takes matrices whose rows are at most `norms`'s one run (csrc/fused.cpp
# kGrain), which it sums in one lane order (a longer one in blocks).
_MATRIX_ROW_MAX = 1 << 15


@lru_cache(maxsize=4096)
def _matrix_view(shape: Sequence[int], strides: Sequence[int], dim: int
                 ) -> tuple[tuple[int, int, int, int, int], bool, tuple[int, ...]] | None:
    """((batch, rows, cols, batch stride, row stride), along_columns, kept shape): a tensor of
    `shape` and `strides` (2-D, or 3-D with a batch dimension first that `dim` does not reduce)
    as matrices whose rows lie adjacent in memory — its last two dimensions in either order,
    the one of stride 1 the columns — as `matrix_norms` reads them; `along_columns` where `dim`
    is the columns' dimension (each row's norm), and the shape of the norms (`shape` without
    `dim`). None where it is not such a view (rows one element apart, as `unfold` makes, are
    not: `norms` sums along them in lanes), a dimension has one element (`_norms` takes |x|
    there), or a row is longer than `matrix_norms` takes."""
    nd = len(shape)
    if nd not in (2, 3) or not -nd <= dim < nd:
        return None
    dim %= nd
    first = nd - 2  # the matrices' first dimension
    if dim < first or min(shape[first:]) < 2:
        return None
    if strides[-1] == 1:
        row_dim, col_dim = first, first + 1
    elif strides[-2] == 1:
        row_dim, col_dim = first + 1, first
    else:
        return None
    if shape[col_dim] > _MATRIX_ROW_MAX or strides[row_dim] == 1:
        return None  # (rows one element apart, an overlapping view: `norms` sums them in lanes)
    batch, batch_stride = (shape[0], strides[0]) if nd == 3 else (1, 0)
    kept = tuple(n for d, n in enumerate(shape) if d != dim)
    return ((batch, shape[row_dim], shape[col_dim], batch_stride, strides[row_dim]),
            dim == col_dim, kept)


@lru_cache(maxsize=4096)
def _norms_layout(shape: Sequence[int], strides: Sequence[int], dim: int
                  ) -> tuple[tuple[int, int, int, int, int, int], tuple[int, ...]] | None:
    """((outer, reduced, inner, outer stride, reduced stride, inner stride), kept shape):
    a tensor of `shape` and `strides` viewed as (outer, reduced, inner) with `dim` reduced and
    the other dimensions in order, outer and inner each one stride, and the shape of its norms
    (`shape` without `dim`); None where they are not (a view of four or more dimensions that do
    not merge). Found by the tensor's own `shape` and `stride()`, which hash as tuples."""
    kept = [(n, s) for d, (n, s) in enumerate(zip(shape, strides, strict=True))
            if d != dim and n != 1]
    merged: list[tuple[int, int]] = []
    for n, s in kept:  # (a dimension merges into the one before it where it steps inside it)
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if len(merged) > 2:
        return None
    while len(merged) < 2:
        merged.insert(0, (1, 0))
    (outer, sa), (inner, sc) = merged
    return (outer, shape[dim], inner, sa, strides[dim], sc), \
        tuple(shape[:dim]) + tuple(shape[dim + 1:])


def _mag(value) -> torch.Tensor | float:
    return value.abs() if isinstance(value, torch.Tensor) else abs(float(value))


# -- zero and relative -------------------------------------------------------------------------

def _zero(ctx, func, args, kwargs, ys) -> list[Bound]:
    """IEEE-754 §5.4.1: add, subtract and multiply are correctly rounded, so on the same inputs
    every conforming machine returns the same compute-dtype bits: e = 0. (Square root:
    `SQRT_MARGIN_ULPS`.)"""
    return [None] * len(ys)


def _relative(max_ulps: float, floor_normals: float = 0.0) -> RuleFn:
    """The relative rule of an op documented to err by `max_ulps` ULPs (`_relative_bound`)."""
    def rule(ctx, func, args, kwargs, ys) -> list[Bound]:
        return [_relative_bound(ctx, max_ulps, floor_normals)] * len(ys)
    return rule


def _relative_bound(ctx: BoundContext, max_ulps: float, floor_normals: float = 0.0,
                    m: torch.Tensor | None = None) -> Affine:
    """e = 4·n·u·|y| + 2·n·tiny (+ 2·floor_normals·smallest normal), n = `max_ulps` (doubled
    for a float32 compute dtype): n ULPs of y are at most n·2u·|y|, and e is twice that; `tiny`
    units cover underflow to subnormals, and the normal floor a kernel whose intermediate
    overflows where the exact result is subnormal. With `m`, the magnitudes it holds stand for
    |y| (`Affine`)."""
    n = max_ulps * ctx.ulp_factor
    floor = 2.0 * n * ctx.tiny + 2.0 * floor_normals * ctx.smallest_normal
    return Affine(4.0 * n * ctx.u, floor, m)


# Documented maximum errors in ULPs of the result, double precision: the larger of glibc's
# libm (x86-64 libm-test-ulps; SLEEF's u10 kernels that ATen vectorises with are within 1.0)
# and the CUDA Math API (Programming Guide, double-precision table). Composite kernels of
# ATen count their own roundings: sigmoid = 1/(1+exp(-x)) is exp (1) + add (0.5) + divide (0.5,
# or a reciprocal and a multiply: 1) <= 3; div on CUDA may be a reciprocal times a multiply
# (<= 1); torch's rsqrt on the CPU is 1/sqrt (<= 1.5), CUDA's rsqrt 1; torch's CPU sqrt is not
# correctly rounded (measured 0.53 ULP on float32 inputs: test_bounds), so it gets 1: the error
# of a root of wide values (`_rstd_error`); on target values the root rounds correctly
# (`SQRT_MARGIN_ULPS`).
_MAX_ULPS = {
    "sqrt": 1,
    "exp": 1, "exp2": 1, "expm1": 1, "log": 1, "log1p": 1, "log2": 2, "log10": 2,
    "tanh": 2, "sigmoid": 3, "erf": 2, "erfc": 5, "rsqrt": 2, "reciprocal": 1, "div": 1,
    "pow": 2, "sin": 2, "cos": 2, "tan": 2, "asin": 2, "acos": 2, "atan": 2, "sinh": 2,
    "cosh": 2, "asinh": 3, "acosh": 3, "atanh": 2, "silu": 3,
}
# Single precision (the float32 compute dtype of the bfloat16 policy): CUDA's float table has
# larger entries than its double one for some functions (expf, powf, tanf, acoshf); twice the
# double figures covers every entry of both tables.
_FLOAT32_FACTOR = 2.0

# Square root on target-dtype inputs (SPEC §3.2.1, bound rules version 5): e = 0, though a
# machine's compute-dtype result need not be correctly rounded (torch's CPU float64 sqrt, MKL's,
# is off by up to 0.53 ULP): no result within SQRT_MARGIN_ULPS of the exact root lies on the
# other side of a target rounding boundary, so every conforming machine rounds to the same,
# correctly rounded, target value, and nothing is ever in the band. Here e = 0 certifies the
# rounding, not the compute-dtype bits (as it does for add, subtract and multiply). A root of
# compute-dtype values (a program computing wide, integers widened) keeps the relative rule:
# they need not be target values (`rule_of`).
#
# Proof. Let the target have p significant bits, the compute dtype p', and a > 0 a target
# value whose root r lies in [2^E, 2^(E+1)). The target midpoints there are m = (2k + 1)·2^(E−p),
# so m² is an odd multiple of 2^(2E−2p); a is a multiple of 2^(2E−2p+1) (a normal a ≥ 2^2E has
# a p-bit significand; a subnormal one is a multiple of 2^(−149), or 2^(−133) in bfloat16, which
# is a multiple of 2^(2E−2p+1) for E ≤ −51, or −59, and its root has E ≤ −64). So a ≠ m², and
# |a − m²| ≥ 2^(2E−2p); with r + m < 2^(E+2), |r − m| = |a − m²| / (r + m) > 2^(E−2p−2), which is
# 2^(p'−2p−3) compute ULPs of the binade: 4 for float64 -> float32, 32 for float32 -> bfloat16.
# Roots of target values are never target subnormals, nor beyond the largest finite value; a
# zero, +inf, NaN or a negative input gives ±0, +inf or NaN, no rounding choice. The documented
# errors (`_MAX_ULPS`, 1 ULP; 2 for a float32 compute dtype), and twice them, what the relative
# rule let a conforming root err by (e / 2 = 2·n·u·|y|, less than 2n ULPs), are inside the margin
# (`_ROOTS_ROUND_CORRECTLY`); tests/protocol/engine/test_bounds.py checks the float32 inputs
# nearest to midpoints at ±3 ULPs, and (slow) every float32 in [1, 4) and every subnormal.
SQRT_MARGIN_ULPS = {(torch.float64, torch.float32): 4, (torch.float32, torch.bfloat16): 32}
# (compute dtype's unit roundoff, target dtype) pairs whose roots round correctly
_ROOTS_ROUND_CORRECTLY = frozenset(
    (torch.finfo(compute).eps / 2, target) for (compute, target), margin in SQRT_MARGIN_ULPS.items()
    if 2 * _MAX_ULPS["sqrt"] * (_FLOAT32_FACTOR if compute == torch.float32 else 1.0) < margin)

# Division of target-dtype values (bound rules version 5): e = 0 where the quotient is a normal
# target value, the relative rule below (`_quotient`). SPEC §3.2.1 lists division among the
# relative functions (for kernels that divide as a reciprocal and a product); this proof covers
# those kernels too, and is proposed as an amendment. The same margin argument as the root's:
# let a = A·2^α and b = B·2^β be target values (integers |A| < 2^p, B odd, |B| < 2^p: every
# finite nonzero one, subnormals too) with exact quotient q = a/b in [2^E, 2^(E+1)), E ≥ −126,
# where the target midpoints are m = (2k + 1)·2^(E−p), 2k + 1 ≥ 2^p. Were α < E − p + β,
# A ≥ 2^(E+β−α)·B > 2^p: impossible; so a is a multiple of 2^(E−p+β), and m·b an odd multiple of
# it, which a is not (an even multiple where α > E − p + β; else A ≠ (2k + 1)·B ≥ 2^p > |A|).
# Hence |a − m·b| ≥ 2^(E−p+β) and |q − m| ≥ 2^(E−p+β) / |b| > 2^(E−2p): 2^(p'−2p−1) compute ULPs,
# 16 for float64 -> float32 and 128 for float32 -> bfloat16. That holds a conforming quotient's
# error (`_MAX_ULPS`: 1 ULP, a reciprocal and a product on CUDA; doubled in float32, and twice that
# for the adversary) with the relative rule's band (2e < 8n ULPs) beside it, so near the
# threshold 2^−125, where two machines may pick different rules, no element is in either band.
# Below the smallest normal the quotient may be a target midpoint exactly (2^−149 / 2): there the
# relative rule, as before. The overflow boundary lies in the binade E = 127, covered above.
QUOTIENT_MARGIN_ULPS = {(torch.float64, torch.float32): 16, (torch.float32, torch.bfloat16): 128}
_SMALL_QUOTIENT = 2.0**-125
# (compute dtype's unit roundoff, target dtype) pairs whose quotients round correctly
_QUOTIENTS_ROUND_CORRECTLY = frozenset(
    (torch.finfo(compute).eps / 2, target)
    for (compute, target), margin in QUOTIENT_MARGIN_ULPS.items()
    if 10 * _MAX_ULPS["div"] * (_FLOAT32_FACTOR if compute == torch.float32 else 1.0) < margin)

# Absolute floors in smallest normals: 1/(1 + exp(-x)) returns 0 where exp(-x) overflows
# (x < -709.78 in float64, -88.7 in float32) while the exact sigmoid is a subnormal below one
# smallest normal; silu = x·sigmoid(x) there is below |x| <= 2**10 of them.
_FLOOR_NORMALS = {"sigmoid": 1.0, "silu": 2.0**10}


def _quotient(ctx, func, args, kwargs, ys) -> list[Bound]:
    """Division of target values (`QUOTIENT_MARGIN_ULPS`): e = 0, except at quotients below
    2^-125 in magnitude and not zero, which keep the relative rule (where the target's
    subnormal results lie); decided from each party's own result, which near 2^-125 lies in no
    band under either rule."""
    y = ys[0]
    magnitude = y.abs()
    small = (magnitude < _SMALL_QUOTIENT) & (magnitude != 0)
    if not bool(small.any()):
        return [None]
    return [_relative_bound(ctx, _MAX_ULPS["div"], m=_f64(magnitude.where(small, 0.0)))]


def conforming_error(ctx: BoundContext, op: str) -> Affine | None:
    """For a site named `op` ('aten.sqrt.default', 'aten._foreach_div_.List') that is a square
    root or a division: the relative rule's bound for its documented error (`_MAX_ULPS`). A
    conforming machine's compute-dtype result errs by at most half of it (e / SAFETY) even where
    the site's rule gives e = 0 — roots and quotients of target values, whose e = 0 certifies
    the rounding, not the compute-dtype bits (`SQRT_MARGIN_ULPS`, `QUOTIENT_MARGIN_ULPS`). None
    for any other op: its e = 0, where it has one, is that of an exact operation. The bound
    adversary moves such sites by it (rounding.py `BoundAdversary`)."""
    family = op.split(".")[1].removeprefix("_foreach_") if op.count(".") >= 2 else ""
    if family in _ROOTS:
        return _relative_bound(ctx, _MAX_ULPS["sqrt"])
    if family in _QUOTIENTS:
        return _relative_bound(ctx, _MAX_ULPS["div"])
    return None


def conforming_bounds(ctx: BoundContext, op: str, ys: list[torch.Tensor], bounds: list[Bound]
                      ) -> list[torch.Tensor | float | None]:
    """Per result `y` of a site named `op`: how far, times SAFETY, a conforming machine's
    compute-dtype result may lie from the exact one — its bound evaluated (`dense_bound`), and
    for a root or a quotient at least its documented error (`conforming_error`), which its
    e = 0, or a floor beside a small quotient, does not say. What the bound adversary moves
    results by and the divergence probe measures them against."""
    error = conforming_error(ctx, op)
    out: list[torch.Tensor | float | None] = []
    for y, bound in zip(ys, bounds, strict=True):
        e = dense_bound(bound, y)
        if error is not None:
            documented = error.dense(y)
            e = documented if e is None else torch.maximum(e, documented) \
                if isinstance(e, torch.Tensor) else documented.clamp(min=e)
        out.append(e)
    return out


# -- own elementwise rules ---------------------------------------------------------------------

def _axpy(ctx, func, args, kwargs, ys) -> list[Bound]:
    """add/sub(a, b, alpha) = a ± alpha·b, rsub(a, b, alpha) = b − alpha·a. With alpha = 1 it is
    one IEEE operation (e = 0). Otherwise alpha·b and the sum are two roundings, or one FMA:
    |error| <= γ_2·(|a| + |alpha·b|) (Higham, Lemma 3.1)."""
    alpha = _arg(args, kwargs, 2, "alpha", 1)
    if alpha == 1:
        return [None] * len(ys)
    a, b = args[0], args[1]
    if func.overloadpacket.__name__.startswith("rsub"):
        a, b = b, a
    return [ctx.sum_bound(2, _mag(a) + abs(float(alpha)) * _mag(b))]


def _lerp(ctx, func, args, kwargs, ys) -> list[Bound]:
    """lerp(s, end, w) with a tensor weight w (a scalar weight is a fixed formula,
    `protocol.engine.pointwise`): ATen computes s + w·(end − s) for |w| < 0.5, else
    end − (end − s)·(1 − w) (CPU and CUDA alike). Each branch is a + b·c with |b| <= |s| + |end|
    and c in {w, 1 − w}, four roundings at most: |error| <= γ_4·(|s| + |end|)·(1 + |w| + |1 − w|).
    """
    s, end, w = args[0], args[1], args[2]
    return [ctx.sum_bound(4, (s.abs() + end.abs()) * (1.0 + w.abs() + (1.0 - w).abs()))]


# -- reductions --------------------------------------------------------------------------------

def _terms_of_output(x: torch.Tensor, y: torch.Tensor) -> int:
    return x.numel() // max(y.numel(), 1)


def _linear(count: Callable[[tuple, dict, torch.Tensor], int]) -> RuleFn:
    """A sum of K terms that is linear in each input and monotone in their magnitudes: the same
    op on |inputs| gives Σ|terms| exactly (up to its own rounding, covered by SAFETY)."""
    def rule(ctx, func, args, kwargs, ys) -> list[Bound]:
        s = func(*_abs(args), **{k: _abs_keyword(v) for k, v in kwargs.items()})
        s = s[0] if isinstance(s, (tuple, list)) else s
        return [ctx.sum_bound(count(args, kwargs, ys[0]), s)]
    return rule


def _sum_count(args, kwargs, y) -> int:
    return _terms_of_output(args[0], y)


def _sum(ctx, func, args, kwargs, ys) -> list[Bound]:
    """A plain sum: the reduction rule, except where every order is exact (`_exact_where`).
    One C++ pass (`torch.ops.ovt.sum_bound`: Σ|x| in its own fixed order, and the same
    decision) where the library is loaded (`fused.own_arithmetic`), `x` and the result are
    float64, `x` contiguous, the targets float32 and the sum one over a run of dimensions or
    over all but a run (`_sum_layout`); else torch ops."""
    x = args[0]
    k = _sum_count(args, kwargs, ys[0])
    dims = _arg(args, kwargs, 1, "dims" if func is prims.sum.default else "dim", None)
    # no dims, or an empty list, reduces them all (aten.sum and prims.sum alike)
    reduced = list(range(x.dim())) if not dims or not x.dim() else _reduced(dims, x.dim())
    if x.numel() and x.dtype == ys[0].dtype == torch.float64 and x.is_contiguous() and \
            ctx.policy.target == torch.float32 and fused.own_arithmetic(x):
        layout = _sum_layout(x.shape, tuple(reduced))
        if layout is not None:
            scale, floor = ctx.sum_factors(k)
            e = torch.ops.ovt.sum_bound(x, *layout, scale, floor, _slack(ctx, k),
                                        _exact_limit(ctx))
            return [Affine(1.0, 0.0, e.reshape(ys[0].shape))]
    s = func(_abs(x), *args[1:], **{key: _abs_keyword(v) for key, v in kwargs.items()})
    bound = ctx.sum_bound(k, s)
    if not isinstance(bound, Affine) or not x.numel():
        return [bound]
    keepdim = bool(_arg(args, kwargs, 2, "keepdim", False)) and func is not prims.sum.default
    smallest = _smallest_terms(ctx, x, reduced, keepdim)
    if smallest is None:
        return [bound]
    return [_exact_where(ctx, k, s, smallest, bound)]


@lru_cache(maxsize=4096)
def _sum_layout(shape: torch.Size, reduced: tuple[int, ...]) -> tuple[int, int, int, bool] | None:
    """A sum over `reduced` of a contiguous tensor of `shape` as `csrc/fused.cpp` `sum_bound`
    reads it: (a, b, c, False) for a sum over a run of dimensions (a the kept ones before it,
    c after), (a, b, c, True) for one over all but a run (b, a batch norm's channels), or None.
    Dimensions of one element belong to either side."""
    groups: list[list] = []  # [reduced?, elements] of alternating runs
    for d, n in enumerate(shape):
        if n == 1:
            continue
        if groups and groups[-1][0] == (d in reduced):
            groups[-1][1] *= n
        else:
            groups.append([d in reduced, n])
    kinds = [g[0] for g in groups]
    sizes = [g[1] for g in groups]
    if kinds == [True, False, True]:
        return sizes[0], sizes[1], sizes[2], True
    if len(groups) > 3 or kinds.count(True) > 1:
        return None
    if True not in kinds:
        return math.prod(sizes), 1, 1, False
    at = kinds.index(True)
    return math.prod(sizes[:at]), sizes[at], math.prod(sizes[at + 1:]), False


def _smallest_terms(ctx, x: torch.Tensor, reduced: list[int], keepdim: bool
                    ) -> torch.Tensor | None:
    """For each result of summing `x` over `reduced`: its smallest nonzero |term| (+inf where
    every term is zero). None where `x` holds other than target values (every input of a
    step's sites holds target values, SPEC §3.2: checked, since the exactness argument rests
    on it; a NaN fails it too). An integer or boolean `x` (a count summed into the target
    dtype) is widened first."""
    if not x.is_floating_point():
        x = x.to(ctx.policy.compute)
    if not _holds_target_values(ctx, x):
        return None
    nonzero = x.abs().masked_fill(x == 0, math.inf)
    return nonzero.amin(dim=reduced, keepdim=keepdim) if reduced else nonzero


def _embedding_backward(ctx, func, args, kwargs, ys) -> list[Bound]:
    """Embedding backward: row w of the result sums the gradient rows of the positions whose
    index is w — a reduction, exact where every order is (`_exact_where`, over the smallest
    nonzero magnitude among the rows summed into each element). Only the rows some index
    names are worked out: every other row has no terms, so it is zero and exact (e = 0) —
    at GPT-2's vocabulary, most of a result that is vocabulary × width. One C++ pass
    (`torch.ops.ovt.embedding_backward_bound`: Σ|g| in position order, the padding row's
    positions skipped, as the op skips them) where the library is loaded
    (`fused.own_arithmetic`) and the gradient is not scaled by frequency; else torch ops."""
    grad, indices, y = args[0], args[1], ys[0]
    k = _embedding_backward_count(args, kwargs, y)
    scale = _arg(args, kwargs, 4, "scale_grad_by_freq", False)
    if not scale and indices.numel() and y.numel() and ctx.policy.target == torch.float32 and \
            grad.dtype == y.dtype == torch.float64 and fused.own_arithmetic(grad):
        factor, floor = ctx.sum_factors(k)
        e = torch.ops.ovt.embedding_backward_bound(
            grad.reshape(-1, y.shape[-1]).contiguous(),
            indices.reshape(-1).to(torch.int64).contiguous(),
            y.shape[0], _arg(args, kwargs, 3, "padding_idx", -1), factor, floor, _slack(ctx, k),
            _exact_limit(ctx))
        return [Affine(1.0, 0.0, e)]
    magnitudes = grad.abs()
    s = func(magnitudes, *args[1:], **kwargs)  # the op on |grad|: Σ|terms| of each element
    bound = ctx.sum_bound(k, s)
    assert isinstance(bound, Affine)  # (`s` is a tensor)
    if scale or not indices.numel() or not _holds_target_values(ctx, grad):
        return [bound]
    rows, position = torch.unique(indices.reshape(-1), return_inverse=True)
    terms = magnitudes.reshape(indices.numel(), -1)
    terms = terms.masked_fill_(terms == 0, math.inf)  # (|grad| is read no more)
    smallest = torch.full((rows.numel(), terms.shape[1]), math.inf, dtype=terms.dtype,
                          device=terms.device)
    smallest.scatter_reduce_(0, position.reshape(-1, 1).expand_as(terms), terms, "amin")
    named = s[rows]
    exact = _exact_where(ctx, k, named, smallest, Affine(bound.scale, bound.floor, named))
    assert exact.m is not None
    e = s  # (0 at every row no index names: no terms; written over, no other reads it)
    e[rows] = exact.m
    return [Affine(1.0, 0.0, e)]


def _holds_target_values(ctx, x) -> bool:
    """`x` holds target-dtype values only (every input of a step's sites does, SPEC §3.2:
    checked, since the exactness argument rests on it; false where `x` holds a NaN)."""
    return isinstance(x, torch.Tensor) and x.numel() > 0 and \
        torch.equal(x.to(ctx.policy.target).to(x.dtype), x)


def _exact_where(ctx, k: int, s: torch.Tensor, smallest: torch.Tensor, bound: Affine
                 ) -> Affine:
    """`bound`, but 0 where a sum of at most `k` target values is exact in every order.

    Each input is target-representable (SPEC §3.2), so it is an integer multiple of its own
    target ULP, and every partial sum, in any order, is a multiple of `m`, the smallest ULP
    among the nonzero terms — the ULP of the smallest nonzero magnitude (`smallest`: the ULP
    grows with the magnitude; +inf where every term is zero) — of magnitude at most `Σ|x|`.
    When `Σ|x| < 2^p · m` (p the compute dtype's significand bits) every partial sum is exactly
    representable, so every order gives the exact sum. That is the common case for short sums
    of like-sized values — micro-batch gradients above all, where two float32 values in
    float64 sum exactly, often onto a target midpoint, which the reduction rule would log
    although no machine can round it otherwise. `Σ|x|` is the computed `S` times (1 + 2γ_K),
    which covers S's own rounding.

    The decision is the same on every machine although `S` is a computed sum: where the true
    `Σ|x| < 2^p · m`, the partial sums of the magnitudes are exact too, so every machine's `S`
    is that exact `Σ|x|`; elsewhere every machine's `S·(1 + 2γ_K) >= Σ|x|·(1 − γ_K)(1 + 2γ_K)
    >= Σ|x|`, and none says exact.
    """
    finite = torch.isfinite(smallest)
    m = target_ulp(torch.where(finite, smallest, 0.0).to(ctx.policy.target), ctx.policy)
    exact = ~finite | (s.to(torch.float64) * _slack(ctx, k) < _exact_limit(ctx) * m)
    e = bound.dense(s)
    return Affine(1.0, 0.0, torch.where(exact.reshape(e.shape), 0.0, e))


def _slack(ctx, k: int) -> float:
    """1 + 2γ_K: `S` times this is at least the exact `Σ|x|` of a K-term sum (`_exact_where`)."""
    return 1 + 2 * ctx.gamma(k)


def _exact_limit(ctx) -> float:
    """2^p, p the compute dtype's significand bits: partial sums that are multiples of `m` and
    below 2^p·m are exact (`_exact_where`)."""
    return 2.0 ** (ctx.policy.fmt["compute_mantissa"] + 1)


def _reduced(dims, ndim: int) -> list[int]:
    return [d % ndim for d in ([dims] if isinstance(dims, int) else dims)]


def _mean_count(args, kwargs, y) -> int:
    return _terms_of_output(args[0], y) + 1  # the division by the count


def _cumsum_count(args, kwargs, y) -> int:
    x = args[0]
    return x.shape[args[1]] if x.dim() else 1


def _embedding_backward_count(args, kwargs, y) -> int:
    scale = _arg(args, kwargs, 4, "scale_grad_by_freq", False)
    return args[1].numel() + (1 if scale else 0)


def _source_count(position: int, name: str, extra: int) -> Callable[[tuple, dict, torch.Tensor],
                                                                    int]:
    def count(args, kwargs, y) -> int:
        return _arg(args, kwargs, position, name, None).numel() + extra
    return count


def _window(kernel: Sequence[int]) -> int:
    """Elements of a pooling window; a one-number kernel is a cube (over-estimated as 3-D)."""
    return math.prod(kernel) if len(kernel) > 1 else kernel[0] ** 3


def _index_put_count(args, kwargs, y) -> int:
    """index_put(accumulate=True): `values` broadcasts over the (broadcast) index positions, so
    one slot can receive a term from every index position, plus its own value."""
    shapes = [t.shape for t in args[1] if t is not None]
    return math.prod(torch.broadcast_shapes(*shapes)) + 1 if shapes else 2


def _pool_count(args, kwargs, y) -> int:
    return _window(args[1]) + 1  # the window's sum and the division


def _adaptive_pool_count(args, kwargs, y) -> int:
    x = args[0]
    return math.prod(x.shape[-2:]) + 1


def _times(scale, t: torch.Tensor) -> torch.Tensor:
    """|scale|·t for a scaling argument (addmm's alpha and beta): `t` itself where |scale| is 1,
    the common case, which saves a pass (1·t is t, bit for bit)."""
    factor = abs(float(scale))
    return t if factor == 1.0 else factor * t


def _mm(ctx, func, args, kwargs, ys) -> list[Bound]:
    """mm(a, b): C_ij is a K-term inner product; Σ_k |a_ik·b_kj| <= ‖a_i‖·‖b_j‖ (Cauchy–Schwarz),
    an outer product of norms: O(M·K + K·N + M·N) work against the GEMM's O(M·K·N)."""
    a, b = args[0], args[1]
    return [ctx.sum_bound(a.shape[1], ctx.norms(a, 1), ctx.norms(b, 0))]


def _addmm(ctx, func, args, kwargs, ys) -> list[Bound]:
    """addmm(c, a, b, beta, alpha) = beta·c + alpha·(a·b): K products, K+1 additions and two
    scalings: γ_{K+2}·(|beta·c| + |alpha|·‖a_i‖‖b_j‖)."""
    c, a, b = args[0], args[1], args[2]
    beta, alpha = _arg(args, kwargs, 3, "beta", 1), _arg(args, kwargs, 4, "alpha", 1)
    add = _times(beta, c.abs()) if beta != 0 else None
    return [ctx.sum_bound(a.shape[1] + 2, _times(alpha, ctx.norms(a, 1)), ctx.norms(b, 0), add)]


def _bmm(ctx, func, args, kwargs, ys) -> list[Bound]:
    """bmm: mm per batch (Cauchy–Schwarz per batch, row and column)."""
    a, b = args[0], args[1]
    return [ctx.sum_bound(a.shape[2], ctx.norms(a, 2), ctx.norms(b, 1))]


def _baddbmm(ctx, func, args, kwargs, ys) -> list[Bound]:
    """baddbmm(c, a, b, beta, alpha): addmm per batch."""
    c, a, b = args[0], args[1], args[2]
    beta, alpha = _arg(args, kwargs, 3, "beta", 1), _arg(args, kwargs, 4, "alpha", 1)
    add = _times(beta, c.abs()) if beta != 0 else None
    return [ctx.sum_bound(a.shape[2] + 2, _times(alpha, ctx.norms(a, 2)), ctx.norms(b, 1), add)]


def _mv(ctx, func, args, kwargs, ys) -> list[Bound]:
    """mv(a, v): ‖a_i‖·‖v‖."""
    a, v = args[0], args[1]
    return [ctx.sum_bound(a.shape[1], _norms(a, 1) * _norms(v, 0))]


def _addmv(ctx, func, args, kwargs, ys) -> list[Bound]:
    """addmv(c, a, v, beta, alpha) = beta·c + alpha·(a·v): as addmm."""
    c, a, v = args[0], args[1], args[2]
    beta, alpha = _arg(args, kwargs, 3, "beta", 1), _arg(args, kwargs, 4, "alpha", 1)
    s = _times(alpha, _norms(a, 1)) * _norms(v, 0)
    if beta != 0:
        s = s + _times(beta, c.abs())
    return [ctx.sum_bound(a.shape[1] + 2, s)]


def _dot(ctx, func, args, kwargs, ys) -> list[Bound]:
    """dot(a, b): ‖a‖·‖b‖."""
    a, b = args[0], args[1]
    return [ctx.sum_bound(a.numel(), _norms(a, 0) * _norms(b, 0))]


def _per_sample(x: torch.Tensor) -> torch.Tensor:
    """‖x[n]‖ over everything but the batch dimension."""
    return _norms(x.reshape(x.shape[0], math.prod(x.shape[1:])), 1)  # (an empty batch too)


def _per_channel(x: torch.Tensor) -> torch.Tensor:
    """‖x[:, c]‖ over everything but the channel dimension (`_channel_sums`)."""
    squares = _channel_sums(x, squares=True).squares
    assert squares is not None
    return squares.sqrt()


@dataclass(frozen=True)
class _ChannelSums:
    """Sums of a tensor t of shape (N, C, *spatial) in float64, each None unless asked for:
    `spatial` Σ_c t² per sample and position, (N, 1, *spatial); per channel (C,): `squares`
    Σ t² and `magnitudes` Σ |t|."""

    spatial: torch.Tensor | None = None
    squares: torch.Tensor | None = None
    magnitudes: torch.Tensor | None = None


def _channel_sums(t: torch.Tensor, spatial: bool = False, squares: bool = False,
                  magnitudes: bool = False) -> _ChannelSums:
    """The asked-for sums of `t` (`_ChannelSums`): all in one C++ read of `t` where the library
    is loaded (`fused.own_arithmetic`) and `t` is a nonempty contiguous float64 or float32
    tensor (`torch.ops.ovt.channel_sums`); else with torch ops, one squared copy shared by the
    two sums of squares. Bounds only: any order of these sums is within `SAFETY`."""
    if fused.own_arithmetic(t) and t.dtype in (torch.float64, torch.float32) and \
            t.is_contiguous() and t.numel() and t.dim() >= 2:
        sums, sq, mag = torch.ops.ovt.channel_sums(t)
        return _ChannelSums(sums.reshape(t.shape[0], 1, *t.shape[2:]), sq, mag)
    wide = _f64(t)
    dims = [0, *range(2, t.dim())]
    square = wide * wide if spatial or squares else None
    return _ChannelSums(
        square.sum(1, keepdim=True) if square is not None and spatial else None,
        square.sum(dims) if square is not None and squares else None,
        wide.abs().sum(dims) if magnitudes else None)


def _per_dim(param: Sequence[int], spatial: int) -> list[int]:
    """A convolution's stride, padding or dilation with one entry per spatial dimension (ATen
    takes a single entry for all of them)."""
    return list(param) * spatial if len(param) == 1 else list(param)


def _window_norms(squares: torch.Tensor, kernel: Sequence[int], stride, padding, dilation,
                  transposed: bool = False, size: Sequence[int] | None = None) -> torch.Tensor:
    """(N, 1, *spatial): the norm, over every channel, of the elements of a tensor t[n] that
    one output position's window reads — a convolution of `squares` = Σ_c t[n, c]²
    (`_ChannelSums.spatial`) with a kernel of ones, in float64 (its own rounding is within
    `SAFETY`); `transposed`: the windows of a transposed convolution, the positions of a
    `size` input that read each one (grad_input's). In two spatial dimensions, where the
    library is loaded (`fused.own_arithmetic`), one C++ pass sums each window directly
    (`torch.ops.ovt.window_norms`) instead of a float64 convolution."""
    spatial = len(kernel)
    stride, padding, dilation = (_per_dim(p, spatial) for p in (stride, padding, dilation))
    if spatial == 2 and fused.own_arithmetic(squares):  # one C++ pass: the same sums
        if transposed:
            assert size is not None
            out = list(size)
        else:
            out = [max(0, (squares.shape[2 + i] + 2 * padding[i] - dilation[i] * (kernel[i] - 1)
                           - 1) // stride[i] + 1) for i in range(2)]
        norms = torch.ops.ovt.window_norms(squares.reshape(squares.shape[0], *squares.shape[2:])
                                           .contiguous(), *kernel, *stride, *padding,
                                           *dilation, transposed, *out)
        return norms.reshape(squares.shape[0], 1, *out)
    ones = torch.ones((1, 1, *kernel), dtype=torch.float64, device=squares.device)
    if not transposed:
        conv = (F.conv1d, F.conv2d, F.conv3d)[spatial - 1]
        return conv(squares, ones, None, stride, padding, dilation).sqrt_()
    assert size is not None
    extra = [size[i] - ((squares.shape[2 + i] - 1) * stride[i] - 2 * padding[i] +
                        dilation[i] * (kernel[i] - 1) + 1) for i in range(spatial)]
    conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[spatial - 1]
    return conv_t(squares, ones, None, stride, padding, extra, 1, dilation).sqrt_()


def _window_norms_read(read_at: torch.Tensor | None, y: torch.Tensor, x: torch.Tensor,
                       kernel: Sequence[int], stride, padding, dilation) -> torch.Tensor | None:
    """`_window_norms(Σ_c x², ...)` of a 2-D convolution (not transposed) of `x` (N, C', H, W)
    whose result is `y` (N, C, *size), the site's only one, at the windows of the site
    positions `read_at` alone (the same bits) and 0 at the others (`bounds_for`: a bound read
    there by mistake rejects), computed from `x` itself in one C++ call
    (`torch.ops.ovt.window_norms_at`), where that serves: `read_at` given, `x` a contiguous
    float64 or float32 CPU tensor that the library reads, and no more positions than one in
    the kernel's size (each costs its window's reads of every channel, against one read of
    `x` for all); else None. (Not for the transposed windows of convolution_backward's
    grad_input: its weight gradient's rule reads every element of the output's gradient
    anyway, and the same pass gives its windows' squares, measured no slower.)"""
    if read_at is None or y.dim() != 4 or x.dim() != 4 or not x.is_contiguous() or \
            x.dtype not in (torch.float64, torch.float32) or not fused.own_arithmetic(x) or \
            read_at.numel() * math.prod(kernel) > y.shape[0] * y.shape[2] * y.shape[3]:
        return None
    stride, padding, dilation = (_per_dim(p, 2) for p in (stride, padding, dilation))
    norms = torch.ops.ovt.window_norms_at(x, read_at, y.shape[1], *kernel, *stride, *padding,
                                          *dilation, *y.shape[2:])
    return norms.unsqueeze(1)


def _spread(e: Affine | float, dims: int) -> Affine | float:
    """A (rows, cols) bound reshaped to broadcast over `dims` trailing spatial dimensions."""
    if not isinstance(e, Affine) or e.m is None:
        return e
    return Affine(e.scale, e.floor, e.m.reshape(*e.m.shape, *([1] * dims)), weight=e.weight)


def _convolution(ctx, func, args, kwargs, ys) -> list[Bound]:
    """convolution(x, w, bias, ...): out[n, o, p] sums products of distinct elements of x[n] with
    distinct elements of the filter of channel o, so by Cauchy–Schwarz Σ|terms| <=
    ‖x[n]‖·‖filter_o‖, whatever the stride, padding (zeros add nothing), dilation or groups
    (a group sees a subset of x[n]); and, not transposed, ‖window_p‖·‖filter_o‖ with the
    norm only over the elements output position p reads (`_window_norms`, every channel's:
    a group's are a subset), tighter by about √(spatial size / kernel size). K = in-channels
    per group × kernel size, plus the bias."""
    x, w, bias = args[0], args[1], args[2]
    stride, padding, dilation = args[3], args[4], args[5]
    transposed, groups = bool(args[6]), int(args[8])
    kernel = math.prod(w.shape[2:])
    spatial = ys[0].dim() - 2
    if transposed:  # w is (C_in, C_out / groups, *k): output channel o uses w[:, o % (C_out/g)]
        filters = _per_channel(w).repeat(groups)
        k = w.shape[0] // groups * kernel
        s = torch.outer(_per_sample(x), filters)
        if bias is not None:
            s, k = s + bias.abs(), k + 1
        return [_spread(ctx.sum_bound(k, s), spatial)]
    # w is (C_out, C_in / groups, *k)
    k = w.shape[1] * kernel
    windows = _window_norms_read(ctx.read_at, ys[0], x, w.shape[2:], stride, padding,
                                 dilation)  # (a replayer's: at its entries alone)
    if windows is None:
        squares = _channel_sums(x, spatial=True).spatial
        assert squares is not None
        windows = _window_norms(squares, w.shape[2:], stride, padding, dilation)
    if bias is None:
        return [_windows_times_channels(ctx, k, windows, _per_sample(w))]
    base = windows * _per_sample(w).reshape(1, -1, *([1] * spatial))
    base = base.add_(_f64(bias).abs().reshape(1, -1, *([1] * spatial)))
    return [ctx.sum_bound(k + 1, base)]


def _windows_times_channels(ctx, k: int, windows: torch.Tensor, channels: torch.Tensor
                            ) -> Affine | float:
    """The K-term sum bound on windows[n, 0, p]·channels[c] for a result (N, C, *spatial),
    left as an outer product (`Affine`: per (n, c) row the channel's factor, per (n, p) column
    the window's), so that no dense tensor of bases is made."""
    n = windows.shape[0]
    return ctx.sum_bound(k, channels.reshape(1, -1).expand(n, -1),
                         windows.reshape(n, math.prod(windows.shape[2:])))  # (n may be 0)


def _convolution_backward(ctx, func, args, kwargs, ys) -> list[Bound]:
    """convolution_backward: each gradient is again a sum of products of distinct elements.
    - grad_input[n, c]: of grad_out[n] with the weights reading channel c: ‖g[n]‖·‖w_c‖, and
      not transposed ‖g's window at the position‖·‖w_c‖, over the positions of g[n] whose
      windows read it;
    - grad_weight[o, c]: of grad_out[:, o] with input channel c (of o's group): ‖g_o‖·‖x_c‖;
    - grad_bias[o]: a plain sum of grad_out[:, o], bounded by the sum of its magnitudes."""
    g, x, w = args[0], args[1], args[2]
    stride, padding, dilation = args[4], args[5], args[6]
    transposed, groups, mask = bool(args[7]), int(args[9]), args[10]
    kernel, spatial = math.prod(w.shape[2:]), x.dim() - 2
    out: list[Bound] = []
    g_sums = _channel_sums(g, spatial=mask[0] and not transposed, squares=mask[1],
                           magnitudes=mask[2])
    if mask[0]:
        if transposed:  # forward used w (C_in, C_out/g, *k): grad_input[:, i] reads w[i]
            w_c, k = _per_sample(w), w.shape[1] * kernel
            out.append(_spread(ctx.sum_bound(k, torch.outer(_per_sample(g), w_c)), spatial))
        else:  # w (C_out, C_in/g, *k): grad_input[:, c] reads w[:, c % (C_in/g)], all o, and
            # of g[n] only the positions whose windows read its position (`_window_norms`)
            w_c, k = _per_channel(w).repeat(groups), w.shape[0] // groups * kernel
            assert g_sums.spatial is not None
            windows = _window_norms(g_sums.spatial, w.shape[2:], stride, padding, dilation,
                                    True, x.shape[2:])
            out.append(_windows_times_channels(ctx, k, windows, w_c))
    if mask[1]:
        assert g_sums.squares is not None
        g_c, x_c = g_sums.squares.sqrt(), _per_channel(x)
        if transposed:  # grad_weight (C_in, C_out/g): row i pairs x_i with g of i's group
            rows, cols = x_c, g_c.reshape(groups, -1)
            k = x.shape[0] * math.prod(x.shape[2:])
        else:  # grad_weight (C_out, C_in/g): row o pairs g_o with x of o's group
            rows, cols = g_c, x_c.reshape(groups, -1)
            k = g.shape[0] * math.prod(g.shape[2:])
        per_group = rows.shape[0] // groups
        cols = cols.repeat_interleave(per_group, dim=0)  # (rows, cols per group)
        out.append(_spread(ctx.sum_bound(k, rows.unsqueeze(1) * cols), spatial))
    if mask[2]:
        assert g_sums.magnitudes is not None
        out.append(ctx.sum_bound(g.numel() // g.shape[1], g_sums.magnitudes))
    return out


# -- factories (ops without floating inputs that make floats) ----------------------------------

def _arange(ctx, func, args, kwargs, ys) -> list[Bound]:
    """arange: y_i = start + i·step, a product and a sum: γ_2·(|start| + |i·step|), and
    |i·step| <= |start| + |y_i|."""
    start = float(args[0]) if len(args) > 1 else 0.0
    return [ctx.sum_bound(2, 2.0 * abs(start) + ys[0].abs())]


def _linspace(ctx, func, args, kwargs, ys) -> list[Bound]:
    """linspace: step = (end − start)/(steps − 1), then start + i·step (or end − j·step for the
    upper half): four roundings on terms below 2·(|start| + |end|)."""
    start, end = (float(v) for v in args[:2])
    return [ctx.sum_bound(4, 2.0 * (abs(start) + abs(end)))]


# -- foreach -----------------------------------------------------------------------------------

def _foreach(inner: RuleFn) -> RuleFn:
    """A _foreach_ op is its per-tensor op on each list element; so is its bound. List
    arguments are taken element-wise, anything else (a scalar, one tensor) as it is."""
    def rule(ctx, func, args, kwargs, ys) -> list[Bound]:
        out: list[Bound] = []
        for i, y in enumerate(ys):
            pick = tuple(a[i] if isinstance(a, (list, tuple)) else a for a in args)
            out.extend(inner(ctx, func, pick, kwargs, [y]))
        return out
    return rule


# -- composite ops with own rules (bound rules version 3) ---------------------------------------
#
# SPEC §3.2.1 lets an op that would be decomposed carry its own rule, with a proof and a test
# against an exact reference (tests/protocol/engine/test_composite_bounds.py): the softmax
# family below, each a row-wise op whose row sums in the compute dtype err by about K·u, far
# below a target ULP, where its decomposition rounds half a dozen full-size intermediates
# (issue 13: the decomposed log-softmax over GPT-2's vocabulary took 0.3 s a step); GELU;
# and layer norm's backward, whose mean and rstd are inputs (its forward, where they are
# computed, and ill-conditioned where the variance is tiny against the mean, stays decomposed).
#
# Each softmax proof bounds, to first order in u, the error of a family of algorithms: every
# summation order and blocking; a two-pass kernel (the row maximum M, then Σ exp(x − M)), an
# online one (a running maximum, the partial sum rescaled by exp(m_old − m_new) as it grows:
# flash attention's), and the log-sum-exp epilogues exp((x − M) − log s) and
# exp(x − (M + log s)); a division or a reciprocal and a multiply; FMA or not. GELU's covers erf
# and erfc forms in any association; layer norm backward's ATen's CPU form and the
# decomposition's. The products of two or more relative errors add less than 2% to the
# first-order sum (`_SLACK`) wherever that sum is at most 1/128, which `rule_of` checks from
# the row length, and for softmax its rows' maxima (`_COMPOSITE_LIMIT`); beyond it the op is
# decomposed. The math functions' errors are
# `_MAX_ULPS`'s (exp, log, div, erf, erfc: n ULPs, at most 2n·u relative).

_SLACK = 1.02
_COMPOSITE_LIMIT = 1 / 128


def _row(x: torch.Tensor, dim: int) -> int:
    """K, the length of the rows along `dim` (1 for a 0-d tensor)."""
    return x.shape[dim] if x.dim() else 1


def _log(k: int) -> float:
    """ln K, 0 for an empty row (which has no results to bound)."""
    return math.log(max(k, 1))


def _f64(t: torch.Tensor) -> torch.Tensor:
    """`t` in float64, where a rule's magnitudes are formed: in a float32 compute dtype a base
    like |x|·C of a large bfloat16 value would overflow to +inf, which certifies nothing."""
    return t.to(torch.float64)


def _ulps(ctx, name: str) -> float:
    return _MAX_ULPS[name] * ctx.ulp_factor


def _row_sum_error(ctx, k: int) -> float:
    """The relative error of a row's Σ_j exp(x_j − M), in units of u, for every algorithm of the
    family. Two-pass: x_j − M rounds by u·|x_j − M|, which moves exp(x_j − M) by that relative
    amount; weighted by the terms, Σ_j exp(−d_j)·d_j ≤ (K − 1)/e against s ≥ 1 (the maximum's
    own term is exp(0) = 1); exp adds 2·n_exp·u per term; the sum, γ_{K−1}. Online: a term
    enters as exp(x_j − m_j), m_j the running maximum (as above, ≤ K/e), and is rescaled by
    each later exp(m_old − m_new): the rescale's argument error, summed over the rescales
    weighted by the partial sums they scale, is at most u·K·Σ Δm·exp(−(M − m_old)) ≤ u·K (a
    lower Riemann sum of ∫ exp(−z) dz); each rescale's exp and multiply, (2·n_exp + 1)·u, on at
    most K rescales. In all: u·((2·n_exp + 4)·K + 2·n_exp + 2) covers both."""
    n_exp = _ulps(ctx, "exp")
    return (2 * n_exp + 4) * k + 2 * n_exp + 2


def _softmax(ctx, func, args, kwargs, ys, *, tops: torch.Tensor | None,
             top: float) -> list[Bound]:
    """_softmax(x, dim): y_i = exp(x_i − M) / s, s = Σ_j exp(x_j − M). Relative to y_i: the
    row sum (`_row_sum_error`); y_i's own exp(x_i − M) (u·|x_i − M| + 2·n_exp·u; through
    exp((x_i − M) − log s), 2u·|x_i − M| + (2·n_log + 1)·u·ln K + 2·n_exp·u; through
    exp(x_i − (M + log s)), the sum M + log s rounds too: u·(|M| + ln K) more); the division or
    a reciprocal and a multiply (at most 3u). |x_i − M| ≤ D = −ln(tiny) + 1 wherever y_i is
    above the compute dtype's smallest subnormal `tiny` (745.1 in float64, 104.3 in float32);
    where it is not (a masked x_i = −inf among them), every machine's y_i is 0 or a few
    subnormal units. So e_i = SAFETY·1.02·u·|y_i|·(|M| + 3·D + R_s + (2·n_log + 2)·ln K +
    2·n_exp + 3), plus (2K + 8) subnormal units. Where every row's |M| is at most the constant
    part c₀, the largest finite |M| of the tensor stands for each row's own (a looser bound):
    relative to y alone, evaluated in the fused band pass; elsewhere (a row masked with −1e9
    beside ordinary ones) each row keeps its own, so one row cannot widen every other row's
    band. Both parties decide alike: the inputs are the same bits. (A row whose M is not
    finite has no finite result; `rule_of` decomposes the op where u·|M| breaks the
    first-order limit, `_softmax_rule`.) `tops` are the rows' finite |M| and `top` their
    largest (`_softmax_rule` found them for its decision: the same values from the op's
    target-dtype input, a maximum being exact); `tops` is None for an empty input."""
    x, dim = args[0], args[1]
    k = _row(x, dim)
    scale, floor = SAFETY * _SLACK * ctx.u, SAFETY * (2 * k + 8) * ctx.tiny
    c = 3 * (1 - math.log(ctx.tiny)) + _row_sum_error(ctx, k) + \
        (2 * _ulps(ctx, "log") + 2) * _log(k) + 2 * _ulps(ctx, "exp") + 3
    if tops is None:
        return [Affine(scale * c, floor)]
    if top <= c:
        return [Affine(scale * (c + top), floor)]
    return [Affine(scale, floor, _f64(ys[0]).abs().mul_(tops + c))]


def _softmax_rule(args: tuple, unit_roundoff: float) -> Rule | None:
    """_softmax's rule where u times its first-order coefficient — `_row_terms` plus the
    largest finite |M| of the rows (exp(x − (M + log s)) rounds M + log s) — is at most
    `_COMPOSITE_LIMIT`, else None (decomposed). The rows' |M| found for the decision are the
    ones its bound reads (`_softmax`): one read of the input for both. A decision on shapes
    and input values, the same on every party."""
    x, dim = args[0], args[1]
    tops = _finite_row_maxima(x, dim) if x.numel() else None
    top = float(tops.max()) if tops is not None else 0.0
    if (_row_terms(args, {}) + top) * unit_roundoff > _COMPOSITE_LIMIT:
        return None
    return Rule("softmax", partial(_softmax, tops=tops, top=top), unsigned_zero=True)


def _finite_row_maxima(x: torch.Tensor, dim: int) -> torch.Tensor:
    """|M| per row along `dim` (kept as a dimension of one), in float64; 0 for a row whose
    maximum is not finite (no finite result there)."""
    rows = _f64(x.amax(dim, keepdim=True) if x.dim() else x)
    return rows.abs().nan_to_num_(nan=0.0, posinf=0.0)  # (|M| is never −inf)


def _log_softmax(ctx, func, args, kwargs, ys) -> list[Bound]:
    """_log_softmax(x, dim): y_i = x_i − M − L, L = log s ∈ [0, ln K]. Absolutely: log ŝ errs by
    the row sum's relative error R_s·u (`_row_sum_error`) plus log's own 2·n_log·u·L; then
    either (x_i − M) − L (u·|x_i − M| and u·|y_i|) or x_i − (M + L) (u·(|M| + L) and u·|y_i|).
    With |x_i − M| = |y_i + L| ≤ |y_i| + ln K: e_i = SAFETY·1.02·u·(2·|y_i| + |M| + R_s +
    (2·n_log + 2)·ln K), plus (K + 4) subnormal units. The base is left as the row's constant
    plus 2·|y_i| (`Affine`), which the band pass evaluates in its read of the result: at
    GPT-2's vocabulary a dense tensor of bases took 50 ms of a record step."""
    x, dim = args[0], args[1]
    k = _row(x, dim)
    scale = SAFETY * _SLACK * ctx.u
    c = _row_sum_error(ctx, k) + (2 * _ulps(ctx, "log") + 2) * _log(k)
    top = _finite_row_maxima(x, dim) if x.numel() else _f64(x)
    return [Affine(scale, SAFETY * (k + 4) * ctx.tiny, top.add_(c), weight=2.0)]


def _softmax_backward(ctx, func, args, kwargs, ys) -> list[Bound]:
    """_softmax_backward_data(g, y, dim, dtype): dx_i = y_i·(g_i − s), s = Σ_j g_j·y_j. Each
    g_j·y_j of two target values is exact in the compute dtype (twice the target's significand
    fits; the float32 compute of bfloat16 values may underflow, a subnormal unit each), so ŝ
    errs by γ_{K−1}·P, P = Σ_j |g_j·y_j| ≥ |s|. Then y_i·(g_i − ŝ) (two roundings, on at most
    |y_i|·(|g_i| + P)), or g_i·y_i − y_i·ŝ (exact, one rounding, one subtraction), FMA or
    not: e_i = SAFETY·1.02·u·((K + 5)·|y_i|·P + 3·|g_i·y_i|), plus (K + 4) subnormal units.
    Rows along the last dimension take one C++ pass per row where the library is loaded
    (`fused.own_arithmetic`: `softmax_backward_bound`), else torch ops."""
    g, y, dim = _f64(args[0]), _f64(args[1]), args[2]
    k = _row(y, dim)
    bound = partial(Affine, SAFETY * _SLACK * ctx.u, SAFETY * (k + 4) * ctx.tiny)
    if fused.own_arithmetic(y) and y.numel() and y.dim() and dim % y.dim() == y.dim() - 1:
        rows = (y.numel() // k, k)
        base = torch.ops.ovt.softmax_backward_bound(g.reshape(rows).contiguous(),
                                                    y.reshape(rows).contiguous(), float(k + 5))
        return [bound(base.reshape(y.shape))]
    q = (g * y).abs_()
    p = q.sum(dim, keepdim=True) if q.numel() else q
    return [bound(torch.add(y.abs().mul_(p * (k + 5)), q, alpha=3))]


def _log_softmax_backward(ctx, func, args, kwargs, ys) -> list[Bound]:
    """_log_softmax_backward_data(g, y, dim, dtype): dx_i = g_i − exp(y_i)·s, s = Σ_j g_j. ŝ errs
    by γ_{K−1}·G, G = Σ_j |g_j|; exp(y_i) by 2·n_exp·u relatively; the product and the
    subtraction one rounding each, on at most exp(y_i)·G and |g_i| + exp(y_i)·G:
    e_i = SAFETY·1.02·u·((K + 2·n_exp + 3)·exp(y_i)·G + |g_i|), plus (K + 4) subnormal
    units. exp(y_i) is computed here in float64 (its own error is within SAFETY). Where exp(y_i)
    is a subnormal of the compute dtype (y_i below −87.3 in float32) its error is n_exp of its
    units, not relative: in float32 compute the bound adds n_exp·tiny·G (as 2·n_exp·(tiny/u)·G
    in the base); in float64 that needs G beyond 2**873. Rows along the last dimension, where
    the library is loaded (`fused.own_arithmetic`), take one C++ pass per row with an upper
    bound on exp(y_i), within 6.2 % of it above the subnormals, from its binary exponent
    (`exp_above`: no exp call): at GPT-2's vocabulary the torch ops took a fifth of a record
    step."""
    g, y, dim = _f64(args[0]), _f64(args[1]), args[2]
    k = _row(y, dim)
    coefficient = k + 2 * _ulps(ctx, "exp") + 3
    extra = 2 * _ulps(ctx, "exp") * ctx.tiny / ctx.u if ctx.policy.compute == torch.float32 \
        else 0.0
    bound = partial(Affine, SAFETY * _SLACK * ctx.u, SAFETY * (k + 4) * ctx.tiny)
    if fused.own_arithmetic(y) and y.numel() and y.dim() and dim % y.dim() == y.dim() - 1:
        rows = (y.numel() // k, k)
        base = torch.ops.ovt.log_softmax_backward_bound(g.reshape(rows).contiguous(),
                                                        y.reshape(rows).contiguous(),
                                                        float(coefficient), extra)
        return [bound(base.reshape(y.shape))]
    total = g.abs().sum(dim, keepdim=True) if g.numel() else g
    factor = y.exp().mul_(coefficient).add_(extra)
    return [bound(torch.add(factor.mul_(total), g.abs()))]


def _gelu_cdf_error(ctx) -> float:
    """The absolute error of 2·Φ(x) = 1 + erf(x/√2) as GELU kernels compute it, in units of u.
    x/√2 as x times a rounded 1/√2 errs by 2u·|t| (t = x/√2), which moves erf by at most
    (2/√π)·e^{−t²}·2u·|t| ≤ (4/√π)·u·max |t|·e^{−t²} < 0.97u; erf's own error is 2·n_erf·u
    (|erf| ≤ 1) and the add u·|1 + erf| ≤ 2u: 2·n_erf + 3. Through erfc(−t) instead (accurate
    in the tail): 4·n_erfc + 1 (|erfc| ≤ 2). The larger of the two."""
    return max(2 * _ulps(ctx, "erf") + 3, 4 * _ulps(ctx, "erfc") + 1)


def _gelu(ctx, func, args, kwargs, ys) -> list[Bound]:
    """gelu(x) (the exact form): y = x·Φ(x) = (x/2)·(1 + erf(x/√2)). x/2 is exact; the product
    one rounding (u·|y|; 2u·|y| as x·(0.5 + 0.5·erf), the sum rounded first); the
    cumulative's error (`_gelu_cdf_error`, C) times |x|/2: e_i = SAFETY·1.02·u·(C/2·|x_i| +
    2·|y_i|), plus 4 subnormal units (a tail result below the normals). Absolute in x: deep in
    the negative tail, where 1 + erf cancels, the result is tiny and the bound is not — those
    elements log their values, as they must, since machines differ there."""
    return [Affine(2 * SAFETY * _SLACK * ctx.u, SAFETY * 4 * ctx.tiny,
                   other=args[0], weight=_gelu_cdf_error(ctx) / 4)]


def _gelu_backward(ctx, func, args, kwargs, ys) -> list[Bound]:
    """gelu_backward(g, x) (the exact form): dx = g·(Φ(x) + x·φ(x)), φ(x) = e^{−x²/2}/√(2π).
    Φ errs by C/2·u (`_gelu_cdf_error`); φ by (2·n_exp + 5)·u relatively (exp's own error, two
    rounded constants and the product), and x·φ(x) one rounding more, on |x|·φ(x) ≤ φ(1) <
    0.242; exp's argument: x·x is exact in the compute dtype and −x²/2 too, but −(x/√2)² errs
    by at most 4.2u relatively, which moves exp by 2.1u·x², times |x|·φ(x) below 1.0u (the
    largest x³·φ(x) is 0.464); their sum one rounding on |Φ + xφ| < 1.13; the product with g one
    on |dx|: e_i = SAFETY·1.02·u·(|g_i|·(C/2 + 0.242·(2·n_exp + 7) + 1.13 + 1) + |dx_i|), plus
    4 subnormal units."""
    c = _gelu_cdf_error(ctx) / 2 + 0.242 * (2 * _ulps(ctx, "exp") + 7) + 1.13 + 1.0
    return [Affine(SAFETY * _SLACK * ctx.u, SAFETY * 4 * ctx.tiny, other=args[0], weight=c)]


def _layer_norm_backward(ctx, func, args, kwargs, ys) -> list[Bound]:
    """native_layer_norm_backward(g, x, shape, μ, ρ, w, b, mask): per row of N = prod(shape)
    elements, with μ and ρ the forward's rounded mean and rstd (inputs here, so nothing is
    ill-conditioned), S1 = Σ g·w and S2 = Σ g·w·(x − μ):
    dx_i = ρ·g_i·w_i − (ρ/N)·S1 − (ρ³/N)·(x_i − μ)·S2; dw_j = Σ_rows g·(x − μ)·ρ;
    db_j = Σ_rows g. With A_i = |g_i·w_i| (exact: two target values), P1 = Σ A,
    Q = Σ A·|x| + |μ|·P1 and Q' = Σ A·|x − μ| ≥ |S2|:
    - ATen's CPU form: S1 and ds = Σ g·w·x in any order, b = (S1·μ − ds)·ρ·ρ·ρ·(1/N) (the
      difference cancels, within (K + 3)·u·Q; five roundings more on at most ρ³·Q'/N),
      c = −b·μ − S1·ρ·(1/N) from that same b, so b's error reaches dx = ρ·g·w + b·x + c as
      Δb·(x_i − μ), while b̂·x and b̂·μ round by u·|b̂|·|x_i| and u·|b̂|·|μ| on the computed
      b̂, which where S1·μ − ds cancels (a constant row, μ·ρ large) is mostly error:
      |b̂| ≤ (ρ³/N)·(Q' + (K + 8)·u·Q); and the decomposition's (and CUDA's) form
      (ρ/N)·((N·g·w − S1) − x̂·Σ g·w·x̂), x̂ = (x − μ)·ρ, whose CUDA kernel rounds
      ρ·g·w-sized terms seven times. Either: |Δdx_i| ≤ u·(7·ρ·A_i + (ρ³/N)·((K + 10)·Q·
      |x_i − μ| + 3·(Q' + (K + 8)·u·Q)·(|x_i| + |μ|)) + (ρ/N)·P1·(K + 6)), K = N;
    - dw: three roundings per term (g·(x − μ)·ρ, or g·(ρ·x − ρ·μ)) on |g|·(|x| + |μ|)·ρ, then
      a sum over the M rows: (M + 5)·u·Σ |g|·(|x| + |μ|)·ρ; db: a sum, (M + 1)·u·Σ |g|.
    Each e = SAFETY·1.02 times these, plus (N + 16) subnormal units (a product of four small
    factors may underflow). Where the library is loaded (`fused.own_arithmetic`) one C++ pass
    over the rows and one over the columns compute these terms (`layer_norm_backward_bound`),
    else torch ops: the same terms, their sums in other orders (the 1.02 covers any)."""
    g, x, shape, mean, rstd, w, b, mask = args[:8]
    n = math.prod(shape)
    scale, floor = SAFETY * _SLACK * ctx.u, SAFETY * (n + 16) * ctx.tiny
    if not x.numel():  # (no results to bound)
        present = [mask[0], mask[1] and w is not None, mask[2] and b is not None]
        return [None] * sum(present)
    m = x.numel() // n
    g, x, mean, rstd = _f64(g), _f64(x), _f64(mean), _f64(rstd)
    w = _f64(w) if w is not None else None
    if fused.own_arithmetic(x):  # the terms below, in two C++ passes
        dx, dw, db = torch.ops.ovt.layer_norm_backward_bound(
            g.reshape(m, n).contiguous(), x.reshape(m, n).contiguous(),
            mean.reshape(m).contiguous(), rstd.reshape(m).contiguous(),
            None if w is None else w.reshape(n).contiguous(), ctx.u)
        present = [(mask[0], dx.reshape(x.shape)), (mask[1] and w is not None, dw.reshape(shape)),
                   (mask[2] and b is not None, db.reshape(shape))]
        return [Affine(scale, floor, base) for wanted, base in present if wanted]
    x2, g2 = x.reshape(m, n), g.reshape(m, n)
    mu, rho = mean.reshape(m, 1).abs(), rstd.reshape(m, 1).abs()
    ax = x2.abs()
    out: list[Bound] = []
    if mask[0]:
        a = (g2 * w.reshape(1, n)).abs_() if w is not None else g2.abs()
        p1 = a.sum(1, keepdim=True)
        deviation = (x2 - mean.reshape(m, 1)).abs_()
        q = (a * ax).sum(1, keepdim=True).add_(mu * p1)
        q_dev = (a * deviation).sum(1, keepdim=True)
        cube = rho.pow(3).div_(n)
        b_hat = q_dev.add_(q * ((n + 8) * ctx.u))
        spread = deviation.mul_(cube * q * (n + 10)).add_((ax + mu).mul_(cube * b_hat * 3))
        base = a.mul_(rho * 7).add_(spread).add_((rho * p1).mul_((n + 6) / n))
        out.append(Affine(scale, floor, base.reshape(x.shape)))
    if mask[1] and w is not None:
        terms = (ax + mu).mul_(g2.abs()).mul_(rho)
        out.append(Affine(scale, floor, terms.sum(0).mul_(m + 5).reshape(shape)))
    if mask[2] and b is not None:
        out.append(Affine(scale, floor, g2.abs().sum(0).mul_(m + 1).reshape(shape)))
    return out


def _layer_norm_backward_terms(args: tuple, kwargs: dict) -> float:
    """The first-order coefficients of `_layer_norm_backward`: the row length N and the row
    count M, plus constants."""
    n = math.prod(args[2])
    return max(n, args[1].numel() // n if n else 0) + 20


def _row_terms(args: tuple, kwargs: dict) -> float:
    """The largest first-order coefficient (in units of u) of the softmax family's rules on
    rows of `args[0]` along `args[1]`, for `rule_of`'s limit: K·(2·n_exp + 4) at float32's
    n_exp = 2, plus the constants (|x_i − M| ≤ 745 where exp(x_i − M) does not underflow in
    float64, 104 in float32)."""
    return 8 * _row(args[0], args[1]) + 2400


def _softmax_backward_terms(args: tuple, kwargs: dict) -> float:
    """`_row_terms` for the backwards, whose rows are those of their output `args[1]` along
    `args[2]`."""
    return _row_terms(args[1:], kwargs)


def _gelu_terms(args: tuple, kwargs: dict) -> float:
    """GELU's first-order coefficients are constants (at most 50 in float32); its tanh
    approximation has no own rule (infinite: it is decomposed)."""
    return 50.0 if kwargs.get("approximate", "none") == "none" else math.inf


# -- norm statistics (bound rules version 4) ---------------------------------------------------
#
# Layer norm and batch norm (training) run as ovt's own two ops (`protocol.engine.normops`):
# the statistics of each row, one site with the rule below, and the normalize formula, a fixed
# formula (e = 0). Their mean and rstd are rounded to the target before the formula reads them,
# so the bound's K·u terms widen the bands of the few statistics only, never those of the
# outputs; and the variance is two-pass, its error relative to the variance itself (plus the
# mean's error squared), so rows whose mean is large against their spread stay certified. Where
# that squared term is not small against the variance and eps (a constant row far from zero
# with eps 0, say), or where the squares could overflow, the op runs as its decomposition.

def _rstd_error(compute: torch.dtype) -> float:
    """c_ρ: rsqrt's relative error in units of u (n ULPs: 2n·u), or 1/sqrt's (sqrt's, and 2u
    for a division or a reciprocal), whichever is larger."""
    factor = _FLOAT32_FACTOR if compute == torch.float32 else 1.0
    return max(2 * _MAX_ULPS["rsqrt"] * factor, 2 * _MAX_ULPS["sqrt"] * factor + 2)


def _norm_stats_rule(args: tuple, unit_roundoff: float) -> Rule | None:
    """norm_stats(x, dims, eps) -> (μ̂, v̂, ρ̂) over rows of K elements: its own rule where it
    holds on these inputs, else None (decomposed). With M = max |x| of a row, every conforming
    machine computes
    - μ̂: the sum in any order and blocking, γ_{K−1}·Σ |x| ≤ γ_{K−1}·K·M (Higham §3.1), then
      divided by K (u) or multiplied by a rounded 1/K (2u): |μ̂ − μ| ≤ Δμ = γ_{K+1}·M, a
      bound with no higher-order remainder (so its square below is one too);
    - v̂: d_j = x_j − μ̂ (u), d_j² (3u in all), a sum of K nonnegative terms in any order
      (γ_{K−1}, relative to the sum), ÷K (2u): v̂ = V'·(1 + θ_{K+4}) with
      V' = Σ (x_j − μ̂)² / K = v + (μ − μ̂)² exactly (Σ (x_j − μ) = 0), so
      |v̂ − v| ≤ (K + 4)·u·v + A, A = Δμ² (to first order; v̂ ≥ 0 always);
    - ρ̂: t̂ = v̂ + eps (u·t), then rsqrt (2·n_rsqrt·u) or 1/sqrt (2·n_sqrt·u + 2u), c_ρ·u
      (`_rstd_error`): |ρ̂ − ρ| ≤ ρ·(½·((K + 5)·u + A/t) + c_ρ·u), where
      t = v + eps ≥ eps + R²/(2K), R = max x − min x of the row (K·v ≥ R²/2).
    Where the squares or the division underflow (bfloat16 values in float32) each adds half a
    subnormal unit: A and Δμ carry (K + 4) and (K + 2) units, a subnormal ρ̂ c_ρ units. Each
    e is SAFETY·1.02 times its sum (the 1.02 covers the products of two or more of the
    relative errors, each at most 1/128 below), with A/t taken at the tensor's largest M and
    smallest R (an upper bound for every row), so the three bounds are relative to the results
    and the rows' M (`Affine`, evaluated in the band pass). eps is the target value the op
    reads (the interceptor rounds a Python float argument to the target, SPEC §3.3).

    The rule holds where eps ≥ 0 (else v/t, which the variance's term takes as at most 1, is
    unbounded: a negative eps can cancel the variance), every first-order relative term is at
    most 1/128: ((K + 5)/2 + c_ρ)·u and A/t (A at the largest M over eps + R²/(2K) at the
    smallest R, which must be positive), and K·M² + eps is below a quarter of the compute
    dtype's largest value (no square, sum or v̂ + eps overflows). The extremes are exact
    selections and the test IEEE operations on them in Python floats, so every party decides
    alike."""
    policy = PrecisionPolicy.of_unit_roundoff(unit_roundoff)
    x, dims = args[0], list(args[1])
    eps = policy.scalar_rounder(float(args[2]))  # as the op reads it (the interceptor rounds it)
    k = math.prod(x.shape[d] for d in dims)
    info = torch.finfo(policy.compute)
    u, tiny, c_rho = unit_roundoff, info.smallest_normal * info.eps, _rstd_error(policy.compute)
    if not x.numel() or ((k + 5) / 2 + c_rho) * u > _COMPOSITE_LIMIT:
        return None
    top, bottom, _ = _row_extremes(x, dims)
    m = torch.maximum(top.abs(), bottom.abs())
    m_max, r_min = float(m.max()), float((top - bottom).min())
    gamma = (k + 1) * u / (1 - (k + 1) * u)  # γ_{K+1}: Δμ exactly, not to first order
    dmu = gamma * m_max + (k + 2) * tiny
    a = dmu * dmu + (k + 4) * tiny
    t_low = eps + r_min * r_min / (2 * k)
    if not (eps >= 0 and t_low > 0 and a <= t_low * _COMPOSITE_LIMIT
            and k * m_max * m_max + eps <= info.max / 4):
        return None  # (a NaN M, R or eps fails every comparison)
    slack = SAFETY * _SLACK
    rstd_scale = slack * (0.5 * ((k + 5) * u + a / t_low) + c_rho * u)
    bounds: list[Bound] = [Affine(slack * gamma, slack * (k + 2) * tiny, m),
                           Affine(slack * (k + 4) * u, slack * a),
                           Affine(rstd_scale, SAFETY * c_rho * tiny)]
    return Rule("norm-stats", lambda ctx, func, wide_args, wide_kwargs, ys: bounds)


def _norm_backward_stats(ctx, func, args, kwargs, ys) -> list[Bound]:
    """norm_backward_stats(g, x, μ̂, dims) -> (Σ g, Σ g·(x − μ̂)) over rows of K elements, μ̂
    an input (a rounded mean): the first a K-term sum, γ_K·Σ |g|; the second's terms round
    twice (x − μ̂, then the product) before a K-term sum in any order: γ_{K+1}·Σ |g|·|x − μ̂|
    ≤ γ_{K+1}·G·D, G = Σ |g| and D = max |x − μ̂| of the row (Higham §3.1, as `sum_bound`;
    a product of bfloat16 values may underflow in float32: its K subnormal units). Where it
    does not hold `rule_of` declines (`_norm_backward_stats_rule`)."""
    g, x, mean, dims = args[0], args[1], _f64(args[2]), list(args[3])
    k = math.prod(x.shape[d] for d in dims)
    top, bottom, total = _row_extremes(x, dims, g)
    assert total is not None
    spread = torch.maximum((top - mean).abs_(), (bottom - mean).abs_())
    return [ctx.sum_bound(k, total), ctx.sum_bound(k + 1, total * spread)]


_NORM_BACKWARD_STATS = Rule("norm-backward-stats", _norm_backward_stats)


def _row_extremes(x: torch.Tensor, dims: list[int], g: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """max x, min x (NaN where a NaN is among them) and, with `g`, Σ |g| over `dims`, kept as
    dimensions of one, in float64: one C++ read of `x` and `g` (`torch.ops.ovt.row_extremes`)
    where `normops.rows_view` serves (a layer norm's rows, a batch norm's channels) and `g`
    has `x`'s layout, else torch ops. The extremes are exact in any order, and the sum is a
    bound's (`SAFETY`)."""
    view = normops.rows_view(x, dims)
    if view is not None and (g is None or (g.shape == x.shape and g.dtype == x.dtype
                                           and g.is_contiguous())):
        kept = normops.kept_shape(x, dims)
        top, bottom, total = torch.ops.ovt.row_extremes(x, g, *view)
        return top.reshape(kept), bottom.reshape(kept), \
            None if g is None else total.reshape(kept)
    return (_f64(x.amax(dims, keepdim=True)), _f64(x.amin(dims, keepdim=True)),
            None if g is None else _f64(g).abs().sum(dims, keepdim=True))


def _norm_backward_stats_rule(args: tuple, unit_roundoff: float) -> Rule | None:
    """norm_backward_stats's rule where it holds, else None (decomposed): a nonempty input,
    the mean constant along the reduced dimensions (a dimension of one there, as the rule's D
    assumes) and, in a float32 compute dtype, K·max |g|·(max |x| + max |μ̂|) below a quarter
    of its largest value, so that no difference, product or partial sum overflows in any order
    (in float64 no product or sum of K float32 values can). A decision on shapes and exact
    selections, the same on every party."""
    g, x, mean, dims = args[0], args[1], args[2], list(args[3])
    if not x.numel() or mean.dim() != x.dim() or any(mean.shape[d] != 1 for d in dims):
        return None  # (an empty row has no extremes: its sums run as primitives)
    compute = PrecisionPolicy.of_unit_roundoff(unit_roundoff).compute
    if compute == torch.float64:
        return _NORM_BACKWARD_STATS
    k = math.prod(x.shape[d] for d in dims)
    mean_top = float(_f64(mean).abs().max()) if mean.numel() else 0.0
    top = float(_f64(g).abs().max()) * (float(_f64(x).abs().max()) + mean_top)
    return _NORM_BACKWARD_STATS if k * top <= torch.finfo(compute).max / 4 else None


# -- the table ---------------------------------------------------------------------------------

def _table() -> dict[str, Rule]:
    table: dict[str, Rule] = {}

    def add(names: Sequence[str], rule: Rule, foreach: bool = False) -> None:
        for name in names:
            for variant in (name, name + "_"):
                table[variant] = rule
                if foreach:
                    table["_foreach_" + variant] = Rule(rule.name, _foreach(rule.fn),
                                                        rule.reads_inputs, rule.elementwise)

    add(["mul"], Rule("zero", _zero, reads_inputs=False, elementwise=True), foreach=True)
    add(["add", "sub", "rsub"], Rule("axpy", _axpy), foreach=True)
    for name, ulps in _MAX_ULPS.items():  # (sqrt's, where its inputs are not target values)
        add([name], Rule(f"relative({ulps} ulp)", _relative(ulps, _FLOOR_NORMALS.get(name, 0.0)),
                         reads_inputs=False, elementwise=True), foreach=True)
    add(["lerp"], Rule("lerp", _lerp), foreach=True)  # tensor weights; else FIXED_FORMULA
    add(["sum"], Rule("sum", _sum))
    add(["mean"], Rule("mean", _linear(_mean_count)))
    add(["cumsum"], Rule("cumsum", _linear(_cumsum_count)))
    add(["embedding_dense_backward"], Rule("embedding-backward", _embedding_backward))
    add(["index_add"], Rule("index-add", _linear(_source_count(3, "source", 2))))
    add(["scatter_add"], Rule("scatter-add", _linear(_source_count(3, "src", 1))))
    add(["index_put"], Rule("index-put-accumulate", _linear(_index_put_count)))
    add(["avg_pool1d", "avg_pool2d", "avg_pool3d"], Rule("avg-pool", _linear(_pool_count)))
    add(["_adaptive_avg_pool2d", "_adaptive_avg_pool2d_backward"],
        Rule("adaptive-avg-pool", _linear(_adaptive_pool_count)))
    add(["mm"], Rule("mm", _mm))
    add(["addmm"], Rule("addmm", _addmm))
    add(["bmm"], Rule("bmm", _bmm))
    add(["baddbmm"], Rule("baddbmm", _baddbmm))
    add(["mv"], Rule("mv", _mv))
    add(["addmv"], Rule("addmv", _addmv))
    add(["dot", "vdot"], Rule("dot", _dot))
    add(["convolution"], Rule("convolution", _convolution, at_positions=True))
    add(["convolution_backward"], Rule("convolution-backward", _convolution_backward))
    add(["arange"], Rule("arange", _arange, reads_inputs=False))
    add(["linspace"], Rule("linspace", _linspace, reads_inputs=False))
    return table


# Composite ops with own rules, and the first-order coefficient `rule_of` limits.
_COMPOSITE: dict[str, tuple[Rule, Callable[[tuple, dict], float]]] = {
    name: (Rule(rule, fn, unsigned_zero=True), terms) for name, rule, fn, terms in (
        ("_log_softmax", "log-softmax", _log_softmax, _row_terms),
        ("_softmax_backward_data", "softmax-backward", _softmax_backward,
         _softmax_backward_terms),
        ("_log_softmax_backward_data", "log-softmax-backward", _log_softmax_backward,
         _softmax_backward_terms),
        ("gelu", "gelu", _gelu, _gelu_terms), ("gelu_", "gelu", _gelu, _gelu_terms),
        ("gelu_backward", "gelu-backward", _gelu_backward, _gelu_terms),
        ("native_layer_norm_backward", "layer-norm-backward", _layer_norm_backward,
         _layer_norm_backward_terms))}


_RULES = _table()
_ZERO = _RULES["mul"]

# A square root of target-dtype values (`SQRT_MARGIN_ULPS`), single or foreach (`_zero` gives
# one e = 0 per result), in place or not.
_CORRECTLY_ROUNDING = Rule("correctly-rounding", _zero, reads_inputs=False, elementwise=True)
_ROOTS = frozenset({"sqrt", "sqrt_"})  # (and their `_foreach_` forms)
# A quotient of target-dtype values (`QUOTIENT_MARGIN_ULPS`), single or foreach.
_QUOTIENT = Rule("quotient", _quotient, reads_inputs=False, elementwise=True)
_QUOTIENT_FOREACH = Rule("quotient", _foreach(_quotient), reads_inputs=False, elementwise=True)
_QUOTIENTS = frozenset({"div", "div_"})  # (and their `_foreach_` forms)

# The rule of a fixed-formula op (`protocol.engine.pointwise.is_fixed`): ovt computes it as a
# fixed sequence of correctly rounded IEEE operations, the same bits on every conforming
# machine (IEEE-754 §5.4.1, as `_zero`), so e = 0. The interceptor gives it before `rule_of`.
FIXED_FORMULA = Rule("fixed-formula", _zero, reads_inputs=False)

# prims reach the interceptor only from decompositions; the few used there have rules.
_PRIMS = {prims.sum.default: _RULES["sum"], prims.div.default: _RULES["div"]}

# avg_pool backward: each input gradient sums the shares of the windows containing it.
_RULES["avg_pool2d_backward"] = Rule(
    "avg-pool-backward", _linear(lambda args, kwargs, y: _window(args[2]) + 1))


def rule_of(func: torch._ops.OpOverload, args: tuple, kwargs: dict,
            unit_roundoff: float = 2.0**-53) -> Rule | None:
    """The bound rule of one op call, or None (then it is decomposed or refused).
    `unit_roundoff` is the compute dtype's u: a composite op's rule holds where its
    first-order error is at most `_COMPOSITE_LIMIT`, which depends on it, the row length and,
    for softmax and norm statistics, the rows' extremes (a decision on shapes and input values,
    which every party holds bit for bit, so every party decides alike). The answer for an op
    whose rule reads no argument is kept (`_FIXED_RULES`): the interceptor asks at every site."""
    fixed = _FIXED_RULES.get(id(func))
    if fixed is not None:
        return fixed[1]
    if func == normops.NORM_STATS:
        return _norm_stats_rule(args, unit_roundoff)
    if func == normops.NORM_BACKWARD_STATS:
        return _norm_backward_stats_rule(args, unit_roundoff)
    name = func.overloadpacket.__name__
    if name == "_softmax":
        return _softmax_rule(args, unit_roundoff)
    composite = _COMPOSITE.get(name)
    if composite is not None:
        own, terms = composite
        return own if terms(args, kwargs) * unit_roundoff <= _COMPOSITE_LIMIT else None
    family = name.removeprefix("_foreach_")
    if family in _ROOTS and _roots_round_correctly(args, unit_roundoff):
        return _CORRECTLY_ROUNDING
    if family in _QUOTIENTS and _arg(args, kwargs, 2, "rounding_mode", None) is None and \
            _quotients_round_correctly(args, kwargs, unit_roundoff):
        return _QUOTIENT if family == name else _QUOTIENT_FOREACH
    rule = _RULES.get(name)
    if rule is not None and rule.name == "axpy" and _arg(args, kwargs, 2, "alpha", 1) == 1:
        return _ZERO  # one IEEE add or subtract: nothing to read
    if name in _INDEX_PUTS and not _arg(args, kwargs, 3, "accumulate", False):
        return None  # index_put without accumulate is exact (optable)
    if name in ("div", "div_") and _arg(args, kwargs, 2, "rounding_mode", None) is not None:
        return None  # floor/trunc division: no rule (a floor amplifies any error)
    if family not in _ROOTS and family not in _QUOTIENTS and name not in _INDEX_PUTS and \
            (rule is None or rule.name != "axpy"):  # none of the branches above read args
        _FIXED_RULES[id(func)] = (func, rule)
    return rule


# Rules that `rule_of` found without reading a call's arguments, by the op's identity: each
# entry holds its op, so that the id stays its own (overloads live as long as torch's registry).
_FIXED_RULES: dict[int, tuple[torch._ops.OpOverload, Rule | None]] = {
    id(func): (func, rule) for func, rule in (
        *_PRIMS.items(), (normops.NORMALIZE, FIXED_FORMULA),
        (normops.NORMALIZE_BACKWARD, FIXED_FORMULA))}  # (IEEE operations: `normops`)
_INDEX_PUTS = frozenset({"index_put", "index_put_"})


def _roots_round_correctly(args: tuple, unit_roundoff: float) -> bool:
    """Whether a square root's inputs (a tensor, or a foreach op's list of them) are all of a
    target dtype whose roots round correctly in this compute dtype (`SQRT_MARGIN_ULPS`): a
    decision on dtypes, which every party holds alike."""
    x = args[0] if args else None
    tensors = x if isinstance(x, (list, tuple)) else [x]
    return all(isinstance(t, torch.Tensor) and (unit_roundoff, t.dtype) in _ROOTS_ROUND_CORRECTLY
               for t in tensors)


def _quotients_round_correctly(args: tuple, kwargs: dict, unit_roundoff: float) -> bool:
    """Whether a division's dividends and divisors are all target values of a target dtype
    whose quotients round correctly in this compute dtype (`QUOTIENT_MARGIN_ULPS`): tensors of
    that dtype, Python floats (rounded to it before use, SPEC §3.3) or integers it holds
    exactly. A decision on dtypes and scalars, which every party holds alike."""
    a = args[0] if args else None
    b = args[1] if len(args) > 1 else kwargs.get("other")
    dividends = a if isinstance(a, (list, tuple)) else [a]
    dtypes = {t.dtype if isinstance(t, torch.Tensor) else None for t in dividends}
    if len(dtypes) != 1:
        return not dividends  # (an empty foreach list: no quotient at all)
    (target,) = dtypes
    if target is None or (unit_roundoff, target) not in _QUOTIENTS_ROUND_CORRECTLY:
        return False
    divisors = b if isinstance(b, (list, tuple)) else [b]
    return all(_target_number(v, target) for v in divisors)


def _target_number(v, target: torch.dtype) -> bool:
    """A divisor that is a `target` value: a tensor of that dtype, a Python float (rounded to
    it before use), or an integer it holds exactly."""
    if isinstance(v, torch.Tensor):
        return v.dtype == target
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, float) or holds_integer(target, v)
