"""The own rules of norm_stats and norm_backward_stats against an exact reference,
adversarially (SPEC §3.2.1).

`torch.ops.ovt.norm_stats(x, dims, eps)` (protocol/engine/normops.py) gives each row's mean μ̂,
biased variance v̂ (two-pass: the squared deviations from the computed mean) and
ρ̂ = rsqrt(v̂ + eps), and its rule (`bounds._norm_stats_rule`) claims: every implementation of
that algorithm family (the sums in any order and blocking, a division by K or a multiply by a
rounded 1/K, rsqrt or 1/sqrt) lands within `e / 2` of the exact μ, v and ρ of every row, where
`rule_of` gives the rule at all. Here that is asserted for every element of the three results,
decided exactly (μ and v in rationals, ρ = (v + eps)^(−1/2) in mpmath at 200 bits from the
exact v and the eps the interceptor passes, Python's float rounded to the target), for these
machines:

- the op itself on the compute dtype, with one and two threads;
- the engine's emulated hardware (`SplitK`: its sums split and recombined, 1/K multiplied,
  rstd as 1/sqrt), where it has a form of the op;
- the formulas written out in numpy, per row, with sequential sums in several orders (given,
  reversed, increasing, decreasing) and numpy's pairwise sum, each with a division by K and
  with a multiply by a rounded 1/K, and ρ̂ as 1/sqrt(t̂), as an rsqrt at the ULP table's limit
  (the float within n_rsqrt ULPs of rsqrt(t̂) farthest from the exact ρ), as a sqrt at its
  table limit then a division, and as sqrt(1/t̂) (1.5·u, inside 1/sqrt's allowance; not a form
  the docstring names, and run only where 1/t̂ does not overflow);
- one rounding of the exact values;
- CUDA's kernels where a GPU is present.

The inputs are float32-representable rows of several lengths K, laid out as layer norm reads
them (the last dimension of a 2-D tensor) and as batch norm does (dims [0, 2, 3] of an NCHW
tensor): normal data; means far from a small spread (1e4 + a few ULPs, 2**20 + a few ULPs,
2**40 and 1e30 + a few ULPs, two-valued rows one ULP apart); constant rows with eps > 0 (and
a constant 1e8 with eps 1e-12, where the rule declines from some K on); huge (1e30, near
float32's largest) and tiny (1e-30, float32 subnormals) values with small and zero eps; one
dominant element; mixed magnitudes; K − 1 copies of one value and one other, picked so that
a sequential sum of the squared deviations rounds alike at every step (the sum's worst case);
constant rows with eps = 0, which the rule must decline.
The same is run under the float32 -> bfloat16 policy (float32 compute, bfloat16 inputs, where
the squares can underflow and the rule's subnormal floors matter).

Where the rule applies is asserted too, against the docstring's condition evaluated exactly
(`docstring_condition`): no input is skipped that the docstring says is certified.

The bound has teeth: the variance's bound without its (mean error)² term is exceeded by the
engine's emulated hardware on a constant row of 49 elements (49·1.5·fl(1/49) ≠ 1.5: v = 0,
v̂ = (μ − μ̂)²); rstd's bound at a quarter of its value is exceeded by an rsqrt at the ULP
table's limit (K = 1), and the variance's and rstd's at nine tenths of e / 2 by a plain
sequential sum in decreasing order of K − 1 equal small terms after a large one (K = 768):
e / 2 is the proof's bound nearly as it stands. The mean's bound is not shown to be that
tight: the largest error seen is about a sixth of e / 2 (float32 values sum exactly in float64
unless their magnitudes are far apart, so only wide rows err, and those by far less than
(K + 1)·u·M).

`test_negative_eps` asks the rule about eps < 0, which nothing forbids: there t = v + eps can
be far smaller than v while eps + R²/(2K) stays positive, and v̂'s relative error is magnified
by v/t in t̂; the rule must then decline or its bounds must hold.

`torch.ops.ovt.norm_backward_stats(g, x, mean, dims)` gives each row's Σ g and Σ g·(x − mean),
mean an input (a target value, broadcast over the row), and its rule
(`bounds._norm_backward_stats`) claims: the first, a K-term sum in any order, within
γ_K·Σ |g|; the second, x − mean and the product each rounded, then a K-term sum in any
order, within γ_{K+1}·Σ |g|·max |x − mean| (e is twice each, plus floors of K and K + 1
smallest subnormals). Asserted for every element against the exact sums
(rationals: differences and products of target values are exact there), on the op with one
and two threads, the `SplitK` profiles (the native op where it has no form of this one), the
formulas in numpy (Σ g and Σ fl(fl(x − mean)·g), sequential in given, reversed, increasing
and decreasing order and in increasing and decreasing magnitude, and numpy's pairwise sum),
one rounding of the exact values and CUDA's kernels where a GPU is present; under both
policies, in both layouts, at K up to 4096, on: normal data; ± pairs of large gradients at
equal x (Σ g and the products cancelling, tiny terms left, shuffled); x near 0 with the mean
±1e8 (x − mean rounds); a mean that is not the row's (beyond its extremes, arbitrary), and one
mean for the whole tensor; magnitudes 2**-40..2**40; huge and tiny values interleaved; float32
subnormal gradients and products among float32 compute's subnormals; zero gradients, x equal
to the mean, zeros throughout; one dominant term; one term of 1 and K − 1 of u ("half-ulp").
Both bounds have teeth: on "half-ulp" a sequential sum from the large term rounds every add
back to 1, an error of (K − 1)·u, past nine tenths of e / 2 (both policies). Under float32
compute a conforming order can overflow where the exact sum is finite, so the rule declines
where K·max |g|·(max |x| + max |mean|) could overflow
(`test_norm_backward_stats_declines_where_float32_compute_could_overflow`). CUDA is one test
for both ops, skipped once without a GPU. The heavy random
sweeps are marked slow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from functools import cache

import mpmath
import numpy as np
import pytest
import torch

from protocol.engine import normops
from protocol.engine.bounds import BoundContext, bounds_for, dense_bound, rule_of
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.splitk import SplitK
from tests.protocol.engine.test_bounds import HAS_CUDA, f32, num_threads, on_cuda

NORM_STATS = normops.NORM_STATS
PREC = 200
# Every float32 (and bfloat16) value times 2**SCALE is an integer: float32's smallest subnormal
# is 2**-149.
SCALE = 149


class Precision:
    """One policy's constants: its compute dtype and numpy's, the unit roundoff, the rule's
    c_ρ from the docstring (rsqrt's 2·n_rsqrt·u or 1/sqrt's 2·n_sqrt·u + 2u, the ULP table's
    n_rsqrt = 2, n_sqrt = 1, doubled in float32), and a rounding of inputs to the target."""

    def __init__(self, policy: PrecisionPolicy) -> None:
        self.policy, self.ctx = policy, BoundContext(policy)
        self.compute = policy.compute
        self.np = np.float64 if self.compute == torch.float64 else np.float32
        self.bits = 53 if self.compute == torch.float64 else 24
        self.u = policy.unit_roundoff
        assert self.u == 2.0 ** -self.bits
        factor = 1 if self.compute == torch.float64 else 2
        self.rsqrt_ulps, self.sqrt_ulps = 2 * factor, 1 * factor
        self.c_rho = max(2 * self.rsqrt_ulps, 2 * self.sqrt_ulps + 2)
        self.tiny = Fraction(policy.tiny)
        self.max = Fraction(float(torch.finfo(self.compute).max))

    def target(self, values) -> np.ndarray:
        """Target-representable float64 values (one rounding)."""
        if self.policy.target == torch.float32:
            return f32(values)
        t = torch.as_tensor(np.asarray(values, dtype=np.float64))
        return t.to(torch.float32).to(torch.bfloat16).double().numpy()

    def eps(self, eps: float) -> float:
        """The eps the interceptor passes: the Python float rounded to the target."""
        return float(self.target([eps])[0])


F64 = Precision(PrecisionPolicy())
F32 = Precision(PrecisionPolicy(torch.float32, torch.bfloat16))


# -- inputs ------------------------------------------------------------------------------------

# kind -> (eps, whether the rule must apply under the float64 policy at every K > 1)
KINDS: dict[str, tuple[float, bool]] = {
    "normal": (1e-5, True),
    "normal-eps0": (0.0, True),
    "offset-1e4": (1e-5, True),        # 1e4 + a few float32 ULPs (2**-10)
    "offset-2**20": (1e-5, True),      # 2**20 + a few ULPs, straddling the binade
    "offset-2**40": (0.0, True),
    "offset-1e30": (0.0, True),
    "two-values": (0.0, True),         # a and its next float32, half each: v = R²/4
    "constant": (1e-5, True),          # R = 0, t = eps
    "constant-offset": (1e-5, True),   # 1e4 + 1/3 (rounded), R = 0
    "constant-1e8-eps-1e-12": (1e-12, False),  # Δμ² against eps: declined from some K on
    "constant-eps0": (0.0, False),     # t = 0: declined
    "zeros-eps0": (0.0, False),
    "huge": (1e-5, True),              # 1e30·normal
    "near-max": (0.0, True),           # near float32's largest, both signs
    "tiny": (0.0, True),               # 1e-30·normal
    "tiny-eps": (1e-5, True),
    "subnormal": (0.0, True),          # float32 subnormals (K > 1: some spread in each row)
    "dominant": (1e-5, True),          # one element 1e6 among 1e-3·normal
    "mixed": (1e-5, True),             # magnitudes 2**-40 .. 2**40, both signs
    "one-off": (1e-5, True),           # K − 1 copies of c and one a (`one_off_rows`)
}
LENGTHS = [1, 2, 7, 49, 128, 768, 4096]
LAYOUTS = ["layer", "batch"]
# batch norm's rows: K = N·H·W for an NCHW tensor of C channels
BATCH = {1: (1, 1, 1), 2: (2, 1, 1), 3: (3, 1, 1), 5: (1, 1, 5), 7: (7, 1, 1), 49: (1, 7, 7),
         128: (2, 8, 8), 768: (3, 16, 16), 1000: (10, 10, 10), 4096: (4, 32, 32)}
ROWS = 3


def make_rows(kind: str, k: int, seed: int, prec: Precision = F64) -> np.ndarray:
    """ROWS target-representable rows of length `k`, by kind."""
    rng = np.random.default_rng(seed)
    shape = (ROWS, k)
    ulps = rng.integers(-3, 4, shape).astype(np.float64)
    ulps[:, 0], ulps[:, -1] = -3, 3  # every row of K > 1 has some spread
    if kind.startswith("normal"):
        v = rng.standard_normal(shape) * 3
    elif kind == "offset-1e4":
        v = 1e4 + ulps * 2.0**-10 if prec is F64 else 1e4 + ulps * 64
    elif kind == "offset-2**20":
        v = 2.0**20 + ulps * (2.0**-4 if prec is F64 else 2.0**12)
    elif kind == "offset-2**40":
        v = 2.0**40 + ulps * (2.0**16 if prec is F64 else 2.0**32)
    elif kind == "offset-1e30":
        v = 1e30 * (1 + ulps * 2.0**-23)
    elif kind == "two-values":
        a = float(prec.target([12345.678])[0])  # 2**13 <= a < 2**14
        step = 2.0 ** (13 - (23 if prec is F64 else 7))  # the target's ULP there
        v = np.broadcast_to(np.where(np.arange(k) % 2 == 0, a, a + step), shape).copy()
    elif kind == "constant":
        v = np.full(shape, 1.5)
    elif kind == "constant-offset":
        v = np.full(shape, 1e4 + 1 / 3)
    elif kind == "constant-1e8-eps-1e-12":
        v = np.full(shape, 1e8 + 8)
    elif kind == "constant-eps0":
        v = np.full(shape, -2.75)
    elif kind == "zeros-eps0":
        v = np.zeros(shape)
    elif kind == "huge":
        v = rng.standard_normal(shape) * 1e30
    elif kind == "near-max":
        v = 3.3e38 - rng.uniform(0, 3e37, shape)
        v[1] = -v[1]
        v[2, ::2] = -v[2, ::2]
    elif kind.startswith("tiny"):
        v = rng.standard_normal(shape) * 1e-30
    elif kind == "subnormal":
        v = rng.integers(-1000, 1000, shape) * 2.0**-149
        v[:, 0], v[:, -1] = -(2.0**-140), 2.0**-141
    elif kind == "dominant":
        v = rng.standard_normal(shape) * 1e-3
        v[:, k // 2] = 1e6
    elif kind == "mixed":
        v = rng.choice([-1.0, 1.0], shape) * rng.uniform(1, 2, shape) * \
            np.ldexp(1.0, rng.integers(-40, 40, shape))
    elif kind == "one-off":
        v = one_off_rows(k, rng, prec)
    elif kind == "underflow-squares":  # float32 compute: the squares land among subnormals
        v = rng.standard_normal(shape) * 2.0**-66
    else:
        raise AssertionError(kind)
    return prec.target(v)


def one_off_rows(k: int, rng: np.random.Generator, prec: Precision) -> np.ndarray:
    """K − 1 copies of c and one a: the K − 1 equal squared deviations (a − c)²/K², summed
    after the large one, each round the same way (their fraction of an ULP of the partial
    sum is the same), the sum's worst case (K − 1)·u. Of 256 random (c, a) the ROWS whose
    variance a sequential sum in decreasing order gets most wrong. One scale for all rows: the
    rule's M and R are the tensor's extremes."""
    scale = np.ldexp(1.0, rng.integers(-20, 20))
    pairs = prec.target(rng.uniform(1, 2, (256, 2)) * scale)
    v = np.repeat(pairs[:, :1], k, axis=1)
    v[:, k // 3] = pairs[:, 1]
    if k < 3:
        return v[:ROWS]
    _, var, _ = formula_stats(v, 0.0, "decreasing", False, prec)
    exact = [Fraction(float(a) - float(c)) ** 2 * (k - 1) / (k * k) for c, a in pairs]
    error = [abs(Fraction(float(y)) - x) / x if x else Fraction(0)
             for y, x in zip(var.tolist(), exact, strict=True)]
    return v[np.argsort(np.array([float(e) for e in error]))[::-1][:ROWS]]


def layout(rows: np.ndarray, kind: str) -> tuple[np.ndarray, list[int]]:
    """The op's input holding `rows` as rows: (rows, K) along dim 1 for layer norm; an NCHW
    tensor with channel c's N·H·W elements, in memory order, = row c for batch norm."""
    if kind == "layer":
        return rows, [1]
    n, h, w = BATCH[rows.shape[1]]
    return np.ascontiguousarray(rows.reshape(-1, n, h, w).transpose(1, 0, 2, 3)), [0, 2, 3]


