"""The interceptor's widening cache (`interceptor.WidenCache`) and the results the rounder
overwrites with their roundings (`round_result_in_place`, issue 13): whatever a view, a write
or a reuse of memory does, what an op reads is exactly its target-dtype argument widened."""

from __future__ import annotations

import math

import pytest
import torch

from protocol.engine import fused
from protocol.engine.interceptor import RoundingMode, WidenCache
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.rounding import SiteRecorder, SiteReplayer

POLICY = PrecisionPolicy()
F64 = torch.float64
needs_fused = pytest.mark.skipif(not fused.ENABLED, reason="the fused passes are not built")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64 if t.dtype == F64 else torch.int32)


def assert_widened(cache: WidenCache, t: torch.Tensor) -> torch.Tensor:
    wide = cache.widen(t)
    assert wide.dtype == F64 and wide.shape == t.shape
    assert torch.equal(bits(wide), bits(t.to(F64)))
    return wide


def odd_values(*shape: int) -> torch.Tensor:
    """float32 values of every magnitude and sign, with a NaN, infinities and subnormals."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-140, 120, shape,
                                                                    generator=g).float())
    flat = x.view(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-42])
    return x


def test_every_view_of_a_widened_storage_reads_its_own_elements():
    """Transposes, slices, reshapes, broadcasts (stride 0) and offsets of one storage, in any
    order: each widened exactly, the later ones from the span the first made."""
    x = odd_values(6, 8)
    cache = WidenCache(F64, cache_from=1)
    views = [x, x.t(), x[1:4], x[:, 2:], x[2:5, 1:7].t(), x.view(3, 16), x[3],
             x[0].expand(5, 8), x.view(-1)[5:40], x.unsqueeze(0).expand(2, 6, 8)]
    for v in views:
        assert_widened(cache, v)
    assert sum(len(spans) for spans in cache.entries.values()) == 1  # all from x's span


def test_a_sparse_view_is_widened_alone_and_not_kept():
    x = odd_values(40, 40)
    cache = WidenCache(F64, cache_from=1)
    assert_widened(cache, x[:, 3])  # 40 elements over a span of 1,561
    assert not cache.entries and cache.held == 0
    assert_widened(cache, x[7:9])  # a dense slice is kept, its span only
    assert cache.held == 80 * 8


def test_two_spans_of_one_storage_live_side_by_side():
    x = odd_values(100)
    cache = WidenCache(F64, cache_from=1)
    a, b = assert_widened(cache, x[0:10]), assert_widened(cache, x[50:70])
    assert len(cache.entries[next(iter(cache.entries))]) == 2
    assert cache.widen(x[2:8]).data_ptr() == a.data_ptr() + 2 * 8  # served from a's span
    assert cache.widen(x[60:61]).data_ptr() == b.data_ptr() + 10 * 8


def test_a_write_is_seen_through_every_view():
    """A write through any view bumps the version the views share; a write through an alias
    with its own counter (`.data`) is dropped by the interceptor's `forget`; a stale span is
    dropped when a newer one is made."""
    x = odd_values(6, 8)
    cache = WidenCache(F64, cache_from=1)
    assert_widened(cache, x.t())
    x[2].add_(1.0)
    assert_widened(cache, x[1:4])
    assert_widened(cache, x.t())
    x.data[0, 0] = 12345.0  # no counter the entries know of: the interceptor forgets it
    cache.forget(x.data)
    assert not cache.entries and cache.held == 0
    assert_widened(cache, x)
    x.mul_(2.0)
    assert_widened(cache, x)
    assert len(next(iter(cache.entries.values()))) == 1 and cache.held == 48 * 8


def test_the_budget_caps_what_is_kept():
    cache = WidenCache(F64, cache_from=1, budget_bytes=100 * 8)
    a, b = odd_values(60), odd_values(60)
    assert_widened(cache, a)
    assert_widened(cache, b)  # over the budget: widened, not kept
    assert cache.held == 60 * 8 and len(cache.entries) == 1


def test_a_tensor_in_the_memory_of_a_dead_one_is_not_served_its_values():
    """An entry refers to its storage weakly: once the program lets go of a widened tensor its
    memory is freed and may hold the next tensor, whose widening must be its own."""
    cache = WidenCache(F64, cache_from=1)
    seen, reused = set(), 0
    for k in range(50):
        t = torch.full((256,), float(k))
        reused += t.data_ptr() in seen
        seen.add(t.data_ptr())
        assert_widened(cache, t)
        del t
    assert reused  # (else no memory was handed on and this proves nothing)


def test_entries_of_storages_let_go_of_make_room_when_the_budget_is_short():
    """A dead tensor's entry serves nothing: it is dropped, its wide copy freed, once a new
    entry would not fit beside it."""
    cache = WidenCache(F64, cache_from=1, budget_bytes=100 * 8)
    a, b = odd_values(60), odd_values(60)
    assert_widened(cache, a)
    del a
    kept = assert_widened(cache, b)
    assert cache.held == 60 * 8 and len(cache.entries) == 1
    assert cache.widen(b).data_ptr() == kept.data_ptr()  # b's own entry


def test_a_cache_full_of_live_entries_is_not_walked_at_every_op(monkeypatch):
    """While every entry's storage is alive, a sweep frees nothing: after one, the cache lets as
    many shortages pass as it has storages before the next; a storage let go of is still
    dropped within that many."""
    cache = WidenCache(F64, cache_from=1, budget_bytes=10 * 8 * 8)
    live = [odd_values(8) for _ in range(10)]
    for t in live:
        assert_widened(cache, t)
    sweeps = []
    real = cache._sweep
    monkeypatch.setattr(cache, "_sweep", lambda: sweeps.append(1) or real())
    for _ in range(110):
        assert_widened(cache, odd_values(8))  # short every time, nothing to drop
    assert 1 <= len(sweeps) <= 110 // 10 + 1
    del live[0]
    kept = []
    for _ in range(12):
        t = odd_values(8)
        assert_widened(cache, t)
        kept.append(t)  # (alive: its entry stays)
    assert cache.held == 10 * 8 * 8 and len(cache.entries) == 10
    assert any((t.untyped_storage().data_ptr(), t.device) in cache.entries for t in kept)


def test_a_noted_result_serves_its_views():
    cache = WidenCache(F64, cache_from=1)
    r = odd_values(5, 7)
    wide = r.to(F64)
    cache.note(r, wide)
    got = assert_widened(cache, r.t())
    assert got.data_ptr() == wide.data_ptr()  # no copy made
    r.add_(1.0)
    assert assert_widened(cache, r).data_ptr() != wide.data_ptr()


class NotInPlace(SiteRecorder):
    rounds_in_place = False


@needs_fused
@pytest.mark.parametrize("rounder", [SiteRecorder, NotInPlace])
def test_a_result_rounded_in_place_is_read_back_as_its_rounding(rounder):
    """A chain of ops reading the previous result through views: with the rounder writing the
    rounding back (the recorder, then the replayer of its log) the same bits and the same log as
    without, and the later reads served by the noted results."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 24, generator=g) / 5
    x = torch.randn(16, 24, generator=g)

    def chain():
        h = torch.mm(x, w)
        h = torch.mm(h.t().contiguous().t(), w.t())
        h = torch.tanh(h.view(4, 96)).view(16, 24)
        return torch.mm(h[:, :12].t(), h[:, 12:])

    rec = rounder(POLICY)
    mode = RoundingMode(POLICY, rec)
    mode._widened.cache_from = 1  # (small tensors: every one kept)
    noted = []
    note = mode._widened.note
    mode._widened.note = lambda r, wide: noted.append(r) or note(r, wide)
    with mode:
        out = chain()
    plain = SiteRecorder(POLICY)
    with RoundingMode(POLICY, plain) as ref_mode:
        ref_mode._widened.budget = 0  # nothing kept: every argument widened afresh
        ref = chain()
    assert torch.equal(bits(out), bits(ref))
    assert [(s.numel, s.indices.tolist(), s.value_indices.tolist()) for s in rec.sites] == \
        [(s.numel, s.indices.tolist(), s.value_indices.tolist()) for s in plain.sites]
    assert len(noted) == (4 if rounder is SiteRecorder else 0)  # (every site of one result)
    rep = SiteReplayer(POLICY, rec.log())
    with RoundingMode(POLICY, rep):
        again = chain()
    rep.finish()
    assert torch.equal(bits(again), bits(out))


