"""protocol.engine.interceptor: RoundingMode computes every FLOAT op wide and rounds it (SPEC §3.2).

A spy rounder (a SiteRecorder that also notes op names and sizes) shows which ops became sites.
Expected values are computed outside the mode, in float64, then rounded once to float32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from protocol.engine.interceptor import RoundingMode
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.rounding import SiteRecorder, SiteReplayer
from protocol.engine.splitk import SplitK
from protocol.errors import DeterminismError

POLICY = PrecisionPolicy()


class Spy(SiteRecorder):
    """Record mode that also remembers (op, element count, ieee) per site."""

    def __init__(self, policy: PrecisionPolicy = POLICY) -> None:
        super().__init__(policy)
        self.calls: list[tuple[str, int, bool]] = []

    def round_site(self, op, ys, ieee=False):
        self.calls.append((op, sum(y.numel() for y in ys), ieee))
        return super().round_site(op, ys, ieee)


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


def test_out_of_place_ops_are_computed_wide_and_rounded():
    a, b, m = rnd(8, 16, seed=1), rnd(8, 16, seed=2).abs() + 0.5, rnd(16, 5, seed=3)
    spy = Spy()
    with RoundingMode(POLICY, spy):
        q, e, p, s = a / b, torch.exp(a), a @ m, a.sum(dim=1)
    assert_same_bits(q, (wide(a) / wide(b)).float())
    assert_same_bits(e, torch.exp(wide(a)).float())
    assert_same_bits(p, (wide(a) @ wide(m)).float())
    assert_same_bits(s, wide(a).sum(dim=1).float())
    assert [c[0] for c in spy.calls] == ["aten.div.Tensor", "aten.exp.default", "aten.mm.default",
                                         "aten.sum.dim_IntList"]
    assert [c[1] for c in spy.calls] == [128, 128, 40, 8]
    # at least one of these differs from float32 arithmetic (else the test proves nothing)
    assert not all(torch.equal(x, y) for x, y in [(q, a / b), (e, torch.exp(a)), (p, a @ m)])


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
    assert spy.calls == [(f"aten.{op}.Tensor", 42, op != "div_")]


def test_in_place_op_on_a_view_writes_through():
    base = rnd(4, 6, seed=6)
    before = base.clone()
    with RoundingMode(POLICY, Spy()):
        base[:, 2:4].mul_(3.3)
    expected = before.clone()
    expected[:, 2:4] = (wide(before[:, 2:4]) * f32(3.3)).float()
    assert_same_bits(base, expected)


def test_out_argument():
    a, b = rnd(5, 3, seed=7), rnd(5, 3, seed=8)
    out = torch.empty(5, 3)
    ptr = out.data_ptr()
    spy = Spy()
    with RoundingMode(POLICY, spy):
        res = torch.atan2(a, b, out=out)
    assert res is out and out.data_ptr() == ptr
    assert_same_bits(out, torch.atan2(wide(a), wide(b)).float())
    assert spy.calls == [("aten.atan2.out", 15, False)]


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
    assert [x.data_ptr() for x in xs] == ptrs
    for x, b, y in zip(xs, before, ys, strict=True):
        assert_same_bits(x, ((wide(b) + wide(y)).float().double() / f32(1.7)).float())
    for o, x in zip(outs, xs, strict=True):
        assert_same_bits(o, wide(x).abs().sqrt().float())
    assert spy.calls == [("aten._foreach_add_.List", 25, True),
                         ("aten._foreach_div_.Scalar", 25, False),
                         ("aten._foreach_sqrt.default", 25, True)]
    assert len(spy.log().sites) == 3


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
    # the same op on float64 copies, with the scalars rounded to float32 first
    erm, erv = wide(rm0), wide(rv0)
    out, _, _ = torch.ops.aten.native_batch_norm(wide(x), wide(weight), wide(bias), erm, erv,
                                                 True, f32(0.1), f32(1e-5))
    assert_same_bits(y, out.float())
    assert_same_bits(running_mean, erm.float())
    assert_same_bits(running_var, erv.float())
    assert not torch.equal(running_mean, rm0) and not torch.equal(running_var, rv0)
    (site,) = [c for c in spy.calls if "native_batch_norm" in c[0]]
    assert site == ("aten.native_batch_norm.default", 288 + 3 + 3 + 3 + 3, False)


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
def test_device_rng_is_refused(make):
    x = rnd(4, seed=21)
    with pytest.raises(DeterminismError, match="SPEC §3.4"), RoundingMode(POLICY, Spy()):
        make(x)


def test_python_float_scalars_are_rounded_to_float32_first():
    x = rnd(100, seed=22)
    with RoundingMode(POLICY, Spy()):
        y = x * 0.1
        z = x + 1e-9
    assert_same_bits(y, (wide(x) * f32(0.1)).float())
    assert not torch.equal(y, (wide(x) * 0.1).float())  # the float64 0.1 would give other bits
    assert_same_bits(z, (wide(x) + f32(1e-9)).float())


def test_narrowing_copy_is_a_site():
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
    assert [c[1] for c in spy.calls] == [3, 3, 3]
    assert all(s.indices.tolist() == [0, 2] for s in spy.log().sites)  # in-band elements logged


def test_integer_ops_pass_through():
    i, j = torch.arange(10), torch.arange(10, 20)
    spy = Spy()
    with RoundingMode(POLICY, spy):
        out = [(i + 3) * j, i.sum(), torch.bincount(i % 3), i // 4, torch.cumsum(j, 0)]
        half = torch.ones(3, dtype=torch.float64) * 0.5  # another floating dtype: untouched
    assert spy.calls == []
    assert torch.equal(out[0], (torch.arange(10) + 3) * torch.arange(10, 20))
    assert int(out[1]) == 45 and half.dtype == torch.float64


def test_factory_asking_for_the_target_dtype_is_rounded():
    spy = Spy()
    with RoundingMode(POLICY, spy):
        t = torch.linspace(0, 1, 7, dtype=torch.float32)
    assert_same_bits(t, torch.linspace(0, 1, 7, dtype=torch.float64).float())
    assert spy.calls == [("aten.linspace.default", 7, False)]


def test_factory_of_the_default_dtype_is_rounded():
    assert torch.get_default_dtype() == torch.float32
    spy = Spy()
    with RoundingMode(POLICY, spy):
        t = torch.linspace(0, 1, 1000)
        u = torch.arange(0, 10, 0.1)
    assert_same_bits(t, torch.linspace(0, 1, 1000, dtype=torch.float64).float())
    assert_same_bits(u, torch.arange(0, 10, f32(0.1), dtype=torch.float64).float())
    assert [c[0] for c in spy.calls] == ["aten.linspace.default", "aten.arange.start_step"]


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
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.LayerNorm(16),
                         nn.GELU(), nn.Linear(16, 3))


def _train(model, opt, policy, rounder_for_step, compute=None, steps=3):
    data = rnd(8, 12, seed=30)
    target = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    losses, rounders = [], []
    for t in range(steps):
        rounder = rounder_for_step(t)
        kwargs = {} if compute is None else {"compute": compute}
        with RoundingMode(policy, rounder, **kwargs):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(data * (1.0 + t)), target)
            loss.backward()
            opt.step()
        if isinstance(rounder, SiteReplayer):
            rounder.finish()
        losses.append(loss.detach())
        rounders.append(rounder)
    return losses, rounders


def _state(model, opt) -> list[torch.Tensor]:
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=True)],
    ids=["sgd", "adam", "adamw"])
def test_training_record_replays_bit_exactly_under_splitk(make_opt):
    model_a = _tiny_model()
    opt_a = make_opt(model_a.parameters())
    losses_a, recs = _train(model_a, opt_a, POLICY, lambda t: Spy())
    logs = [r.log() for r in recs]
    ops = {c[0] for r in recs for c in r.calls}
    assert {"aten.addmm.default", "aten.mm.default", "aten.native_layer_norm.default",
            "aten.native_layer_norm_backward.default"} <= ops
    assert any(op.startswith("aten._foreach_") for op in ops)  # the optimizer ran under the mode
    assert sum(log.n_entries for log in logs) > 0

    model_b = _tiny_model()
    opt_b = make_opt(model_b.parameters())
    losses_b, _ = _train(model_b, opt_b, POLICY, lambda t: SiteReplayer(POLICY, logs[t], step=t),
                         compute=SplitK(seed=3, chunks=3))
    for x, y in zip(_state(model_a, opt_a), _state(model_b, opt_b), strict=True):
        assert x.dtype == y.dtype
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    assert all(torch.equal(x, y) for x, y in zip(losses_a, losses_b, strict=True))


def test_splitk_compute_really_changes_the_wide_values():
    """The replay above is not trivially equal: SplitK's float64 results differ from native."""
    a, b = rnd(16, 300, seed=40).double(), rnd(300, 16, seed=41).double()
    assert not torch.equal(SplitK(seed=3)(torch.ops.aten.mm.default, (a, b), {}), a @ b)
