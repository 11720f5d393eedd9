"""The step interceptor: every floating-point op of a step, computed wide and rounded (SPEC §3.2).

`RoundingMode` is a `TorchDispatchMode`, so it sits below autograd and sees the forward pass,
the backward pass and the optimizer update as one stream of aten ops; the user's model and
optimizer code run unmodified. For each FLOAT op (see `optable`) with a bound rule (`bounds`) it:

1. upcasts every target-dtype tensor argument to the compute dtype (exact) and rounds every
   Python float argument to the target dtype, so the op's inputs are target-representable;
2. runs the op in the compute dtype (through `compute`, which a profile may replace to re-order
   accumulation, see `splitk`), keeping the native kernel;
3. computes each result element's certified error bound from the op's rule (SPEC §3.2.1);
4. hands all floating results — outputs, then arguments the op wrote to — with their bounds to
   the rounder as one site, and returns target-dtype tensors (writing in place where the op was
   in place).

Step 1 widens each storage's memory once a step where it can (`WidenCache`: the views an op
reads of what an earlier op read are served from the same copy), and a lone result the op owns
is rounded in place (`round_result_in_place`): its compute-dtype memory is left holding its
rounding widened, which the ops reading that rounding then read instead of a fresh copy.

The fixed formulas (addcmul, addcdiv, lerp with a scalar weight) run as `pointwise` computes
them, never as ATen's kernels, with e = 0. An op with e = 0 whose operands the fused pointwise
pass reads (`pointwise.fused_plan`) skips steps 1–4: if the rounder claims the site
(`claim_exact_site`), that pass computes its float32 results straight from its float32 inputs;
so do layer and batch norm's normalize formulas (`normops.fused_formula`).

A FLOAT op without a rule runs its decomposition (`decompositions`) under this same mode, so
each primitive inside is its own site; one with neither is refused. EXACT ops run untouched on
target-dtype tensors. RANDOM ops are served from the step's portable generator, or refused with
a `DeterminismError` naming them (`random_ops.serve_random_op`, SPEC §3.4): their values are
exact, no site; only the arithmetic a served op does on its inputs runs here as sites.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from protocol.engine import normops, pointwise
from protocol.engine.bandpass import CANONICAL_NAN, canonical_nans
from protocol.engine.bounds import FIXED_FORMULA, BoundContext, Rule, bounds_for, rule_of
from protocol.engine.decompositions import decomposition_of
from protocol.engine.optable import OpKind, accumulates, mutated_args, op_kind, op_name
from protocol.engine.precision import PrecisionPolicy
from protocol.engine.random_ops import StepRandomness, serve_random_op
from protocol.errors import DeterminismError

Compute = Callable[[torch._ops.OpOverload, tuple, dict], object]

# Large elementwise sites are computed and rounded in parts (`RoundingMode._in_parts`): from
# PARTS_FROM elements, PART at a time (4 MiB of float64 per buffer: a part's result and each
# widened operand). Parts of 1 MiB repeat each part's Python work four times as often: the
# optimizer's square root and division at GPT-2 width took about 10 % longer; parts of 8 MiB
# gained nothing more (issue 13).
PARTS_FROM = 1 << 21
PART = 1 << 19

# `WidenCache` keeps the widened copies of tensors from this many elements (8 K: 64 KiB of
# float64); a smaller one is widened afresh, which costs less than finding or keeping an entry.
CACHE_FROM = 1 << 13


def native_compute(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    return func(*args, **kwargs)


class _Warmed(threading.local):
    """Per thread: the thread counts at which the CPU math library has been warmed from it
    (`warm_math_library`; OpenMP keeps a pool of worker threads per thread that starts
    parallel work)."""

    def __init__(self) -> None:
        self.counts: set[int] = set()


_WARMED = _Warmed()
# Elements per thread of each warm-up call: ATen shares these ops out in chunks of at least 2,048,
# so that every worker thread gets some.
_WARM_GRAIN = 2048


def warm_math_library() -> None:
    """Make every worker thread's first call into the CPU math library, at the current thread
    count, on values no site uses. Measured on torch 2.13's CPU wheel (MKL's vector
    math): a process's first float64 square root, 3,001 elements on 2 threads, returned in 3 of
    40 fresh processes the half its second thread computed with errors up to 1.4e5 float64
    ULPs (2^-36 relative) — far past the rules' bounds (`bounds._MAX_ULPS`, SPEC
    §3.2.1), so an honest record need not replay (a test's recording in parts and whole
    disagreed once in ten runs) — while every later call, of that function or another (atan,
    tanh, exp, log, erf, sin), was right. After one warm-up call none of 40 processes showed
    it. Both compute dtypes are warmed, once per thread count and calling thread."""
    threads = torch.get_num_threads()
    if threads in _WARMED.counts:
        return
    for dtype in (torch.float64, torch.float32):
        torch.sqrt(torch.linspace(1.0, 2.0, _WARM_GRAIN * threads, dtype=dtype, device="cpu"))
    _WARMED.counts.add(threads)


class _Span(NamedTuple):
    """A `WidenCache` entry: elements [first, first + len(wide)) of the storage `source` refers
    to, widened, made at `version` of the tensor they came from; `size` the bytes it counts
    against the budget (its wide copy's)."""

    source: StorageWeakRef  # the storage's identity, without keeping its memory alive
    version: int
    first: int
    wide: torch.Tensor
    size: int

    def serves(self, storage: torch.UntypedStorage, version: int) -> bool:
        """Whether the span still holds what `storage`'s elements were when it was made, as far
        as the cache can see: the same storage (not another one since placed at its address)
        at the same version."""
        return self.version == version and self.source.cdata == storage._cdata


class WidenCache:
    """Compute-dtype copies of target-dtype memory already widened during one step.

    The backward pass reads the weights and activations the forward pass read, and an op often
    reads another view (a transpose, a reshape, a slice) of what an earlier op made or read, so
    widening every argument afresh repeats most of the widening traffic. An entry is a widened
    span of one storage's elements (`_Span`), from which any view of that storage lying inside
    the span is served as a view (`as_strided`), checked against the version counter of the
    tensor it was made from (which views share) and against the storage being that same
    storage. A write the program makes bumps that counter; a write the interceptor itself
    executes bumps none (inside a dispatch mode no in-place op does), and neither does one
    through an alias with its own counter (`p.data.mul_(...)`), so every write the interceptor
    executes drops the entries of the storage written (`forget`). An entry refers to its
    storage weakly (`StorageWeakRef`): the program's memory is freed when the program lets go of
    it, and once it has, the entry serves nothing and is dropped when the budget is short
    (`fits`), its wide copy freed. Entries are made two ways: `widen`, from a view whose span
    holds at most twice its elements (a sparser one is widened alone, and not kept); and `note`,
    a site's result that the rounder overwrote with its rounding (`round_result_in_place`), so
    that no copy is made at all. Entries stop being added once their wide copies of storages
    still alive hold `budget_bytes`. A tensor of fewer than `cache_from` elements
    (`CACHE_FROM`: a bias, a norm's weight or statistics) is widened afresh each time and never
    kept: its copy costs less than an entry's bookkeeping (in a transformer step at bench size,
    about 1.2 of 65 ms).

    The default budget, 1 GiB, holds at GPT-2's vocabulary the language-model head's widened
    weights (300 MiB), read again by the backward pass, besides the roundings of its logits and
    of their gradients (300 MiB each) while they are alive. With 512 MiB, and entries that kept
    their storages alive, each was widened twice: 180 ms of a record step against 65 ms (issue
    13).
    """

    def __init__(self, compute: torch.dtype, budget_bytes: int = 2**30,
                 cache_from: int = CACHE_FROM) -> None:
        if cache_from < 1:
            raise ValueError(f"cache_from must be at least 1 (an empty tensor has no span to "
                             f"keep), got {cache_from}")
        self.compute, self.budget, self.held = compute, budget_bytes, 0
        self.cache_from = cache_from
        self.entries: dict[tuple, list[_Span]] = {}  # per storage (`_storage_key`)
        self._wait = 0  # shortages to pass before the next sweep (`fits`)

    def widen(self, t: torch.Tensor) -> torch.Tensor:
        """`t.to(self.compute)`, as a view of a cached span where one covers `t`; a tensor of
        fewer than `cache_from` elements, or an inference tensor (`torch.inference_mode`: it
        has no version counter to check an entry by), afresh."""
        if t.numel() < self.cache_from or t.is_inference():  # (no version to check it by)
            return t.to(self.compute)
        first = int(t.storage_offset())
        if t.is_contiguous():
            last = first + t.numel() - 1
        else:
            last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        version = t._version
        spans = self.entries.get(key, [])
        for span in spans:
            if span.first <= first and last < span.first + span.wide.numel() and \
                    span.serves(storage, version):
                wide = span.wide
                return wide.as_strided(t.shape, t.stride(),
                                       wide.storage_offset() + first - span.first)
        length = last - first + 1
        if key[0] == 0 or length > 2 * t.numel():
            return t.to(self.compute)
        current = [span for span in spans if span.serves(storage, version)]
        if len(current) < len(spans):  # the others are of no use
            self.held -= sum(span.size for span in spans) - sum(span.size for span in current)
            if current:
                self.entries[key] = current
            else:
                del self.entries[key]
        wide = t.as_strided((length,), (1,), first).to(self.compute)
        self._add(key, _Span(StorageWeakRef(storage), version, first, wide, _bytes(wide)))
        return wide.as_strided(t.shape, t.stride(), 0)

    def note(self, r: torch.Tensor, wide: torch.Tensor) -> None:
        """Take `wide`, a contiguous compute-dtype tensor equal to `r.to(self.compute)`, as the
        widened copy of `r`'s memory: `r` contiguous and not empty, `wide` nobody else's. One
        of fewer than `cache_from` elements, or an inference tensor, is not kept (`widen`
        serves none)."""
        if r.numel() < self.cache_from or r.is_inference():
            return
        storage = r.untyped_storage()
        self._add((storage.data_ptr(), r.device),
                  _Span(StorageWeakRef(storage), r._version, int(r.storage_offset()),
                        wide.view(-1), _bytes(wide)))

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` would be kept; where the budget is short, first drops
        the entries whose storage the program has let go of (`_sweep`) — after a sweep that
        dropped nothing, only once as many shortages again as there are storages have passed,
        so that a cache full of live entries costs no walk over them at every op."""
        if self.held + nbytes > self.budget:
            if self._wait:
                self._wait -= 1
            elif not self._sweep():
                self._wait = len(self.entries)
        return self.held + nbytes <= self.budget

    def _sweep(self) -> bool:
        """Drop the spans whose storage the program has let go of; whether there were any."""
        dropped = False
        for key, spans in list(self.entries.items()):
            alive = [span for span in spans if not span.source.expired()]
            if len(alive) < len(spans):
                dropped = True
                self.held -= sum(span.size for span in spans) - sum(span.size for span in alive)
                if alive:
                    self.entries[key] = alive
                else:
                    del self.entries[key]
        return dropped

    def _add(self, key: tuple, span: _Span) -> None:
        if self.fits(span.size):
            self.entries.setdefault(key, []).append(span)
            self.held += span.size

    def forget(self, written) -> None:
        """Drop every entry over the storage of `written` (a tensor or a list of them)."""
        for t in written if isinstance(written, (list, tuple)) else (written,):
            if isinstance(t, torch.Tensor):
                for span in self.entries.pop(_storage_key(t), ()):
                    self.held -= span.size


def _shares_storage(y: torch.Tensor, inputs: tuple[tuple, dict]) -> bool:
    """Whether `y`'s memory is that of a tensor among an op's arguments (one level of lists,
    as ATen's arguments nest)."""
    key = _storage_key(y)
    for value in (*inputs[0], *inputs[1].values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and _storage_key(t) == key:
                return True
    return False


def _flatten(out) -> tuple[list, TreeSpec | None]:
    """`tree_flatten(out)`, without a pytree walk where `out` is one tensor or a flat tuple or
    list of tensors and Nones, as an ATen op's results are: then the spec is None."""
    if isinstance(out, torch.Tensor):
        return [out], None
    if type(out) in (tuple, list) and all(v is None or isinstance(v, torch.Tensor) for v in out):
        return list(out), None
    return tree_flatten(out)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_of(ids: set[int]):
    """A tree_map function copying the tensors in `ids` (an in-place op's wide inputs)."""
    def copy(value):
        return value.clone() if isinstance(value, torch.Tensor) and id(value) in ids else value
    return copy


@lru_cache(maxsize=1024)
def _functional_of(func: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The out-of-place form of an in-place op that writes its first argument only
    (`addcmul_` -> `addcmul`, `_foreach_lerp_.Scalar` -> `_foreach_lerp.Scalar`), or None.
    A rule that reads an in-place op's inputs then reads them unchanged, with no copy taken
    before the op runs; the result is the value written, rounded and copied back as before."""
    positions, names = mutated_args(func)
    arguments = func._schema.arguments
    if not pointwise.family(func)[2] or positions != {0} or names != {arguments[0].name}:
        return None
    packet = getattr(torch.ops.aten, func.overloadpacket.__name__[:-1], None)
    functional = getattr(packet, func._overloadname, None) if packet is not None else None
    if not isinstance(functional, torch._ops.OpOverload) or \
            [a.name for a in functional._schema.arguments] != [a.name for a in arguments]:
        return None
    return functional


@dataclass(frozen=True)
class _OpPlan:
    """What the interceptor needs to know of an op overload, worked out once per overload and
    found by its identity (`_plan_of`): an `OpOverload` hashes in Python, and the hot path
    asked each of these facts of it through a cache of its own (issue 13)."""

    func: torch._ops.OpOverload  # held, so that its id stays its own
    kind: OpKind
    name: str  # op_name
    source: int | None  # the argument a conversion casts (`_CONVERSIONS`), else None
    machine_bits: int  # _NAN_AND_ZERO_BITS, _NAN_BITS (`_MACHINE_BITS`) or 0
    index_put: bool  # whether it accumulates depends on the call (`optable.accumulates`)
    positions: frozenset[int]  # the arguments it writes (mutated_args)
    names: frozenset[str]
    fixed: bool  # computed by its fixed formula (pointwise.is_fixed)
    elementwise: bool  # one of pointwise's ops, in a form it takes (pointwise.takes)
    foreach: bool
    in_place: bool
    norm_formula: bool  # one of normops's normalize formulas (`RoundingMode._fused_formula`)
    statistics: bool  # one of normops's statistics (`RoundingMode._narrow_statistics`)
    passthrough: bool  # EXACT, writing, converting and accumulating nothing: run as it is


_PLANS: dict[int, _OpPlan] = {}

# The exact ops that cast one argument's values into another dtype, by the position of that
# argument (`_OpPlan.source`): `_to_copy` and `to` into the dtype they are asked for
# (`_cast_dtype`), the others into their first argument's dtype, element by element for the
# foreach form. A cast into the target dtype among them is a rounding
# (`RoundingMode._narrowing_copy`). (`to` reaches the mode inside decompositions and under
# inference mode; `_foreach_copy`, out of place, is a FLOAT op: rounded as a site on the
# widened path.)
_CONVERSIONS = {"_to_copy": 0, "to": 0, "copy_": 1, "copy": 1, "_foreach_copy_": 1,
                "slice_scatter": 1, "select_scatter": 1, "diagonal_scatter": 1,
                "as_strided_scatter": 1}


@lru_cache(maxsize=64)
def _narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether a cast from the floating dtype `source` into `target` may round: `source` holds
    values `target` does not (more significand bits, or a wider exponent range: float64 or
    float32 into float32 or bfloat16, and float16 into bfloat16, which torch's CPU casts
    through float32, writing a NaN by code path, where a GPU writes its own NaN)."""
    if source == target:
        return False
    wide, narrow = torch.finfo(source), torch.finfo(target)
    return wide.eps < narrow.eps or wide.max > narrow.max or wide.smallest_normal < \
        narrow.smallest_normal


# Exact ops whose results' NaN bits or zero signs are the machine's (a cross-instruction-set
# audit of every exact op, run natively and under ATEN_CPU_CAPABILITY=default, on 1 and 2
# threads and in several layouts). The max/min family, in every floating dtype: the vectorised
# maximum writes an all-ones NaN where the scalar kernel keeps an operand's, and a max or min
# over zeros of both signs returns either sign by thread count and layout. Others choose a
# NaN's bits: in bfloat16 on the CPU relu, clamp, threshold and the like write 0xFFFF for a NaN
# from the vectorised kernels, an operand's bits from the scalar one, and floor, ceil, round,
# trunc, abs and neg and the scatters and gathers alike; a GPU's float instructions write its
# own NaN (0x7FFFFFFF) where the CPU's keep an operand's (not measured here: no GPU was lent to
# the audit); neg turns the one NaN into another. The interceptor runs them natively, then
# makes those bits canonical (`RoundingMode._canonical_bits`), in every dtype and on every
# device: every NaN its dtype's one NaN (`bandpass.CANONICAL_NAN`) and, for the max/min family,
# every zero +0.
_NAN_AND_ZERO_BITS, _NAN_BITS = 1, 2
_MACHINE_BITS = {
    **dict.fromkeys(("maximum", "minimum", "max", "min", "amax", "amin", "clamp", "clamp_",
                     "clamp_min", "clamp_min_", "clamp_max", "clamp_max_"), _NAN_AND_ZERO_BITS),
    **dict.fromkeys(("relu", "relu_", "hardtanh", "hardtanh_", "threshold",
                     "threshold_backward", "floor", "floor_", "ceil", "ceil_", "round", "round_",
                     "trunc", "trunc_", "abs", "abs_", "neg", "neg_", "scatter", "scatter_",
                     "gather"), _NAN_BITS),
}

# Ops with a positional `input_dtype` naming the dtype of their result: computed wide, it is the
# compute dtype (`RoundingMode._widen`).
_INPUT_DTYPE_OPS = frozenset({"_softmax_backward_data", "_log_softmax_backward_data"})


def _plan_of(func: torch._ops.OpOverload) -> _OpPlan:
    """`func`'s plan, made on its first call (overloads live as long as torch's op registry,
    and each plan holds its own)."""
    plan = _PLANS.get(id(func))
    if plan is None:
        packet = func.overloadpacket.__name__
        positions, names = mutated_args(func)
        _, foreach, in_place = pointwise.family(func)
        kind, source = op_kind(func), _CONVERSIONS.get(packet)
        machine_bits = _MACHINE_BITS.get(packet, 0)
        index_put = packet in ("index_put", "index_put_")
        plan = _OpPlan(func, kind, op_name(func), source, machine_bits, index_put, positions,
                       names, pointwise.is_fixed(func), pointwise.takes(func), foreach, in_place,
                       func in normops.FORMULAS, func in normops.STATISTICS,
                       kind is OpKind.EXACT and source is None and not machine_bits and
                       not (index_put or positions or names))
        _PLANS[id(func)] = plan
    return plan


def _in_index_order(func: torch._ops.OpOverload, args: tuple, kwargs: dict):
    """Run `index_put` without accumulating so that a position named twice gets its writes in
    index order, the last one landing: torch leaves that choice to the kernel, and on two CPU
    threads (or a GPU) it lands another value than on one. On the CPU on one intra-op thread
    (a switch each step pins already; other threads' ops only run slower meanwhile), on a GPU
    by torch's deterministic implementation (a process-wide switch too, under which another
    thread's op without such an implementation would raise: no other thread computes on the
    GPU during a step)."""
    if args[0].is_cpu:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return func(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    if torch.are_deterministic_algorithms_enabled():
        return func(*args, **kwargs)
    torch.use_deterministic_algorithms(True)
    try:
        return func(*args, **kwargs)
    finally:
        torch.use_deterministic_algorithms(False)


def _copying(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """`func`'s arguments (an `aten.to` overload) with `copy=True`: given a tensor of the
    dtype asked already, `to` would hand it back as it is, in the rounding's layout, where a
    cast copies into the memory format asked."""
    names = [a.name for a in func._schema.arguments]
    where = names.index("copy")
    if where < len(args):
        return (*args[:where], True, *args[where + 1:]), kwargs
    return args, {**kwargs, "copy": True}


def _cast_dtype(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The dtype a `_to_copy` or `to` call converts into: its `dtype=`, else the first dtype
    among its positional arguments (`to.dtype`, `to.device`) or the first tensor's there
    (`to.other`), else its `out=` tensor's (`_to_copy.out`); None where it keeps the dtype."""
    dtype = kwargs.get("dtype")
    if isinstance(dtype, torch.dtype):
        return dtype
    for value in args[1:]:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, torch.Tensor):
            return value.dtype
    out = kwargs.get("out")
    return out.dtype if isinstance(out, torch.Tensor) else None


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.device)


class RoundingMode(TorchDispatchMode):
    """Computes each FLOAT op in `policy.compute` and rounds its results through `rounder`.

    `rounder` is a `SiteRecorder` (record mode) or `SiteReplayer` (replay mode); anything with
    `round_site(op_name, [tensors], [bounds]) -> [tensors]` works (the divergence probe and the
    bound adversary use that). One with `bounds_needed() -> bool` is asked before each site
    whether it reads the bounds; where it does not (a replayed site with no log entries: most
    of them) they are not computed, and one with `bound_positions() -> positions | None` (on
    its class) where it reads them, so that a rule may compute them there alone
    (`bounds.bounds_for`; asked for a rule with `at_positions` only). One with
    `claim_exact_site(op_name, numel) -> bool` may take a site with e = 0 without seeing its
    values (the fused pointwise pass); a rounder that must see every site's values (a probe)
    declines, and so must a wrapper that forwards unknown attributes to another rounder, unless
    passing the site over is right for it too (the bound adversary passes over exact
    operations, and takes roots and quotients wide: its own `claim_exact_site`). `randomness`
    serves the step's RANDOM ops; without it they are refused.
    """

    def __init__(self, policy: PrecisionPolicy, rounder, compute: Compute = native_compute,
                 randomness: StepRandomness | None = None):
        super().__init__()
        warm_math_library()
        self.policy, self.rounder, self.compute = policy, rounder, compute
        self.randomness = randomness
        self._round_scalar = policy.scalar_rounder
        self._unit_roundoff = policy.unit_roundoff
        self._widened = WidenCache(policy.compute)
        self._bounds = BoundContext(policy)
        # asked at every site: looked up once (`_bounds_needed`, `_round_result`, the fused paths)
        self._needed = getattr(rounder, "bounds_needed", None)
        self._in_place = getattr(type(rounder), "rounds_in_place", False)
        self._positions = getattr(type(rounder), "bound_positions", None)
        self._claim = getattr(rounder, "claim_exact_site", None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        plan = _plan_of(func)
        if plan.passthrough:  # (most ops of a step: views, copies, shape ops)
            return func(*args, **kwargs) if kwargs else func(*args)
        kwargs = kwargs or {}
        kind = plan.kind
        if kind is OpKind.RANDOM:  # SPEC §3.4; what the served op computes comes back here
            with self:
                return serve_random_op(func, args, kwargs, self.randomness)
        if kind is OpKind.EXACT and not (plan.index_put and accumulates(func, args, kwargs)):
            source = plan.source
            if source is not None and (narrowing := self._narrowing(source, args, kwargs)):
                out = self._narrowing_copy(plan, source, narrowing, args, kwargs)
            elif plan.index_put:  # (not accumulating)
                out = _in_index_order(func, args, kwargs)
            else:
                out = func(*args, **kwargs)
            if plan.machine_bits:
                self._canonical_bits(plan.machine_bits, out)
            elif "out" in plan.names:  # (it may have cast wider floats into its `out`'s dtype)
                self._canonical_bits(_NAN_BITS, kwargs.get("out"))
            if plan.positions or plan.names:
                self._forget_writes(plan, args, kwargs)
            return out
        return self._float_op(plan, func, args, kwargs)

    @staticmethod
    def _canonical_bits(machine_bits: int, out) -> None:
        """Make the bits that an exact op's kernel chooses by machine canonical in its
        floating results (`_MACHINE_BITS`; an in-place op's result, and an `out=` form's, is
        the tensor it wrote): every NaN its dtype's one NaN and, under `_NAN_AND_ZERO_BITS`,
        every zero +0 (−0 + 0 = +0, every other value as it is)."""
        for leaf in _flatten(out)[0]:
            if not isinstance(leaf, torch.Tensor) or leaf.dtype not in CANONICAL_NAN:
                continue  # (a dtype no policy computes in is refused at the first float op)
            if machine_bits == _NAN_AND_ZERO_BITS:
                leaf.add_(0.0)
            canonical_nans(leaf)

    def _forget(self, written) -> None:
        """What the interceptor keeps of the memory of `written` (a tensor or a list of them),
        which it writes without bumping a version counter: widened copies (`WidenCache`) and
        matrix norms (`BoundContext.norms`)."""
        self._widened.forget(written)
        self._bounds.forget(written)

    def _forget_writes(self, plan: _OpPlan, args, kwargs) -> None:
        for i in plan.positions:
            if i < len(args):
                self._forget(args[i])
        for name in plan.names:
            if name in kwargs:
                self._forget(kwargs[name])

    # -- FLOAT ops -----------------------------------------------------------------------------

    def _float_op(self, plan: _OpPlan, func, args, kwargs):
        if plan.norm_formula and not kwargs:
            done = self._fused_formula(plan, args)
            if done is not None:
                return done[0]
        if plan.elementwise:
            done = self._fused_pointwise(plan, args, kwargs)
            if done is not None:
                return done[0]
        fixed = plan.fixed
        rule = FIXED_FORMULA if fixed else rule_of(func, args, kwargs, self._unit_roundoff)
        if rule is None and self._reads_floats(args, kwargs):
            return self._decompose(func, args, kwargs)
        if rule is not None and rule.elementwise and not fixed and not kwargs:
            done = self._in_parts(plan, func, args, rule)
            if done is not None:
                return done[0]
        if plan.statistics and rule is not None and not kwargs:
            done = self._narrow_statistics(func, args, rule)
            if done is not None:
                return done[0]
        positions, names = plan.positions, plan.names
        writes: list[tuple[torch.Tensor, torch.Tensor]] = []
        found = [False, False]  # target-dtype inputs, compute-dtype inputs
        wide_args = tuple(self._widen(func, a, i in positions, writes, found)
                          for i, a in enumerate(args))
        wide_kwargs = {k: self._widen(func, v, k in names, writes, found)
                       for k, v in kwargs.items()} if kwargs else {}
        requested = self._requested_dtype(func, kwargs) if kwargs else None
        if requested == self.policy.target:  # a factory or reduction asked for the target dtype
            wide_kwargs["dtype"], found[0] = self.policy.compute, True
        if not any(found):
            return self._no_float_inputs(func, rule, args, kwargs)
        assert rule is not None  # an op reading floats without a rule was decomposed
        unsigned_zero = rule.unsigned_zero
        if not self._bounds_needed():
            rule = None  # (e = 0 for the rounder, which does not read it)
        inputs = (wide_args, wide_kwargs)
        keep_compute = requested == self.policy.compute or (requested is None and not found[0])
        functional = _functional_of(func) if writes and rule is not None and \
            rule.reads_inputs else None  # the rule reads what the op overwrites
        out: Any
        if fixed:  # SPEC §3.2.1: ovt's formula, never ATen's kernel, computed out of place
            fixed_elements = pointwise.operands(func, wide_args, wide_kwargs)
            if fixed_elements is None:
                raise DeterminismError(
                    f"{op_name(func)} is computed by its fixed formula (SPEC §3.2.1), which "
                    f"takes real tensors and real scalars only; this call passes other "
                    f"arguments")
            results = [pointwise.fixed_result(e) for e in fixed_elements]
            out = results if plan.foreach else results[0]
        elif functional is not None:  # out of place, so that the inputs stay as they were
            out = self.compute(functional, wide_args, wide_kwargs)
            results = list(out) if isinstance(out, (list, tuple)) else [out]
        else:
            if writes and rule is not None and rule.reads_inputs:
                inputs = tree_map(_copy_of({id(wide) for _, wide in writes}), inputs)
            out = self.compute(func, wide_args, wide_kwargs)
        if (fixed or functional is not None) and writes:  # the results are the values written
            writes[:] = [(orig, r) for (orig, _), r in zip(writes, results, strict=True)]
            if not func._schema.returns:  # a foreach op's in-place form returns nothing
                out = None
        rounded = self._round_results(func, rule, inputs, out, writes, keep_compute=keep_compute,
                                      unsigned_zero=unsigned_zero)
        if unsigned_zero:  # −0 + 0 = +0, every other value as it is (`Rule.unsigned_zero`)
            for leaf in _flatten(rounded)[0] + [orig for orig, _ in writes]:
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    leaf.add_(0.0)
        return rounded

    def _fused_pointwise(self, plan: _OpPlan, args, kwargs) -> tuple[Any] | None:
        """Compute an op with `e = 0` straight from its target-dtype inputs in one fused pass
        (`pointwise`), as a site of its own with nothing in its band; `(result,)`, or None where
        the fused pass does not serve it (then the widened path computes the same bits). A
        foreach op is one list call where it can be (`pointwise.foreach_call`), else a call per
        element. The rounder claims the site first (`claim_exact_site`); one that must see
        every site's wide values, or a replayer whose log has entries here (a violation it
        reports with the values), declines."""
        policy = self.policy
        claim = self._claim
        foreach, in_place = plan.foreach, plan.in_place
        if claim is None or (policy.compute, policy.target) != (torch.float64, torch.float32) \
                or plan.func._overloadname.endswith("out"):  # (an out= form writes its `out`)
            return None
        listed = pointwise.foreach_call(plan.func, args, kwargs, self._round_scalar) \
            if foreach else None
        total = pointwise.list_serves(listed, in_place) if listed is not None else None
        if listed is not None and total is not None:
            if not claim(plan.name, total):
                return None
            results = pointwise.run_list(listed, in_place)
            if in_place:
                self._forget(listed.a)
                return (None,)
            return (results,)
        elements = pointwise.operands(plan.func, args, kwargs)
        if not elements:  # (an empty foreach list is no site on any path)
            return None
        calls = pointwise.fused_plan(elements, in_place)
        if calls is None or pointwise.small_quotients(calls, self._round_scalar) or \
                not claim(plan.name, sum(c.numel for c in calls)):
            return None
        results = pointwise.run_fused(calls, in_place, self._round_scalar)
        if in_place:
            for e in elements:
                self._forget(e.a)
            return (None if foreach else args[0],)
        return (results if foreach else results[0],)

    def _fused_formula(self, plan: _OpPlan, args: tuple) -> tuple[torch.Tensor] | None:
        """Compute a normalize formula (e = 0) straight from its target-dtype operands in one
        C++ pass (`normops.fused_formula`), as a site of its own with nothing in its band;
        `(result,)`, or None where that pass does not serve (then the widened path computes the
        same bits). The rounder claims the site first, as for `_fused_pointwise`."""
        policy = self.policy
        claim = self._claim
        if claim is None or (policy.compute, policy.target) != (torch.float64, torch.float32):
            return None
        run = normops.fused_formula(plan.func, args)
        if run is None or not claim(plan.name, args[0].numel()):
            return None
        return (run(),)

    def _narrow_statistics(self, func, args: tuple, rule: Rule) -> tuple[Any] | None:
        """A normalisation statistic (`normops.STATISTICS`) computed straight from its
        target-dtype operands (`normops.narrow_statistics`: the bits of the op on widened
        operands, with no widened copy of them) and rounded as a site like any other, its
        rule's bounds read from those operands; `(results,)`, or None where that does not
        serve (then the widened path computes the same bits). Under the float64 -> float32
        policy only (in another the kernels' float64 is not the compute dtype), and with the
        native compute only: an emulated machine's (`splitk`) computes the statistics in its
        own form."""
        policy = self.policy
        if (policy.compute, policy.target) != (torch.float64, torch.float32) or \
                self.compute is not native_compute:
            return None
        operands = tuple(self._round_scalar(a) if isinstance(a, float) else a for a in args)
        run = normops.narrow_statistics(func, operands)
        if run is None:
            return None
        return (self._round_results(func, rule if self._bounds_needed() else None,
                                    (operands, {}), run(), []),)

    def _in_parts(self, plan: _OpPlan, func, args: tuple, rule: Rule) -> tuple[Any] | None:
        """Compute and round a large elementwise op (`Rule.elementwise`, called without keyword
        arguments) in parts of `PART` elements, each widened, computed and rounded while it is
        in the cache: one site all the same, its values the parts' concatenation
        (`SiteRecorder.round_site_in_parts`), with no compute-dtype copy of a whole operand or
        result. At GPT-2 width the optimizer's ops are 91 M elements, whose fresh
        float64 buffers cost more in page faults than the arithmetic. `(result,)`, or None
        where this does not apply: a rounder that does not round in parts (`rounds_in_parts`,
        looked up on its class, so that a wrapper forwarding attributes to another rounder does
        not pass it by), an operand that is not a contiguous target-dtype CPU tensor of its
        result's shape, a scalar that is not a real number, an in-place op with tensor operands
        besides the one it writes or whose written tensors share memory (each part is written
        before the next is read), or fewer than `PARTS_FROM` elements. (On CUDA the
        whole-tensor path runs: its allocator keeps its memory.)"""
        foreach = plan.foreach
        first = args[0] if args else None
        leads: list[torch.Tensor]  # each result's first operand (its shape, or it, written)
        if foreach and isinstance(first, (list, tuple)) and first and \
                all(isinstance(t, torch.Tensor) for t in first):
            leads = list(first)
        elif not foreach and isinstance(first, torch.Tensor):
            leads = [first]
        else:
            return None
        total = sum(t.numel() for t in leads)
        if total < PARTS_FROM or not getattr(type(self.rounder), "rounds_in_parts", False) or \
                (plan.positions and not (plan.in_place and plan.positions == {0})):
            return None  # (the size first: this runs for every op with an elementwise rule)
        if foreach:  # one call per list element, each on one-element lists
            calls = [tuple([a[i]] if isinstance(a, (list, tuple)) else a for a in args)
                     for i in range(len(leads))]
        else:
            calls = [args]
        for call, lead in zip(calls, leads, strict=True):
            leaves = [v for a in call for v in (a if isinstance(a, (list, tuple)) else [a])]
            if not all(isinstance(v, (torch.Tensor, bool, int, float)) for v in leaves):
                return None
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            if not all(t.dtype == self.policy.target and t.is_cpu and t.is_contiguous()
                       and t.shape == lead.shape for t in tensors):
                return None
            if plan.in_place and len(tensors) > 1:
                return None
        if plan.in_place and len({_storage_key(t) for t in leads}) < len(leads):
            return None
        outs = leads if plan.in_place else [torch.empty_like(t) for t in leads]
        needed = self._bounds_needed()

        def parts(call: tuple, out: torch.Tensor):
            dest = out.view(-1)
            for start in range(0, out.numel(), PART):
                piece = tuple(self._part(a, start, start + PART) for a in call)
                result: Any = self.compute(func, piece, {})
                if plan.in_place:  # the op wrote its (widened) first operand
                    result = piece[0]
                y = result[0] if foreach else result
                b = bounds_for(self._bounds, rule, func, piece, {}, [y])[0] if needed else None
                yield y, b, dest[start:start + PART]

        self.rounder.round_site_in_parts(
            plan.name, total, (parts(call, out) for call, out in zip(calls, outs, strict=True)))
        if plan.in_place:
            for t in leads:
                self._forget(t)
            return (None if foreach else args[0],)
        return (outs if foreach else outs[0],)

    def _part(self, value, start: int, stop: int):
        """The compute-dtype form of one argument's elements [start, stop) (`_in_parts`):
        a tensor's, flat; a Python float rounded to the target dtype, as `_widen` does."""
        if isinstance(value, torch.Tensor):
            return value.view(-1)[start:stop].to(self.policy.compute)
        if isinstance(value, float):
            return self._round_scalar(value)
        if isinstance(value, (list, tuple)):
            return type(value)(self._part(v, start, stop) for v in value)
        return value

    def _requested_dtype(self, func, kwargs) -> torch.dtype | None:
        """The floating `dtype=` an op was asked for, if any; refuse one the policy does not
        certify (SPEC §3.1)."""
        dtype = kwargs.get("dtype")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            return None
        if dtype not in (self.policy.target, self.policy.compute):
            raise DeterminismError(
                f"{op_name(func)} asks for {dtype} results inside a step; the precision policy "
                f"{self.policy.name} certifies only its two dtypes (SPEC §3.1)")
        return dtype

    def _reads_floats(self, args, kwargs) -> bool:
        """Whether an op reads (or asks for) a float of the policy's dtypes. An ATen op's
        arguments nest one level at most (Tensor[], Tensor?[]), read here without a pytree
        walk; a deeper container (a custom op's) is walked."""
        dtypes = (self.policy.target, self.policy.compute)
        if kwargs.get("dtype") in dtypes:
            return True
        for value in (*args, *kwargs.values()):
            if isinstance(value, (list, tuple)) and \
                    not any(isinstance(v, (list, tuple, dict)) for v in value):
                leaves = value
            elif isinstance(value, (list, tuple, dict)):
                leaves = tree_flatten(value)[0]
            else:
                leaves = (value,)
            if any(isinstance(v, torch.Tensor) and v.dtype in dtypes for v in leaves):
                return True
        return False

    def _decompose(self, func, args, kwargs):
        """Run `func` as its decomposition into ops with bound rules (SPEC §3.2.1), each
        intercepted by this mode; refuse an op that has neither."""
        decomposition = decomposition_of(func)
        if decomposition is None:
            raise DeterminismError(
                f"{op_name(func)} has no certified error bound and no decomposition into ops "
                f"that have one (SPEC §3.2.1), so ovt cannot round it soundly; express it "
                f"with supported ops, or add a bound rule to protocol.engine.bounds")
        with self:
            return decomposition(*args, **kwargs)

    def _no_float_inputs(self, func, rule: Rule | None, args, kwargs):
        """An op without floating inputs: integer ops pass; one that still makes target- or
        compute-dtype floats (linspace, arange(0, 1, 0.1), int / int) is re-run in the compute
        dtype, with integer and boolean tensors widened, and rounded as a site (SPEC §3.2)."""
        out = func(*args, **kwargs)
        made = {leaf.dtype for leaf in tree_flatten(out)[0]
                if isinstance(leaf, torch.Tensor) and (leaf.is_floating_point()
                                                       or leaf.is_complex())}
        if made - {self.policy.target, self.policy.compute}:
            raise DeterminismError(
                f"{op_name(func)} makes {sorted(map(str, made))} results inside a step; the "
                f"precision policy {self.policy.name} certifies only its two dtypes (SPEC §3.1)")
        if not made:
            self._forget_writes(_plan_of(func), args, kwargs)
            return out
        if rule is None:
            return self._decompose(func, args, kwargs)
        if not self._bounds_needed():
            rule = None
        compute = self.policy.compute
        wide_args, wide_kwargs = tree_map(self._widen_exact, (args, kwargs))
        if "dtype" in {a.name for a in func._schema.arguments}:
            wide_kwargs["dtype"] = compute
        out = self.compute(func, wide_args, wide_kwargs)
        return self._round_results(func, rule, (wide_args, wide_kwargs), out, [],
                                   keep_compute=self.policy.target not in made)

    def _bounds_needed(self) -> bool:
        return self._needed is None or self._needed()

    def _widen_exact(self, value):
        if isinstance(value, torch.Tensor) and not value.is_floating_point() \
                and not value.is_complex():
            return value.to(self.policy.compute)
        return self._round_scalar(value) if isinstance(value, float) else value

    def _widen(self, func, value, mutable: bool, writes: list, found: list):
        """The compute-dtype form of one argument; notes in `found` which float dtypes it read.

        A compute-dtype tensor (a decomposition's upcast, or a program computing wide) is
        already wide: the op is a site all the same, its results rounded to the target and
        handed back in the compute dtype. Any other floating dtype cannot be certified.
        """
        target = self.policy.target
        if isinstance(value, torch.Tensor):
            if value.dtype == self.policy.compute:
                found[1] = True
                if mutable:
                    writes.append((value, value))
                return value
            if value.dtype != target:
                if value.is_floating_point() or value.is_complex():
                    raise DeterminismError(
                        f"{op_name(func)} computes on a {value.dtype} tensor inside a step; "
                        f"the precision policy {self.policy.name} certifies only its two dtypes "
                        f"(SPEC §3.1): keep the model and its data in {target}")
                return value
            found[0] = True
            if not mutable:  # the op only reads it: a cached copy serves
                return self._widened.widen(value)
            wide = value.to(self.policy.compute)
            writes.append((value, wide))
            return wide
        if isinstance(value, float):
            return self._round_scalar(value)
        if isinstance(value, torch.dtype) and value == target and \
                func.overloadpacket.__name__ in _INPUT_DTYPE_OPS:
            return self.policy.compute  # the dtype their result is made in
        if isinstance(value, (list, tuple)) and value:
            return type(value)(self._widen(func, v, mutable, writes, found) for v in value)
        return value

    def _round_results(self, func, rule: Rule | None, inputs: tuple[tuple, dict], out,
                       writes: list, keep_compute: bool = False, unsigned_zero: bool = False):
        """Round one site: the op's floating outputs, then the arguments it wrote, with the
        bounds of `rule` computed from `inputs` (None: e = 0, for a correctly rounded
        conversion, or for a rounder that reads no bounds here, `_bounds_needed`).
        `keep_compute`: the op had no target-dtype input, so its outputs go back in the compute
        dtype (rounded all the same: exact target values, widened). `unsigned_zero`: the caller
        turns the roundings' −0 into +0 (`Rule.unsigned_zero`), which a result's noted copy
        must match (`_round_result`)."""
        if not writes and isinstance(out, torch.Tensor) and out.dtype == self.policy.compute:
            if keep_compute:  # (its rounding goes back widened, a new tensor: nothing to note)
                return self._round_site(func, rule, inputs, [out])[0].to(self.policy.compute)
            return self._round_result(func, rule, inputs, out, unsigned_zero)  # the common case
        write_of = {id(wide): orig for orig, wide in writes}
        leaves, spec = _flatten(out)
        # per leaf: index into ys, the written original, or the leaf itself
        ys: list[torch.Tensor] = []
        slots: list[tuple[str, Any]] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor) and id(leaf) in write_of:
                slots.append(("orig", write_of[id(leaf)]))
            elif isinstance(leaf, torch.Tensor) and leaf.dtype == self.policy.compute:
                slots.append(("y", len(ys)))
                ys.append(leaf)
            else:
                slots.append(("keep", leaf))
        first_write = len(ys)
        ys.extend(wide for _, wide in writes)
        rounded = self._round_site(func, rule, inputs, ys)
        if keep_compute:
            rounded = [r.to(self.policy.compute) for r in rounded]
        for (orig, _), r in zip(writes, rounded[first_write:], strict=True):
            orig.copy_(r)
            self._forget(orig)
        results = [rounded[v] if kind == "y" else v for kind, v in slots]
        if spec is not None:
            return tree_unflatten(results, spec)
        return results[0] if isinstance(out, torch.Tensor) else type(out)(results)

    def _round_result(self, func, rule: Rule | None, inputs: tuple[tuple, dict],
                      y: torch.Tensor, unsigned_zero: bool) -> torch.Tensor:
        """One site of one result `y`. Where `y` is the op's own — a contiguous tensor over
        memory that none of the op's tensor arguments reads (a view's `_base` is not set inside
        a dispatch mode, so the storages are compared), large enough for the cache to keep
        (`WidenCache.cache_from`) — and the rounder takes it in place
        (`rounds_in_place`, looked up on its class as `rounds_in_parts` is), the rounder may
        overwrite `y` with its rounding widened; `y` is then noted as the rounding's
        compute-dtype copy (`WidenCache.note`), so that the ops reading the rounding next
        widen nothing (not once the cache is full: then the write would be for nothing).
        With `unsigned_zero` the caller adds +0 to the rounding (in place, which
        inside the mode bumps no version counter), so `y` gets the same first: −0 + 0 = +0 in
        either dtype, every other value (and the widening of each) as it is."""
        if not (self._in_place and y.numel() >= self._widened.cache_from and y.is_contiguous()
                and self._widened.fits(_bytes(y)) and not _shares_storage(y, inputs)):
            return self._round_site(func, rule, inputs, [y])[0]
        bound = None if rule is None else \
            bounds_for(self._bounds, rule, func, inputs[0], inputs[1], [y], self._read_at(rule))[0]
        r, widened = self.rounder.round_result_in_place(_plan_of(func).name, y, bound)
        if widened:
            if unsigned_zero:
                y.add_(0.0)
            self._widened.note(r, y)
        return r

    def _round_site(self, func, rule: Rule | None, inputs: tuple[tuple, dict],
                    ys: list[torch.Tensor]) -> list[torch.Tensor]:
        bounds = [None] * len(ys) if rule is None else \
            bounds_for(self._bounds, rule, func, inputs[0], inputs[1], ys, self._read_at(rule))
        return self.rounder.round_site(_plan_of(func).name, ys, bounds)

    def _read_at(self, rule: Rule) -> torch.Tensor | None:
        """Where the rounder reads the next site's bounds (`bound_positions`, looked up on its
        class as `rounds_in_place` is: a wrapper that forwards attributes to another rounder,
        and reads the bounds everywhere itself, does not pass it on), for a rule that computes
        them there alone (`Rule.at_positions`: the others are not handed positions, which a
        replayer gathers from its log); None: everywhere."""
        if not rule.at_positions or self._positions is None:
            return None
        return self._positions(self.rounder)

    # -- conversions into the target dtype -------------------------------------------------------

    def _narrowing(self, source: int, args, kwargs) -> list[int]:
        """Which of a conversion's sources (argument `source`, `_CONVERSIONS`) it casts into
        the target dtype from a floating dtype holding values the target does not (`_narrows`):
        their indices in the foreach form's list, else [0] or []."""
        if len(args) <= source:
            return []
        if source == 0:  # _to_copy, to
            into, sources = [_cast_dtype(args, kwargs)], [args[0]]
        elif isinstance(args[source], (list, tuple)):  # _foreach_copy_
            if len(args[0]) != len(args[source]):
                return []  # (the op itself refuses the call)
            into = [d.dtype if isinstance(d, torch.Tensor) else None for d in args[0]]
            sources = list(args[source])
        else:
            into = [args[0].dtype if isinstance(args[0], torch.Tensor) else None]
            sources = [args[source]]
        target = self.policy.target
        return [i for i, (dtype, src) in enumerate(zip(into, sources, strict=True))
                if dtype == target and isinstance(src, torch.Tensor) and src.is_floating_point()
                and _narrows(src.dtype, target)]

    def _narrowing_copy(self, plan: _OpPlan, source: int, narrowing: list[int], args, kwargs):
        """A cast into the target dtype is a rounding like any other (SPEC §3.2): the sources
        that narrow (`_narrowing`) are rounded as one site, with e = 0 (a conversion is
        correctly rounded, IEEE-754 §5.4.2), and the op then copies their roundings, exactly.
        So the cast's bits are the rounder's (`bandpass.to_target`): under a bfloat16 target
        torch's own cast writes a NaN's bits by code path, which differ between machines and
        layouts."""
        compute = self.policy.compute
        listed = isinstance(args[source], (list, tuple))
        sources = list(args[source]) if listed else [args[source]]
        rounded = self.rounder.round_site(plan.name, [sources[i].to(compute) for i in narrowing],
                                          [None] * len(narrowing))
        for i, r in zip(narrowing, rounded, strict=True):
            sources[i] = r
        args = (*args[:source], sources if listed else sources[0], *args[source + 1:])
        if plan.func.overloadpacket is torch.ops.aten.to:  # a copy, as the cast was: in the
            args, kwargs = _copying(plan.func, args, kwargs)  # layout asked, not the rounding's
        return plan.func(*args, **kwargs)  # (the rest of the request: device, layout, `out`)