def out_shape(x: np.ndarray, dims: list[int]) -> tuple[int, ...]:
    return tuple(1 if d in dims else s for d, s in enumerate(x.shape))


# -- exact values ------------------------------------------------------------------------------

def exact_stats(rows: np.ndarray, eps: float) -> list[list]:
    """[μ per row, v per row] as rationals and [ρ per row] in mpmath: v = (K·Σ n² − (Σ n)²) /
    K² with the row's elements n·2**-SCALE, integers n; ρ = (v + eps)^(−1/2) at PREC bits."""
    means, variances, rstds = [], [], []
    k = rows.shape[1]
    for row in rows:
        n = [int(v) for v in np.ldexp(row, SCALE)]
        assert Fraction(n[0], 2**SCALE) == Fraction(float(row[0]))  # (ldexp was exact)
        s, q = sum(n), sum(a * a for a in n)
        means.append(Fraction(s, k << SCALE))
        var = Fraction(k * q - s * s, (k * k) << (2 * SCALE))
        variances.append(var)
        t = var + Fraction(eps)
        with mpmath.workprec(PREC):
            rstds.append(1 / mpmath.sqrt(mpmath.mpf(t.numerator) / t.denominator)
                         if t else mpmath.inf)
    return [means, variances, rstds]


def docstring_condition(rows: np.ndarray, eps: float, prec: Precision) -> bool | None:
    """Whether the rule applies, by its docstring, in exact arithmetic: ((K + 5)/2 + c_ρ)·u ≤
    1/128, A = ((K + 1)·u·M + (K + 2)·tiny)² + (K + 4)·tiny ≤ (eps + R²/(2K)) / 128 with M the
    largest |x| and R the smallest row range of the tensor, that bound positive, and
    K·M² ≤ max/4. None within a relative 1e-9 of a threshold (the rule decides in floats)."""
    k = rows.shape[1]
    u = Fraction(prec.u)
    m = max(Fraction(float(v)) for v in np.abs(rows).max(axis=1))
    r = min(Fraction(float(a)) - Fraction(float(b))
            for a, b in zip(rows.max(axis=1), rows.min(axis=1), strict=True))
    if (Fraction(k + 5, 2) + prec.c_rho) * u > Fraction(1, 128):
        return False
    a = ((k + 1) * u * m + (k + 2) * prec.tiny) ** 2 + (k + 4) * prec.tiny
    t_low = Fraction(eps) + r * r / (2 * k)
    if t_low <= 0:
        return False
    ratios = [a * 128 / t_low, k * m * m * 4 / prec.max]
    if any(abs(ratio - 1) < Fraction(1, 10**9) for ratio in ratios):
        return None
    return all(ratio <= 1 for ratio in ratios)


