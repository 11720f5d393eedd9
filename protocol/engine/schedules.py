"""Learning-rate schedules as part of the step (SPEC §3.5): the same bits on every machine.

A program may give a `torch.optim.lr_scheduler` scheduler; the executor steps it once per step,
after the optimizer, and commits the learning rate of every parameter group in `S_t`. The
schedule must give the same learning rate bits on every machine, and Python's float arithmetic
does (+, -, *, / are IEEE-754 double operations, correctly rounded everywhere), but `math.cos`
comes from the platform's C library, whose last bits differ between glibc, musl, macOS and
Windows. So while a schedule runs, `torch.optim.lr_scheduler` sees a `math` whose `cos` is
`portable_cos` below: the same IEEE operations in the same order on every machine.

Only schedulers whose learning rates come from arithmetic and `cos` alone are accepted
(`SCHEDULERS`); MultiStepLR, PolynomialLR and CyclicLR raise floats to powers (the C library's
`pow`), and ReduceLROnPlateau needs a metric the step does not give. A `LambdaLR` function is
the program's own code: it must use arithmetic and `portable_cos` only, never `math`'s
transcendental functions.

    >>> portable_cos(0.0)
    1.0
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.optim import lr_scheduler

from protocol.errors import ConfigError, DeterminismError, ProgramError

SchedulerFactory = Callable[[torch.optim.Optimizer], lr_scheduler.LRScheduler]

SCHEDULERS = (
    lr_scheduler.LambdaLR, lr_scheduler.MultiplicativeLR, lr_scheduler.StepLR,
    lr_scheduler.ConstantLR, lr_scheduler.LinearLR, lr_scheduler.ExponentialLR,
    lr_scheduler.CosineAnnealingLR, lr_scheduler.CosineAnnealingWarmRestarts,
    lr_scheduler.OneCycleLR, lr_scheduler.SequentialLR, lr_scheduler.ChainedScheduler,
)

# Cody–Waite reduction by pi/2 in three parts (fdlibm's __ieee754_rem_pio2 constants): the
# first has 33 significant bits, so k * _PIO2_1 is exact for |k| < 2**20, and the sum of the
# three is pi/2 to about 2**-140.
_PIO2_1 = 1.57079632673412561417e+00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_3 = 2.02226624871116645580e-21
_TWO_OVER_PI = 6.36619772367581382433e-01
_TAYLOR_TERMS = 11  # |r| <= pi/4: the first omitted term is below 2**-80
_COS_TERMS = tuple(1.0 / math.factorial(2 * k) for k in range(_TAYLOR_TERMS))
_SIN_TERMS = tuple(1.0 / math.factorial(2 * k + 1) for k in range(_TAYLOR_TERMS))


def _series(r2: float, terms: tuple[float, ...]) -> float:
    """sum_k (-1)^k terms[k] r2^k, by Horner (the same operations in the same order always)."""
    total = 0.0
    for term in reversed(terms):
        total = term - r2 * total
    return total


def portable_cos(x: float) -> float:
    """cos(x) from IEEE-754 double arithmetic only: the same bits on every machine.

    x is reduced by pi/2 (Cody–Waite, three parts) to |r| <= pi/4 and quadrant q, then cos or
    sin of r is an 11-term Taylor polynomial. Within a few ULPs of the true cosine for
    |x| < 2**20 (tested against `math.cos`); beyond that less accurate, still portable.
    Raises DeterminismError for a non-finite x.
    """
    if not math.isfinite(x):
        raise DeterminismError(f"portable_cos of a non-finite value {x!r}")
    k = math.floor(x * _TWO_OVER_PI + 0.5)
    r = ((x - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_3
    r2 = r * r
    cos_r, sin_r = _series(r2, _COS_TERMS), r * _series(r2, _SIN_TERMS)
    return (cos_r, -sin_r, -cos_r, sin_r)[k % 4]


def _unavailable(name: str) -> Callable[..., float]:
    def refuse(*args: object) -> float:
        raise DeterminismError(f"a learning-rate schedule called math.{name}, which comes from "
                               f"the platform's C library; step schedulers without an epoch "
                               f"argument (SPEC §3.5)")
    return refuse


_PORTABLE_MATH = types.SimpleNamespace(cos=portable_cos, pi=math.pi, floor=math.floor,
                                       log=_unavailable("log"))


@contextlib.contextmanager
def portable_schedule_math() -> Iterator[None]:
    """Make `torch.optim.lr_scheduler` compute with `portable_cos` while the block runs.

    Callers hold the executor's step lock, so no other schedule runs meanwhile."""
    saved = lr_scheduler.math  # type: ignore[attr-defined]
    lr_scheduler.math = _PORTABLE_MATH  # type: ignore[attr-defined, assignment]
    try:
        yield
    finally:
        lr_scheduler.math = saved  # type: ignore[attr-defined]


