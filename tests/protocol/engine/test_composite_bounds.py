"""The own rules of composite ops against an exact reference, adversarially (SPEC §3.2.1).

The softmax family (`_softmax`, `_log_softmax` and their backwards), GELU (its exact form, and
its backward) and layer norm's backward carry their own rules in bounds version 3 instead of
being decomposed. Each rule claims: every implementation of the op's algorithm family
(protocol/engine/bounds.py: two-pass, online or log-sum-exp softmax, any summation order, a
division or a reciprocal and a multiply; GELU through erf or erfc; layer norm's backward in
ATen's CPU form or the decomposition's; FMA or not) lands within `e / 2` of the exact result.
Here that is asserted for every element, decided in mpmath at 200 bits (the backwards of
softmax and layer norm in rationals, exactly), for these machines:

- the native float64 kernels with one and two threads, along the last dimension and along
  another one (ATen's vectorised last-dimension kernel and its strided one), or, elementwise,
  on a strided view (ATen's scalar loop);
- the engine's emulated hardware (`SplitK`: another form of each op, its sums split);
- the formulas written out in numpy, per row, with their sums sequential in several orders
  (given, reversed, increasing and decreasing), and the other forms of each (online softmax
  with the row sorted increasing: a new maximum at every element, the most rescales;
  exp(x − M − log s); t·(1/s); x − (M + log s); g·y − y·s; GELU as x·erfc(−x/√2)/2 and as
  x·(0.5 + 0.5·erf)); one rounding of the exact value, what an FMA-based kernel at its best
  gives;
- CUDA's kernels where a GPU is present.

The inputs are adversarial: wide ranges where exp underflows, a huge maximum (log-softmax's
u·|M| term), a maximum with a long fraction beside tiny values (the rounding of x − M),
ties at the maximum, constant rows, one dominant element, near-cancelling gradients; GELU's
negative tail (1 + erf cancels) down to underflow, its backward's zero crossing, subnormal
and huge inputs; layer norm rows with a mean far from a small spread, near-constant gradients,
mixed magnitudes and zero weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction

import mpmath
import numpy as np
import pytest
import torch

from protocol.engine.bounds import BoundContext, bounds_for, dense_bound, rule_of
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.splitk import SplitK
from tests.protocol.engine.test_bounds import HAS_CUDA, f32, num_threads, on_cuda, t64

aten = torch.ops.aten
POLICY = PrecisionPolicy()
CTX = BoundContext(POLICY)
mpmath.mp.prec = 200
ORDERS = ("given", "reversed", "increasing", "decreasing")


def rows(kind: str, k: int, seed: int, n: int = 3) -> np.ndarray:
    """`n` float32-representable rows of length `k`, by kind."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        v = rng.standard_normal((n, k)) * 3
    elif kind == "wide":  # exp underflows for most of the row
        v = rng.uniform(-800, 0, (n, k))
    elif kind == "huge":  # |M| near float32's largest: log-softmax's u·|M|
        v = 3e38 - rng.uniform(0, 1e32, (n, k))
        v[1] = -v[1]
    elif kind == "ties-at-2**52":  # M + log 5 rounds to an integer: the u·|M| term, realised
        v = np.full((n, k), 2.0**52 - 2.0**30)
        v[:, :5] = 2.0**52
    elif kind == "long-max":  # x − M inexact: a maximum with a long fraction, tiny others
        v = rng.standard_normal((n, k)) * 1e-30
        v[:, 0] = 700.5 + 2.0**-14
        v[1, 0] = 30.25 + 2.0**-18
    elif kind == "ties":
        v = rng.choice([0.0, -1.0, -0.5], (n, k))
        v[:, :3] = 2.0
    elif kind == "constant":
        v = np.full((n, k), 1.5)
    elif kind == "dominant":
        v = np.full((n, k), -30.0)
        v[:, k // 2] = 0.0
    elif kind == "mixed":
        v = rng.choice([-1.0, 1.0], (n, k)) * rng.uniform(1, 2, (n, k)) * \
            np.ldexp(1.0, rng.integers(-40, 8, (n, k)))
    elif kind == "masked":  # a causal mask's −inf beside finite scores
        v = rng.standard_normal((n, k)) * 3
        v[:, 1::2] = -np.inf
    elif kind == "far-max":  # M far from zero: exp(x − (M + log s)) rounds M + log s
        v = 100003.0 - rng.choice([0.0, 1.0, 2.0, 0.5], (n, k))
    else:
        raise AssertionError(kind)
    return f32(v)


KINDS = ["normal", "wide", "huge", "ties-at-2**52", "long-max", "ties", "constant", "dominant",
         "mixed", "masked", "far-max"]
LENGTHS = [1, 7, 64, pytest.param(1000, marks=pytest.mark.slow)]


def ordered(v: np.ndarray, order: str) -> np.ndarray:
    if order == "given":
        return v
    if order == "reversed":
        return v[::-1]
    if order == "increasing":
        return np.sort(v)
    return np.sort(v)[::-1]


def seq_sum(v: np.ndarray, order: str) -> float:
    """A sequential float64 sum in `order` (numpy's cumsum adds one term at a time)."""
    return float(np.cumsum(ordered(v, order))[-1]) if v.size else 0.0


# -- machines ----------------------------------------------------------------------------------

def native(threads: int, transposed: bool = False) -> Callable:
    """The op's float64 kernel on (rows, K) inputs; `transposed`: on their transpose along
    dim 0 (ATen's strided kernel), the result transposed back."""
    def run(func, tensors: list[torch.Tensor], rest: tuple) -> np.ndarray:
        with num_threads(threads):
            if transposed:
                out = func(*(t.t().contiguous() for t in tensors), 0, *rest[1:]).t()
            else:
                out = func(*tensors, *rest)
        return out.contiguous().numpy()
    return run


def emulated(splitk: SplitK) -> Callable:
    """The engine's emulated hardware (`splitk`): another form of each op, its row sums
    split and combined in another order."""
    def run(func, tensors: list[torch.Tensor], rest: tuple) -> np.ndarray:
        return splitk(func, (*tensors, *rest), {}).numpy()
    return run


NATIVE = {"native-1t": native(1), "native-2t": native(2), "native-dim0": native(1, True),
          **{repr(s): emulated(s) for s in (SplitK(seed=5, chunks=3, order="permuted"),
                                            SplitK(seed=5, chunks=8, order="pairwise"),
                                            SplitK(seed=5, chunks=5, order="reversed"))}}
if HAS_CUDA:
    NATIVE["cuda"] = lambda func, tensors, rest: on_cuda(func, (*tensors, *rest), {}).numpy()


def per_row(formula: Callable[..., np.ndarray]) -> Callable:
    def run(*arrays: np.ndarray) -> np.ndarray:
        return np.stack([formula(*(a[i] for a in arrays)) for i in range(arrays[0].shape[0])])
    return run


def softmax_formulas() -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    for order in ORDERS:
        def two_pass(x, order=order):
            t = np.exp(x - x.max())
            return t / seq_sum(t, order)
        out[f"two-pass-{order}"] = per_row(two_pass)

        def lse(x, order=order):
            m = x.max()
            return np.exp((x - m) - math.log(seq_sum(np.exp(x - m), order)))
        out[f"log-sum-exp-{order}"] = per_row(lse)

    def reciprocal(x):
        t = np.exp(x - x.max())
        return t * (1.0 / seq_sum(t, "given"))

    def folded(x):
        m = x.max()
        return np.exp(x - (m + math.log(seq_sum(np.exp(x - m), "given"))))
    out["folded-log-sum-exp"] = per_row(folded)
    out["reciprocal"] = per_row(reciprocal)
    out["online-increasing"] = per_row(lambda x: online_softmax(x, np.argsort(x)))
    out["online-given"] = per_row(lambda x: online_softmax(x, np.arange(x.size)))
    return out


def online_softmax(x: np.ndarray, visit: np.ndarray) -> np.ndarray:
    """Online softmax (a running maximum; the partial sum rescaled whenever it grows), the
    elements visited in the order `visit`."""
    m, s = -math.inf, 0.0
    for j in visit:
        if x[j] == -math.inf:  # a masked element adds nothing
            continue
        if x[j] > m:
            s = s * math.exp(m - x[j]) if s else 0.0
            m = x[j]
        s += math.exp(x[j] - m)
    return np.exp(x - m) / s


def log_softmax_formulas() -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    for order in ORDERS:
        def shifted(x, order=order):
            m = x.max()
            return (x - m) - math.log(seq_sum(np.exp(x - m), order))
        out[f"shifted-{order}"] = per_row(shifted)

        def folded(x, order=order):
            m = x.max()
            return x - (m + math.log(seq_sum(np.exp(x - m), order)))
        out[f"folded-{order}"] = per_row(folded)

    def online(x):
        m, s = -math.inf, 0.0
        for j in np.argsort(x):
            if x[j] == -math.inf:
                continue
            if x[j] > m:
                s = s * math.exp(m - x[j]) if s else 0.0
                m = x[j]
            s += math.exp(x[j] - m)
        return x - m - math.log(s)
    out["online-increasing"] = per_row(online)
    return out


def fma(a: float, b: float, c: float) -> float:
    """a·b + c with one rounding (Python's float of a Fraction is correctly rounded)."""
    return float(Fraction(a) * Fraction(b) + Fraction(c))


def softmax_backward_formulas() -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    for order in ORDERS:
        out[f"factored-{order}"] = per_row(
            lambda g, y, order=order: y * (g - seq_sum(g * y, order)))
        out[f"expanded-{order}"] = per_row(
            lambda g, y, order=order: g * y - y * seq_sum(g * y, order))
    out["fma"] = per_row(lambda g, y: np.array(
        [fma(-yi, seq_sum(g * y, "given"), gi * yi) for gi, yi in zip(g, y, strict=True)]))
    return out


def log_softmax_backward_formulas() -> dict[str, Callable]:
    out: dict[str, Callable] = {}
    for order in ORDERS:
        out[f"direct-{order}"] = per_row(
            lambda g, y, order=order: g - np.exp(y) * seq_sum(g, order))
    out["fma"] = per_row(lambda g, y: np.array(
        [fma(-math.exp(yi), seq_sum(g, "reversed"), gi) for gi, yi in zip(g, y, strict=True)]))
    return out


# -- exact values ------------------------------------------------------------------------------

def exact_softmax(x: np.ndarray) -> list[mpmath.mpf]:
    xs = [mpmath.mpf(float(v)) for v in x]
    m = max(xs)
    t = [mpmath.exp(v - m) for v in xs]
    s = mpmath.fsum(t)
    return [v / s for v in t]


def exact_log_softmax(x: np.ndarray) -> list[mpmath.mpf]:
    xs = [mpmath.mpf(float(v)) for v in x]
    m = max(xs)
    lse = m + mpmath.log(mpmath.fsum(mpmath.exp(v - m) for v in xs))
    return [v - lse for v in xs]


def exact_softmax_backward(g: np.ndarray, y: np.ndarray) -> list[Fraction]:
    gs, ys = [Fraction(float(v)) for v in g], [Fraction(float(v)) for v in y]
    s = sum((a * b for a, b in zip(gs, ys, strict=True)), Fraction(0))
    return [b * (a - s) for a, b in zip(gs, ys, strict=True)]


def exact_log_softmax_backward(g: np.ndarray, y: np.ndarray) -> list[mpmath.mpf]:
    s = mpmath.fsum(mpmath.mpf(float(v)) for v in g)
    return [mpmath.mpf(float(a)) - mpmath.exp(mpmath.mpf(float(b))) * s
            for a, b in zip(g, y, strict=True)]


# -- the judge ---------------------------------------------------------------------------------

def bound_of(func, tensors: list[torch.Tensor], rest: tuple, y: np.ndarray) -> np.ndarray:
    """e per element of `y`, as the interceptor computes it on these float64 inputs."""
    args = (*tensors, *rest)
    rule = rule_of(func, args, {})
    assert rule is not None, f"{func} has no rule"
    (e,) = bounds_for(CTX, rule, func, args, {}, [t64(y)])
    return np.broadcast_to(torch.as_tensor(dense_bound(e, t64(y))).numpy(), y.shape)


def judge(family: str, machine: str, y: np.ndarray, e: np.ndarray, exact: list) -> float:
    """Assert |y − exact| ≤ e / 2 at every finite element; the largest ratio to e / 2."""
    worst, failures = 0.0, []
    for yi, ei, xi in zip(y.ravel().tolist(), e.ravel().tolist(), exact, strict=True):
        if not math.isfinite(yi):  # no rounding site: only where the exact result is not finite
            assert not mpmath.isfinite(xi) or abs(xi) > np.finfo(np.float64).max, (machine, yi)
            continue
        exact_i = xi if isinstance(xi, Fraction) else None
        diff = abs(Fraction(yi) - exact_i) if exact_i is not None else \
            abs(mpmath.mpf(yi) - xi)
        half = Fraction(ei) / 2 if exact_i is not None else mpmath.mpf(ei) / 2
        if diff > half:
            failures.append(f"y={yi!r} exact~{float(xi)!r} |diff|~{float(diff):.3g} "
                            f"e/2={float(half):.3g}")
        elif half:
            worst = max(worst, float(diff / half))
    assert not failures, (f"bound exceeded: {family} on {machine}, {len(failures)} elements; "
                          + "; ".join(failures[:4]))
    return worst


def check(family: str, func, arrays: list[np.ndarray], rest: tuple, exact_fn: Callable,
          formulas: dict[str, Callable]) -> float:
    """Every machine's results on `arrays` (the op's tensor inputs, (rows, K) each) within
    e / 2 of `exact_fn`'s, row by row; the largest ratio to e / 2 seen."""
    tensors = [t64(a) for a in arrays]
    exact = [v for i in range(arrays[0].shape[0]) for v in exact_fn(*(a[i] for a in arrays))]
    runs = {name: machine(func, tensors, rest) for name, machine in NATIVE.items()}
    with np.errstate(all="ignore"):
        runs.update({name: formula(*arrays) for name, formula in formulas.items()})
    runs["rounded-once"] = np.array([float(v) for v in exact]).reshape(arrays[0].shape)
    worst = 0.0
    for machine, y in runs.items():
        e = bound_of(func, tensors, rest, y)
        worst = max(worst, judge(family, machine, y, e, exact))
    return worst


# -- the tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize("k", LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_softmax_forward(kind, k):
    x = rows(kind, k, seed=k)
    if rule_of(aten._softmax.default, (t64(x), 1, False), {}) is None:
        assert kind in ("huge", "ties-at-2**52")  # u·|M| beyond the first-order limit
    else:
        check("softmax", aten._softmax.default, [x], (1, False), exact_softmax,
              softmax_formulas())
    check("log-softmax", aten._log_softmax.default, [x], (1, False), exact_log_softmax,
          log_softmax_formulas())


def gradients(kind: str, k: int, y: np.ndarray, seed: int) -> np.ndarray:
    """Upstream gradients for softmax outputs `y`: random, near-constant (g_i − s cancels),
    one-hot (the loss's), or of mixed magnitudes."""
    rng = np.random.default_rng(seed)
    n = y.shape[0]
    if kind == "normal":
        g = rng.standard_normal((n, k))
    elif kind == "near-constant":
        g = 1.0 + rng.choice([0.0, 2.0**-20, -(2.0**-21)], (n, k))
    elif kind == "one-hot":
        g = np.zeros((n, k))
        g[np.arange(n), rng.integers(0, k, n)] = -1.0 / 8
    else:
        g = rng.choice([-1.0, 1.0], (n, k)) * np.ldexp(1.0, rng.integers(-60, 60, (n, k)))
    return f32(g)


@pytest.mark.parametrize("k", LENGTHS)
@pytest.mark.parametrize("grad", ["normal", "near-constant", "one-hot", "mixed"])
@pytest.mark.parametrize("kind", ["normal", "wide", "dominant", "ties"])
def test_softmax_backward(kind, grad, k, own_arithmetic):
    x = t64(rows(kind, k, seed=3 * k + 1))
    y = f32(torch.softmax(x, 1).numpy())
    logp = f32(torch.log_softmax(x, 1).numpy())
    g = gradients(grad, k, y, seed=k)
    rest = (1, torch.float64)
    check("softmax-backward", aten._softmax_backward_data.default, [g, y], rest,
          exact_softmax_backward, softmax_backward_formulas())
    check("log-softmax-backward", aten._log_softmax_backward_data.default, [g, logp], rest,
          exact_log_softmax_backward, log_softmax_backward_formulas())


def test_a_bound_without_its_terms_fails():
    """The judge has teeth: the rule's bound with nine tenths of log-softmax's u·|M| term left
    out is exceeded by the folded form x − (M + log s) where M + log 5 rounds to an integer;
    and softmax's bound without its |M| term (the bound of the same rows shifted to M ≈ 0) is
    exceeded by exp(x − (M + log s)) where M is far from zero."""
    x = rows("ties-at-2**52", 7, seed=0)
    tensors, rest = [t64(x)], (1, False)
    func = aten._log_softmax.default
    y = log_softmax_formulas()["folded-given"](x)
    exact = [v for row in x for v in exact_log_softmax(row)]
    e = bound_of(func, tensors, rest, y)
    judge("log-softmax", "folded", y, e, exact)
    top = np.abs(x.max(axis=1, keepdims=True))
    weakened = e - 0.9 * 2 * 1.02 * POLICY.unit_roundoff * top
    with pytest.raises(AssertionError, match="bound exceeded"):
        judge("log-softmax", "folded", y, weakened, exact)
    x = rows("far-max", 64, seed=1)
    y = softmax_formulas()["folded-log-sum-exp"](x)
    exact = [v for row in x for v in exact_softmax(row)]
    judge("softmax", "folded", y, bound_of(aten._softmax.default, [t64(x)], rest, y), exact)
    shifted = bound_of(aten._softmax.default, [t64(x - 100003.0)], rest, y)
    with pytest.raises(AssertionError, match="bound exceeded"):
        judge("softmax", "folded", y, shifted, exact)


def test_rows_beyond_the_first_order_limit_are_decomposed():
    """Where K·u is too large for the first-order proof (float32 compute, a long row),
    `rule_of` gives no rule and the op is decomposed; in float64 any row length qualifies."""
    x = torch.zeros(2, 20000, dtype=torch.float64)
    assert rule_of(aten._softmax.default, (x, 1, False), {}, 2.0**-53) is not None
    assert rule_of(aten._softmax.default, (x, 1, False), {}, 2.0**-24) is None
    assert rule_of(aten._softmax.default, (x[:, :100], 1, False), {}, 2.0**-24) is not None


# -- GELU (the exact form) ---------------------------------------------------------------------

def gelu_inputs(seed: int) -> np.ndarray:
    """x over GELU's regimes: ordinary, the negative tail where 1 + erf cancels (down to where
    the result underflows), the backward's zero crossing near −0.7518, the smallest and
    largest float32 magnitudes."""
    rng = np.random.default_rng(seed)
    return f32(np.concatenate([
        rng.standard_normal(60) * 3, -rng.uniform(4, 12, 30), -rng.uniform(30, 38.5, 10),
        -0.7518 + rng.uniform(-1e-3, 1e-3, 20), [-0.75179, -0.751792, -0.7517915],
        rng.choice([-1.0, 1.0], 10) * np.ldexp(1.0, rng.integers(-149, -120, 10)),
        [0.0, -0.0, 3e38, -3e38, 1e30, -1e30, 7.0, 40.0]]))


def gelu_formulas() -> dict[str, Callable]:
    def erf_form(x):
        return np.array([v * 0.5 * (1.0 + math.erf(v * math.sqrt(0.5))) for v in x])

    def erfc_form(x):
        return np.array([v * (0.5 * math.erfc(-v * math.sqrt(0.5))) for v in x])

    def summed_first(x):
        return np.array([v * (0.5 + 0.5 * math.erf(v * math.sqrt(0.5))) for v in x])
    return {"erf": erf_form, "erfc": erfc_form, "0.5+0.5erf": summed_first}


def gelu_backward_formulas() -> dict[str, Callable]:
    beta = 2 / math.sqrt(math.pi) * math.sqrt(0.5) * 0.5  # (ATen's kBeta)

    def aten_form(g, x):
        return np.array([gi * (0.5 * (1 + math.erf(v * math.sqrt(0.5))) +
                               v * (beta * math.exp(-0.5 * v * v)))
                         for gi, v in zip(g, x, strict=True)])

    def squared_half(g, x):
        return np.array([gi * (0.5 * math.erfc(-v * math.sqrt(0.5)) +
                               v * math.exp(-(v * math.sqrt(0.5)) ** 2) / math.sqrt(2 * math.pi))
                         for gi, v in zip(g, x, strict=True)])
    return {"aten-form": aten_form, "erfc-squared-half": squared_half}


def check_elementwise(family: str, func, arrays: list[np.ndarray], exact: list,
                      formulas: dict[str, Callable]) -> float:
    """`check` for an elementwise op on 1-D inputs: the native kernel (one thread, two threads
    on a copy tiled past the parallel grain, a strided view: ATen's scalar loop), the emulated
    hardware, `formulas`, and the exact value rounded once."""
    tensors = [t64(a) for a in arrays]
    runs: dict[str, np.ndarray] = {}
    with num_threads(1):
        runs["native-1t"] = func(*tensors).numpy()
        runs["native-strided"] = func(*(t64(np.repeat(a, 2))[::2] for a in arrays)).numpy()
    reps = 70000 // arrays[0].size + 1
    with num_threads(2):
        tiled = func(*(t64(np.tile(a, reps)) for a in arrays)).numpy().reshape(reps, -1)
    runs.update({f"native-2t-{i}": row for i, row in enumerate(np.unique(tiled, axis=0))})
    for splitk in (SplitK(seed=5, chunks=3, order="permuted"),):
        runs[repr(splitk)] = splitk(func, tuple(tensors), {}).numpy()
    if HAS_CUDA:
        runs["cuda"] = on_cuda(func, tuple(tensors), {}).numpy()
    with np.errstate(all="ignore"):
        runs.update({name: formula(*arrays) for name, formula in formulas.items()})
    runs["rounded-once"] = np.array([float(v) for v in exact])
    worst = 0.0
    for machine, y in runs.items():
        e = bound_of(func, tensors, (), y)
        worst = max(worst, judge(family, machine, y, e, exact))
    return worst


@pytest.mark.parametrize("seed", [0, 1])
def test_gelu_forward_and_backward(seed):
    x = gelu_inputs(seed)
    g = f32(np.random.default_rng(seed + 9).standard_normal(x.size) *
            np.ldexp(1.0, np.random.default_rng(seed).integers(-20, 20, x.size)))
    xs = [mpmath.mpf(float(v)) for v in x]
    exact = [v * mpmath.ncdf(v) for v in xs]
    check_elementwise("gelu", aten.gelu.default, [x], exact, gelu_formulas())
    exact = [mpmath.mpf(float(a)) * (mpmath.ncdf(v) + v * mpmath.npdf(v))
             for a, v in zip(g, xs, strict=True)]
    check_elementwise("gelu-backward", aten.gelu_backward.default, [g, x], exact,
                      gelu_backward_formulas())


def test_gelu_bound_has_teeth_and_its_tanh_form_is_decomposed():
    """GELU's bound needs its absolute term: where 1 + erf cancels (the tail's results are tiny,
    their errors are not) even a thousand ULPs of the result are exceeded, as a relative rule
    would have it; the tanh approximation has no own rule."""
    x = f32(-np.linspace(4, 9, 40))
    y = gelu_formulas()["erf"](x)
    exact = [mpmath.mpf(float(v)) * mpmath.ncdf(mpmath.mpf(float(v))) for v in x]
    e = bound_of(aten.gelu.default, [t64(x)], (), y)
    judge("gelu", "erf", y, e, exact)
    relative = 2 * 1.02 * POLICY.unit_roundoff * 2000 * np.abs(y)
    with pytest.raises(AssertionError, match="bound exceeded"):
        judge("gelu", "erf", y, relative, exact)
    assert rule_of(aten.gelu.default, (t64(x),), {"approximate": "tanh"}) is None
    assert rule_of(aten.gelu.default, (t64(x),), {"approximate": "none"}) is not None


# -- layer norm's backward ---------------------------------------------------------------------

def layer_norm_inputs(kind: str, m: int, n: int, seed: int, eps: float = 1e-5):
    """(g, x, mean, rstd, w, b) of float32 values: the forward's rounded mean and rstd of x,
    and upstream gradients, by kind: ordinary; a large mean over a small spread (x − μ and
    S1·μ − ds cancel; ρ large); near-constant gradients (N·g·w − S1 cancels); mixed
    magnitudes with zero weights."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, n))
    g = rng.standard_normal((m, n))
    w = rng.standard_normal(n)
    if kind == "offset":
        x = 1000.0 + x * 1e-3
    elif kind == "near-constant-grad":
        g = 0.25 + rng.choice([0.0, 2.0**-18, -(2.0**-19)], (m, n))
    elif kind == "mixed":
        x = x * np.ldexp(1.0, rng.integers(-20, 20, (m, n)))
        g = g * np.ldexp(1.0, rng.integers(-30, 30, (m, n)))
        w[::3] = 0.0
    elif kind == "constant-large":  # μ·ρ = 1e10: S1·μ − ds is all rounding error, b̂ too
        x = np.full((m, n), 1e4)
        eps = 1e-12
    x, g, w, b = f32(x), f32(g), f32(w), f32(rng.standard_normal(n))
    _, mean, rstd = aten.native_layer_norm.default(t64(x), [n], t64(w), t64(b), eps)
    return g, x, f32(mean.numpy()), f32(rstd.numpy()), w, b


def exact_layer_norm_backward(g, x, mean, rstd, w):
    """dx, dw, db of native_layer_norm_backward in rationals (every input a float)."""
    q = np.vectorize(Fraction, otypes=[object])
    g, x, w = q(g), q(x), q(w)
    mu, rho = q(mean).reshape(-1, 1), q(rstd).reshape(-1, 1)
    n = x.shape[1]
    gw = g * w
    s1 = gw.sum(axis=1, keepdims=True)
    s2 = (gw * (x - mu)).sum(axis=1, keepdims=True)
    dx = rho * gw - rho / n * s1 - rho ** 3 / n * (x - mu) * s2
    dw = (g * (x - mu) * rho).sum(axis=0)
    return dx.ravel().tolist(), dw.tolist(), g.sum(axis=0).tolist()


def layer_norm_backward_formulas(order: str) -> Callable:
    """ATen's CPU form, row by row, with sequential sums in `order`: ds and S1, then
    b = (S1·μ − ds)·ρ³/N, c = −b·μ − S1·ρ/N, dx = ρ·g·w + b·x + c; dw and db summed over the
    rows in the same order."""
    def run(g, x, mean, rstd, w):
        m, n = x.shape
        dx = np.empty_like(x)
        for i in range(m):
            a, mu = float(rstd[i, 0]), float(mean[i, 0])
            gw = g[i] * w
            ds, db = seq_sum(gw * x[i], order), seq_sum(gw, order)
            b = (db * mu - ds) * a * a * a * (1.0 / n)
            c = -b * mu - db * a * (1.0 / n)
            dx[i] = a * g[i] * w + b * x[i] + c
        terms = g * (x - mean) * rstd
        dw = np.array([seq_sum(terms[:, j], order) for j in range(n)])
        db = np.array([seq_sum(g[:, j], order) for j in range(n)])
        return dx, dw, db
    return run


@pytest.mark.parametrize("kind", ["normal", "offset", "near-constant-grad", "mixed",
                                  "constant-large"])
@pytest.mark.parametrize("shape", [(6, 7), (40, 64), pytest.param((300, 96),
                                                                  marks=pytest.mark.slow)])
def test_layer_norm_backward(kind, shape, own_arithmetic):
    m, n = shape
    g, x, mean, rstd, w, b = layer_norm_inputs(kind, m, n, seed=m + n)
    func = aten.native_layer_norm_backward.default
    args = (t64(g), t64(x), [n], t64(mean), t64(rstd), t64(w), t64(b), [True, True, True])
    exact = exact_layer_norm_backward(g, x, mean, rstd, w)
    runs: dict[str, tuple] = {}
    for threads in (1, 2):
        with num_threads(threads):
            runs[f"native-{threads}t"] = tuple(t.numpy() for t in func(*args))
    for splitk in (SplitK(seed=5, chunks=3, order="permuted"),
                   SplitK(seed=5, chunks=8, order="pairwise")):
        runs[repr(splitk)] = tuple(t.numpy() for t in splitk(func, args, {}))
    if HAS_CUDA:
        runs["cuda"] = tuple(t.numpy() for t in on_cuda(func, args, {}))
    for order in ORDERS:
        runs[f"cpu-form-{order}"] = layer_norm_backward_formulas(order)(g, x, mean, rstd, w)
    runs["rounded-once"] = tuple(np.array([float(v) for v in part]).reshape(like.shape)
                                 for part, like in zip(exact, (x, w, b), strict=True))
    rule = rule_of(func, args, {})
    assert rule is not None
    for machine, ys in runs.items():
        es = bounds_for(CTX, rule, func, args, {}, [t64(y) for y in ys])
        for name, y, e, ex in zip(("dx", "dw", "db"), ys, es, exact, strict=True):
            dense = np.broadcast_to(torch.as_tensor(dense_bound(e, t64(y))).numpy(), y.shape)
            judge(f"layer-norm-backward {name}", machine, np.asarray(y), dense, ex)


def test_layer_norm_backward_bound_has_teeth(own_arithmetic):
    """Where the mean is large against the spread, ATen's CPU form errs by far more than the
    decomposition's form would: S1·μ − ds cancels and b·x + c rounds on |b|·(|x| + |μ|). The
    rule's bound holds there; the bound an analysis of the centred form alone gives (Q' and
    |x_i − μ| in place of Q and |x_i| + |μ|) is exceeded."""
    g, x, mean, rstd, w, b = layer_norm_inputs("offset", 6, 7, seed=13)
    func = aten.native_layer_norm_backward.default
    args = (t64(g), t64(x), [7], t64(mean), t64(rstd), t64(w), t64(b), [True, False, False])
    (dx, _, _) = layer_norm_backward_formulas("given")(g, x, mean, rstd, w)
    exact = exact_layer_norm_backward(g, x, mean, rstd, w)[0]
    (e,) = bounds_for(CTX, rule_of(func, args, {}), func, args, {}, [t64(dx)])
    judge("layer-norm-backward dx", "cpu-form", dx, dense_bound(e, t64(dx)).numpy(), exact)
    a = np.abs(g * w)
    rho, cube = rstd.reshape(-1, 1), rstd.reshape(-1, 1) ** 3 / 7
    deviation = np.abs(x - mean.reshape(-1, 1))
    q_dev = (a * deviation).sum(1, keepdims=True)
    centred = 5 * rho * a + cube * q_dev * (7 + 13) * deviation + \
        rho * a.sum(1, keepdims=True) * (7 + 6) / 7
    with pytest.raises(AssertionError, match="bound exceeded"):
        judge("layer-norm-backward dx", "cpu-form", dx,
              2 * 1.02 * POLICY.unit_roundoff * centred, exact)


def test_empty_rows_and_zero_signs():
    """Rows of length 0 give empty results on every path; and a zero result is +0 whichever
    form computed it: y·(g − s) gives −0 where y = +0 and g < s, g·y − y·s gives +0, and no
    bound absorbs the sign of a zero, so the interceptor makes every composite op's zero +0
    (`Rule.unsigned_zero`): the native kernel and the emulated hardware agree bit for bit."""
    from protocol.engine.interceptor import RoundingMode
    from protocol.engine.rounding import SiteRecorder
    empty = torch.zeros(2, 0)
    y, g = torch.tensor([[1.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.5, -0.0]])
    computes = {"native": None, "emulated": SplitK(seed=1, chunks=2)}
    results = {}
    for name, compute in computes.items():
        kw = {} if compute is None else {"compute": compute}
        with RoundingMode(POLICY, SiteRecorder(POLICY), **kw):
            for func in (aten._softmax.default, aten._log_softmax.default):
                assert func(empty, 1, False).shape == (2, 0)
            results[name] = aten._softmax_backward_data.default(g, y, 1, torch.float32)
    native = aten._softmax_backward_data.default(g.double(), y.double(), 1, torch.float64)
    assert torch.signbit(native[0, 1])  # ATen's CPU form: −0
    assert torch.equal(results["native"].view(torch.int32), results["emulated"].view(torch.int32))
    assert not torch.signbit(results["native"]).any()


def test_softmax_rows_far_from_zero_and_masked_rows():
    """Where u·|M| breaks the first-order limit (rows at 2**55: exp(x − (M + log s)) may drop
    log s entirely) softmax is decomposed; a row masked with −1e9 keeps the rule but widens
    no other row's band (each row's own |M| then); and a result that rounds to zero is +0
    whichever order summed it (log-softmax's backward, ŝ = ±2**-10 by order)."""
    from protocol.engine.interceptor import RoundingMode
    from protocol.engine.rounding import SiteRecorder
    func = aten._softmax.default
    assert rule_of(func, (torch.full((2, 50), 2.0**55, dtype=torch.float64), 1, False), {}) \
        is None
    x = t64(rows("normal", 64, seed=3, n=4))
    y = torch.softmax(x, 1)
    masked = torch.cat([torch.full((1, 64), -1e9, dtype=torch.float64), x])
    alone = bound_of(func, [x], (1, False), y.numpy())
    beside = bound_of(func, [masked], (1, False), torch.softmax(masked, 1).numpy())[1:]
    assert (beside <= alone * (1 + 2**-40)).all()  # (the two paths round their products apart)
    g = torch.tensor([[0.0, 2.0**60, -(2.0**60), 2.0**-10, -(2.0**-10)]])
    y = torch.tensor([[-300.0, -1.0, -1.0, -1.0, -1.0]])
    bits = set()
    for compute in (None, SplitK(seed=1, chunks=2, order="reversed"),
                    SplitK(seed=1, chunks=5, order="permuted")):
        kw = {} if compute is None else {"compute": compute}
        with RoundingMode(POLICY, SiteRecorder(POLICY), **kw):
            dx = aten._log_softmax_backward_data.default(g, y, 1, torch.float32)
        assert not torch.signbit(dx[0, 0])
        bits.add(dx.view(torch.int32)[0, 0].item())
    assert bits == {0}
