"""protocol.engine.interceptor: RoundingMode computes every FLOAT op wide, bounds it and rounds it
(SPEC §3.2, §3.2.1, §3.3).

A spy rounder (a SiteRecorder that also notes op names, sizes and whether the op's bound is
nonzero) shows which ops became sites; it also checks, at every site, the contract the rounding
engine relies on: one bound per tensor, each None, a number >= 0, or a tensor >= 0 broadcastable
to its result. Expected values are computed outside the mode in float64, rounded once per op.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protocol.codec.roundinglog import RoundingLog, SiteLog, encode_log
from protocol.engine import fused, normops
from protocol.engine.bounds import Affine, dense_bound, rule_of
from protocol.engine.decompositions import decomposition_of
from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.rounding import BoundAdversary, SiteRecorder, SiteReplayer
from protocol.engine.splitk import SplitK
from protocol.errors import DeterminismError

POLICY = PrecisionPolicy()
aten = torch.ops.aten


class Spy(SiteRecorder):
    """Record mode that also remembers (op, element count, bounded) per site, bounded meaning
    that some element's bound is nonzero, after checking the bounds' shape and sign."""

    def __init__(self, policy: PrecisionPolicy = POLICY) -> None:
        super().__init__(policy)
        self.calls: list[tuple[str, int, bool]] = []

    def round_site(self, op, ys, bounds):
        assert len(bounds) == len(ys), op
        bounded = False
        for y, b in zip(ys, bounds, strict=True):
            assert y.dtype == self.policy.compute, op
            b = dense_bound(b, y)
            if isinstance(b, torch.Tensor):
                assert torch.broadcast_shapes(b.shape, y.shape) == y.shape, op
                assert bool((b >= 0).all()), op
                finite = torch.isfinite(y).expand_as(y) & torch.isfinite(b).expand_as(y) | \
                    ~torch.isfinite(y)
                assert bool(finite.all()), f"{op}: infinite bound for a finite value"
                bounded |= bool((b > 0).any())
            elif b is not None:
                assert isinstance(b, float) and b >= 0 and math.isfinite(b), op
                bounded |= b > 0
        self.calls.append((op, sum(y.numel() for y in ys), bounded))
        return super().round_site(op, ys, bounds)

    def claim_exact_site(self, op: str, numel: int) -> bool:
        self.calls.append((op, numel, False))  # computed by the fused pointwise pass, e = 0
        return super().claim_exact_site(op, numel)

    @property
    def ops(self) -> list[str]:
        return [c[0] for c in self.calls]


def rnd(*shape, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32)


def wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def f32(x: float) -> float:
    return float(np.float32(x))


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
    assert torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def close_to(a: torch.Tensor, reference: torch.Tensor, ulps: int) -> bool:
    """|a - reference| within `ulps` float32 ULPs of reference's largest magnitude: rounding op
    by op stays near the float64 result (a closeness claim, not an exactness one)."""
    scale = float(reference.abs().max()) * 2.0**-23
    return float((a.double() - reference.double()).abs().max()) <= ulps * scale


def test_out_of_place_ops_are_computed_wide_and_rounded():
    a, b, m = rnd(8, 16, seed=1), rnd(8, 16, seed=2).abs() + 0.5, rnd(16, 5, seed=3)
    spy = Spy()
    with RoundingMode(POLICY, spy):
        q, e, p, s = a / b, torch.exp(a), a @ m, a.sum(dim=1)
        spread = (a * torch.tensor([2.0**40, 1.0]).repeat(8)).sum(dim=1)
        prod, total, axpy = a * b, a + b, torch.sub(a, b, alpha=2.5)
    assert_same_bits(q, (wide(a) / wide(b)).float())
    assert_same_bits(e, torch.exp(wide(a)).float())
    assert_same_bits(p, (wide(a) @ wide(m)).float())
    assert_same_bits(s, wide(a).sum(dim=1).float())
    assert_same_bits(spread, (wide(a) * torch.tensor([2.0**40, 1.0]).repeat(8).double())
                     .sum(dim=1).float())
    assert_same_bits(prod, (wide(a) * wide(b)).float())
    assert_same_bits(total, (wide(a) + wide(b)).float())
    assert_same_bits(axpy, torch.sub(wide(a), wide(b), alpha=2.5).float())
    # exp, reductions and scaled adds have bounds; IEEE mul and add have e = 0, and so has a
    # sum that is exact in every order (16 like-sized terms), unlike one of terms 2**40 apart,
    # and a quotient of float32 values none of which is below 2**-125 (bound rules version 5)
    assert spy.calls == [("aten.div.Tensor", 128, False), ("aten.exp.default", 128, True),
                         ("aten.mm.default", 40, True), ("aten.sum.dim_IntList", 8, False),
                         ("aten.mul.Tensor", 128, False), ("aten.sum.dim_IntList", 8, True),
                         ("aten.mul.Tensor", 128, False), ("aten.add.Tensor", 128, False),
                         ("aten.sub.Tensor", 128, True)]
    # at least one of these differs from float32 arithmetic (else the test proves nothing)
    assert not all(torch.equal(x, y) for x, y in [(q, a / b), (e, torch.exp(a)), (p, a @ m)])


def test_bounds_have_the_shapes_of_their_rules():
    """Reductions and relative rules give a bound per output element (or per row); a Cauchy–
    Schwarz mm bound is an outer product of norms, a relative one a multiple of |y|, both left
    unevaluated (`Affine`) for the fused band pass; zero rules give None."""
    seen = []

    def form(b: Affine) -> str:
        return "relative" if b.m is None else "outer" if b.col is not None else "tensor"

    class Bounds(SiteRecorder):
        def round_site(self, op, ys, bounds):
            seen.append((op, [None if b is None else
                              (form(b), tuple(torch.as_tensor(dense_bound(b, y)).shape))
                              for y, b in zip(ys, bounds, strict=True)]))
            return super().round_site(op, ys, bounds)

    a, m = rnd(4, 6, seed=4), rnd(6, 3, seed=5)
    with RoundingMode(POLICY, Bounds(POLICY)):
        a @ m, a.exp(), a.sum(1), a * 2.0, a.mean(0, keepdim=True)
    # (a * 2.0 has e = 0: on the fused pointwise pass it is no `round_site` call at all)
    mul = [] if fused.ENABLED else [("aten.mul.Tensor", [None])]
    assert seen == [("aten.mm.default", [("outer", (4, 3))]),
                    ("aten.exp.default", [("relative", (4, 6))]),
                    ("aten.sum.dim_IntList", [("tensor", (4,))]), *mul,
                    ("aten.mean.dim", [("tensor", (1, 6))])]


@pytest.mark.parametrize("op", ["add_", "mul_", "div_"])
def test_in_place_ops_write_the_original_tensor(op):
    x, y = rnd(6, 7, seed=4), rnd(6, 7, seed=5)
    before = x.clone()
    ptr = x.data_ptr()
    spy = Spy()
    with RoundingMode(POLICY, spy):
        out = getattr(x, op)(y)
    assert out is x and x.data_ptr() == ptr and x.dtype == torch.float32
    expected = getattr(wide(before), op)(wide(y)).float()
    assert_same_bits(x, expected)
    assert spy.calls == [(f"aten.{op}.Tensor", 42, False)]  # (quotients: bound rules v5)


IN_PLACE_READING_INPUTS = {
    "add": (lambda x, y, z: torch.add(x, y, alpha=3.0), lambda x, y, z: x.add_(y, alpha=3.0)),
    "lerp-tensor": (lambda x, y, z: torch.lerp(x, y, z), lambda x, y, z: x.lerp_(y, z)),
    "foreach-add": (lambda x, y, z: torch._foreach_add([x], [y], alpha=-0.3)[0],
                    lambda x, y, z: torch._foreach_add_([x], [y], alpha=-0.3)),
    "index-add": (lambda x, y, z: x.index_add(0, torch.arange(50), y),
                  lambda x, y, z: x.index_add_(0, torch.arange(50), y)),
}


@pytest.mark.parametrize("op", sorted(IN_PLACE_READING_INPUTS))
def test_in_place_rule_reads_the_inputs_before_they_are_overwritten(op):
    """x.div_(y)'s relative bound depends on the result only, but the axpy, lerp (tensor
    weight) and index-add bounds read x: they must see x as it was (the op runs out of place,
    `_functional_of`), so the in-place bound and value equal the out-of-place ones."""
    x, y, z = rnd(50, seed=6) * 1e3, rnd(50, seed=7), rnd(50, seed=8).abs() + 0.5
    got = []

    class Bounds(SiteRecorder):
        def round_site(self, op, ys, bounds):
            got.append(dense_bound(bounds[0], ys[0]).clone())
            return super().round_site(op, ys, bounds)

    out_of_place, in_place = IN_PLACE_READING_INPUTS[op]
    with RoundingMode(POLICY, Bounds(POLICY)):
        want = out_of_place(x, y, z)
        before = x.clone()
        in_place(x, y, z)
    assert torch.equal(got[0], got[1]) and not torch.equal(x, before)
    assert_same_bits(x, want)


def test_in_place_op_on_a_view_writes_through():
    base = rnd(4, 6, seed=6)
    before = base.clone()
    with RoundingMode(POLICY, Spy()):
        base[:, 2:4].mul_(3.3)
    expected = before.clone()
    expected[:, 2:4] = (wide(before[:, 2:4]) * f32(3.3)).float()
    assert_same_bits(base, expected)


def test_out_argument():
    a, b = rnd(5, 3, seed=7), rnd(3, 4, seed=8)
    out, mm_out = torch.empty(5, 3), torch.empty(5, 4)
    ptrs = out.data_ptr(), mm_out.data_ptr()
    spy = Spy()
    with RoundingMode(POLICY, spy):
        res = torch.exp(a, out=out)
        mm_res = torch.mm(a, b, out=mm_out)
    assert res is out and mm_res is mm_out and (out.data_ptr(), mm_out.data_ptr()) == ptrs
    assert_same_bits(out, torch.exp(wide(a)).float())
    assert_same_bits(mm_out, (wide(a) @ wide(b)).float())
    assert spy.calls == [("aten.exp.out", 15, True), ("aten.mm.out", 20, True)]


def test_foreach_op_is_one_site_over_all_list_elements():
    xs = [rnd(3, 4, seed=9), rnd(5, seed=10), rnd(2, 2, 2, seed=11)]
    ys = [rnd(3, 4, seed=12), rnd(5, seed=13), rnd(2, 2, 2, seed=14)]
    before = [x.clone() for x in xs]
    ptrs = [x.data_ptr() for x in xs]
    spy = Spy()
    with RoundingMode(POLICY, spy):
        torch._foreach_add_(xs, ys)
        torch._foreach_div_(xs, 1.7)
        outs = torch._foreach_sqrt([x.abs() for x in xs])
        torch._foreach_add_(xs, ys, alpha=0.5)
    assert [x.data_ptr() for x in xs] == ptrs
    for x, b, y in zip(xs, before, ys, strict=True):
        step1 = ((wide(b) + wide(y)).float().double() / f32(1.7)).float()
        assert_same_bits(x, (wide(step1) + 0.5 * wide(y)).float())
    for o, b, y in zip(outs, before, ys, strict=True):
        step1 = ((wide(b) + wide(y)).float().double() / f32(1.7)).float()
        assert_same_bits(o, wide(step1).abs().sqrt().float())
    # a square root and quotients of target values round correctly: e = 0 (bound rules v5)
    assert spy.calls == [("aten._foreach_add_.List", 25, False),
                         ("aten._foreach_div_.Scalar", 25, False),
                         ("aten._foreach_sqrt.default", 25, False),
                         ("aten._foreach_add_.List", 25, True)]
    assert len(spy.log().sites) == 4


# -- ops without a rule: decomposed, or refused ---------------------------------------------------


def test_layer_norm_runs_as_its_statistics_and_the_normalize_formula():
    """Bound rules version 4: two sites, the rows' statistics (their own rule: bounded) and the
    normalize formula on the rounded mean and rstd (a fixed formula: e = 0), so the result is
    exactly that formula's, rounded once."""
    x = rnd(6, 16, seed=15) * 3 + 1
    weight, bias = rnd(16, seed=16), rnd(16, seed=17)
    spy = Spy()
    with RoundingMode(POLICY, spy):
        y, mean, rstd = aten.native_layer_norm(x, [16], weight, bias, 1e-5)
    assert spy.calls == [("ovt.norm_stats.default", 18, True),
                         ("ovt.normalize.default", 96, False)]
    stats = normops.NORM_STATS(wide(x), [1], f32(1e-5))
    assert_same_bits(mean, stats[0].float())
    assert_same_bits(rstd, stats[2].float())
    expected = normops.NORMALIZE(wide(x), wide(mean), wide(rstd), wide(weight), wide(bias))
    assert_same_bits(y, expected.float())
    reference = F.layer_norm(wide(x), (16,), wide(weight), wide(bias), eps=f32(1e-5)).float()
    assert close_to(y, reference, 8)