# -- machines ----------------------------------------------------------------------------------
# Each takes (x, dims, eps) (x a numpy array of the op's layout, eps the Python float the
# interceptor passes) and gives [mean, var, rstd] in the compute dtype, each of the op's
# (keepdim) result shape.

Machine = Callable[[np.ndarray, list[int], float], list[np.ndarray]]


def tensor(x: np.ndarray, prec: Precision) -> torch.Tensor:
    return torch.from_numpy(np.array(x, dtype=np.float64, copy=True)).to(prec.compute)


def native(threads: int, prec: Precision) -> Machine:
    def run(x, dims, eps):
        with num_threads(threads):
            return [t.numpy() for t in NORM_STATS(tensor(x, prec), dims, eps)]
    return run


def emulated(splitk: SplitK, prec: Precision) -> Machine:
    def run(x, dims, eps):
        return [t.numpy() for t in splitk(NORM_STATS, (tensor(x, prec), dims, eps), {})]
    return run


def cuda(prec: Precision) -> Machine:
    def run(x, dims, eps):
        return [t.numpy() for t in on_cuda(NORM_STATS, (tensor(x, prec), dims, eps), {})]
    return run


def machines(x: np.ndarray, dims: list[int], eps: float, rows: np.ndarray, exact, prec,
             emulated_too: bool = True) -> dict:
    """Every machine's three results on one case: the native op with one and two threads, the
    emulated GPU's forms (`EMULATED`), and the formulas written out in numpy."""
    runs = {f"native-{n}t": native(n, prec)(x, dims, eps) for n in (1, 2)}
    if emulated_too:
        runs.update({repr(s): emulated(s, prec)(x, dims, eps) for s in EMULATED})
    runs.update(formula_runs(rows, out_shape(x, dims), eps, exact, prec))
    return runs


def rows_of(x: np.ndarray, dims: list[int]) -> np.ndarray:
    """The (rows, K) view back from the op's layout (the inverse of `layout`)."""
    if dims == [1]:
        return x
    return x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1)


def ordered(v: np.ndarray, order: str) -> np.ndarray:
    if order == "given":
        return v
    if order == "reversed":
        return v[:, ::-1]
    if order == "increasing":
        return np.sort(v, axis=1)
    return np.sort(v, axis=1)[:, ::-1]


SUM_ORDERS = ("given", "reversed", "increasing", "decreasing", "pairwise")


def row_sum(v: np.ndarray, order: str) -> np.ndarray:
    """Each row's sum: sequential in `order` (numpy's cumsum adds one term at a time, in the
    array's dtype), or numpy's pairwise sum."""
    if order == "pairwise":
        return np.add.reduce(np.ascontiguousarray(v), axis=1)
    return np.cumsum(ordered(v, order), axis=1, dtype=v.dtype)[:, -1]


def formula_stats(rows: np.ndarray, eps: float, order: str, reciprocal: bool,
                  prec: Precision) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(μ̂, v̂, t̂ = v̂ + eps) per row in the compute dtype: the sums in `order`, then ÷K or
    ×fl(1/K) (`reciprocal`)."""
    dt = prec.np
    a = rows.astype(dt)
    k = dt(rows.shape[1])
    inverse = dt(1) / k

    def scale(s: np.ndarray) -> np.ndarray:
        return s * inverse if reciprocal else s / k
    mean = scale(row_sum(a, order))
    d = a - mean[:, None]
    var = scale(row_sum(d * d, order))
    return mean, var, var + dt(eps)


def ulp(r: mpmath.mpf, bits: int) -> mpmath.mpf:
    """The spacing of `bits`-bit floats at r > 0 (normal numbers)."""
    _, e = mpmath.frexp(r)
    return mpmath.ldexp(1, int(e) - bits)


def farthest_within(r: mpmath.mpf, ulps: int, exact: mpmath.mpf, prec: Precision) -> float:
    """The float within `ulps` ULPs of r (the ULP at r) farthest from `exact`: what a function
    at the ULP table's limit may return for a true value r."""
    with mpmath.workprec(PREC):
        step = ulp(r, prec.bits)
        direction = 1 if r >= exact else -1
        y = r + direction * ulps * step
        # round toward r: the float nearest y on r's side
        y32 = prec.np(float(y))
        if direction * (mpmath.mpf(float(y32)) - y) > 0:
            y32 = np.nextafter(y32, prec.np(float(r)))
        assert abs(mpmath.mpf(float(y32)) - r) <= ulps * step
        return float(y32)


