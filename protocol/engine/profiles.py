"""Hardware profiles: genuinely different floating-point execution of the same step.

A profile is what an auditor's machine differs in. Real ones on one CPU:
- `threads`: intra-op thread count (float32 weight-gradient GEMMs differ between 1 and 2);
- `channels_last`: memory format of 4-D activations and weights (float64 convs differ ~1e5 ulp);
- `isa`: the kernel instruction set (`ATEN_CPU_CAPABILITY`, fixed when the process starts, so a
  profile asking for another one runs in a subprocess, see `needs_subprocess`);
- `cuda`: the device itself, where one exists.
And emulated ones, stronger than any single CPU knob:
- `splitk` (+ `chunks`, `order`): accumulation re-ordered like another GPU's kernels, the reduced
  dimension cut into `chunks` pieces whose partial sums are combined "permuted" (seeded),
  "pairwise" (a balanced tree) or "reversed" (see `splitk`; `reorder()` builds it);
- `adversary`: the bound adversary, an emulated machine whose errors reach the certified bounds
  of SPEC §3.2.1 (its effect lives in the rounding engine; the profile only carries the switch).

Presets (`PRESETS`) name the useful ones: cpu-1t, cpu-2t, channels-last, isa-default,
emulated-gpu (3 chunks, permuted), splitk-8 (8 chunks, permuted), pairwise (8 chunks),
reversed (16 chunks, 1 thread), adversary, adversary-gpu (adversary plus 4 permuted chunks) and
cuda. `Profile.parse` also takes `key=value,...`, e.g. `threads=1,splitk=7,chunks=5,order=pairwise`,
`adversary=1` or `device=cuda`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from protocol.engine.splitk import ORDERS, SplitK
from protocol.errors import ConfigError

_ISA_VALUES = ("default", "avx2", "avx512")
_KEYS = "device, threads, memory, isa, splitk, chunks, order, adversary"
_BOOLS = {"1": True, "true": True, "0": False, "false": False}


@dataclass(frozen=True)
class Profile:
    name: str
    device: str = "cpu"
    threads: int | None = None
    channels_last: bool = False
    isa: str | None = None
    splitk: int | None = None  # seed of the re-ordered accumulation; None = native order
    chunks: int = 3  # pieces the reduced dimension is split into (splitk only)
    order: str = "permuted"  # how the pieces' partial sums are combined: one of splitk.ORDERS
    adversary: bool = False  # the bound adversary (its effect: the rounding engine)

    def __post_init__(self) -> None:
        """Raises ConfigError for a chunk count below two or an unknown order."""
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 2:
            raise ConfigError(f"profile {self.name!r}: chunks must be an integer >= 2, "
                              f"not {self.chunks!r}")
        if self.order not in ORDERS:
            raise ConfigError(f"profile {self.name!r}: unknown order {self.order!r}; choose one "
                              f"of {', '.join(ORDERS)}")

    @classmethod
    def parse(cls, text: str) -> Profile:
        """A preset by name, or `key=value,...` (keys: see `_KEYS`). Raises ConfigError."""
        if text in PRESETS:
            return PRESETS[text]
        if "=" not in text:
            raise ConfigError(f"unknown profile {text!r}; presets: {', '.join(PRESETS)}; or "
                              f"key=value pairs with keys {_KEYS}")
        fields: dict = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            fields.update(_parse_field(key.strip(), value.strip(), text))
        if fields.keys() & {"chunks", "order"} and "splitk" not in fields:
            # without a split-K seed they would change nothing: say so rather than run natively
            raise ConfigError(f"profile {text!r}: chunks and order need splitk=SEED")
        return cls(name=text, **fields)

    def describe(self) -> str:
        parts = [self.device, f"threads={self.threads or torch.get_num_threads()}"]
        if self.channels_last:
            parts.append("channels_last")
        if self.isa:
            parts.append(f"isa={self.isa}")
        if self.splitk is not None:
            parts.append(f"splitk={self.splitk} chunks={self.chunks} order={self.order}")
        if self.adversary:
            parts.append("adversary")
        return " ".join(parts)

    def reorder(self) -> SplitK | None:
        """The `compute` re-ordering this profile's accumulation, or None for the native order."""
        if self.splitk is None:
            return None
        return SplitK(self.splitk, chunks=self.chunks, order=self.order)

    @property
    def needs_subprocess(self) -> bool:
        """True when this process cannot run the profile (its ISA is fixed at start-up)."""
        return self.isa is not None and self.isa != current_isa()

    def check_runnable(self) -> None:
        if self.needs_subprocess:
            raise ConfigError(f"profile {self.name!r} needs ATEN_CPU_CAPABILITY={self.isa} set "
                              f"before the process starts (this one runs {current_isa()})")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"profile {self.name!r} needs a CUDA device and none is available")

    def env(self) -> dict[str, str]:
        """Environment a subprocess running this profile needs."""
        return {"ATEN_CPU_CAPABILITY": self.isa} if self.isa else {}

    @contextlib.contextmanager
    def applied(self):
        """Set this profile's thread count for the duration (restored afterwards)."""
        self.check_runnable()
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield self
        finally:
            torch.set_num_threads(before)


