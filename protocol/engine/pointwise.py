"""Elementwise ops whose rounding to the target dtype is the same on every conforming machine,
and the fused pass that computes them from target-dtype inputs in one read (SPEC §3.2.1; issues
11 and 13).

Three kinds, all with `e = 0`, so their sites never log anything:

- **one correctly rounded operation** — mul, and add or sub with alpha 1 — on target-dtype
  inputs: every conforming machine returns the same compute-dtype bits (IEEE-754 §5.4.1;
  `bounds._zero`). ATen's kernels compute them as that one operation.
- **square root and division** of target-dtype inputs (bound rules version 5): their
  compute-dtype bits may differ per machine, their rounding never does
  (`bounds.SQRT_MARGIN_ULPS`, `bounds.QUOTIENT_MARGIN_ULPS`). The fused pass computes IEEE's
  root and quotient, the torch ops ATen's; both round to the correctly rounded target value. A
  quotient below 2^-125 in magnitude keeps a band (`bounds._quotient`): the fused pass leaves
  a site with one to the widened path (`small_quotients`).
- **fixed formulas** (bound rules version 2): addcmul, addcdiv and lerp with a scalar weight,
  the optimizer's update terms. ovt does not run ATen's kernels for them — those may contract
  into an FMA, or branch on the weight, differently per machine — but computes them as a fixed
  sequence of IEEE operations in the compute dtype, in this order:

      addcmul(s, t1, t2, value) = s + (value·t1)·t2
      addcdiv(s, t1, t2, value) = s + value·(t1 / t2)
      lerp(s, end, weight)      = s + weight·(end − s)

  Each step is one correctly rounded operation (value·t1, two target values, is even exact);
  a quotient of two tensors is one IEEE division on the CPU and on CUDA alike (ATen replaces
  a division by a reciprocal and a product only for a CPU-scalar divisor, which `fixed_result`
  never passes). So every conforming machine computes the same bits. Under bound rules version 1
  these ops had bounds γ_3·Σ|terms| or γ_4·Σ|terms| and logged elements in their bands.

On the CPU, for the float64 -> float32 policy, all three kinds run as `torch.ops.ovt.pointwise`
(`csrc/fused.cpp`): float32 inputs in, float32 results out, one pass, with no widened copy of
any input and no band pass (nothing can be in the band of an `e = 0` site). That is the same
bits as the torch ops on widened inputs (both round to nearest-even a float64 result that is
fixed, or, for a root, one whose rounding is), which run everywhere else: CUDA, the bfloat16
policy, a strided call or one broadcast other than by runs or rows (`_broadcast`), a rounder
that must see every site's wide values (tests/protocol/engine/test_pointwise.py). NaN results
are NaN on both paths, but their sign and payload, which IEEE-754 leaves to the machine (§6.3),
may differ: x86 takes them from one operand or the other by the order its instruction reads
them in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TypeGuard

import torch

from protocol.engine import fused
from protocol.engine.precision import holds_integer

# csrc/fused.cpp `Pointwise`
(MUL_SCALAR, MUL, ADD_SCALAR, ADD, SUB_SCALAR, SUB, ADDCMUL, ADDCDIV, LERP, SQRT, DIV_SCALAR,
 DIV) = range(12)

FIXED = frozenset({"addcmul", "addcdiv", "lerp"})  # computed by formula, never by ATen

# The overloads taken, per op family: (single tensor, foreach). A foreach op's `.Tensor` form
# of addcmul/addcdiv holds its scalars in a tensor; that of mul, add and div takes one tensor
# for every element (`_foreach_add_(steps, one)`: the optimizer's step counts); lerp's
# `.Tensor`/`.List` take tensor weights: those stay ATen ops. The `out=` forms of the fixed
# formulas are fixed formulas too, computed on the widened path only.
_OVERLOADS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "mul": (frozenset({"Tensor", "Scalar"}),
            frozenset({"Scalar", "List", "ScalarList", "Tensor"})),
    "add": (frozenset({"Tensor", "Scalar"}),
            frozenset({"Scalar", "List", "ScalarList", "Tensor"})),
    "sub": (frozenset({"Tensor", "Scalar"}), frozenset({"Scalar", "List", "ScalarList"})),
    "addcmul": (frozenset({"default", "out"}), frozenset({"Scalar", "ScalarList", "Tensor"})),
    "addcdiv": (frozenset({"default", "out"}), frozenset({"Scalar", "ScalarList", "Tensor"})),
    "lerp": (frozenset({"Scalar", "Scalar_out"}), frozenset({"Scalar", "ScalarList"})),
    "sqrt": (frozenset({"default"}), frozenset({"default"})),
    "div": (frozenset({"Tensor", "Scalar"}),
            frozenset({"Scalar", "List", "ScalarList", "Tensor"})),
}


@dataclass(frozen=True)
class Elementwise:
    """One result tensor of such an op: `code` (csrc `Pointwise`) applied to tensors `a`, `b`,
    `c` (None where the code has no such operand) and the number `v`: a Python scalar argument,
    rounded to the target dtype before use where it is a float (SPEC §3.3), or where `exact`
    a value read from a tensor argument, used as it is."""

    code: int
    a: torch.Tensor
    b: torch.Tensor | None
    c: torch.Tensor | None
    v: float | int
    exact: bool = False


@lru_cache(maxsize=4096)
def family(func: torch._ops.OpOverload) -> tuple[str, bool, bool]:
    """(op family, foreach, in place) of an op: `_foreach_addcmul_` -> ("addcmul", True, True)."""
    name = func.overloadpacket.__name__
    foreach = name.startswith("_foreach_")
    if foreach:
        name = name[len("_foreach_"):]
    in_place = name.endswith("_") and not name.endswith("__")
    return (name[:-1] if in_place else name), foreach, in_place


@lru_cache(maxsize=4096)
def is_fixed(func: torch._ops.OpOverload) -> bool:
    """Whether ovt computes `func` by its fixed formula (module docstring)."""
    return family(func)[0] in FIXED and takes(func)


@lru_cache(maxsize=4096)
def takes(func: torch._ops.OpOverload) -> bool:
    """Whether `func` is one of this module's ops in a form `operands` may take (whether it
    does depends on the call's arguments)."""
    name, foreach, _ = family(func)
    overloads = _OVERLOADS.get(name)
    return overloads is not None and func._overloadname in overloads[foreach]


