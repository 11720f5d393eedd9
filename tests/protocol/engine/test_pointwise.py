"""Fixed-formula ops and the fused pointwise pass (protocol/engine/pointwise.py; SPEC §3.2.1).

The claim under test: addcmul, addcdiv and lerp with a scalar weight are computed by their
fixed formulas, one IEEE operation at a time, so their compute-dtype result is the same bits on
every conforming machine (e = 0, nothing logged); and the fused pass, which computes them and
the single IEEE ops (mul, add, sub) straight from float32 inputs, gives the bits of the torch
ops on widened inputs. The exact reference is numpy's float64 arithmetic, one ufunc per
operation (each correctly rounded, never contracted), rounded to float32 by numpy's cast.
Inputs are hard: heavy cancellation, subnormals, zeros (and zero divisors), ±inf, NaN, values
near float32's overflow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from protocol.codec.roundinglog import RoundingLog, SiteLog
from protocol.engine import fused, pointwise
from protocol.engine.bandpass import CANONICAL_NAN
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.rounding import SiteRecorder, SiteReplayer
from protocol.errors import LogViolationError

POLICY = PrecisionPolicy()
needs_fused = pytest.mark.skipif(fused.MISSING is not None,
                                 reason=f"the fused passes are not built: {fused.MISSING}")


def hard(seed: int, n: int = 4099) -> np.ndarray:
    """float32 values of every magnitude, with zeros, subnormals, ±inf, NaN and huge values."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=n) * 10.0 ** rng.integers(-30, 30, size=n)).astype(np.float32)
    specials = np.array([0.0, -0.0, 2.0**-149, -(2.0**-140), 2.0**-126, np.inf, -np.inf, np.nan,
                         3.4e38, -3.4e38, 1.0, -1.0], dtype=np.float32)
    where = rng.choice(n, size=4 * specials.size, replace=False)
    x[where] = np.tile(specials, 4)
    return x