def test_norm_statistics_decompose_where_their_rule_does_not_hold():
    """A constant row far from zero with a negligible eps: the mean's error squared is not small
    against eps + R²/(2K) (R = 0), so the statistics run as the two-pass primitives; the
    normalize formula reads their rounded results all the same."""
    x = rnd(3, 16, seed=18)
    x[1] = 1e6
    weight, bias = rnd(16, seed=19), rnd(16, seed=20)
    assert rule_of(normops.NORM_STATS, (x, [1], 1e-30), {}) is None
    assert rule_of(normops.NORM_STATS, (x, [1], 1e-5), {}) is not None
    spy = Spy()
    with RoundingMode(POLICY, spy):
        y = F.layer_norm(x, (16,), weight, bias, eps=1e-30)
    assert "ovt.norm_stats.default" not in spy.ops
    assert {"aten.mean.dim", "aten.sum.dim_IntList", "aten.rsqrt.default"} <= set(spy.ops)
    assert spy.ops[-1] == "ovt.normalize.default"
    assert_same_bits(y[1], bias)  # x − μ is 0 exactly there, so the formula gives the bias


def test_norm_statistics_decide_on_eps_as_the_op_reads_it():
    """A positive eps that float32 rounds to 0 (the op reads the rounded value, SPEC §3.3):
    constant rows then have t = 0, which the rule must not certify; decomposed, the record
    replays bit for bit under the emulated GPU (whose 1/K multiply makes another mean)."""
    x = torch.full((2, 49), 1.5 * 2.0**-40)
    assert f32(1e-46) == 0.0
    assert rule_of(normops.NORM_STATS, (x, [1], 1e-46), {}) is None
    recorder = Spy()
    with RoundingMode(POLICY, recorder):
        recorded = aten.native_layer_norm(x, [49], None, None, 1e-46)
    replayer = SiteReplayer(POLICY, recorder.log(), step=1)
    with RoundingMode(POLICY, replayer, compute=SplitK(seed=1, chunks=3)):
        replayed = aten.native_layer_norm(x, [49], None, None, 1e-46)
    replayer.finish()
    for a, b in zip(recorded, replayed, strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        assert_same_bits(torch.nan_to_num(a), torch.nan_to_num(b))


def test_convolution_bounds_take_one_entry_for_every_spatial_dimension():
    """ATen reads a single stride, padding or dilation entry for all spatial dimensions; so do
    the bounds (the backward's window norms), with the same result as the entries spelt out."""
    x = rnd(2, 3, 8, 8, seed=30).requires_grad_()
    w = rnd(4, 3, 3, 3, seed=31).requires_grad_()
    g = rnd(2, 4, 4, 4, seed=32)
    grads = []
    for lists in (([2], [1], [1]), ([2, 2], [1, 1], [1, 1])):
        spy = Spy()
        with RoundingMode(POLICY, spy):
            y = torch.convolution(x, w, None, *lists, False, [0], 1)
            y.backward(g)
        assert [c[2] for c in spy.calls if "convolution" in c[0]] == [True, True]
        grads.append((y.detach(), x.grad.clone(), w.grad.clone()))
        x.grad, w.grad = None, None
    for a, b in zip(*grads, strict=True):
        assert_same_bits(a, b)


def test_var_std_and_var_mean_are_the_two_pass_algorithm_rounded_per_op():
    """ovt's own decomposition (torch's uses the fused prims.var): mean, deviations, squares,
    their sum, the division — each a site, so the result is exactly those rounded steps."""
    x = rnd(5, 40, seed=18) * 4 + 100  # a large mean: a one-pass formula would cancel
    spy = Spy()
    with RoundingMode(POLICY, spy):
        v = torch.var(x, dim=1)
        s = torch.std(x, dim=1, unbiased=False)
        vm_var, vm_mean = torch.var_mean(x, dim=0, keepdim=True)
    def two_pass(t, dim, correction, keepdim):
        mean = wide(t).mean(dim, keepdim=True).float()
        dev = (wide(t) - wide(mean)).float()
        sq = (wide(dev) * wide(dev)).float()
        total = wide(sq).sum(dim, keepdim=keepdim).float()
        return (wide(total) / (t.shape[dim] - correction)).float(), mean
    assert_same_bits(v, two_pass(x, 1, 1, False)[0])
    assert_same_bits(s, wide(two_pass(x, 1, 0, False)[0]).sqrt().float())
    expected_var, expected_mean = two_pass(x, 0, 1, True)
    assert_same_bits(vm_var, expected_var)
    assert_same_bits(vm_mean, expected_mean)
    per_var = ["aten.mean.dim", "aten.sub.Tensor", "aten.mul.Tensor", "aten.sum.dim_IntList",
               "aten.div.Scalar"]
    assert spy.ops == per_var + per_var + ["aten.sqrt.default"] + per_var


def test_batch_norm_training_updates_running_stats_in_place():
    x = rnd(6, 3, 4, 4, seed=15) * 2 + 1
    weight, bias = rnd(3, seed=16), rnd(3, seed=17)
    running_mean, running_var = rnd(3, seed=18), rnd(3, seed=19).abs() + 0.5
    rm0, rv0 = running_mean.clone(), running_var.clone()
    ptrs = (running_mean.data_ptr(), running_var.data_ptr())
    spy = Spy()
    with RoundingMode(POLICY, spy):
        y = F.batch_norm(x, running_mean, running_var, weight, bias, training=True,
                         momentum=0.1, eps=1e-5)
    assert (running_mean.data_ptr(), running_var.data_ptr()) == ptrs
    assert not torch.equal(running_mean, rm0) and not torch.equal(running_var, rv0)
    assert not any("batch_norm" in op for op in spy.ops)  # decomposed (bound rules version 4)
    assert spy.ops[:2] == ["ovt.norm_stats.default", "ovt.normalize.default"]
    stats = [r.float() for r in normops.NORM_STATS(wide(x), [0, 2, 3], f32(1e-5))]
    expected = normops.NORMALIZE(wide(x), wide(stats[0]), wide(stats[2]),
                                 wide(weight).reshape(3, 1, 1), wide(bias).reshape(3, 1, 1))
    assert_same_bits(y, expected.float())
    erm, erv = wide(rm0), wide(rv0)
    out, _, _ = aten.native_batch_norm(wide(x), wide(weight), wide(bias), erm, erv, True,
                                       f32(0.1), f32(1e-5))
    assert close_to(y, out, 8)
    assert close_to(running_mean, erm, 4) and close_to(running_var, erv, 4)


def test_batch_norm_backward_runs_as_its_sums_and_the_input_gradients_formula():
    """Bound rules version 4: the backward in training is the channels' Σ g and Σ g·(x − μ)
    (one site, the reduction rule), the input gradient's fixed formula on their rounded values
    and rstd, and the weight's gradient Σ g·(x − μ)·rstd (a product of two target values):
    each gradient is exactly those, rounded once."""
    x = (rnd(6, 3, 4, 4, seed=23) * 2 + 1).requires_grad_()
    weight = rnd(3, seed=24).requires_grad_()
    bias = rnd(3, seed=25).requires_grad_()
    g = rnd(6, 3, 4, 4, seed=26)
    spy = Spy()
    with RoundingMode(POLICY, spy):
        y = F.batch_norm(x, None, None, weight, bias, training=True, eps=1e-5)
        y.backward(g)
    assert spy.ops[-3:] == ["ovt.norm_backward_stats.default", "ovt.normalize_backward.default",
                            "aten.mul.Tensor"]
    assert not any("batch_norm" in op for op in spy.ops)
    stats = [r.float() for r in normops.NORM_STATS(wide(x.detach()), [0, 2, 3], f32(1e-5))]
    mean, rstd = wide(stats[0]), wide(stats[2])
    sums = [r.float() for r in normops.NORM_BACKWARD_STATS(wide(g), wide(x.detach()), mean,
                                                           [0, 2, 3])]
    grad_input = normops.NORMALIZE_BACKWARD(wide(g), wide(x.detach()), mean, rstd,
                                            wide(weight.detach()).reshape(1, 3, 1, 1),
                                            wide(sums[0]), wide(sums[1]), 6 * 16)
    assert_same_bits(x.grad, grad_input.float())
    assert_same_bits(weight.grad, (wide(sums[1]) * rstd).float().reshape(3))
    assert_same_bits(bias.grad, sums[0].reshape(3))
    x64, w64 = wide(x.detach()).requires_grad_(), wide(weight.detach()).requires_grad_()
    F.batch_norm(x64, None, None, w64, wide(bias.detach()), training=True,
                 eps=f32(1e-5)).backward(wide(g))
    assert close_to(x.grad, x64.grad, 64) and close_to(weight.grad, w64.grad, 64)


def test_batch_norm_backward_sums_of_an_empty_batch_run_as_primitives():
    """No row has extremes to bound by: the two sums run as their primitives (zeros)."""
    g, x, mean = torch.zeros(0, 3, 4, 4), torch.zeros(0, 3, 4, 4), torch.zeros(1, 3, 1, 1)
    assert rule_of(normops.NORM_BACKWARD_STATS, (g, x, mean, [0, 2, 3]), {}) is None
    spy = Spy()
    with RoundingMode(POLICY, spy):
        sums = normops.NORM_BACKWARD_STATS(g, x, mean, [0, 2, 3])
    assert "ovt.norm_backward_stats.default" not in spy.ops
    for s in sums:
        assert_same_bits(s, torch.zeros(1, 3, 1, 1))


_NESTED = torch.library.Library("ovt_test_nesting", "DEF")  # (defined once per process)
_NESTED.define("lists(Tensor[][] x) -> Tensor")
_NESTED.impl("lists", lambda x: x[0][0] * 1.1, "CPU")
_NESTED.define("mapping(Dict(str, Tensor) x) -> Tensor")
_NESTED.impl("mapping", lambda x: x["a"] * 1.1, "CPU")


@pytest.mark.parametrize("call", [lambda a: torch.ops.ovt_test_nesting.lists([[a]]),
                                  lambda a: torch.ops.ovt_test_nesting.lists(x=[[a]]),
                                  lambda a: torch.ops.ovt_test_nesting.mapping({"a": a})],
                         ids=["nested-lists", "nested-keyword", "dict"])
def test_floats_nested_deeper_than_atens_are_found(call):
    """An op without a rule that reads floats is decomposed or refused by name, also where a
    custom op nests them deeper than ATen's one level (`_reads_floats` walks such containers;
    a regression: it read one level only, and the op met an assertion instead)."""
    with pytest.raises(DeterminismError, match="no certified error bound"), \
            RoundingMode(POLICY, Spy()):
        call(torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("transposed", [False, True])
def test_a_convolution_of_an_empty_batch_is_rounded(transposed):
    """A batch of no samples, forward and backward, has its sites (of no elements) like any
    other: the bounds' window and sample norms take an empty batch (a regression: a reshape
    with -1 refused one)."""
    x = torch.zeros(0, 3, 8, 8, requires_grad=True)
    w = rnd(3, 4, 3, 3, seed=31) if transposed else rnd(4, 3, 3, 3, seed=31)
    w.requires_grad_()
    conv = F.conv_transpose2d if transposed else F.conv2d
    spy = Spy()
    with RoundingMode(POLICY, spy):
        y = conv(x, w, padding=1)
        y.backward(torch.zeros_like(y))
    assert y.shape == (0, 4, 8, 8)
    assert_same_bits(w.grad, torch.zeros_like(w))
    assert "aten.convolution.default" in spy.ops
    assert "aten.convolution_backward.default" in spy.ops


class _CountingSplitK(SplitK):
    """SplitK that notes each op it computes."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.funcs: list = []

    def __call__(self, func, args: tuple, kwargs: dict):
        self.funcs.append(func)
        return super().__call__(func, args, kwargs)


def test_batch_norm_training_replays_bit_exactly_under_splitk():
    """Forward and backward, under the emulated GPU (its own form of the statistics, its sums
    split: the statistics reach it, not the native kernels' narrow path) and with the log
    recorded natively."""
    x0 = rnd(8, 3, 5, 5, seed=20) * 2 + 1
    weight0, bias0 = rnd(3, seed=21), rnd(3, seed=22)
    g = rnd(8, 3, 5, 5, seed=27)

    def run(rounder, compute=None):
        x, weight, bias = (t.clone().requires_grad_() for t in (x0, weight0, bias0))
        rm, rv = torch.zeros(3), torch.ones(3)
        kwargs = {} if compute is None else {"compute": compute}
        with RoundingMode(POLICY, rounder, **kwargs):
            y = F.batch_norm(x, rm, rv, weight, bias, training=True, momentum=0.1)
            y.backward(g)
        return [y.detach(), rm, rv, x.grad, weight.grad, bias.grad]

    spy = Spy()
    recorded = run(spy)
    replayer = SiteReplayer(POLICY, spy.log(), step=1)
    emulated = _CountingSplitK(seed=5, chunks=4, order="pairwise")
    replayed = run(replayer, emulated)
    replayer.finish()
    for a, b in zip(recorded, replayed, strict=True):
        assert_same_bits(a, b)
    assert normops.NORM_STATS in emulated.funcs and normops.NORM_BACKWARD_STATS in emulated.funcs


def _overload(name: str) -> torch._ops.OpOverload:
    """'aten.mm.default' -> torch.ops.aten.mm.default."""
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


@pytest.mark.parametrize("make, name", [
    (lambda x: torch.logcumsumexp(x, 0), "aten.logcumsumexp.default"),
    (lambda x: torch.special.polygamma(1, x), "aten.polygamma.default"),
    (lambda x: torch.histc(x), "aten.histc.default"),
    (lambda x: torch.cdist(x, x), "aten._cdist_forward.default"),
    # a decomposition that reaches a primitive without a rule: refused, naming the primitive
    (lambda x: torch.atan2(x, x + 1), "prims.atan2.default"),
], ids=["logcumsumexp", "polygamma", "histc", "cdist", "atan2"])
def test_op_without_rule_or_decomposition_is_refused_by_name(make, name):
    func = _overload(name)
    assert rule_of(func, (), {}) is None and decomposition_of(func) is None
    x = rnd(5, 7, seed=23)
    spy = Spy()
    with pytest.raises(DeterminismError, match=rf"^{name} has no certified error bound"), \
            RoundingMode(POLICY, spy):
        make(x)
    assert all(not op.startswith(name) for op in spy.ops)


def test_views_and_exact_ops_make_no_site():
    x = rnd(4, 6, seed=20)
    spy = Spy()
    with RoundingMode(POLICY, spy):
        v = x.view(6, 4).t().transpose(0, 1)[1:, ::2].reshape(-1)
        exact = [x.relu(), torch.cat([x, x]), x.max(), x.abs(), -x, x.clone(), x[x > 0],
                 torch.where(x > 0, x, torch.zeros_like(x)), x.flip(0), x.clamp(-1, 1),
                 torch.stack([x, x]), x.argmax(), x.sort().values, x.contiguous()]
    assert spy.calls == []
    assert v.dtype == torch.float32 and all(isinstance(e, torch.Tensor) for e in exact)


@pytest.mark.parametrize("make", [lambda x: torch.rand(3), lambda x: torch.bernoulli(x.sigmoid()),
                                  lambda x: torch.randn_like(x), lambda x: x.normal_(),
                                  lambda x: torch.randperm(5)],
                         ids=["rand", "bernoulli", "randn_like", "normal_", "randperm"])
def test_rng_without_step_randomness_is_refused(make):
    """RANDOM ops are served from a step's randomness (test_random_ops.py); a RoundingMode
    given none refuses them rather than let a device RNG decide."""
    x = rnd(4, seed=21)
    with pytest.raises(DeterminismError, match="no step randomness.*SPEC §3.4"), \
            RoundingMode(POLICY, Spy()):
        make(x)


@pytest.mark.parametrize("make", [
    lambda z: z * z,
    lambda z: z * 2.0,
    lambda z: torch.view_as_real(z.exp()),
], ids=["complex-mul", "complex-scale", "complex-exp"])
def test_complex_arithmetic_is_refused(make):
    """Complex arithmetic has no rounding site (its kernels differ between CPU and CUDA, FMA or
    not): a complex RoPE must be refused, not run natively. Views to and from complex pass."""
    x = rnd(4, 2, seed=23)
    z = torch.view_as_complex(x)
    with pytest.raises(DeterminismError, match="complex64"), RoundingMode(POLICY, Spy()):
        make(z)
    with RoundingMode(POLICY, Spy()):
        assert torch.equal(torch.view_as_real(torch.view_as_complex(x)), x)


def test_python_float_scalars_are_rounded_to_float32_first():
    x = rnd(100, seed=22)
    with RoundingMode(POLICY, Spy()):
        y = x * 0.1
        z = x + 1e-9
    assert_same_bits(y, (wide(x) * f32(0.1)).float())
    assert not torch.equal(y, (wide(x) * 0.1).float())  # the float64 0.1 would give other bits
    assert_same_bits(z, (wide(x) + f32(1e-9)).float())


def test_narrowing_copy_is_a_site_with_bound_zero():
    """A cast into the target dtype is one correctly rounded conversion (IEEE-754 §5.4.2): a
    site, but with e = 0, so not even an exact midpoint is logged."""
    w = torch.tensor([1.0 + 2.0**-24, 1.0 + 2.0**-30, 3.0 + 2.0**-23 + 2.0**-40],
                     dtype=torch.float64)
    spy = Spy()
    dst = torch.empty(3)
    with RoundingMode(POLICY, spy):
        a = w.to(torch.float32)
        dst.copy_(w)
        b = w.double()  # widening: no site
        c = w.float().to(torch.float64)
    assert_same_bits(a, w.float())
    assert_same_bits(dst, w.float())
    assert b.dtype == c.dtype == torch.float64
    assert spy.calls == [("aten._to_copy.default", 3, False), ("aten.copy_.default", 3, False),
                         ("aten._to_copy.default", 3, False)]
    assert spy.log().n_entries == 0


BF16 = PrecisionPolicy(torch.float32, torch.bfloat16)

# Every exact op that casts one tensor's values into another's dtype (interceptor._CONVERSIONS),
# each writing a float32 source into bfloat16: (name, the call, the bfloat16 values it writes,
# whether torch writes them with its vectorised cast: contiguous, so another NaN than 0x7FC0).
_CASTS = [
    ("aten.copy.default", lambda d, s: aten.copy.default(d, s), lambda r: r, True),
    ("aten.copy_.default", lambda d, s: d.copy_(s), lambda r: r, True),
    ("aten._foreach_copy_.default", lambda d, s: aten._foreach_copy_.default([d], [s]) or d,
     lambda r: r, True),
    ("aten.slice_scatter.default", lambda d, s: aten.slice_scatter.default(d, s), lambda r: r,
     True),
    ("aten.select_scatter.default",
     lambda d, s: aten.select_scatter.default(d.view(1, -1), s, 0, 0), lambda r: r[0], True),
    ("aten.as_strided_scatter.default",
     lambda d, s: aten.as_strided_scatter.default(d, s, s.shape, (1,)), lambda r: r, True),
    ("aten.diagonal_scatter.default",
     lambda d, s: aten.diagonal_scatter.default(d.view(1, -1).expand(s.numel(), -1).clone(), s),
     lambda r: r.diagonal(), False),
    ("aten._to_copy.default", lambda d, s: s.to(torch.bfloat16), lambda r: r, True),
]


@pytest.mark.parametrize("name, call, written, vectorised", _CASTS, ids=[c[0] for c in _CASTS])
def test_every_cast_into_the_target_is_a_site_with_one_nan(name, call, written, vectorised):
    """A cast into the target dtype is a site (e = 0) whatever op makes it: `copy` and the
    scatters cast their source into the first argument's dtype as `copy_` does. torch's own
    contiguous float32 -> bfloat16 cast writes 0xFFFF for a NaN where its scalar kernel (a
    strided or 0-d tensor, the isa-default machine) writes 0x7FC0; rounded as a site, every NaN
    comes out as the one bfloat16 NaN (bandpass.to_target) and every other value as torch's
    nearest-even cast."""
    from protocol.engine.bandpass import CANONICAL_NAN
    src = torch.tensor([float("nan"), -float("nan"), 1.0 + 2.0**-9, 3.0 + 2.0**-8 + 2.0**-20,
                        -0.0, float("inf")] * 8, dtype=torch.float32)
    plain = written(call(torch.zeros(src.numel(), dtype=torch.bfloat16), src))
    spy = Spy(BF16)
    with RoundingMode(BF16, spy):
        out = written(call(torch.zeros(src.numel(), dtype=torch.bfloat16), src))
    assert spy.calls == [(name, src.numel(), False)]
    assert spy.log().n_entries == 0
    bits, nan = out.view(torch.int16), src.isnan()
    assert torch.equal(bits[nan], torch.full_like(bits[nan], CANONICAL_NAN[torch.bfloat16]))
    assert torch.equal(bits[~nan], plain.view(torch.int16)[~nan])
    # (the machine's vectorised cast writes another NaN: what the site is there for)
    assert torch.equal(plain.view(torch.int16)[nan], bits[nan]) != \
        (vectorised and torch.backends.cpu.get_cpu_capability() != "DEFAULT")


# The exact max/min family (interceptor._MACHINE_BITS), each on two tensors.
_MAX_MIN = {
    "maximum": lambda a, b: torch.maximum(a, b),
    "minimum": lambda a, b: torch.minimum(a, b),
    "max.other": lambda a, b: torch.max(a, b),
    "clamp.Tensor": lambda a, b: torch.clamp(a, min=b),
    "clamp_max_.Tensor": lambda a, b: a.clone().clamp_max_(b),
    "amax": lambda a, b: torch.stack([a, b]).amax(0),
    "min.dim": lambda a, b: torch.stack([a, b]).min(0).values,
    "max": lambda a, b: torch.stack([a, b]).max().reshape(1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", list(_MAX_MIN))
def test_the_max_min_family_writes_one_nan_and_unsigned_zeros(name, dtype):
    """torch's max/min kernels choose a NaN's bits (an all-ones NaN from the vectorised ones,
    an operand's from the scalar one) and the sign of a zero among zeros of both signs by
    instruction set, thread count and layout; exact ops all the same, each result's NaNs come
    back as its dtype's one NaN and its zeros as +0, every other value as torch computes it."""
    policy = BF16 if dtype == torch.bfloat16 else POLICY
    ints = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}
    nans = {torch.float32: [0x7FC00001, -0x400000], torch.float64: [0x7FF8000000000001, -1],
            torch.bfloat16: [0x7FC1, -0x40]}[dtype]
    payload = torch.tensor(nans, dtype=ints[dtype]).view(dtype)
    a = torch.cat([payload, torch.tensor([-0.0, 0.0, -0.0, 1.5, -2.0, 0.0], dtype=dtype)] * 16)
    b = torch.cat([torch.tensor([1.0, -0.0, 0.0, -0.0, -0.0, 2.0, -3.0, 0.0], dtype=dtype)] * 16)
    plain = _MAX_MIN[name](a, b)
    with RoundingMode(policy, Spy(policy)):
        got = _MAX_MIN[name](a, b)
    from protocol.engine.bandpass import CANONICAL_NAN
    bits, nan, zero = got.view(ints[dtype]), got.isnan(), got == 0
    assert torch.equal(nan, plain.isnan()) and bool(nan.any())
    assert torch.equal(bits[nan], torch.full_like(bits[nan], CANONICAL_NAN[dtype]))
    assert torch.equal(bits[zero], torch.zeros_like(bits[zero]))
    assert torch.equal(bits[~nan & ~zero], plain.view(ints[dtype])[~nan & ~zero])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_ops_that_choose_a_nan_write_the_one_nan(dtype):
    """relu, floor, abs, neg and gather write a NaN's bits by kernel (0xFFFF from torch's
    vectorised bfloat16 kernels, a GPU's own NaN, a flipped sign from neg): under the mode every
    NaN they write is the one NaN of its dtype, on every device, every other value as torch's."""
    from protocol.engine.bandpass import CANONICAL_NAN
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[dtype]
    payload = torch.tensor([0x7FC00001, -0x400000] if dtype == torch.float32 else
                           [0x7FC1, -0x40], dtype=ints).view(dtype)
    x = torch.cat([payload, torch.tensor([-1.5, 2.5, -0.0], dtype=dtype)] * 16)
    calls = [torch.relu, torch.floor, torch.abs, torch.neg,
             lambda t: t.gather(0, torch.arange(t.numel() - 1, -1, -1))]
    for call in calls:
        plain = call(x)
        with RoundingMode(BF16 if dtype == torch.bfloat16 else POLICY, Spy()):
            got = call(x)
        bits, nan = got.view(ints), plain.isnan()
        assert torch.equal(got.isnan(), nan) and bool(nan.any())
        assert torch.equal(bits[nan], torch.full_like(bits[nan], CANONICAL_NAN[dtype]))
        assert torch.equal(bits[~nan], plain.view(ints)[~nan])


def test_a_max_over_zeros_of_both_signs_is_the_same_on_any_thread_count():
    """torch's max and amax of 2^18 zeros of both signs return +0 on one thread and −0 on two,
    or the other way round (the cpu-1t and cpu-2t profiles would differ): under the mode both
    are +0."""
    zeros = torch.zeros(1 << 18)
    zeros[::3] = -0.0
    zeros[5::7] = -0.0
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with RoundingMode(POLICY, Spy()):
                got.append([zeros.amax(), zeros.max(), zeros.amin(), zeros.min()])
    finally:
        torch.set_num_threads(threads)
    assert [[int(t.view(torch.int32)) for t in row] for row in got] == [[0] * 4] * 2


_TOS = {  # aten.to's overloads, which reach the mode inside decompositions and inference mode
    "aten.to.dtype": lambda s: aten.to.dtype(s, torch.bfloat16),
    "aten.to.device": lambda s: aten.to.device(s, s.device, torch.bfloat16),
    "aten.to.other": lambda s: aten.to.other(s, torch.zeros(1, dtype=torch.bfloat16)),
    "aten.to.dtype_layout": lambda s: aten.to.dtype_layout(s, dtype=torch.bfloat16),
    "aten._to_copy.out": lambda s: aten._to_copy.out(
        s, out=torch.empty(s.shape, dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("name", list(_TOS))
def test_every_to_into_the_target_is_a_site_with_one_nan(name):
    """`to` (in inference mode, and inside decompositions: a bfloat16 tanh's backward) and
    `_to_copy.out` ask for their dtype otherwise than `_to_copy`'s `dtype=`: each cast into the
    target is a site all the same, every NaN the one bfloat16 NaN."""
    from protocol.engine.bandpass import CANONICAL_NAN
    src = torch.tensor([float("nan"), -float("nan"), 1.0 + 2.0**-9, -0.0] * 16)
    spy = Spy(BF16)
    with torch.inference_mode(), RoundingMode(BF16, spy):
        out = _TOS[name](src)
    assert spy.calls == [(name, src.numel(), False)]
    bits, nan = out.view(torch.int16), src.isnan()
    assert out.dtype == torch.bfloat16
    assert torch.equal(bits[nan], torch.full_like(bits[nan], CANONICAL_NAN[torch.bfloat16]))
    assert torch.equal(bits[~nan], src[~nan].to(torch.bfloat16).view(torch.int16))


def test_a_float16_cast_into_bfloat16_is_a_site_with_one_nan():
    """float16 holds values bfloat16 does not (three more significand bits): a cast between
    them rounds, so it is a site like a cast from float32 (torch's CPU cast writes 0x7FC0 for
    every NaN, a GPU its own 0x7FFF), every NaN the one bfloat16 NaN and every other value the
    nearest-even rounding, as torch's. A cast from bfloat16 into float32 under the float32
    policy is exact, and no site."""
    from protocol.engine.bandpass import CANONICAL_NAN
    src = torch.tensor([math.nan, 1.0 + 2.0**-9 + 2.0**-10, 65504.0, 6e-8, -0.0] * 16,
                       dtype=torch.float16)
    src.view(torch.int16)[1] = 0x7E01  # a NaN with a payload
    spy = Spy(BF16)
    with RoundingMode(BF16, spy):
        out = src.to(torch.bfloat16)
    assert spy.calls == [("aten._to_copy.default", src.numel(), False)]
    bits, nan = out.view(torch.int16), src.isnan()
    assert torch.equal(bits[nan], torch.full_like(bits[nan], CANONICAL_NAN[torch.bfloat16]))
    assert torch.equal(bits[~nan], src[~nan].to(torch.bfloat16).view(torch.int16))
    spy = Spy(POLICY)
    with RoundingMode(POLICY, spy):
        widened = out.to(torch.float32)
    assert spy.calls == [] and torch.equal(widened.view(torch.int32)[~nan],
                                           out[~nan].to(torch.float32).view(torch.int32))


def test_a_decomposition_s_cast_into_bfloat16_writes_one_nan():
    """tanh's backward decomposes through torch._refs, whose type promotion calls `to`: the
    gradient of a NaN is the one bfloat16 NaN (torch's vectorised cast wrote 0xFFFF there,
    its scalar one 0x7FC0)."""
    from protocol.engine.bandpass import CANONICAL_NAN
    x = torch.full((64,), float("nan"), dtype=torch.bfloat16, requires_grad=True)
    with RoundingMode(BF16, SiteRecorder(BF16)):
        torch.tanh(x).sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad.view(torch.int16),
                       torch.full((64,), CANONICAL_NAN[torch.bfloat16], dtype=torch.int16))


def test_an_out_form_casting_into_the_target_writes_one_nan():
    """An exact op asked to write wider floats into a target-dtype `out=` tensor casts them
    natively (correctly rounded, the same values on every machine, but torch's vectorised cast
    into bfloat16 writes 0xFFFF for a NaN): every NaN it writes is the one NaN, every other
    value torch's. Comparisons into a float `out=` and same-dtype forms run as they are."""
    from protocol.engine.bandpass import CANONICAL_NAN
    wide = torch.tensor([float("nan"), 1.0 + 2.0**-9, -0.0, 3.0] * 16)
    calls = {
        "cat": lambda out: torch.cat([wide], out=out),
        "stack": lambda out: torch.stack([wide], out=out.view(1, -1)).view(-1),
        "eq": lambda out: torch.eq(wide, 1.0, out=out),
    }
    for name, call in calls.items():
        plain = call(torch.empty(64, dtype=torch.bfloat16))
        with RoundingMode(BF16, Spy(BF16)):
            got = call(torch.empty(64, dtype=torch.bfloat16))
        bits, nan = got.view(torch.int16), plain.isnan()
        assert torch.equal(got.isnan(), nan), name
        assert torch.equal(bits[nan], torch.full_like(bits[nan], CANONICAL_NAN[torch.bfloat16]))
        assert torch.equal(bits[~nan], plain.view(torch.int16)[~nan]), name


def test_a_to_into_the_target_keeps_the_memory_format_asked():
    """A cast copies into the memory format it is asked for: the rounding handed to `to`
    (already of the dtype asked) is copied, not handed back in its own layout."""
    x = torch.randn(4, 5).t()
    native = x.to(torch.bfloat16, memory_format=torch.contiguous_format)
    with torch.inference_mode(), RoundingMode(BF16, Spy(BF16)):
        got = x.to(torch.bfloat16, memory_format=torch.contiguous_format)
        kept = x.to(torch.bfloat16)  # (preserve_format: the source's strides, as natively)
    assert got.is_contiguous() and got.stride() == native.stride()
    assert kept.stride() == x.to(torch.bfloat16).stride()
    assert torch.equal(got.view(torch.int16), native.view(torch.int16))


def test_index_put_writes_repeated_positions_in_index_order_on_any_thread_count():
    """index_put without accumulating, where positions repeat: torch leaves which write lands
    to its kernel (two CPU threads land another than one); under the mode the last write in
    index order lands, on one thread and on two."""
    g = torch.Generator().manual_seed(5)
    rows, cols = torch.randint(0, 10, (1 << 18,), generator=g), \
        torch.randint(0, 100, (1 << 18,), generator=g)
    values = torch.randn(1 << 18, generator=g)
    last = {}
    for i, j, v in zip(rows.tolist(), cols.tolist(), values.tolist(), strict=True):
        last[i, j] = v
    want = torch.zeros(10, 100)
    for (i, j), v in last.items():
        want[i, j] = v
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 2, 2):  # (natively, nine two-thread runs in ten land other values)
            torch.set_num_threads(n)
            x = torch.zeros(10, 100)
            with RoundingMode(POLICY, Spy()):
                x.index_put_((rows, cols), values)
            assert torch.equal(x, want), n
    finally:
        torch.set_num_threads(threads)
    assert not torch.are_deterministic_algorithms_enabled()


def test_a_cast_within_the_target_dtype_or_widening_is_no_site():
    """The conversions copy without a site where nothing narrows: a bfloat16 source, or a
    bfloat16 destination's values widened into float32."""
    src = rnd(16, seed=31).to(torch.bfloat16)
    spy = Spy(BF16)
    with RoundingMode(BF16, spy):
        same = aten.slice_scatter.default(torch.zeros(16, dtype=torch.bfloat16), src)
        up = aten.copy.default(torch.zeros(16), src)
    assert spy.calls == []
    assert torch.equal(same, src) and torch.equal(up, src.float())


def test_integer_ops_pass_through():
    i, j = torch.arange(10), torch.arange(10, 20)
    spy = Spy()
    with RoundingMode(POLICY, spy):
        out = [(i + 3) * j, i.sum(), torch.bincount(i % 3), i // 4, torch.cumsum(j, 0)]
    assert spy.calls == []
    assert torch.equal(out[0], (torch.arange(10) + 3) * torch.arange(10, 20))
    assert int(out[1]) == 45 and out[1].dtype == torch.int64


def test_compute_dtype_ops_in_a_step_are_rounded_sites():
    """A float64 tensor inside the step (a program computing wide) is already in the compute
    dtype: the op is a site all the same, its result rounded to float32 values and handed back
    as float64 — no float64 bits that differ between machines survive a site."""
    w = torch.tensor([1.0 + 2.0**-30, 3.0 + 2.0**-28, -7.0], dtype=torch.float64)
    spy = Spy()
    with RoundingMode(POLICY, spy):
        z = w * 3.0
        q = torch.exp(w)
    assert z.dtype == q.dtype == torch.float64
    assert torch.equal(z, (w * 3.0).float().double())
    assert torch.equal(q, torch.exp(w).float().double())
    assert not torch.equal(z, w * 3.0)  # the float64 product itself is not what came back
    assert spy.calls == [("aten.mul.Tensor", 3, False), ("aten.exp.default", 3, True)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_other_floating_dtypes_are_refused(dtype):
    """The policy certifies float64 -> float32 only (SPEC §3.1): a half-precision op in the step
    is refused, naming the op and the dtype."""
    x = torch.ones(3, dtype=dtype)
    with pytest.raises(DeterminismError, match=rf"aten.mul.Tensor computes on a {dtype} "), \
            RoundingMode(POLICY, Spy()):
        x * 0.5


def test_factory_asking_for_the_target_dtype_is_rounded():
    spy = Spy()
    with RoundingMode(POLICY, spy):
        t = torch.linspace(0, 1, 7, dtype=torch.float32)
        z = torch.zeros(4, dtype=torch.float32)  # exact: no site
    assert_same_bits(t, torch.linspace(0, 1, 7, dtype=torch.float64).float())
    assert spy.calls == [("aten.linspace.default", 7, True)]
    assert z.tolist() == [0.0] * 4


def test_factory_of_the_default_dtype_is_rounded():
    assert torch.get_default_dtype() == torch.float32
    spy = Spy()
    with RoundingMode(POLICY, spy):
        t = torch.linspace(0, 1, 1000)
        u = torch.arange(0, 10, 0.1)
        k = torch.arange(10)  # integers: no site
    assert_same_bits(t, torch.linspace(0, 1, 1000, dtype=torch.float64).float())
    assert_same_bits(u, torch.arange(0, 10, f32(0.1), dtype=torch.float64).float())
    assert spy.calls == [("aten.linspace.default", 1000, True),
                         ("aten.arange.start_step", 100, True)]
    assert k.dtype == torch.int64


def test_reads_after_an_in_place_write_see_the_new_values():
    x, y = torch.ones(4), torch.full((4,), 2.0)
    with RoundingMode(POLICY, Spy()):
        a = x * y
        x.mul_(3.0)
        view = x[1:3]
        view.add_(1.0)
        b = x * y
    assert a.tolist() == [2.0] * 4 and b.tolist() == [6.0, 8.0, 8.0, 6.0]


def test_reads_after_a_write_through_data_see_the_new_values():
    x, y = torch.ones(4), torch.full((4,), 2.0)
    with RoundingMode(POLICY, Spy()):
        x * y
        x.data.mul_(3.0)
        b = x * y
    assert x.tolist() == [3.0] * 4
    assert b.tolist() == [6.0] * 4


# -- autograd and optimizers -------------------------------------------------------------------


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)  # outside any step: this is only a test fixture
    return nn.Sequential(nn.Linear(12, 64), nn.Tanh(), nn.Linear(64, 64), nn.LayerNorm(64),
                         nn.GELU(), nn.Linear(64, 3))


def _train(model, opt, policy, rounder_for_step, compute=None, steps=3):
    data = rnd(32, 12, seed=30)
    target = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1] * 4)
    losses, rounders = [], []
    for t in range(steps):
        rounder = rounder_for_step(t)
        kwargs = {} if compute is None else {"compute": compute}
        with RoundingMode(policy, rounder, **kwargs):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(data * (1.0 + t)), target)
            loss.backward()
            opt.step()
        if hasattr(rounder, "finish"):
            rounder.finish()
        losses.append(loss.detach())
        rounders.append(rounder)
    return losses, rounders


def _state(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


OPTIMIZERS = [
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3,
                                            foreach=True), id="sgd"),
    pytest.param(lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True), id="adam"),
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=True),
                 id="adamw")]


