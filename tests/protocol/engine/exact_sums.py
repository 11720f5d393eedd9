"""Exact references for the reduction rules of protocol.engine.bounds (test helper).

A reduction's exact result is a sum of exact float64 terms: from float32-representable inputs a
product of two of them is exact in float64 (24 + 24 significant bits, exponents far inside
float64's range), and a third float32 factor (an `alpha`) is applied exactly by splitting the
product into two 26-bit halves first (Veltkamp). `Terms` holds, for every output element, the
list of its terms (and an optional integer divisor, for means); it decides
`|y_impl − y_exact| <= e / 2` exactly:

- `math.fsum` gives `y − Σ terms` correctly rounded (for a divisor `n`: `n·y − Σ terms`, with
  `n·y` split exactly into two products), so the ratio `|y − y_exact| / (e / 2)` is known to a
  few float64 ULPs;
- a ratio within 1e-3 of 1 (or an `e` of zero) is decided again in integers: every float64 is
  an integer multiple of 2**-1074, so `2·|n·y − Σ t| <= n·e` is checked on those integers.

`conv_triples` enumerates a convolution as (output, input, weight) index triples with explicit
index arithmetic (not through torch), so the forward pass and all three backward gradients have
exact references built from the same enumeration.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

SPLITTER = 2.0**27 + 1.0  # Veltkamp: hi keeps 26 significant bits of a float64


def split(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """v = hi + lo exactly, hi and lo of at most 26 significant bits each (|v| < 2**996)."""
    c = v * SPLITTER
    hi = c - (c - v)
    return hi, v - hi


def is_power_of_two(c: float) -> bool:
    return c != 0 and math.frexp(abs(c))[0] == 0.5


def fixed(v: float) -> int:
    """v · 2**1074, an integer for every finite float64."""
    num, den = float(v).as_integer_ratio()
    return num << (1074 - (den.bit_length() - 1))


class Terms:
    """The exact terms of every output element of one op (flat output index `owner`)."""

    def __init__(self, n_out: int) -> None:
        self.n_out = n_out
        self._owners: list[np.ndarray] = []
        self._values: list[np.ndarray] = []
        self.divisor: np.ndarray | None = None
        self._groups: list[np.ndarray] | None = None

    def add(self, owner, values, coef: float = 1.0) -> Terms:
        """Terms `coef · values[i]` of outputs `owner[i]`: `values` exact float64 (a product of
        two float32 values at most), `coef` a float32 value."""
        owner = np.asarray(owner, dtype=np.int64).ravel()
        values = np.asarray(values, dtype=np.float64).ravel()
        owner = np.broadcast_to(owner, values.shape) if owner.size == 1 else owner
        assert owner.shape == values.shape
        if coef == 1.0:
            parts = [values]
        elif is_power_of_two(coef):
            parts = [values * coef]
        else:
            hi, lo = split(values)
            parts = [hi * coef, lo * coef]  # 26 + 24 bits each: exact
        for p in parts:
            self._owners.append(owner)
            self._values.append(p)
        self._groups = None
        return self

    def products(self, owner, a, b, coef: float = 1.0) -> Terms:
        return self.add(owner, np.asarray(a, dtype=np.float64) * np.asarray(b, dtype=np.float64),
                        coef)

    def divide(self, n) -> Terms:
        """The exact result of output i is Σ terms / n[i] (n a positive integer < 2**26)."""
        self.divisor = np.broadcast_to(np.asarray(n, dtype=np.int64), (self.n_out,)).copy()
        assert (self.divisor > 0).all() and (self.divisor < 2**26).all()
        return self

    def groups(self) -> list[np.ndarray]:
        """Per output, its terms in insertion order."""
        if self._groups is None:
            owner = np.concatenate(self._owners) if self._owners else np.zeros(0, np.int64)
            values = np.concatenate(self._values) if self._values else np.zeros(0)
            order = np.argsort(owner, kind="stable")
            cuts = np.searchsorted(owner[order], np.arange(1, self.n_out))
            self._groups = np.split(values[order], cuts)
        return self._groups

    def count(self) -> int:
        return sum(len(g) for g in self.groups())

    # -- the decision ----------------------------------------------------------------------------

    def ratios(self, y: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, list[str]]:
        """Per output, |y − y_exact| / (e / 2) (approximate to ~1e-15, inf for e = 0 with any
        error) and the descriptions of the elements where the bound fails (decided exactly)."""
        y = np.asarray(y, dtype=np.float64).ravel()
        e = np.asarray(e, dtype=np.float64).ravel()
        assert y.shape == e.shape == (self.n_out,)
        n = self.divisor if self.divisor is not None else np.ones(self.n_out, np.int64)
        y_hi, y_lo = split(y)
        out = np.empty(self.n_out)
        failures: list[str] = []
        for i, terms in enumerate(self.groups()):
            neg = (-terms).tolist()
            if n[i] == 1:
                nd = math.fsum([float(y[i]), *neg])
            else:
                nd = math.fsum([float(n[i] * y_hi[i]), float(n[i] * y_lo[i]), *neg])
            half = float(e[i]) / 2.0
            d = nd / float(n[i])
            ratio = abs(d) / half if half > 0 else (0.0 if nd == 0 else math.inf)
            if not 0.999 < ratio < 1.001 and e[i] > 0:
                ok = ratio <= 1.0
            else:  # decide in integers: 2·|n·y − Σ t| <= n·e
                lhs = 2 * abs(int(n[i]) * fixed(y[i]) - sum(fixed(t) for t in terms.tolist()))
                rhs = int(n[i]) * fixed(e[i])
                ok = lhs <= rhs
                ratio = float(Fraction(lhs, rhs)) if rhs else (0.0 if lhs == 0 else math.inf)
            out[i] = ratio
            if not ok:
                exact = Fraction(sum(fixed(t) for t in terms.tolist()), int(n[i]) << 1074)
                failures.append(f"element {i}: y_impl={float(y[i])!r} y_exact~{float(exact)!r} "
                                f"|diff|~{abs(d)!r} e/2={half!r} ratio={ratio:.6g} "
                                f"({len(terms)} terms, divisor {int(n[i])})")
        return out, failures

    # -- machines made of the terms ----------------------------------------------------------------

    def sequential(self, how: str, seed: int = 0) -> np.ndarray:
        """Each output's terms added one by one in float64 (products already exact): in the
        order given ("given"), reversed, by decreasing or increasing magnitude, or shuffled;
        then divided by the divisor. Conforming implementations of the op, one order each."""
        rng = np.random.default_rng(seed)
        out = np.empty(self.n_out)
        for i, terms in enumerate(self.groups()):
            if how == "reversed":
                terms = terms[::-1]
            elif how == "largest-first":
                terms = terms[np.argsort(-np.abs(terms), kind="stable")]
            elif how == "smallest-first":
                terms = terms[np.argsort(np.abs(terms), kind="stable")]
            elif how == "shuffled":
                terms = terms[rng.permutation(len(terms))]
            else:
                assert how == "given", how
            s = 0.0
            for t in terms.tolist():
                s += t
            out[i] = s if self.divisor is None else s / float(self.divisor[i])
        return out


ORDERS = ("given", "reversed", "largest-first", "smallest-first", "shuffled")


def _ravel(index: Sequence[np.ndarray], shape: Sequence[int]) -> np.ndarray:
    return np.ravel_multi_index(tuple(index), tuple(shape))


def conv_out_shape(x_shape, w_shape, stride, padding, dilation, transposed, output_padding,
                   groups) -> tuple[int, ...]:
    spatial = range(len(x_shape) - 2)
    k = w_shape[2:]
    if transposed:
        sizes = [(x_shape[2 + i] - 1) * stride[i] - 2 * padding[i] + dilation[i] * (k[i] - 1)
                 + output_padding[i] + 1 for i in spatial]
        return (x_shape[0], w_shape[1] * groups, *sizes)
    sizes = [(x_shape[2 + i] + 2 * padding[i] - dilation[i] * (k[i] - 1) - 1) // stride[i] + 1
             for i in spatial]
    return (x_shape[0], w_shape[0], *sizes)


def conv_triples(x_shape, w_shape, stride, padding, dilation, transposed, output_padding,
                 groups) -> tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray]:
    """(out_shape, oi, xi, wi): out[oi] += x[xi] · w[wi] over all triples (flat indices), the
    convolution written out from its definition (zero padding contributes no terms)."""
    sd = len(x_shape) - 2
    out_shape = conv_out_shape(x_shape, w_shape, stride, padding, dilation, transposed,
                               output_padding, groups)
    k = tuple(w_shape[2:])
    if transposed:  # x (N, C_in, *S), w (C_in, C_out/g, *k): out[q = p·s − pad + k·d]
        n, c_in = x_shape[:2]
        grid = np.indices((n, c_in, w_shape[1], *k, *x_shape[2:])).reshape(3 + 2 * sd, -1)
        nn_, i, j = grid[0], grid[1], grid[2]
        kk, pin = grid[3:3 + sd], grid[3 + sd:]
        q = [pin[d] * stride[d] - padding[d] + kk[d] * dilation[d] for d in range(sd)]
        valid = np.all([(q[d] >= 0) & (q[d] < out_shape[2 + d]) for d in range(sd)], axis=0)
        o = (i // (c_in // groups)) * w_shape[1] + j
        sel = [a[valid] for a in (nn_, i, j, o)]
        kk = [a[valid] for a in kk]
        pin = [a[valid] for a in pin]
        q = [a[valid] for a in q]
        xi = _ravel([sel[0], sel[1], *pin], x_shape)
        wi = _ravel([sel[1], sel[2], *kk], w_shape)
        oi = _ravel([sel[0], sel[3], *q], out_shape)
        return out_shape, oi, xi, wi
    n, c_out, cg = x_shape[0], w_shape[0], w_shape[1]
    grid = np.indices((n, c_out, cg, *k, *out_shape[2:])).reshape(3 + 2 * sd, -1)
    nn_, o, c = grid[0], grid[1], grid[2]
    kk, q = grid[3:3 + sd], grid[3 + sd:]
    pos = [q[d] * stride[d] - padding[d] + kk[d] * dilation[d] for d in range(sd)]
    valid = np.all([(pos[d] >= 0) & (pos[d] < x_shape[2 + d]) for d in range(sd)], axis=0)
    ci = (o // (c_out // groups)) * cg + c
    nn_, o, c, ci = (a[valid] for a in (nn_, o, c, ci))
    kk = [a[valid] for a in kk]
    q = [a[valid] for a in q]
    pos = [a[valid] for a in pos]
    xi = _ravel([nn_, ci, *pos], x_shape)
    wi = _ravel([o, c, *kk], w_shape)
    oi = _ravel([nn_, o, *q], out_shape)
    return out_shape, oi, xi, wi


def reduce_owner(shape: Sequence[int], dims: Sequence[int]) -> tuple[np.ndarray, int]:
    """For a reduction of an array of `shape` over `dims`: the flat output index of each input
    element (C order) and the number of outputs."""
    dims = sorted({d % len(shape) for d in dims}) if len(shape) else []
    keep = [d for d in range(len(shape)) if d not in dims]
    coords = np.indices(tuple(shape)).reshape(len(shape), -1)
    kept_shape = [shape[d] for d in keep]
    if not keep:
        return np.zeros(int(np.prod(shape, dtype=np.int64)), np.int64), 1
    return _ravel([coords[d] for d in keep], kept_shape), int(np.prod(kept_shape))


def cumsum_ratios(x: np.ndarray, y: np.ndarray, e: np.ndarray, axis: int
                  ) -> tuple[np.ndarray, list[str]]:
    """|y − exact cumsum| / (e / 2) along `axis`, decided in integers (exact prefix sums)."""
    xm = np.moveaxis(x, axis, -1).reshape(-1, x.shape[axis])
    ym = np.moveaxis(y, axis, -1).reshape(-1, x.shape[axis])
    em = np.moveaxis(e, axis, -1).reshape(-1, x.shape[axis])
    out = np.empty(xm.shape)
    failures: list[str] = []
    for r in range(xm.shape[0]):
        s = 0
        for j, (xv, yv, ev) in enumerate(zip(xm[r].tolist(), ym[r].tolist(), em[r].tolist(),
                                             strict=True)):
            s += fixed(xv)
            lhs, rhs = 2 * abs(fixed(yv) - s), fixed(ev)
            out[r, j] = float(Fraction(lhs, rhs)) if rhs else (0.0 if lhs == 0 else math.inf)
            if lhs > rhs:
                failures.append(f"row {r} position {j}: y_impl={yv!r} "
                                f"y_exact~{float(Fraction(s, 1 << 1074))!r} e/2={ev / 2!r}")
    return out, failures