def cancelling(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """s, t1, t2 where s ≈ −t1·t2 and −t1/t2 for a third of the elements: the results are far
    below the terms, where a bounded rule would have logged the most."""
    rng = np.random.default_rng(seed)
    s, t1, t2 = hard(seed), hard(seed + 1), hard(seed + 2)
    k = s.size // 3
    with np.errstate(all="ignore"):
        s[:k] = (-(t1[:k].astype(np.float64) * t2[:k]) * (1 + rng.choice([0, 2.0**-22], k))
                 ).astype(np.float32)
        s[k:2 * k] = (-(t1[k:2 * k].astype(np.float64) / t2[k:2 * k])).astype(np.float32)
    return s, t1, t2


def q(v: float) -> float:
    """A Python float scalar as the interceptor rounds it (float32, SPEC §3.3)."""
    return float(np.float32(v))


def reference(code: int, a, b, c, v) -> np.ndarray:
    """The formula in float64, one correctly rounded numpy operation at a time, cast to float32,
    every NaN the one NaN a rounding writes (`bandpass.CANONICAL_NAN`)."""
    a, b = a.astype(np.float64), None if b is None else b.astype(np.float64)
    c = None if c is None else c.astype(np.float64)
    with np.errstate(all="ignore"):
        y = {pointwise.MUL_SCALAR: lambda: a * v, pointwise.MUL: lambda: a * b,
             pointwise.ADD_SCALAR: lambda: a + v, pointwise.ADD: lambda: a + b,
             pointwise.SUB_SCALAR: lambda: a - v, pointwise.SUB: lambda: a - b,
             pointwise.ADDCMUL: lambda: a + (v * b) * c,
             pointwise.ADDCDIV: lambda: a + v * (b / c),
             pointwise.LERP: lambda: a + v * (b - a),
             pointwise.SQRT: lambda: np.sqrt(a)}[code]()
        r = y.astype(np.float32)
        r.view(np.int32)[np.isnan(r)] = CANONICAL_NAN[torch.float32]
        return r


def assert_bits(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    assert got.dtype == torch.float32, what
    g = got.contiguous().view(torch.int32).numpy()
    w = want.view(np.int32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got.numpy()), nan), what
    assert np.array_equal(g[~nan], w[~nan]), f"{what}: {int((g[~nan] != w[~nan]).sum())} differ"


T = torch.from_numpy


def cases(seed: int):
    """(name, call on (s, t1, t2) float32 tensors, code, scalar, in place)."""
    s, t1, t2 = cancelling(seed)
    v, w = -0.3, 0.7  # rounded to float32 first
    yield s, t1, t2, [
        ("addcmul", lambda x, y, z: torch.addcmul(x, y, z, value=v), pointwise.ADDCMUL, q(v)),
        ("addcmul_", lambda x, y, z: x.addcmul_(y, z, value=v), pointwise.ADDCMUL, q(v)),
        ("addcdiv", lambda x, y, z: torch.addcdiv(x, y, z, value=v), pointwise.ADDCDIV, q(v)),
        ("addcdiv_", lambda x, y, z: x.addcdiv_(y, z, value=v), pointwise.ADDCDIV, q(v)),
        ("lerp", lambda x, y, z: torch.lerp(x, y, w), pointwise.LERP, q(w)),
        ("lerp_ small", lambda x, y, z: x.lerp_(y, 0.25), pointwise.LERP, 0.25),
        ("mul", lambda x, y, z: x * y, pointwise.MUL, 0.0),
        ("mul scalar", lambda x, y, z: x * 0.1, pointwise.MUL_SCALAR, q(0.1)),
        ("mul int", lambda x, y, z: x * 3, pointwise.MUL_SCALAR, 3.0),
        ("mul_", lambda x, y, z: x.mul_(y), pointwise.MUL, 0.0),
        ("add", lambda x, y, z: x + y, pointwise.ADD, 0.0),
        ("add scalar", lambda x, y, z: x + 1e-8, pointwise.ADD_SCALAR, q(1e-8)),
        ("sub", lambda x, y, z: x - y, pointwise.SUB, 0.0),
        ("sub scalar", lambda x, y, z: torch.sub(x, 2.5), pointwise.SUB_SCALAR, 2.5),
        ("sub zero", lambda x, y, z: x - 0, pointwise.SUB_SCALAR, 0.0),
        ("add big int", lambda x, y, z: x + (2**40 + 1), pointwise.ADD_SCALAR, 2.0**40 + 1),
        ("add_", lambda x, y, z: x.add_(y), pointwise.ADD, 0.0),
        ("sqrt", lambda x, y, z: torch.sqrt(x), pointwise.SQRT, 0.0),
        ("sqrt_", lambda x, y, z: x.sqrt_(), pointwise.SQRT, 0.0),
    ]


class Exact(SiteRecorder):
    """A recorder that counts the sites it claims and the sites handed to `round_site`."""

    def __init__(self, policy=POLICY, claims: bool = True) -> None:
        super().__init__(policy)
        self.claimed: list[tuple[str, int]] = []
        self.rounded: list[tuple[str, list[torch.Tensor]]] = []
        self.claims = claims

    def claim_exact_site(self, op, numel):
        if not self.claims:
            return False
        self.claimed.append((op, numel))
        return super().claim_exact_site(op, numel)

    def round_site(self, op, ys, bounds):
        self.rounded.append((op, [y.clone() for y in ys]))
        return super().round_site(op, ys, bounds)


@pytest.mark.parametrize("path", ["fused", "torch"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_op_gives_its_formula_bit_for_bit(path, threads, seed, monkeypatch):
    if path == "fused" and fused.MISSING is not None:
        pytest.skip(f"the fused passes are not built: {fused.MISSING}")
    monkeypatch.setattr(fused, "ENABLED", path == "fused")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for s, t1, t2, ops in cases(seed):
            for name, call, code, v in ops:
                x, y, z = T(s.copy()), T(t1.copy()), T(t2.copy())
                rec = Exact()
                with RoundingMode(POLICY, rec):
                    out = call(x, y, z)
                operand_c = t2 if code in (pointwise.ADDCMUL, pointwise.ADDCDIV) else None
                operand_b = None if code in (pointwise.MUL_SCALAR, pointwise.ADD_SCALAR,
                                             pointwise.SUB_SCALAR, pointwise.SQRT) else t1
                want = reference(code, s, operand_b, operand_c, v)
                assert_bits(out, want, f"{name} ({path})")
                if name.endswith("_") or name.endswith("small"):
                    assert out is x, name
                # one site of s.size elements, logged nothing, taken by the fused pass or not
                assert [site.numel for site in rec.sites] == [s.size], name
                assert not any(site.indices.size or site.value_indices.size
                               for site in rec.sites), name
                assert len(rec.claimed) == (1 if path == "fused" else 0), name
    finally:
        torch.set_num_threads(before)


def roots_operands(seed: int) -> np.ndarray:
    """Positive float32 values of every magnitude (subnormals, zeros, +inf, NaN among them) and
    those nearest to the squares of float32 rounding midpoints, whose roots lie nearest to one
    (bounds.SQRT_MARGIN_ULPS), 4 − 2^−22 the nearest of all."""
    k = np.random.default_rng(seed).integers(2**23, 2**24, size=2000)
    near = (((2 * k + 1) * 2.0**-24) ** 2).astype(np.float32)
    return np.concatenate([np.abs(hard(seed)), near, np.float32([4 - 2.0**-22])])


@pytest.mark.parametrize("path", ["fused", "torch"])
def test_square_roots_round_correctly_in_every_form(path, monkeypatch):
    """sqrt, sqrt_, _foreach_sqrt and _foreach_sqrt_ give the correctly rounded float32 root
    (numpy's float32 sqrt, IEEE) on either path — though torch's float64 root on the CPU is not
    always correctly rounded — each call one site that logs nothing."""
    if path == "fused" and fused.MISSING is not None:
        pytest.skip(f"the fused passes are not built: {fused.MISSING}")
    monkeypatch.setattr(fused, "ENABLED", path == "fused")
    a = roots_operands(11)
    want = np.sqrt(a)
    pieces = np.split(a, [300, 301])
    calls = {
        "sqrt": lambda: [torch.sqrt(T(a.copy()))],
        "sqrt_": lambda: [T(a.copy()).sqrt_()],
        "_foreach_sqrt": lambda: torch._foreach_sqrt([T(p.copy()) for p in pieces]),
        "_foreach_sqrt_": lambda: _in_place_foreach_sqrt([T(p.copy()) for p in pieces]),
    }
    for name, call in calls.items():
        rec = Exact()
        with RoundingMode(POLICY, rec):
            out = call()
        assert_bits(torch.cat(out), want, f"{name} ({path})")
        assert [site.numel for site in rec.sites] == [a.size], name
        assert not any(site.indices.size or site.value_indices.size for site in rec.sites), name
        assert len(rec.claimed) == (1 if path == "fused" else 0), name


@needs_fused
def test_roots_of_negatives_zeros_and_nans_are_the_torch_paths_bits():
    """Where IEEE leaves the NaN's sign and payload to the machine (the instruction's root of a
    negative is −NaN, ATen's +NaN; a NaN input's root keeps its bits), both paths write the one
    float32 NaN of every rounding (`bandpass.CANONICAL_NAN`), and −0 for −0: the same bits,
    every element."""
    bits = [0xBF800000, 0xC0200000, 0xFF800000, 0x80000000, 0x00000000, 0x80000001, 0x7FC00000,
            0xFFC00000, 0x7FC00001, 0xFFC12345, 0x7F800000, 0x3F800000]
    a = torch.tensor(np.array(bits * 700, dtype=np.uint32).view(np.int32)).view(torch.float32)
    out = {}
    for path in ("fused", "torch"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "ENABLED", path == "fused")
            with RoundingMode(POLICY, Exact()):
                out[path] = torch.sqrt(a).view(torch.int32)
    assert torch.equal(out["fused"], out["torch"])
    aten = a.double().sqrt().float()
    want = aten.view(torch.int32).masked_fill(aten.isnan(), CANONICAL_NAN[torch.float32])
    assert torch.equal(out["torch"], want)


def quotient_operands(seed: int, n: int = 3001) -> tuple[np.ndarray, np.ndarray]:
    """Dividends and divisors from 2^-60 to 2^60 of both signs, with zeros, infinities and NaNs
    among both: no quotient lies below 2^-125 but zeros (`bounds._quotient`)."""
    rng = np.random.default_rng(seed)
    a, b = ((rng.uniform(1, 2, (2, n)) * 2.0 ** rng.integers(-60, 61, (2, n)) *
             rng.choice([-1, 1], (2, n))).astype(np.float32))
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], dtype=np.float32)
    a[:5], b[5:10] = specials, specials
    return a, b


@pytest.mark.parametrize("path", ["fused", "torch"])
def test_quotients_round_correctly_in_every_form(path, monkeypatch):
    """Division of float32 values, by a tensor, a float (rounded to float32 first) or an
    integer, single, in place and foreach, gives the correctly rounded float32 quotient
    (numpy's float32 division, IEEE) on either path, each call one site that logs nothing."""
    if path == "fused" and fused.MISSING is not None:
        pytest.skip(f"the fused passes are not built: {fused.MISSING}")
    monkeypatch.setattr(fused, "ENABLED", path == "fused")
    a, b = quotient_operands(13)
    with np.errstate(all="ignore"):
        wants = {"by tensor": a / b, "by float": a / np.float32(0.3), "by int": a / np.float32(3)}
    pieces = np.split(np.arange(a.size), [300, 301])
    calls = {
        "by tensor": [lambda: [torch.div(T(a), T(b))], lambda: [T(a.copy()).div_(T(b))],
                      lambda: torch._foreach_div([T(a[i]) for i in pieces],
                                                 [T(b[i]) for i in pieces])],
        "by float": [lambda: [T(a) / 0.3], lambda: [T(a.copy()).div_(0.3)],
                     lambda: _in_place_foreach_div([T(a[i].copy()) for i in pieces], 0.3)],
        "by int": [lambda: [T(a) / 3],
                   lambda: _in_place_foreach_div([T(a[i].copy()) for i in pieces], [3] * 3)],
    }
    for kind, forms in calls.items():
        for form, call in enumerate(forms):
            rec = Exact()
            with RoundingMode(POLICY, rec):
                out = call()
            what = f"{kind} form {form} ({path})"
            assert_bits(torch.cat(out), wants[kind], what)
            assert [site.numel for site in rec.sites] == [a.size], what
            assert not any(site.indices.size or site.value_indices.size
                           for site in rec.sites), what
            assert len(rec.claimed) == (1 if path == "fused" else 0), what


def _in_place_foreach_div(xs: list[torch.Tensor], by) -> list[torch.Tensor]:
    torch._foreach_div_(xs, by)
    return xs


@needs_fused
def test_small_quotients_leave_the_fused_pass_and_keep_their_band():
    """Quotients in float32's subnormal range keep the relative rule (halves of odd multiples
    of 2^-149 are ties, logged): the fused pass does not take such a site, and both paths log
    and return the same bits."""
    a = np.arange(1, 4001, dtype=np.float32) * np.float32(2.0**-149)
    logs, outs = {}, {}
    for path in ("fused", "torch"):
        rec = Exact()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "ENABLED", path == "fused")
            with RoundingMode(POLICY, rec):
                outs[path] = T(a) / 2.0
        assert not rec.claimed
        logs[path] = rec.log()
    assert logs["fused"] == logs["torch"] and torch.equal(outs["fused"], outs["torch"])
    assert logs["fused"].sites[0].indices.size == 2000  # the odd multiples