@pytest.mark.parametrize("make_opt", OPTIMIZERS)
@pytest.mark.parametrize("auditor", ["splitk", "splitk+adversary"])
def test_training_record_replays_bit_exactly_under_splitk(make_opt, auditor):
    model_a = _tiny_model()
    opt_a = make_opt(model_a.parameters())
    losses_a, recs = _train(model_a, opt_a, POLICY, lambda t: Spy())
    logs = [r.log() for r in recs]
    ops = {op for r in recs for op in r.ops}
    assert {"aten.addmm.default", "aten.mm.default", "ovt.norm_stats.default",
            "ovt.normalize.default"} <= ops
    # the loss and its backward: decomposed; layer norm's forward: its statistics and the
    # normalize formula (bound rules version 4); log-softmax, GELU, their backwards and layer
    # norm's backward: one site each, by their own rules (bound rules version 3)
    for composite in ("nll_loss", "native_layer_norm.default", "cross_entropy"):
        assert not any(composite in op for op in ops), composite
    assert {"aten._log_softmax.default", "aten._log_softmax_backward_data.default",
            "aten.gelu.default", "aten.gelu_backward.default",
            "aten.native_layer_norm_backward.default"} <= ops
    assert "aten.erf.default" not in ops
    assert any(op.startswith("aten._foreach_") for op in ops)  # the optimizer ran under the mode
    assert sum(log.n_entries for log in logs) > 0

    model_b = _tiny_model()
    opt_b = make_opt(model_b.parameters())

    def replayer(t):
        rep = SiteReplayer(POLICY, logs[t], step=t)
        return BoundAdversary(rep, POLICY) if "adversary" in auditor else rep

    losses_b, _ = _train(model_b, opt_b, POLICY, replayer, compute=SplitK(seed=3, chunks=3))
    for x, y in zip(_state(model_a, opt_a), _state(model_b, opt_b), strict=True):
        assert x.dtype == y.dtype
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    assert all(torch.equal(x, y) for x, y in zip(losses_a, losses_b, strict=True))