def test_a_replayed_result_with_entries_is_written_back_as_its_rounding():
    """A result whose site has log entries (every element a float32 midpoint, 1 + 2**-24) is
    replayed with its entries applied, and its compute-dtype memory then holds that rounding
    widened and is noted for the ops that read it next, as after record's band pass."""
    x, w = torch.tensor([[1.0, 2.0**-24]] * 4), torch.ones(2, 3)
    rec = SiteRecorder(POLICY)
    with RoundingMode(POLICY, rec):
        out = torch.mm(x, w)
    assert rec.sites[0].indices.size == 12
    rep = SiteReplayer(POLICY, rec.log())
    mode = RoundingMode(POLICY, rep)
    mode._widened.cache_from = 1
    noted: list[tuple[torch.Tensor, torch.Tensor]] = []
    note = mode._widened.note
    mode._widened.note = lambda r, wide: noted.append((r, wide)) or note(r, wide)
    with mode:
        again = torch.mm(x, w)
    rep.finish()
    assert torch.equal(bits(again), bits(out))
    assert len(noted) == 1 and noted[0][0] is again and torch.equal(noted[0][1], out.double())


def run_both(fn):
    """`fn()` under record with results rounded in place and spans kept, and with neither:
    (outputs, sites) of each."""
    runs = []
    for rounder in (SiteRecorder, NotInPlace):
        rec = rounder(POLICY)
        mode = RoundingMode(POLICY, rec)
        mode._widened.cache_from = 1  # (small tensors: every one kept)
        if rounder is NotInPlace:
            mode._widened.budget = 0
        with mode:
            out = fn()
        runs.append(([bits(t) for t in out],
                     [(s.numel, s.indices.tolist(), s.value_indices.tolist()) for s in rec.sites]))
    return runs