def rstd_forms(t: np.ndarray, exact_rstd: list, prec: Precision) -> dict[str, np.ndarray]:
    """ρ̂ from t̂ per row: 1/sqrt, sqrt(1/t), an rsqrt at the ULP table's limit, a sqrt at its
    limit then a correctly rounded division."""
    dt = prec.np
    out = {"1/sqrt": dt(1) / np.sqrt(t)}
    if np.isfinite(dt(1) / t).all():  # (not the docstring's form: it overflows where t̂ is
        out["sqrt(1/t)"] = np.sqrt(dt(1) / t)  # below 1/max, a float32 subnormal variance)
    limit, sqrt_limit = [], []
    with mpmath.workprec(PREC):
        for ti, rho in zip(t.tolist(), exact_rstd, strict=True):
            if ti <= 0:  # (declined by the rule: not judged)
                limit.append(math.inf)
                sqrt_limit.append(math.inf)
                continue
            root = mpmath.sqrt(mpmath.mpf(ti))
            limit.append(farthest_within(1 / root, prec.rsqrt_ulps, rho, prec))
            s = farthest_within(root, prec.sqrt_ulps, 1 / rho, prec)
            sqrt_limit.append(float(dt(1) / dt(s)))
    out["rsqrt-at-limit"] = np.array(limit, dtype=dt)
    out["sqrt-at-limit"] = np.array(sqrt_limit, dtype=dt)
    return out


def fraction(value) -> Fraction:
    """A Fraction or a finite mpf as a Fraction, exactly."""
    if isinstance(value, Fraction):
        return value
    man, exp = value.man_exp
    return Fraction(int(man)) * Fraction(2) ** int(exp)


def rounded(value, prec: Precision) -> float:
    """`value` (a Fraction or an mpf) rounded once to the compute dtype, to nearest."""
    exact = fraction(value)
    y = prec.np(float(value))
    best = y
    for n in (np.nextafter(y, prec.np(-np.inf)), np.nextafter(y, prec.np(np.inf))):
        if abs(Fraction(float(n)) - exact) < abs(Fraction(float(best)) - exact):
            best = n
    return float(best)


def formula_runs(rows: np.ndarray, shape: tuple, eps: float, exact: list[list],
                 prec: Precision) -> dict[str, list[np.ndarray]]:
    """Every numpy form and the rounded-once values, as [mean, var, rstd] of the op's shape."""
    runs = {}
    with np.errstate(all="ignore"):
        for order in SUM_ORDERS:
            for reciprocal in (False, True):
                mean, var, t = formula_stats(rows, eps, order, reciprocal, prec)
                name = f"{order}-{'x1/K' if reciprocal else '/K'}"
                for form, rstd in rstd_forms(t, exact[2], prec).items():
                    runs[f"{name}-{form}"] = [y.reshape(shape) for y in (mean, var, rstd)]
    with mpmath.workprec(PREC):
        runs["rounded-once"] = [np.array([rounded(v, prec) for v in part], dtype=prec.np)
                                .reshape(shape) for part in exact]
    return runs


# -- the judge ---------------------------------------------------------------------------------

NAMES = ("mean", "var", "rstd")


def bounds_of(prec: Precision, rule, x: np.ndarray, dims: list[int], eps: float,
              ys: list[np.ndarray]) -> list[np.ndarray]:
    """e per element of each result, as the interceptor computes it for these results."""
    args = (tensor(x, prec), dims, eps)
    tys = [torch.from_numpy(np.array(y, dtype=prec.np)) for y in ys]
    out = []
    for b, y in zip(bounds_for(prec.ctx, rule, NORM_STATS, args, {}, tys), tys, strict=True):
        e = dense_bound(b, y)
        e = torch.zeros(()) if e is None else torch.as_tensor(e)
        out.append(np.broadcast_to(e.double().numpy(), y.shape).ravel())
    return out


def judge(label: str, y: np.ndarray, e: np.ndarray, exact: list) -> float:
    """Assert |y − exact| ≤ e / 2 for every element, exactly; the largest ratio to e / 2."""
    worst, failures = 0.0, []
    for yi, ei, xi in zip(y.ravel().tolist(), e.tolist(), exact, strict=True):
        if not math.isfinite(yi) or not math.isfinite(ei):
            failures.append(f"y={yi!r} e={ei!r}")
            continue
        if isinstance(xi, Fraction):
            diff, half = abs(Fraction(yi) - xi), Fraction(ei) / 2
        else:
            with mpmath.workprec(PREC):
                diff, half = abs(mpmath.mpf(yi) - xi), mpmath.mpf(ei) / 2
        if diff > half:
            failures.append(f"y={yi!r} exact~{float(xi)!r} |diff|~{float(diff):.4g} "
                            f"e/2={float(half):.4g} ratio={float(diff / half):.4g}")
        elif half:
            worst = max(worst, float(diff / half))
        elif diff:
            failures.append(f"y={yi!r} exact={float(xi)!r} with e = 0")
    assert not failures, f"bound exceeded: {label}, {len(failures)} elements; " + \
        "; ".join(failures[:4])
    return worst


@cache
def case(kind: str, k: int, lay: str, seed: int, prec: Precision = F64):
    """(x, dims, eps, rows, exact, rule) of one input, rounded as the interceptor rounds it."""
    eps = prec.eps(KINDS.get(kind, (0.0, True))[0])
    rows = make_rows(kind, k, seed, prec)
    x, dims = layout(rows, lay)
    assert np.array_equal(rows_of(x, dims), rows)
    rule = rule_of(NORM_STATS, (tensor(x, prec), dims, eps), {}, prec.u)
    return x, dims, eps, rows, exact_stats(rows, eps), rule


def check(label: str, prec: Precision, x, dims, eps, rule, exact,
          runs: dict[str, list[np.ndarray]]) -> float:
    """Every run's three results within e / 2 of the exact values; the largest ratio."""
    worst = 0.0
    for machine, ys in runs.items():
        es = bounds_of(prec, rule, x, dims, eps, ys)
        for name, y, e, ex in zip(NAMES, ys, es, exact, strict=True):
            assert y.shape == out_shape(x, dims), (machine, name, y.shape)
            worst = max(worst, judge(f"{label} {name} on {machine}", y, e, ex))
    return worst