def _parse_field(key: str, value: str, text: str) -> dict:
    try:
        if key == "device":
            if value != "cpu" and not value.startswith("cuda"):
                raise ValueError
            return {"device": value}
        if key == "threads":
            n = int(value)
            if n < 1:
                raise ValueError
            return {"threads": n}
        if key == "memory":
            if value not in ("contiguous", "channels_last"):
                raise ValueError
            return {"channels_last": value == "channels_last"}
        if key == "isa":
            if value not in _ISA_VALUES:
                raise ValueError
            return {"isa": value}
        if key == "splitk":
            return {"splitk": int(value)}
        if key == "chunks":
            n = int(value)
            if n < 2:
                raise ValueError
            return {"chunks": n}
        if key == "order":
            if value not in ORDERS:
                raise ValueError
            return {"order": value}
        if key == "adversary":
            return {"adversary": _BOOLS[value.lower()]}
    except (ValueError, KeyError):
        raise ConfigError(f"bad value {value!r} for {key!r} in profile {text!r}") from None
    raise ConfigError(f"unknown profile key {key!r} in {text!r}")


def current_isa() -> str:
    """The instruction set this process's ATen kernels run (lower case, e.g. 'avx512')."""
    return torch.backends.cpu.get_cpu_capability().lower()


PRESETS: dict[str, Profile] = {
    "cpu-1t": Profile("cpu-1t", threads=1),
    "cpu-2t": Profile("cpu-2t", threads=2),
    "channels-last": Profile("channels-last", threads=2, channels_last=True),
    "isa-default": Profile("isa-default", threads=2, isa="default"),
    "emulated-gpu": Profile("emulated-gpu", threads=2, splitk=1),
    "splitk-8": Profile("splitk-8", threads=2, splitk=2, chunks=8),
    "pairwise": Profile("pairwise", threads=2, splitk=3, chunks=8, order="pairwise"),
    "reversed": Profile("reversed", threads=1, splitk=4, chunks=16, order="reversed"),
    "adversary": Profile("adversary", threads=2, adversary=True),
    "adversary-gpu": Profile("adversary-gpu", threads=2, splitk=5, chunks=4, adversary=True),
    "cuda": Profile("cuda", device="cuda"),
}


def plain_profile(device: str, threads: int) -> Profile:
    """The unperturbed profile of `device` ("cpu" or "cuda"): `cuda`, or `cpu-<threads>t` (the
    CPU on `threads` intra-op threads); the benchmarks' record and plain roles run under it."""
    if device == "cuda":
        return PRESETS["cuda"]
    if device != "cpu":
        raise ConfigError(f"device {device!r}: expected cpu or cuda")
    return Profile(f"cpu-{threads}t", threads=threads)


# The presets that run on any CPU, in the order `available_profiles` lists them.
_CPU_PRESETS = ("cpu-1t", "cpu-2t", "isa-default", "emulated-gpu", "splitk-8", "pairwise",
                "reversed", "adversary", "adversary-gpu")


def available_profiles(program_has_conv: bool) -> list[Profile]:
    """The presets that really perturb a program on this machine.

    channels_last changes nothing for a program without 4-D tensors, and `cuda` needs a GPU;
    every other preset (the emulated ones included) runs on any CPU.
    """
    names = list(_CPU_PRESETS)
    if program_has_conv:
        names.insert(2, "channels-last")
    if torch.cuda.is_available():
        names.append("cuda")
    return [PRESETS[n] for n in names]