def operands(func: torch._ops.OpOverload, args: tuple, kwargs: dict
             ) -> list[Elementwise] | None:
    """The op as this module's elementwise ops, one per result tensor (a foreach op: one per
    list element), or None where it is none of them: another op or overload, add or sub with
    alpha != 1, a scalar that is not a real number, a tensor scalar list."""
    if not takes(func):
        return None
    name, foreach, _ = family(func)
    if not foreach:
        one = _element(name, args, kwargs)
        return None if one is None else [one]
    scalars = None
    if name in ("addcmul", "addcdiv") and func._overloadname == "Tensor":
        scalars = args[3]  # the scalars, as a tensor: of the target or the compute dtype only
        if not isinstance(scalars, torch.Tensor) or \
                scalars.dtype not in (torch.float32, torch.float64):
            return None
    per_element = []
    for i in range(len(args[0])):
        pick = tuple(a[i] if isinstance(a, (list, tuple)) else a for a in args)
        if scalars is not None:
            pick = (*pick[:3], scalars[i].item())
        one = _element(name, pick, kwargs)
        if one is None:
            return None
        per_element.append(one if scalars is None else
                           Elementwise(one.code, one.a, one.b, one.c, one.v, exact=True))
    return per_element


@dataclass(frozen=True)
class ForeachCall:
    """A foreach op as one `torch.ops.ovt.pointwise_list` call: `code` on each list element i,
    with tensors `a[i]`, `b[i]`, `c[i]` (`b`, `c` empty where the code has no such operand) and
    the number `v[i]`, rounded as `_scalar` rounds it."""

    code: int
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    c: list[torch.Tensor]
    v: list[float]