class _Keeping:
    """A rounder wrapper that keeps each site's rounded values."""

    def __init__(self, inner) -> None:
        self.inner, self.values = inner, []

    def round_site(self, op, ys, bounds):
        out = self.inner.round_site(op, ys, bounds)
        self.values.append(torch.cat([o.reshape(-1) for o in out]))
        return out

    def finish(self):
        if hasattr(self.inner, "finish"):
            self.inner.finish()


def test_training_replay_without_the_entries_differs():
    """The replays above are not trivially equal: with every entry dropped (same sites, same
    sizes) the adversary auditor's own rounding, under SplitK, rounds some logged element the
    other way. (Most such elements are intermediate values whose other rounding later ops
    absorb, so the final state may still agree: that is a legal move, SPEC §6.)"""
    model_a = _tiny_model()
    opt_a = torch.optim.Adam(model_a.parameters(), lr=1e-2, foreach=True)
    _, recs = _train(model_a, opt_a, POLICY, lambda t: _Keeping(Spy()))
    assert sum(r.inner.log().n_entries for r in recs) > 0
    empty = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    plain = [RoundingLog(tuple(SiteLog(s.numel, *empty) for s in r.inner.log().sites))
             for r in recs]
    model_b = _tiny_model()
    opt_b = torch.optim.Adam(model_b.parameters(), lr=1e-2, foreach=True)
    _, reps = _train(model_b, opt_b, POLICY,
                     lambda t: _Keeping(BoundAdversary(SiteReplayer(POLICY, plain[t]), POLICY)),
                     compute=SplitK(seed=3, chunks=3))
    assert any(not torch.equal(x, y) for rec, rep in zip(recs, reps, strict=True)
               for x, y in zip(rec.values, rep.values, strict=True))