@needs_fused
def test_a_noted_result_loses_its_negative_zeros_with_its_rounding():
    """Rules with `unsigned_zero` turn a rounded −0 into +0 after rounding (inside the mode, an
    in-place op bumps no version counter): the noted copy must turn with it, or the next op
    reads −0 where the honest value is +0 (1/x: −inf against +inf), and a replay, a machine
    without the fused passes or an adversary auditor, none of which note the site, disagrees
    with the record (a regression: the first version of this noted −0)."""
    p = torch.tensor([[1.0, 0.0, 0.0], [0.4, 0.6, 0.0]])
    g = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, 2.0, -5.0]])
    x = torch.tensor([-40.0, -1.0, 0.5, 2.0, -60.0, 3.0])

    def fn():
        d = torch.ops.aten._softmax_backward_data(g, p, 1, torch.float32)
        h = torch.nn.functional.gelu(x)  # gelu(-40) = -0 before its fix-up
        return 1.0 / d, 1.0 / h

    (noted, noted_log), (plain, plain_log) = run_both(fn)
    assert all(torch.equal(a, b) for a, b in zip(noted, plain, strict=True))
    assert noted_log == plain_log
    reciprocal = noted[1].view(torch.float32)  # 1/gelu(x): +inf where gelu gave +0
    assert reciprocal[0] == math.inf and reciprocal[4] == math.inf