def foreach_call(func: torch._ops.OpOverload, args: tuple, kwargs: dict, round_scalar
                 ) -> ForeachCall | None:
    """A foreach op of this module as one list call (`ForeachCall`): what `operands` makes of it
    element by element, without a Python step per element. None where it is not one: not a
    foreach op this module takes, keyword arguments other than alpha 1 (the optimizer's
    `_foreach_add_(steps, one, alpha=1.0)`), scalars held in a tensor (the `.Tensor`
    forms of addcmul and addcdiv), an empty list, or a number that `_element` refuses; then
    `operands` takes it. Whether the lists' tensors qualify is `list_serves`'s to say."""
    name, foreach, _ = family(func)
    overload = func._overloadname
    if not foreach or (kwargs and kwargs != {"alpha": 1}) or not takes(func) or not args[0] or \
            (overload == "Tensor" and name in FIXED):
        return None
    first = _element(name, tuple(a[0] if isinstance(a, (list, tuple)) else a for a in args),
                     kwargs)
    if first is None:
        return None
    count = len(args[0])
    numbers = args[-1] if overload == "ScalarList" else None
    if numbers is None:
        v = [_scalar(first, round_scalar)] * count
    else:
        taken = _divisor if first.code == DIV_SCALAR else _number
        if len(numbers) != count or not all(taken(x) for x in numbers):
            return None
        v = [_rounded(x, round_scalar) for x in numbers]
    b = [] if first.b is None else [args[1]] * count if overload == "Tensor" else list(args[1])
    return ForeachCall(first.code, list(args[0]), b, list(args[2]) if first.c is not None else [],
                       v)


def list_serves(call: ForeachCall, in_place: bool) -> int | None:
    """The elements of `call` where `torch.ops.ovt.pointwise_list` serves it, else None: the
    fused passes built and enabled, and every tensor a contiguous float32 CPU tensor, not empty,
    of its element's result's shape; in place, with memory as `fused_plan` requires it; and no
    quotient that keeps a band (`small_quotients`)."""
    if not fused.serves(call.a[0]):
        return None
    total = torch.ops.ovt.pointwise_list_serves(call.code, call.a, call.b, call.c, call.v,
                                                in_place)
    return None if total < 0 else total


def run_list(call: ForeachCall, in_place: bool) -> list[torch.Tensor]:
    """Make the call (`list_serves` said it serves): into each `a[i]` in place, else into new
    tensors."""
    out = call.a if in_place else [torch.empty_like(t) for t in call.a]
    torch.ops.ovt.pointwise_list(call.code, call.a, call.b, call.c, call.v, out)
    return out