def test_splitk_compute_really_changes_the_wide_values():
    """SplitK's float64 results differ from native ones, so replays under it are a real test."""
    a, b = rnd(16, 300, seed=40).double(), rnd(300, 16, seed=41).double()
    assert not torch.equal(SplitK(seed=3)(torch.ops.aten.mm.default, (a, b), {}), a @ b)


def test_a_mode_warms_the_math_library_once_per_thread_count_and_thread(monkeypatch):
    """`warm_math_library` runs before a mode computes anything: one call per compute dtype,
    on CPU tensors with a chunk for every worker thread, at a thread count not yet warmed from
    the calling thread; none at one already warmed."""
    import threading

    from protocol.engine import interceptor
    calls: list[tuple[torch.dtype, str, int]] = []
    real = torch.sqrt

    def counted(x, *args, **kwargs):
        calls.append((x.dtype, x.device.type, x.numel()))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(interceptor, "_WARMED", interceptor._Warmed())
    monkeypatch.setattr(torch, "sqrt", counted)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        RoundingMode(POLICY, SiteRecorder(POLICY))
        assert calls == [(torch.float64, "cpu", 3 * 2048), (torch.float32, "cpu", 3 * 2048)]
        RoundingMode(POLICY, SiteRecorder(POLICY))
        assert len(calls) == 2
        torch.set_num_threads(4)
        RoundingMode(POLICY, SiteRecorder(POLICY))
        assert len(calls) == 4
        other = threading.Thread(target=RoundingMode, args=(POLICY, SiteRecorder(POLICY)))
        other.start()
        other.join()
        assert len(calls) == 6  # (another thread starts parallel work with workers of its own)
    finally:
        torch.set_num_threads(before)