def _in_place_foreach_sqrt(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    torch._foreach_sqrt_(xs)
    return xs


def test_the_widened_path_computes_the_formula_not_aten():
    """The compute-dtype values handed to the rounder are the formula's, bit for bit, even for
    lerp with a weight >= 0.5, where ATen's kernel computes end − (end − s)·(1 − w) instead."""
    s, t1, t2 = cancelling(5)
    rec = Exact(claims=False)
    with RoundingMode(POLICY, rec):
        torch.lerp(T(s), T(t1), 0.75)
        torch.addcmul(T(s), T(t1), T(t2), value=0.5)
    a, b, c = (x.astype(np.float64) for x in (s, t1, t2))
    with np.errstate(all="ignore"):
        formulas = [a + 0.75 * (b - a), a + (0.5 * b) * c]
    for (op, [y]), want in zip(rec.rounded, formulas, strict=True):
        got = y.numpy()
        same = (got.view(np.int64) == want.view(np.int64)) | (np.isnan(got) & np.isnan(want))
        assert same.all(), op
    aten = torch.lerp(T(s).double(), T(t1).double(), 0.75).numpy()
    finite = np.isfinite(aten) & np.isfinite(formulas[0])
    assert (aten[finite] != formulas[0][finite]).any()  # (else this proves nothing)


@needs_fused
@pytest.mark.parametrize("overload", ["Scalar", "ScalarList", "Tensor"])
def test_foreach_forms_are_one_site_and_the_formula(overload):
    sizes = (300, 1, 77)
    s, t1, t2 = cancelling(7)
    cuts = np.cumsum(sizes)[:-1]
    ss, aa, bb = (np.split(x[:sum(sizes)], cuts) for x in (s, t1, t2))
    values = [0.3, -2.0, 1e-3]
    for path in ("fused", "torch"):
        for name in ("addcmul", "addcdiv"):
            scalars = {"Scalar": values[0], "ScalarList": values,
                       "Tensor": torch.tensor(values, dtype=torch.float32)}[overload]
            xs = [T(x.copy()) for x in ss]
            rec = Exact()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(fused, "ENABLED", path == "fused")
                with RoundingMode(POLICY, rec):
                    getattr(torch, f"_foreach_{name}_")(xs, [T(x) for x in aa],
                                                        [T(x) for x in bb], scalars)
            code = pointwise.ADDCMUL if name == "addcmul" else pointwise.ADDCDIV
            for i, x in enumerate(xs):
                v = q(values[0] if overload == "Scalar" else values[i])
                assert_bits(x, reference(code, ss[i], aa[i], bb[i], v), f"{name} {i} {path}")
            assert [site.numel for site in rec.sites] == [sum(sizes)]
            assert len(rec.claimed) == (1 if path == "fused" else 0)


def _foreach_in_place(op: str, xs: list[torch.Tensor], *rest, **keywords) -> list[torch.Tensor]:
    getattr(torch, f"_foreach_{op}_")(xs, *rest, **keywords)
    return xs


def _foreach_cases(values: list[float]):
    """(name, call on lists xs, ys, zs, code, the scalar per element before rounding)."""
    v, w = values[0], values[1]
    for place in ("", "_"):
        def run(op, rest, place=place):
            if place:
                return lambda xs, ys, zs: _foreach_in_place(op, xs, *rest(ys, zs))
            return lambda xs, ys, zs: getattr(torch, f"_foreach_{op}")(xs, *rest(ys, zs))
        yield from [
            (f"mul{place}.Scalar", run("mul", lambda y, z: (v,)), pointwise.MUL_SCALAR, [v] * 3),
            (f"mul{place}.List", run("mul", lambda y, z: (y,)), pointwise.MUL, [0.0] * 3),
            (f"mul{place}.ScalarList", run("mul", lambda y, z: (values,)), pointwise.MUL_SCALAR,
             values),
            (f"add{place}.Scalar", run("add", lambda y, z: (w,)), pointwise.ADD_SCALAR, [w] * 3),
            (f"add{place}.List", run("add", lambda y, z: (y,)), pointwise.ADD, [0.0] * 3),
            (f"sub{place}.ScalarList", run("sub", lambda y, z: (values,)), pointwise.SUB_SCALAR,
             values),
            (f"sub{place}.List", run("sub", lambda y, z: (y,)), pointwise.SUB, [0.0] * 3),
            (f"div{place}.ScalarList", run("div", lambda y, z: (values,)), pointwise.DIV_SCALAR,
             values),
            (f"div{place}.List", run("div", lambda y, z: (y,)), pointwise.DIV, [0.0] * 3),
            (f"addcmul{place}.Scalar", run("addcmul", lambda y, z: (y, z, v)), pointwise.ADDCMUL,
             [v] * 3),
            (f"addcdiv{place}.ScalarList", run("addcdiv", lambda y, z: (y, z, values)),
             pointwise.ADDCDIV, values),
            (f"lerp{place}.Scalar", run("lerp", lambda y, z: (y, w)), pointwise.LERP, [w] * 3),
            (f"lerp{place}.ScalarList", run("lerp", lambda y, z: (y, values)), pointwise.LERP,
             values),
            (f"sqrt{place}", run("sqrt", lambda y, z: ()), pointwise.SQRT, [0.0] * 3),
        ]


@needs_fused
@pytest.mark.parametrize("seed", [0, 1])
def test_foreach_ops_are_one_list_call_with_the_formulas_bits(seed, monkeypatch):
    """Every foreach form the fused pass takes (Scalar, List, ScalarList; in place and not) is
    one `pointwise_list` call (`pointwise.foreach_call`) over elements of three sizes, one of
    them a single element, on hard values: each element the formula's float32 bits (numpy's
    exact reference; quotients of `quotient_operands`, none of which keeps a band), one site of
    the lists' total, claimed, nothing logged; and the torch path's bits, NaNs' payloads aside
    (`_same`)."""
    sizes = (300, 1, 77)
    s, t1, t2 = cancelling(seed + 40)
    cuts = np.cumsum(sizes)[:-1]
    dividends, divisors = quotient_operands(seed + 40)  # (no quotient below 2^-125)
    values = [0.3, -2.0, 3]  # (an int among them, used as it is)
    listed = []
    real = pointwise.run_list
    monkeypatch.setattr(pointwise, "run_list", lambda *a: listed.append(1) or real(*a))
    for name, call, code, scalars in _foreach_cases(values):
        quotient = code in (pointwise.DIV, pointwise.DIV_SCALAR)
        ss, aa, bb = (np.split(x[:sum(sizes)], cuts) for x in (
            dividends if quotient else s, divisors if quotient else t1, t2))
        outs = {}
        for path in ("fused", "torch"):
            xs, ys, zs = ([T(x.copy()) for x in group] for group in (ss, aa, bb))
            rec, calls = Exact(), len(listed)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(fused, "ENABLED", path == "fused")
                with RoundingMode(POLICY, rec):
                    outs[path] = call(xs, ys, zs)
            assert len(listed) - calls == (path == "fused"), (name, path)
            assert len(rec.claimed) == (path == "fused"), (name, path)
            assert [site.numel for site in rec.sites] == [sum(sizes)], (name, path)
            assert not any(site.indices.size or site.value_indices.size for site in rec.sites)
            if name.endswith("_") or "_." in name:
                assert outs[path] is xs, name
        b = None if code in (pointwise.MUL_SCALAR, pointwise.ADD_SCALAR, pointwise.SUB_SCALAR,
                             pointwise.DIV_SCALAR, pointwise.SQRT) else aa
        c = bb if code in (pointwise.ADDCMUL, pointwise.ADDCDIV) else None
        for i, got in enumerate(outs["fused"]):
            v = q(scalars[i]) if isinstance(scalars[i], float) else float(scalars[i])
            if code in (pointwise.DIV, pointwise.DIV_SCALAR, pointwise.SQRT):
                with np.errstate(all="ignore"):
                    a64 = ss[i].astype(np.float64)
                    want = (np.sqrt(a64) if code == pointwise.SQRT else
                            a64 / (aa[i].astype(np.float64) if b is not None else v))
                want = want.astype(np.float32)
            else:
                want = reference(code, ss[i], None if b is None else b[i],
                                 None if c is None else c[i], v)
            if code == pointwise.SQRT:  # (the correctly rounded float32 root)
                with np.errstate(all="ignore"):
                    want = np.sqrt(ss[i])
            assert_bits(got, want, f"{name} {i}")
            assert _same(got, outs["torch"][i]), f"{name} {i}"


@needs_fused
def test_foreach_ops_by_one_tensor_are_fused_with_the_formulas_bits(monkeypatch):
    """The `.Tensor` forms of foreach mul, add and div take one tensor for every element:
    the optimizer's `_foreach_add_(steps, one, alpha=1.0)` (its step counts: 0-d tensors and a
    0-d tensor; without alpha, torch reads the tensor as a number: the `.Scalar` form) is one
    list call, and so is a division of 0-d tensors; a 0-d tensor broadcast over elements of
    other shapes goes element by element, fused all the same. Each the formula's float32 bits,
    one site claimed (of the form named), nothing logged, and the torch path's bits."""
    listed = []
    real = pointwise.run_list
    monkeypatch.setattr(pointwise, "run_list", lambda *a: listed.append(1) or real(*a))
    s, t1, _ = cancelling(29)
    steps = [T(np.float32([k])).reshape(()) for k in (1, 7, 2**24 - 1)]
    pieces = np.split(s[:378], [300, 301])
    dividends = np.split(quotient_operands(29)[0][:378], [300, 301])  # (no tiny quotient)
    by = np.float32(-0.3)
    counted = [np.float32([k]).reshape(()) + np.float32(1) for k in (1, 7, 2**24 - 1)]
    calls = {
        "add_ steps": (lambda: _foreach_in_place("add", [x.clone() for x in steps],
                                                 torch.tensor(1.0), alpha=1.0), counted, True),
        "add_ steps by number": (lambda: _foreach_in_place("add", [x.clone() for x in steps],
                                                           torch.tensor(1.0)), counted, True),
        "mul broadcast": (lambda: torch._foreach_mul([T(p.copy()) for p in pieces],
                                                     T(np.array(by))),
                          [reference(pointwise.MUL_SCALAR, p, None, None, float(by))
                           for p in pieces], False),
        "div_ 0-d": (lambda: _foreach_in_place("div", [T(p[:1].copy()).reshape(())
                                                       for p in dividends], T(np.array(by))),
                     [p[0] / by for p in dividends], True),  # (IEEE's float32 quotient)
    }
    forms = {"add_ steps": "aten._foreach_add_.Tensor",
             "add_ steps by number": "aten._foreach_add_.Scalar",
             "mul broadcast": "aten._foreach_mul.Tensor", "div_ 0-d": "aten._foreach_div_.Tensor"}
    for name, (call, wants, one_call) in calls.items():
        outs = {}
        for path in ("fused", "torch"):
            rec, before = Exact(), len(listed)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(fused, "ENABLED", path == "fused")
                with RoundingMode(POLICY, rec):
                    outs[path] = call()
            assert len(listed) - before == (path == "fused" and one_call), (name, path)
            assert [op for op, _ in rec.claimed] == ([forms[name]] if path == "fused" else []), \
                (name, path)
            assert [site.numel for site in rec.sites] == [sum(w.size for w in wants)], name
            assert not any(site.indices.size or site.value_indices.size for site in rec.sites)
        for got, other, want in zip(outs["fused"], outs["torch"], wants, strict=True):
            assert_bits(got, np.asarray(want, dtype=np.float32), name)
            assert _same(got, other), name


@needs_fused
def test_the_list_call_declines_what_it_cannot_serve_and_the_bits_stay():
    """Lists the list call does not take go element by element (`pointwise.operands`): a
    broadcast operand (which that path still fuses), a strided element, a float64 one, an
    element written twice, an operand that is another element's written memory, a quotient
    below 2^-125 (which keeps its band), an integer divisor that is no float32 value and an
    alpha (both the bounded path) — each with the torch path's bits, every element read as it
    was before the op wrote any."""
    s, t1, _ = cancelling(23)
    a = [T(s[:64].copy()), T(s[64:128].copy())]
    b = [T(t1[:64].copy()), T(t1[64:65].copy())]  # the second broadcast over its element
    tiny = np.arange(1, 65, dtype=np.float32) * np.float32(2.0**-149)
    listed = []
    real = pointwise.run_list

    def spy(*args):
        listed.append(1)
        return real(*args)

    calls = {
        "broadcast": lambda: torch._foreach_mul([x.clone() for x in a], b),
        "strided": lambda: torch._foreach_mul([a[0].clone(), a[1].reshape(8, 8).t()], 2.0),
        "float64": lambda: torch._foreach_add([a[0].clone(), a[1].double()], 1.0),
        "written twice": lambda: _foreach_in_place("mul", [a[0].clone()] * 2, 2.0),
        "another's memory": lambda: _two_shared(a),
        "small quotient": lambda: _foreach_in_place("div", [T(tiny.copy()), a[1].clone()], 2.0),
        "int divisor": lambda: torch._foreach_div([x.clone() for x in a], [3, 2**40 + 1]),
        "alpha 2": lambda: torch._foreach_add([x.clone() for x in a], [x.clone() for x in a],
                                              alpha=2),
    }
    got = {}
    for name, call in calls.items():
        outs = {}
        for path in ("fused", "torch"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(fused, "ENABLED", path == "fused")
                mp.setattr(pointwise, "run_list", spy)
                with RoundingMode(POLICY, Exact()):
                    outs[path] = [x.clone() for x in call()]
        assert not listed, name
        assert all(_same(x, y) for x, y in zip(outs["fused"], outs["torch"], strict=True)), name
        got[name] = outs["fused"]
    x = s[:64].astype(np.float64)  # another's memory: both read x before either was written
    with np.errstate(all="ignore"):
        square = T((x * x).astype(np.float32))
    assert all(_same(y, square) for y in got["another's memory"])


def _two_shared(a: list[torch.Tensor]) -> list[torch.Tensor]:
    """x.mul_(x) and y.mul_(x) as one foreach op: y's operand is x, which the list writes."""
    x, y = a[0].clone(), a[0].clone()
    torch._foreach_mul_([x, y], [x, x])
    return [x, y]


def _both_paths(call) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`call()` under record on the fused and the torch path: the two results and whether the
    fused path claimed the site."""
    out, claimed = {}, False
    for path in ("fused", "torch"):
        rec = Exact()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "ENABLED", path == "fused")
            with RoundingMode(POLICY, rec):
                out[path] = call().clone()
        claimed |= bool(rec.claimed)
        assert [site.numel for site in rec.sites] == [out[path].numel()]
    return out["fused"], out["torch"], claimed


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal bits, except that any NaN equals any NaN: IEEE-754 leaves a NaN result's sign and
    payload to the machine (§6.2.3, §6.3), and x86 takes them from one operand or the other by
    the order an instruction reads them in."""
    view = torch.int32 if x.dtype == torch.float32 else torch.int64
    nan = torch.isnan(x)
    return x.shape == y.shape and torch.equal(nan, torch.isnan(y)) and \
        torch.equal(x[~nan].view(view), y[~nan].view(view))


@needs_fused
def test_broadcast_mul_add_sub_are_fused_with_the_same_bits():
    """A mul, add or sub whose other operand is a row, a column, a channel value or one value
    broadcast over the result is fused (a broadcast `a` of a mul or add too, swapped)."""
    s, t1, _ = cancelling(9)
    x = T(s[:4096].copy()).reshape(4, 8, 128)
    other = {"rows": (4, 8, 1), "columns": (128,), "planes": (8, 128), "channels": (1, 8, 1),
             "one": (1,), "leading": (4, 1, 1)}
    ops = {"mul": torch.mul, "add": torch.add, "sub": torch.sub}
    for shape_name, shape in other.items():
        b = T(t1[:int(np.prod(shape))].copy()).reshape(shape)
        for name, op in ops.items():
            calls = {"b": lambda op=op, b=b: op(x, b),
                     "in place": lambda name=name, b=b: getattr(x.clone(), name + "_")(b)}
            if name != "sub":
                calls["a"] = lambda op=op, b=b: op(b, x)
            for which, call in calls.items():
                got, want, claimed = _both_paths(call)
                assert claimed, (shape_name, name, which)
                assert _same(got, want), (shape_name, name, which)
    want = reference(pointwise.MUL, s[:4096], np.broadcast_to(t1[:128], (32, 128)).reshape(-1),
                     None, 0.0)
    assert_bits((x * T(t1[:128].copy())).reshape(-1), want, "the reference")  # (NaNs: torch's)


@needs_fused
def test_ops_on_a_scalar_of_an_expanded_tensor_are_fused_with_the_same_bits():
    """A division, product, sum, difference or root of an expanded tensor (a mean's or a
    sum's backward: `grad.expand(...) / n`) is fused — computed on its compact form, the
    result expanded — a site of the result's size, with the torch path's bits, hard values
    and NaNs included; an expansion of a non-contiguous tensor and an in-place op are not."""
    s, _, _ = cancelling(11)
    compact = T(s[:4 * 8].copy()).reshape(4, 8, 1, 1)
    expanded = compact.expand(4, 8, 5, 6)
    leading = T(s[:6].copy()).expand(7, 6)
    calls = {
        "div": lambda: expanded / 256, "div float": lambda: torch.div(expanded, 0.3),
        "mul": lambda: expanded * 1e-3, "add": lambda: expanded + 2.5,
        "sub": lambda: expanded - 1, "sqrt": lambda: torch.sqrt(expanded),
        "leading": lambda: leading / 3,
    }
    for name, call in calls.items():
        got, want, claimed = _both_paths(call)
        assert claimed, name
        assert got.shape == want.shape and got.is_contiguous() and _same(got, want), name
    transposed = T(s[:48].copy()).reshape(6, 8).t().reshape(8, 6, 1).expand(8, 6, 3)
    for name, call in {"expanded transpose": lambda: transposed / 3,
                       "tensor operand": lambda: expanded * expanded}.items():
        got, want, claimed = _both_paths(call)
        assert not claimed, name
        assert _same(got, want), name
    assert pointwise.fused_plan(pointwise.operands(torch.ops.aten.div_.Scalar,
                                                   (expanded, 2.0), {}), True) is None


def _add_shifted(buf: torch.Tensor) -> torch.Tensor:
    """buf[i] += buf[i + 1], in place over the same memory."""
    return buf[:-1].add_(buf[1:])


@needs_fused
def test_the_fused_pass_declines_what_it_cannot_read_in_order():
    """A broadcast with a gap, a broadcast `a` of a sub, strided and float64 operands, and an
    in-place write over memory an operand partly shares take the widened path — with the same
    bits."""
    s, t1, _ = cancelling(9)
    x = T(s[:4096].copy()).reshape(64, 64)
    gap = T(t1[:64].copy()).reshape(4, 1, 16)
    buf = T(s[:4097].copy())
    calls = {
        "gap": lambda: x.reshape(4, 64, 16) * gap,
        "sub of a broadcast a": lambda: T(t1[:64].copy()).reshape(64, 1) - x,
        "strided": lambda: x.t() * x,
        "float64": lambda: x * x.double(),
        "overlap": lambda: _add_shifted(buf.clone()),
    }
    for name, call in calls.items():
        got, want, claimed = _both_paths(call)
        assert not claimed, name
        assert _same(got, want), name
    # an operand that is the written tensor itself is read in order: x.mul_(x) is fused
    y = T(s.copy())
    rec = Exact()
    with RoundingMode(POLICY, rec):
        y.mul_(y)
    assert rec.claimed and np.array_equal(y.numpy().view(np.int32),
                                          reference(pointwise.MUL, s, s, None, 0.0).view(np.int32))


def test_a_log_entry_at_a_fixed_formula_site_is_a_violation():
    """e = 0: no honest trainer logs anything at a fixed-formula site. A replayer given such a
    log declines the fused pass and the widened path reports the violation by site and op."""
    s, t1, t2 = cancelling(11)
    n = s.size
    for path in ("fused", "torch"):
        if path == "fused" and fused.MISSING is not None:
            continue
        for entry in ("direction", "value"):
            if entry == "direction":
                site = SiteLog(n, np.array([17], dtype=np.int64), np.array([True]))
            else:
                site = SiteLog(n, np.zeros(0, np.int64), np.zeros(0, bool),
                               np.array([17], dtype=np.int64), np.array([0x3F800000], np.uint32))
            replayer = SiteReplayer(POLICY, RoundingLog((site,)), step=4)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(fused, "ENABLED", path == "fused")
                with pytest.raises(LogViolationError) as raised, \
                        RoundingMode(POLICY, replayer):
                    torch.addcdiv(T(s), T(t1), T(t2), value=0.5)
            text = str(raised.value)
            assert "step 4" in text and "site 0" in text and "aten.addcdiv" in text \
                and "17" in text, text


@needs_fused
def test_an_empty_site_replays_through_the_fused_pass():
    s, t1, t2 = cancelling(13)
    rec = SiteRecorder(POLICY)
    with RoundingMode(POLICY, rec):
        recorded = torch.addcmul(T(s), T(t1), T(t2), value=2.0)
    replayer = ClaimCounting(POLICY, rec.log())
    with RoundingMode(POLICY, replayer):
        replayed = torch.addcmul(T(s), T(t1), T(t2), value=2.0)
    replayer.finish()
    assert replayer.position == 1 and replayer.claims == [True]
    assert _same(recorded, replayed)


class ClaimCounting(SiteReplayer):
    """A replayer that notes what it answered each claim."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.claims: list[bool] = []

    def claim_exact_site(self, op, numel):
        self.claims.append(super().claim_exact_site(op, numel))
        return self.claims[-1]


def test_a_replayer_declines_a_site_of_another_size_and_reports_it():
    """A claim for a site whose size differs from the log's claims nothing (its position stays)
    and the widened path reports the mismatch, naming the site."""
    from protocol.errors import LogMismatchError
    s, t1, _ = cancelling(15)
    log = RoundingLog((SiteLog(s.size + 1, np.zeros(0, np.int64), np.zeros(0, bool)),))
    replayer = ClaimCounting(POLICY, log, step=2)
    with pytest.raises(LogMismatchError, match="site 0"), RoundingMode(POLICY, replayer):
        T(s) * T(t1)
    assert replayer.claims in ([False], [])  # ([] where the fused passes are not built)
    assert replayer.position == 0


@needs_fused
def test_an_in_place_op_over_a_part_of_its_own_memory_is_not_fused():
    """x.mul_(x[0]) broadcasts a row of x over x: the fused pass would read row 0 after writing
    it, so it declines, and the widened path reads a copy."""
    s, _, _ = cancelling(17)
    for call in (lambda x: x.mul_(x[0]), lambda x: x.sub_(x[:1]), lambda x: x.add_(x[:, :1])):
        got, want, claimed = _both_paths(lambda call=call: call(T(s[:4096].copy()).reshape(64, 64)))
        assert not claimed and _same(got, want)
    x = s[:4096].reshape(64, 64).astype(np.float64)
    with np.errstate(all="ignore"):  # the last: every row read as it was before the write
        assert _same(got, T((x + x[:, :1]).astype(np.float32)))


@pytest.mark.parametrize("call", [lambda: torch._foreach_mul_([], 2.0),
                                  lambda: torch._foreach_addcmul_([], [], [], 0.5)])
def test_an_empty_foreach_list_is_refused_as_by_aten_and_no_site(call):
    for path in ("fused", "torch"):
        rec = Exact()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "ENABLED", path == "fused")
            with pytest.raises(RuntimeError, match="at least one tensor"), \
                    RoundingMode(POLICY, rec):
                call()
        assert rec.sites == [] and rec.claimed == []


def test_float64_scalars_of_a_foreach_op_are_used_unrounded():
    """`_foreach_addcmul.Tensor` with float64 scalars: both paths use each value as it is (it is
    of the compute dtype), none rounds it to float32; a float16 scalars tensor is refused."""
    from protocol.errors import DeterminismError
    s, t1, t2 = cancelling(19)
    value = 0.1  # not a float32 value
    outs = {}
    for path in ("fused", "torch"):
        if path == "fused" and fused.MISSING is not None:
            continue
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "ENABLED", path == "fused")
            with RoundingMode(POLICY, Exact()):
                outs[path] = torch._foreach_addcmul([T(s)], [T(t1)], [T(t2)],
                                                    torch.tensor([value], dtype=torch.float64))[0]
        assert_bits(outs[path], reference(pointwise.ADDCMUL, s, t1, t2, value), path)
    with pytest.raises(DeterminismError, match="float16"), RoundingMode(POLICY, Exact()):
        torch._foreach_addcmul([T(s)], [T(t1)], [T(t2)], torch.tensor([0.5], dtype=torch.float16))


def test_out_forms_of_the_fixed_formulas_write_their_out():
    s, t1, t2 = cancelling(21)
    for path in ("fused", "torch"):
        if path == "fused" and fused.MISSING is not None:
            continue
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused, "ENABLED", path == "fused")
            rec = Exact()
            out_cm, out_lerp = torch.empty(s.size), torch.empty(s.size)
            with RoundingMode(POLICY, rec):
                r1 = torch.addcmul(T(s), T(t1), T(t2), value=0.5, out=out_cm)
                r2 = torch.lerp(T(s), T(t1), 0.75, out=out_lerp)
        assert r1 is out_cm and r2 is out_lerp
        assert_bits(out_cm, reference(pointwise.ADDCMUL, s, t1, t2, 0.5), path)
        assert_bits(out_lerp, reference(pointwise.LERP, s, t1, None, 0.75), path)
        assert [site.numel for site in rec.sites] == [s.size, s.size] and not rec.claimed