def check_scheduler(scheduler: object) -> lr_scheduler.LRScheduler:
    """`scheduler` if it (and every scheduler it chains) is one of `SCHEDULERS`.

    Raises ConfigError naming the scheduler and why it is refused."""
    if not isinstance(scheduler, SCHEDULERS):
        raise ConfigError(
            f"learning-rate scheduler {type(scheduler).__name__} is not supported: its rates "
            f"would depend on the C library's pow or on a metric; use one of "
            f"{', '.join(s.__name__ for s in SCHEDULERS)} (SPEC §3.5)")
    for child in getattr(scheduler, "_schedulers", ()):
        check_scheduler(child)
    return scheduler


def make_scheduler(factory: SchedulerFactory, optimizer: torch.optim.Optimizer
                   ) -> lr_scheduler.LRScheduler:
    """A fresh scheduler from the program's factory, at step 0: every group's learning rate
    first reset to its initial one, so a rebuilt scheduler starts where the first one did.
    Raises ConfigError for an unsupported scheduler."""
    for group in optimizer.param_groups:
        if "initial_lr" in group:
            group["lr"] = group["initial_lr"]
    with portable_schedule_math():
        return check_scheduler(factory(optimizer))


def advance(scheduler: lr_scheduler.LRScheduler, steps: int = 1) -> None:
    """Step the schedule `steps` times (once per training step; more to fast-forward a fresh
    schedule to a loaded state, where torch would warn that the optimizer did not step).
    Raises ProgramError where the scheduler itself fails (OneCycleLR stepped past its
    total_steps)."""
    with portable_schedule_math(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)",
                                category=UserWarning)
        for _ in range(steps):
            try:
                scheduler.step()
            except (ValueError, ZeroDivisionError, OverflowError) as err:
                raise ProgramError(f"the learning-rate schedule failed after "
                                   f"{scheduler.last_epoch} steps: {err}") from None


def learning_rates(optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Every parameter group's learning rate, as the float64 tensor `S_t` holds."""
    return torch.tensor([float(g["lr"]) for g in optimizer.param_groups], dtype=torch.float64)


def warmup_cosine(warmup_steps: int, decay_steps: int, min_lr: float
                  ) -> SchedulerFactory | None:
    """The usual language-model schedule, as a factory: a linear warm-up from 1/(warmup_steps
    + 1) of each group's rate to all of it over `warmup_steps` steps, then a cosine decay to
    `min_lr` over `decay_steps` steps, then `min_lr`; either part may be 0 steps. None when
    both are 0 (a constant rate).

    One `LambdaLR` in closed form with `portable_cos`, so a rate never depends on earlier
    rounding (a chain of recursive schedulers would) nor on the C library. Raises ConfigError
    for negative lengths or a negative min_lr.
    """
    if warmup_steps < 0 or decay_steps < 0 or min_lr < 0:
        raise ConfigError("warm-up and decay steps and min_lr must be >= 0")
    if not warmup_steps and not decay_steps:
        return None

    def factor(floor: float, step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if not decay_steps:
            return 1.0
        done = min(step - warmup_steps, decay_steps)
        return floor + (1.0 - floor) * (1.0 + portable_cos(math.pi * done / decay_steps)) / 2

    def factory(optimizer: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
        floors = [min_lr / group["lr"] for group in optimizer.param_groups]
        return lr_scheduler.LambdaLR(optimizer, [functools.partial(factor, f) for f in floors])
    return factory