_FIRST_SQRT = """
import sys, torch
from protocol.engine.interceptor import warm_math_library
warm_math_library()
torch.manual_seed(int(sys.argv[1]))
x = (torch.rand(3001) * 4 + 0.25).double()
print(int(torch.equal(torch.sqrt(x), torch.sqrt(x))))
"""


@pytest.mark.slow  # (24 processes, 40 s)
def test_the_first_square_root_after_the_warm_up_is_accurate():
    """Statistical, in fresh processes (the fault is a process's first call): without the
    warm-up, about one process in twelve computed half of its first float64 square root with
    errors of 1e5 ULPs (`warm_math_library`), so that this test would fail with a probability
    of about 0.85; after it, the first call must equal the next."""
    import subprocess
    import sys
    outcomes = [subprocess.run([sys.executable, "-c", _FIRST_SQRT, str(seed)], check=True,
                               capture_output=True, text=True, timeout=120).stdout.strip()
                for seed in range(24)]
    assert outcomes == ["1"] * 24


def test_a_compiled_function_in_a_step_does_not_trace_the_interceptor():
    """A program may `torch.compile` a function it calls inside a step: dynamo must not trace
    `RoundingMode`'s own Python (torch wraps a mode's `__torch_dispatch__` in a frame that
    disables dynamo, which the mode keeps, though it costs about 1.7 µs an op: traced, the
    recorder's state and its caches would be a compiled graph's). The compiled function records
    the eager function's sites and values, and dynamo warns of nothing it traced."""
    def step(x, w):
        return torch.tanh(x @ w).sum()

    x, w = rnd(4, 4, seed=40), rnd(4, 4, seed=41)
    compiled = torch.compile(step, backend="eager")
    eager, traced = Spy(), Spy()
    try:
        with RoundingMode(POLICY, eager):
            want = step(x, w)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with RoundingMode(POLICY, traced):
                got = compiled(x, w)
    finally:
        torch._dynamo.reset()
    assert_same_bits(got, want)
    assert [s.numel for s in traced.sites] == [s.numel for s in eager.sites]
    assert not [w for w in caught if "Dynamo" in str(w.message)], \
        [str(w.message)[:120] for w in caught]


def test_inference_mode_matmuls_are_rounded_as_outside_it():
    """Inference tensors have no version counter, so the caches that check entries by one (the
    widened copies, the matrix norms) pass them by: a chain of matmuls small and large (the
    widening cache keeps tensors from 8 K elements) under `torch.inference_mode` rounds to the
    same bits and logs the same entries as outside it."""
    g = torch.Generator().manual_seed(23)
    a, b = torch.randn(160, 96, generator=g), torch.randn(96, 120, generator=g)

    def chain() -> tuple[torch.Tensor, SiteRecorder]:
        recorder = SiteRecorder(POLICY)
        with RoundingMode(POLICY, recorder):
            x = a * 1.5
            y = torch.mm(x, b)
            z = torch.mm(y.t(), x)
            return torch.mm(x[:8, :6], b[:6, :8]).sum() + z.sum(), recorder

    plain, plain_log = chain()
    with torch.inference_mode():
        inferred, inferred_log = chain()
    assert torch.equal(inferred.view(torch.int32), plain.view(torch.int32))
    assert encode_log(inferred_log.log()) == encode_log(plain_log.log())