def test_a_storage_moved_by_resize_serves_no_span():
    """`resize_` moves a storage's memory: the entries over the old memory must not serve a
    new tensor that lands there (the interceptor's `forget` after the op looks up the new
    memory, and a fresh tensor's version is 0 again)."""
    def fn():
        outs = []
        for k in range(20):
            x = torch.full((1024,), 1.0 + k)
            y = torch.exp(x)      # x's span widened and kept
            old = x.untyped_storage().data_ptr()
            x.resize_(1 << 16)    # its memory moved, the old block freed
            z = torch.zeros(1024)  # may land on the old block
            landed.append(z.untyped_storage().data_ptr() == old)
            outs.append(torch.exp(z))
            del y
        return outs

    landed: list[bool] = []

    (kept, kept_log), (plain, plain_log) = run_both(fn)
    assert all(torch.equal(a, b) for a, b in zip(kept, plain, strict=True))
    assert all(torch.equal(t.view(torch.float32), torch.ones(1024)) for t in kept)
    if not any(landed):  # (this allocator put no new tensor there: the case did not arise)
        pytest.skip("no tensor landed on a block freed by resize_")


def test_a_result_over_an_arguments_memory_is_not_rounded_in_place():
    """`_base` is not set inside a dispatch mode, so a result's memory is compared with its
    op's arguments, lists included: a result sharing it is rounded by `round_site`."""
    from protocol.engine.interceptor import _shares_storage
    a = torch.randn(4, 4, dtype=F64)
    assert _shares_storage(a[1], ((a,), {}))
    assert _shares_storage(a.t(), (([torch.ones(2), a[2:]],), {}))
    assert _shares_storage(a[0], ((), {"out": a}))
    assert not _shares_storage(a.clone(), ((a, [a]), {"other": a}))


def test_nothing_is_rounded_in_place_once_the_cache_is_full():
    """With no room to note a result, overwriting it would be a write for nothing: the site
    goes to `round_site`."""
    class Counting(SiteRecorder):
        in_place = 0

        def round_result_in_place(self, op, y, bound):
            Counting.in_place += 1
            return super().round_result_in_place(op, y, bound)

    x = torch.randn(64, 64)
    for budget, expected in ((512 * 2**20, 2), (64 * 64 * 8 - 1, 0)):
        Counting.in_place = 0
        mode = RoundingMode(POLICY, Counting(POLICY))
        mode._widened.budget, mode._widened.cache_from = budget, 1
        with mode:
            torch.tanh(torch.exp(x))
        assert Counting.in_place == expected, budget


def test_a_small_tensor_is_widened_afresh_and_never_kept():
    """Below `cache_from` elements (`CACHE_FROM`: a bias, a norm's statistics) a copy costs
    less than an entry: nothing is kept, noted or rounded in place, and every read is still
    exactly the argument widened; from it on, the span is kept and serves views as large
    (a smaller view of it is copied afresh too)."""
    from protocol.engine.interceptor import CACHE_FROM
    cache = WidenCache(F64)
    assert cache.cache_from == CACHE_FROM
    with pytest.raises(ValueError, match="cache_from must be at least 1"):
        WidenCache(F64, cache_from=0)
    small = odd_values(CACHE_FROM - 1)
    assert_widened(cache, small)
    assert_widened(cache, small[3:])
    cache.note(small, small.to(F64))
    assert not cache.entries and cache.held == 0
    large = odd_values(2 * CACHE_FROM)
    wide = assert_widened(cache, large)
    assert cache.entries and assert_widened(cache, large[5:]).data_ptr() == wide.data_ptr() + 40
    assert assert_widened(cache, large[:CACHE_FROM - 1]).data_ptr() != wide.data_ptr()

    class Counting(SiteRecorder):
        in_place = 0

        def round_result_in_place(self, op, y, bound):
            Counting.in_place += 1
            return super().round_result_in_place(op, y, bound)

    with RoundingMode(POLICY, Counting(POLICY)):
        torch.exp(small)
        torch.exp(large)
    assert Counting.in_place == 1  # the large result only