def certified(kind: str, k: int, lay: str, seed: int, prec: Precision):
    """The case, its rule asserted to agree with the docstring's condition; None where the
    rule (rightly) declines."""
    x, dims, eps, rows, exact, rule = case(kind, k, lay, seed, prec)
    expected = docstring_condition(rows, eps, prec)
    if expected is not None:
        assert (rule is not None) == expected, (kind, k, lay, "rule", rule, "docstring", expected)
    if prec is F64 and KINDS[kind][1] and k > 1:
        assert rule is not None, (kind, k, lay)
    return None if rule is None else (x, dims, eps, rows, exact, rule)


# -- float64 compute (the default policy) ------------------------------------------------------

@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("k", LENGTHS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_norm_stats_native_and_formulas(kind, k, lay, own_arithmetic):
    got = certified(kind, k, lay, seed=k, prec=F64)
    if got is None:
        return  # declined, as the docstring says (asserted by `certified`)
    x, dims, eps, rows, exact, rule = got
    runs = machines(x, dims, eps, rows, exact, F64, emulated_too=False)  # (the next test's)
    check(f"{kind} K={k} {lay}", F64, x, dims, eps, rule, exact, runs)


EMULATED = (SplitK(seed=0), SplitK(seed=5, chunks=8, order="pairwise"),
            SplitK(seed=5, chunks=5, order="reversed"))


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("k", LENGTHS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_norm_stats_emulated(kind, k, lay):
    got = certified(kind, k, lay, seed=k, prec=F64)
    if got is None:
        return
    x, dims, eps, rows, exact, rule = got
    runs = {repr(s): emulated(s, F64)(x, dims, eps) for s in EMULATED}
    check(f"{kind} K={k} {lay}", F64, x, dims, eps, rule, exact, runs)


def test_where_the_rule_declines():
    """Constant rows with eps = 0 (t = 0: ρ infinite) are declined at every K, in both
    layouts and both policies; so is a constant 1e8 with eps 1e-12 once Δμ² = ((K + 1)·u·M)²
    passes eps/128, and so is a single element of 1e30 with eps 1e-5, and float32 compute's
    squares of 1e30 (K·M² past a quarter of the largest float32); ordinary rows with eps 1e-5
    are certified at every length."""
    for k in LENGTHS:
        for lay in LAYOUTS:
            for kind in ("constant-eps0", "zeros-eps0"):
                for prec in (F64, F32):
                    assert case(kind, k, lay, 0, prec)[-1] is None, (kind, k, lay)
            assert case("normal", k, lay, 0, F64)[-1] is not None
            assert case("normal", k, lay, 0, F32)[-1] is not None, (k, lay)
            # 1e30·normal: a spread (K > 1) certifies it in float64; a single element has
            # R = 0 and Δμ² ≈ (2u·1e30)² far above eps
            assert (case("huge", k, lay, 0, F64)[-1] is not None) == (k > 1)
            assert case("huge", k, lay, 0, F32)[-1] is None
    # a constant 1e8: certified for short rows, declined for long ones
    assert case("constant-1e8-eps-1e-12", 2, "layer", 0)[-1] is not None
    assert case("constant-1e8-eps-1e-12", 128, "layer", 0)[-1] is None
    # K = 1 with eps = 0 has no spread: declined; with eps > 0 certified
    assert case("normal-eps0", 1, "layer", 0)[-1] is None
    assert case("normal", 1, "layer", 0)[-1] is not None
    # one zero-spread row with eps = 0 declines the whole tensor (R is the smallest range)
    x = np.vstack([make_rows("normal", 64, 0), np.full((1, 64), 3.0)])
    assert rule_of(NORM_STATS, (tensor(x, F64), [1], 0.0), {}, F64.u) is None
    assert rule_of(NORM_STATS, (tensor(x[:-1], F64), [1], 0.0), {}, F64.u) is not None
    # an infinite or NaN element anywhere, or a NaN eps, declines it too; so does an empty x
    for bad in (math.inf, -math.inf, math.nan):
        y = x[:-1].copy()
        y[1, 5] = bad
        assert rule_of(NORM_STATS, (tensor(y, F64), [1], 1e-5), {}, F64.u) is None, bad
    assert rule_of(NORM_STATS, (tensor(x[:-1], F64), [1], math.nan), {}, F64.u) is None
    assert rule_of(NORM_STATS, (torch.zeros(0, 5, dtype=torch.float64), [1], 1e-5), {},
                   F64.u) is None


@pytest.mark.parametrize("k", [3, 7, 768])
def test_negative_eps(k):
    """Nothing keeps eps non-negative (layer_norm and batch_norm pass any float). With
    eps < 0, t = v + eps can be far below v while eps + R²/(2K) stays positive (a row
    [−1, 1, 0, ..., 0] has v = R²/(2K) exactly, so t = t_low), and v̂'s relative error
    (K + 4)·u is magnified by v/t in t̂ = v̂ + eps: the docstring's step |v̂ − v|/t ≤
    (K + 4)·u + A/t needs v ≤ t, i.e. eps ≥ 0. Either the rule declines such an eps or its
    bounds hold on every machine."""
    x = np.zeros((1, k))
    x[0, :2] = -1.0, 1.0
    eps = float(f32([-2 / k * (1 - 2.0**-20)])[0])  # t = 2/K + eps ≈ 2**-20·v
    rule = rule_of(NORM_STATS, (tensor(x, F64), [1], eps), {}, F64.u)
    if rule is None:
        return
    exact = exact_stats(x, eps)
    runs = machines(x, [1], eps, x, exact, F64)
    check(f"eps={eps!r} K={k}", F64, x, [1], eps, rule, exact, runs)


# -- float32 compute (the float32 -> bfloat16 policy) ------------------------------------------

KINDS_F32 = ["normal", "normal-eps0", "offset-1e4", "offset-2**20", "two-values", "constant",
             "constant-offset", "constant-eps0", "huge", "tiny", "tiny-eps", "dominant",
             "mixed", "one-off", "underflow-squares"]


@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("k", [1, 2, 7, 49, 768, 4096])
@pytest.mark.parametrize("kind", KINDS_F32)
def test_norm_stats_float32_compute(kind, k, lay):
    got = certified(kind, k, lay, seed=k, prec=F32)
    if got is None:
        return
    x, dims, eps, rows, exact, rule = got
    runs = machines(x, dims, eps, rows, exact, F32)
    check(f"{kind} K={k} {lay} (float32 compute)", F32, x, dims, eps, rule, exact, runs)


# -- teeth -------------------------------------------------------------------------------------

def test_variance_bound_needs_its_mean_error_term():
    """A constant row of 49 × 1.5 has v = 0, but μ̂ = 49·1.5·fl(1/49) = 1.5 − 2**-52 for a
    machine that multiplies by a rounded 1/K (the engine's emulated hardware does): v̂ =
    (μ − μ̂)², which the variance's bound holds only through its (mean error)² term A. Without
    A (only (K + 4)·u·v̂ left) it is exceeded."""
    x, dims, eps, rows, exact, rule = case("constant", 49, "batch", 0)
    assert rule is not None and exact[1] == [0, 0, 0]
    runs = {"emulated": emulated(SplitK(seed=0), F64)(x, dims, eps),
            "numpy-x1/K": formula_runs(rows, out_shape(x, dims), eps, exact, F64)
            ["given-x1/K-1/sqrt"]}
    for machine, ys in runs.items():
        assert (ys[1] > 0).all(), machine
        e = bounds_of(F64, rule, x, dims, eps, ys)
        judge(f"var on {machine}", ys[1], e[1], exact[1])
        slack = 2 * 1.02
        without_a = slack * (49 + 4) * F64.u * np.abs(ys[1]).ravel()
        assert (without_a < e[1]).all()
        with pytest.raises(AssertionError, match="bound exceeded"):
            judge(f"var on {machine}", ys[1], without_a, exact[1])


def test_rstd_bound_at_a_quarter_is_exceeded():
    """rstd's bound is not four times too wide: for K = 1 (v̂ = 0 exactly, t̂ = eps) an rsqrt
    at the ULP table's limit (2 ULPs in float64) errs by about 2 ULPs of ρ, and a quarter of
    the bound, 1.02·(3 + 4)·u·ρ̂ / 4, is less where ρ's significand is near 1."""
    eps = 0.25 * (1 - 2.0**-20)  # ρ = 2·(1 + 2**-21 + ...): ULP(ρ)/ρ ≈ 2u
    x = np.array([[0.5], [-3.0], [1e4]])
    rule = rule_of(NORM_STATS, (tensor(x, F64), [1], eps), {}, F64.u)
    assert rule is not None
    exact = exact_stats(x, eps)
    runs = formula_runs(x, (3, 1), eps, exact, F64)
    ys = runs["given-/K-rsqrt-at-limit"]
    e = bounds_of(F64, rule, x, [1], eps, ys)
    judge("rstd at the limit", ys[2], e[2], exact[2])
    with pytest.raises(AssertionError, match="bound exceeded"):
        judge("rstd at the limit", ys[2], e[2] / 4, exact[2])


@pytest.mark.parametrize("prec, kind, k, fraction", [
    (F64, "one-off", 768, 0.9), (F32, "one-off", 128, 0.7),
    (F64, "subnormal", 4096, 0.25), (F32, "mixed", 4096, 0.25)],
    ids=["float64-one-off", "float32-one-off", "float64-subnormal", "float32-mixed"])
def test_variance_and_rstd_bounds_are_nearly_reached(prec, kind, k, fraction):
    """The (K + 4)·u·v̂ and (K + 5)·u·ρ̂/2 terms are nearly reached by a plain sequential sum
    of the squared deviations in decreasing order (then ÷K and 1/sqrt): on K − 1 copies of c
    and one a (`one_off_rows`: the K − 1 equal small terms round alike, the sum's worst case)
    its errors pass nine tenths of e / 2 in float64 (seven tenths in float32 compute), and a
    quarter on float32 subnormals in float64 (the squares carry ~46 bits) and on mixed
    magnitudes in float32 compute. So e / 2 is the proof's bound nearly as it stands: only
    the safety factor 2 of e lies beyond it."""
    x, dims, eps, rows, exact, rule = case(kind, k, "layer", k, prec)
    assert rule is not None
    ys = formula_runs(rows, out_shape(x, dims), eps, exact, prec)["decreasing-/K-1/sqrt"]
    es = bounds_of(prec, rule, x, dims, eps, ys)
    for i in (1, 2):
        judge(f"{NAMES[i]} decreasing", ys[i], es[i], exact[i])
        with pytest.raises(AssertionError, match="bound exceeded"):
            judge(f"{NAMES[i]} decreasing", ys[i], es[i] * fraction, exact[i])


# -- the heavy sweep ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("prec", [F64, F32], ids=["float64", "float32"])
def test_random_sweep(prec):
    """Many seeds of every kind at lengths beyond the fast set's, every machine; prints the
    largest |error| / (e / 2) seen per result."""
    kinds = list(KINDS) if prec is F64 else KINDS_F32
    worst = 0.0
    for seed in range(1, 6):
        for kind in kinds:
            for k in (3, 5, 49, 1000):
                for lay in LAYOUTS:
                    got = certified(kind, k, lay, seed=seed, prec=prec)
                    if got is None:
                        continue
                    x, dims, eps, rows, exact, rule = got
                    runs = machines(x, dims, eps, rows, exact, prec)
                    worst = max(worst, check(f"{kind} K={k} {lay} seed={seed}", prec, x,
                                             dims, eps, rule, exact, runs))
    print(f"norm_stats {prec.compute}: worst |error| / (e/2) = {worst:.3g}")


# == norm_backward_stats ========================================================================

NORM_BACKWARD_STATS = normops.NORM_BACKWARD_STATS
BACKWARD_NAMES = ("sum_grad", "sum_product")
BACKWARD_KINDS = ["normal", "cancel", "far-mean", "wrong-mean", "shared-mean", "mixed",
                  "huge-tiny", "subnormal", "underflow", "zeros", "dominant", "half-ulp"]
BACKWARD_LENGTHS = [1, 2, 7, 49, 768, 4096]


def backward_rows(kind: str, k: int, seed: int, prec: Precision = F64
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(g, x, mean): ROWS target-representable rows of g and of x, of length `k`, and each
    row's mean (an input of the op: a target value, by default the rounded row mean of x, by
    kind anything else). Magnitudes stay where float32 compute's products and sums of bfloat16
    values cannot overflow (`big`)."""
    rng = np.random.default_rng(seed)
    shape = (ROWS, k)
    big = 1e30 if prec is F64 else 1e15
    g = rng.standard_normal(shape)
    x = rng.standard_normal(shape) * 3 + 1
    mean = None
    if kind in ("normal", "shared-mean"):
        pass
    elif kind == "cancel":
        # ± pairs of large g over widely spread binades, each pair at one x (so the products
        # cancel too), and one or two tiny terms, shuffled: Σ g and Σ g·(x − mean) are tiny
        # against Σ |g| and Σ |g|·|x − mean|, and the partial sums round
        pairs = (k - 1) // 2
        a = prec.target(rng.standard_normal((ROWS, pairs)) * 1e4 *
                        np.ldexp(1.0, rng.integers(-10, 10, (ROWS, pairs))))
        b = prec.target(rng.standard_normal((ROWS, pairs)) * 10 + 100)
        rest = k - 2 * pairs
        g = np.hstack([a, -a, rng.standard_normal((ROWS, rest)) * 1e-7])
        x = np.hstack([b, b, rng.standard_normal((ROWS, rest)) * 10 + 100])
        order = rng.permutation(k)
        g, x = g[:, order], x[:, order]
    elif kind == "far-mean":
        # x near 0 (down to 2**-44), the mean ±1e8: x − mean rounds
        x = rng.standard_normal(shape) * 2.0**-20
        mean = np.array([1e8, -1e8, 3e9])[:ROWS]
    elif kind == "wrong-mean":
        # not the row's mean: beyond its maximum, below its minimum, arbitrary
        mean = np.array([x[0].max() + 7.25, x[1].min() - 1e3, rng.uniform(-50, 50)])
    elif kind == "mixed":
        g, x = (rng.choice([-1.0, 1.0], shape) * rng.uniform(1, 2, shape) *
                np.ldexp(1.0, rng.integers(-40, 40, shape)) for _ in range(2))
    elif kind == "huge-tiny":
        g = rng.standard_normal(shape) * np.where(np.arange(k) % 2 == 0, big, 1 / big)
        x = rng.standard_normal(shape) * np.where(np.arange(k) % 3 == 0, big, 1 / big)
    elif kind == "subnormal":  # float32 subnormal g: products in the compute dtype's subnormals
        g = rng.integers(-1000, 1000, shape) * 2.0**-149
        g[:, 0] = 2.0**-140
    elif kind == "underflow":  # products near 2**-140: float32 compute's subnormals
        g = rng.standard_normal(shape) * 2.0**-70
        x = rng.standard_normal(shape) * 2.0**-70
    elif kind == "zeros":
        # no gradient; x equal to the mean; half the gradient zero, x and the mean zero
        g[0] = 0.0
        x[1], g[2, ::2], x[2] = -2.75, 0.0, 0.0
        mean = np.array([0.5, -2.75, 0.0])
    elif kind == "dominant":
        g = rng.standard_normal(shape) * 1e-3
        g[:, k // 2] = 1e6
        x[:, k // 3] = 1e5
    elif kind == "half-ulp":
        # the sums' worst case: one term of 1 then K − 1 terms of u, each a tie of the
        # partial sum 1 that rounds back to it in a sequential sum from the large term on
        g = np.full(shape, prec.u)
        g[:, 0] = 1.0
        x = np.full(shape, 1.5)
        mean = np.full(ROWS, 0.5)
    else:
        raise AssertionError(kind)
    g, x = prec.target(g), prec.target(x)
    if mean is None:
        mean = x.mean(axis=1) if kind != "shared-mean" else np.full(ROWS, x.mean())
    return g, x, prec.target(mean)


def exact_backward(g_rows: np.ndarray, x_rows: np.ndarray, means: np.ndarray) -> list[list]:
    """[Σ g per row, Σ g·(x − mean) per row] as rationals: every value n·2**-SCALE, n an
    integer."""
    def ints(v):
        n = [int(a) for a in np.ldexp(np.asarray(v, dtype=np.float64).ravel(), SCALE)]
        assert Fraction(n[0], 2**SCALE) == Fraction(float(np.ravel(v)[0]))  # (exact ldexp)
        return n
    sums, products = [], []
    for g, x, (m,) in zip(g_rows, x_rows, (ints([m]) for m in means), strict=True):
        gn, xn = ints(g), ints(x)
        sums.append(Fraction(sum(gn), 1 << SCALE))
        products.append(Fraction(sum(a * (b - m) for a, b in zip(gn, xn, strict=True)),
                                 1 << (2 * SCALE)))
    return [sums, products]


def target_tensor(v: np.ndarray, prec: Precision) -> torch.Tensor:
    """The target-dtype tensor of target-representable values (what the interceptor holds)."""
    return torch.from_numpy(np.array(v, dtype=np.float64, copy=True)).to(
        torch.float32).to(prec.policy.target)


@cache
def backward_case(kind: str, k: int, lay: str, seed: int, prec: Precision = F64):
    """(g, x, mean, dims, rows, exact, rule) of one input in the op's layout; rows = (g rows, x
    rows, means). The mean is kept as a dimension of one over `dims` (one value for the whole
    tensor, shaped all ones, for "shared-mean")."""
    g_rows, x_rows, means = backward_rows(kind, k, seed, prec)
    g, dims = layout(g_rows, lay)
    x, _ = layout(x_rows, lay)
    if kind == "shared-mean":
        mean = means[:1].reshape((1,) * x.ndim)
    else:
        mean = means.reshape(out_shape(x, dims))
    rule = rule_of(NORM_BACKWARD_STATS, (*(target_tensor(v, prec) for v in (g, x, mean)), dims),
                   {}, prec.u)
    assert rule is not None, (kind, k, lay)  # (no condition: it always applies)
    return g, x, mean, dims, (g_rows, x_rows, means), exact_backward(g_rows, x_rows, means), rule


def backward_args(prec: Precision, g, x, mean, dims) -> tuple:
    return tensor(g, prec), tensor(x, prec), tensor(mean, prec), dims


def backward_native(threads: int, prec: Precision, g, x, mean, dims) -> list[np.ndarray]:
    with num_threads(threads):
        return [t.numpy() for t in NORM_BACKWARD_STATS(*backward_args(prec, g, x, mean, dims))]


def backward_emulated(splitk: SplitK, prec: Precision, g, x, mean, dims) -> list[np.ndarray]:
    """`SplitK`'s form of the op, or the native op where it has none."""
    out = splitk(NORM_BACKWARD_STATS, backward_args(prec, g, x, mean, dims), {})
    return [t.numpy() for t in out]


def backward_sum(v: np.ndarray, order: str) -> np.ndarray:
    """`row_sum`, and sequential sums in increasing or decreasing order of magnitude."""
    if not order.startswith("magnitude"):
        return row_sum(v, order)
    index = np.argsort(np.abs(v), axis=1, kind="stable")
    if order.endswith("decreasing"):
        index = index[:, ::-1]
    return np.cumsum(np.take_along_axis(v, index, axis=1), axis=1, dtype=v.dtype)[:, -1]


BACKWARD_ORDERS = (*SUM_ORDERS, "magnitude-increasing", "magnitude-decreasing")


def backward_formula_runs(rows: tuple, shape: tuple, exact: list[list], prec: Precision
                          ) -> dict[str, list[np.ndarray]]:
    """The formulas in numpy per row, in the compute dtype: Σ g and Σ fl(fl(x − mean)·g), each
    sum sequential in every order of `BACKWARD_ORDERS` or numpy's pairwise; and the exact values
    rounded once."""
    g_rows, x_rows, means = rows
    dt = prec.np
    g = g_rows.astype(dt)
    runs = {}
    with np.errstate(all="ignore"):
        product = (x_rows.astype(dt) - means.astype(dt)[:, None]) * g
        for order in BACKWARD_ORDERS:
            runs[order] = [backward_sum(g, order).reshape(shape),
                           backward_sum(product, order).reshape(shape)]
    runs["rounded-once"] = [np.array([rounded(v, prec) for v in part], dtype=dt).reshape(shape)
                            for part in exact]
    return runs


def backward_bounds(prec: Precision, rule, g, x, mean, dims, ys: list[np.ndarray]
                    ) -> list[np.ndarray]:
    """e per element of the two results, as the interceptor computes it (the rule on the
    compute dtype's arguments)."""
    tys = [torch.from_numpy(np.array(y, dtype=prec.np)) for y in ys]
    out = []
    for b, y in zip(bounds_for(prec.ctx, rule, NORM_BACKWARD_STATS,
                               backward_args(prec, g, x, mean, dims), {}, tys), tys, strict=True):
        e = dense_bound(b, y)
        e = torch.zeros(()) if e is None else torch.as_tensor(e)
        out.append(np.broadcast_to(e.double().numpy(), y.shape).ravel())
    return out


def backward_check(label: str, prec: Precision, case_: tuple,
                   runs: dict[str, list[np.ndarray]]) -> float:
    """Every run's two results within e / 2 of the exact sums; the largest ratio."""
    g, x, mean, dims, _, exact, rule = case_
    worst = 0.0
    for machine, ys in runs.items():
        es = backward_bounds(prec, rule, g, x, mean, dims, ys)
        for name, y, e, ex in zip(BACKWARD_NAMES, ys, es, exact, strict=True):
            assert y.shape == out_shape(x, dims), (machine, name, y.shape)
            worst = max(worst, judge(f"{label} {name} on {machine}", y, e, ex))
    return worst


def backward_runs(prec: Precision, case_: tuple) -> dict[str, list[np.ndarray]]:
    """Every CPU machine's results on one case."""
    g, x, mean, dims, rows, exact, _ = case_
    runs = {f"native-{n}t": backward_native(n, prec, g, x, mean, dims) for n in (1, 2)}
    handled = NORM_BACKWARD_STATS in getattr(SplitK(seed=0), "_handlers", {})
    runs.update({repr(s) + ("" if handled else " (native)"):
                 backward_emulated(s, prec, g, x, mean, dims) for s in EMULATED})
    runs.update(backward_formula_runs(rows, out_shape(x, dims), exact, prec))
    return runs


@pytest.mark.parametrize("prec", [F64, F32], ids=["float64", "float32"])
@pytest.mark.parametrize("lay", LAYOUTS)
@pytest.mark.parametrize("k", BACKWARD_LENGTHS)
@pytest.mark.parametrize("kind", BACKWARD_KINDS)
def test_norm_backward_stats(kind, k, lay, prec, own_arithmetic):
    case_ = backward_case(kind, k, lay, seed=k, prec=prec)
    backward_check(f"{kind} K={k} {lay} ({prec.compute})", prec, case_,
                   backward_runs(prec, case_))


@pytest.mark.parametrize("prec", [F64, F32], ids=["float64", "float32"])
def test_norm_backward_stats_bounds_are_nearly_reached(prec, own_arithmetic):
    """Both bounds are the proofs' nearly as they stand: on one term of 1 then K − 1 terms of
    u (K = 768, "half-ulp"), a sequential sum in decreasing order rounds every add back to 1,
    an error of (K − 1)·u against e / 2 = γ_K·Σ |g| (Σ g) and γ_{K+1}·Σ |g|·max |x − mean|
    (Σ g·(x − mean), x − mean = 1 exactly): nine tenths of e / 2 are exceeded."""
    case_ = backward_case("half-ulp", 768, "layer", 0, prec)
    g, x, mean, dims, rows, exact, rule = case_
    ys = backward_formula_runs(rows, out_shape(x, dims), exact, prec)["decreasing"]
    es = backward_bounds(prec, rule, g, x, mean, dims, ys)
    for name, y, e, ex in zip(BACKWARD_NAMES, ys, es, exact, strict=True):
        assert judge(f"{name} decreasing", y, e, ex) > 0.99
        with pytest.raises(AssertionError, match="bound exceeded"):
            judge(f"{name} decreasing", y, e * 0.9, ex)


def test_norm_backward_stats_declines_where_float32_compute_could_overflow():
    """g = [1, 1, −1], x = 2e38 (bfloat16-rounded), mean = 0, float32 compute: the products
    are ±p, p ≈ 2e38; in the given order p + p overflows to inf, in the reversed order
    (−p + p) + p = p, the exact value. No finite bound covers both, so the rule declines where
    K·max |g|·(max |x| + max |mean|) could overflow (the op then runs as its primitives);
    float64 compute, where nothing can overflow, keeps it. A mean that varies along the
    reduced dimensions (the rule's D assumes one per row) is declined too."""
    prec = F32
    g = prec.target(np.array([[1.0, 1.0, -1.0]]))
    x = prec.target(np.full((1, 3), 2e38))
    mean = np.zeros((1, 1))
    rows = (g, x, mean.ravel())
    exact = exact_backward(*rows)
    runs = backward_formula_runs(rows, (1, 1), exact, prec)
    assert np.isfinite(runs["reversed"][1]).all() and np.isinf(runs["given"][1]).all()
    args = (*(target_tensor(v, prec) for v in (g, x, mean)), [1])
    assert rule_of(NORM_BACKWARD_STATS, args, {}, prec.u) is None
    assert rule_of(NORM_BACKWARD_STATS, args, {}, F64.u) is not None
    x4 = torch.ones(4, 3, 2, 2)
    assert rule_of(NORM_BACKWARD_STATS, (x4, x4, torch.zeros(4, 1, 1, 1), [0, 2, 3]), {},
                   F64.u) is None
    assert rule_of(NORM_BACKWARD_STATS, (x4, x4, torch.zeros(1, 3, 1, 1), [0, 2, 3]), {},
                   F64.u) is not None


@pytest.mark.slow
@pytest.mark.parametrize("prec", [F64, F32], ids=["float64", "float32"])
def test_norm_backward_stats_random_sweep(prec):
    """Many seeds of every kind at lengths beyond the fast set's, every machine; prints the
    largest |error| / (e/2) seen per policy."""
    worst = 0.0
    for seed in range(1, 6):
        for kind in BACKWARD_KINDS:
            for k in (3, 5, 49, 1000):
                for lay in LAYOUTS:
                    case_ = backward_case(kind, k, lay, seed=seed, prec=prec)
                    worst = max(worst, backward_check(f"{kind} K={k} {lay} seed={seed}", prec,
                                                      case_, backward_runs(prec, case_)))
    print(f"norm_backward_stats {prec.compute}: worst |error| / (e/2) = {worst:.3g}")


# -- CUDA --------------------------------------------------------------------------------------

def test_on_cuda():
    """CUDA's kernels as one more machine, for both ops under both policies on every input of
    the fast sets (norm_stats where its rule applies); skipped once where no GPU is present."""
    if not HAS_CUDA:
        pytest.skip("no CUDA device")
    for kind in KINDS:
        for k in LENGTHS:
            for lay in LAYOUTS:
                for prec in (F64, F32):
                    got = certified(kind, k, lay, seed=k, prec=prec)
                    if got is not None:
                        x, dims, eps, rows, exact, rule = got
                        check(f"{kind} K={k} {lay} ({prec.compute})", prec, x, dims, eps, rule,
                              exact, {"cuda": cuda(prec)(x, dims, eps)})
    for kind in BACKWARD_KINDS:
        for k in BACKWARD_LENGTHS:
            for lay in LAYOUTS:
                for prec in (F64, F32):
                    case_ = backward_case(kind, k, lay, seed=k, prec=prec)
                    g, x, mean, dims = case_[:4]
                    out = on_cuda(NORM_BACKWARD_STATS, backward_args(prec, g, x, mean, dims), {})
                    backward_check(f"{kind} K={k} {lay} ({prec.compute})", prec, case_,
                                   {"cuda": [t.numpy() for t in out]})