def _number(value) -> TypeGuard[float | int]:
    """A real Python number, not a bool (which ATen refuses in places: `x - True`)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _divisor(value) -> TypeGuard[float | int]:
    """A number the fused pass divides by: an integer divisor that is no float32 value takes
    the bounded path."""
    return _number(value) and not (isinstance(value, int) and
                                   not holds_integer(torch.float32, value))


def _element(name: str, args: tuple, kwargs: dict) -> Elementwise | None:
    a = args[0]
    if not isinstance(a, torch.Tensor):
        return None
    if name == "sqrt":
        return Elementwise(SQRT, a, None, None, 0.0)
    if name == "div":
        other = args[1] if len(args) > 1 else kwargs.get("other")
        if isinstance(other, torch.Tensor):
            return Elementwise(DIV, a, other, None, 0.0)
        if not _divisor(other):
            return None
        return Elementwise(DIV_SCALAR, a, None, None, other)
    if name in ("mul", "add", "sub"):
        other = args[1] if len(args) > 1 else kwargs.get("other")
        alpha = args[2] if len(args) > 2 else kwargs.get("alpha", 1)
        if name != "mul" and alpha != 1:
            return None  # an axpy: two roundings or an FMA (bounds `_axpy`)
        if isinstance(other, torch.Tensor):
            return Elementwise({"mul": MUL, "add": ADD, "sub": SUB}[name], a, other, None, 0.0)
        if not _number(other):
            return None
        code = {"mul": MUL_SCALAR, "add": ADD_SCALAR, "sub": SUB_SCALAR}[name]
        return Elementwise(code, a, None, None, other)
    if name in ("addcmul", "addcdiv"):
        t1, t2 = args[1], args[2]
        value = args[3] if len(args) > 3 else kwargs.get("value", 1)
        if not (isinstance(t1, torch.Tensor) and isinstance(t2, torch.Tensor)
                and _number(value)):
            return None
        return Elementwise(ADDCMUL if name == "addcmul" else ADDCDIV, a, t1, t2, value)
    end = args[1]  # lerp
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    if not (isinstance(end, torch.Tensor) and _number(weight)):
        return None
    return Elementwise(LERP, a, end, None, weight)


def fixed_result(e: Elementwise) -> torch.Tensor:
    """A fixed formula's compute-dtype result from compute-dtype operands, with torch ops (each
    one IEEE operation; the formulas of the module docstring)."""
    assert e.b is not None
    v = float(e.v)
    device = e.a.device  # a CPU-scalar operand moves there: never a reciprocal shortcut
    b = e.b if e.b.device == device else e.b.to(device)
    if e.code == ADDCMUL:
        assert e.c is not None
        return e.a + (b * v) * (e.c if e.c.device == device else e.c.to(device))
    if e.code == ADDCDIV:
        assert e.c is not None
        return e.a + (b / (e.c if e.c.device == device else e.c.to(device))) * v
    if e.code == LERP:
        return e.a + (b - e.a) * v
    raise ValueError(f"code {e.code} is not a fixed formula")


@dataclass(frozen=True)
class FusedCall:
    """One `torch.ops.ovt.pointwise` call: `element` (its `b` possibly swapped with `a`), and
    b's broadcast over the result (`_broadcast`); (1, numel) for none. With `expand`, `element`
    is an op on a scalar whose `a` is the compact form of an expanded operand (`_compact`), and
    the result is its result expanded to that shape: the same values, each computed once."""

    element: Elementwise
    b_inner: int
    b_count: int
    expand: torch.Size | None = None

    @property
    def numel(self) -> int:
        """The elements of the result."""
        return math.prod(self.expand) if self.expand is not None else self.element.a.numel()


def fused_plan(elements: list[Elementwise], in_place: bool) -> list[FusedCall] | None:
    """The fused calls computing these, or None where `torch.ops.ovt.pointwise` does not serve
    them: the fused passes not built or not enabled, a tensor not a contiguous float32 CPU
    tensor, or of another shape than its result — except a mul, add or sub's `b` broadcast in
    runs or rows (`_broadcast`), or its `a` so (mul and add commute: the operands are swapped;
    not in place, where `a` is written). In place, the written tensors' memory is each their
    own, and an operand may be its element's written tensor itself but no other view of written
    memory, so that every element is read before it is written, as in the widened path, which
    reads copies. An op on a scalar (no `b`) takes an expanded `a` too, not in place: computed
    on its compact form, the result expanded (`FusedCall.expand`)."""
    written = {_storage(e.a) for e in elements} if in_place else set()
    if in_place and len(written) < len(elements):
        return None
    calls = []
    for e in elements:
        compact = _compact(e.a) if e.b is None and not in_place else None
        expand = e.a.shape if compact is not None else None
        if compact is not None:  # (an op on a scalar: b and c are None)
            e = Elementwise(e.code, compact, None, None, e.v, e.exact)
        tensors = [t for t in (e.a, e.b, e.c) if t is not None]
        if not all(t.dtype == torch.float32 and t.is_contiguous() and fused.serves(t)
                   and t.numel() for t in tensors):
            return None
        if in_place and any(t is not e.a and _storage(t) in written and not (
                _storage(t) == _storage(e.a) and t.data_ptr() == e.a.data_ptr()
                and t.shape == e.a.shape) for t in tensors):  # (both contiguous: one view)
            return None
        call = _call(e, in_place)
        if call is None:
            return None
        calls.append(call if expand is None else FusedCall(call.element, call.b_inner,
                                                           call.b_count, expand))
    return calls


def _compact(t: torch.Tensor) -> torch.Tensor | None:
    """The contiguous tensor that `t` is an expansion of, or None. An expansion (`t.expand`,
    which the backward of a mean or a sum makes) has a dimension of stride 0 and length above
    one, and is contiguous once its dimensions of stride 0 are made one long: its compact form.
    An op on a scalar is the same on each copy of an element."""
    if not any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride(), strict=True)):
        return None
    compact = t.as_strided([1 if s == 0 else n for n, s in zip(t.shape, t.stride(), strict=True)],
                           t.stride())
    return compact if compact.is_contiguous() else None


def _call(e: Elementwise, in_place: bool) -> FusedCall | None:
    if all(t is None or t.shape == e.a.shape for t in (e.b, e.c)):
        return FusedCall(e, 1, e.a.numel())
    if e.code not in (MUL, ADD, SUB) or e.b is None:
        return None
    spread = _broadcast(e.b.shape, e.a.shape)
    if spread is not None:
        return FusedCall(e, *spread)
    spread = _broadcast(e.a.shape, e.b.shape)
    if spread is not None and e.code != SUB and not in_place:  # a * b == b * a, bit for bit
        return FusedCall(Elementwise(e.code, e.b, e.a, None, e.v), *spread)
    return None


def _broadcast(small: torch.Size, shape: torch.Size) -> tuple[int, int] | None:
    """(inner, count) where a contiguous tensor of shape `small` broadcast to `shape` is, for
    flat element i of the result, its element (i // inner) % count: `small` is ones, then a run
    of `shape`'s dimensions, then ones (a row vector, a column, a channel's value...); else
    None."""
    if len(small) > len(shape):
        return None
    padded = (1,) * (len(shape) - len(small)) + tuple(small)
    kept = [d for d, n in enumerate(padded) if n != 1]
    if not kept:
        return math.prod(shape), 1
    first, last = kept[0], kept[-1]
    if any(padded[d] != shape[d] for d in range(first, last + 1)):
        return None
    return math.prod(shape[last + 1:]), math.prod(shape[first:last + 1])


def small_quotients(calls: list[FusedCall], round_scalar) -> bool:
    """Whether a division among `calls` has a quotient below 2^-125 in magnitude, not zero
    (`torch.ops.ovt.small_quotients`): its site is not one with e = 0 throughout
    (`bounds._quotient`), so the fused pass does not take it."""
    for call in calls:
        e = call.element
        if e.code in (DIV, DIV_SCALAR) and torch.ops.ovt.small_quotients(
                e.a, e.b, _scalar(e, round_scalar)):
            return True
    return False


def _scalar(e: Elementwise, round_scalar) -> float:
    """The number an element's op uses: `_rounded`, or an exact value as it is."""
    return float(e.v) if e.exact else _rounded(e.v, round_scalar)


def _rounded(value: float | int, round_scalar) -> float:
    """A Python float rounded to the target dtype first (SPEC §3.3), as the widened path does;
    an integer as it is."""
    return round_scalar(value) if isinstance(value, float) else float(value)


def run_fused(calls: list[FusedCall], in_place: bool, round_scalar) -> list[torch.Tensor]:
    """Make the calls (`fused_plan`): each into its element's `a` in place, else into a new
    tensor of the result's shape. `round_scalar` rounds a Python float scalar to the target
    dtype first (SPEC §3.3), as the widened path does."""
    results = []
    for call in calls:
        e = call.element
        out = e.a if in_place else torch.empty_like(e.a)
        torch.ops.ovt.pointwise(e.code, e.a, e.b, e.c, _scalar(e, round_scalar), out,
                                call.b_inner, call.b_count)
        results.append(out if call.expand is None else out.expand(call.expand).contiguous())
    return results


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
