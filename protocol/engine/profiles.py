"""Hardware profiles: genuinely different floating-point execution of the same step.

A profile is what an auditor's machine differs in. Real ones on one CPU:
- `threads`: intra-op thread count (float32 weight-gradient GEMMs differ between 1 and 2);
- `channels_last`: memory format of 4-D activations and weights (float64 convs differ ~1e5 ulp);
- `isa`: the kernel instruction set (`ATEN_CPU_CAPABILITY`, fixed when the process starts, so a
  profile asking for another one runs in a subprocess, see `needs_subprocess`);
- `cuda`: the device itself, where one exists.
And one emulated: `splitk`, accumulation re-ordered like another GPU's kernels (see `splitk`).

Presets (`PRESETS`) name the useful ones; `Profile.parse` also takes `key=value,...`, e.g.
`threads=1,splitk=7` or `device=cuda`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from protocol.errors import ConfigError

_ISA_VALUES = ("default", "avx2", "avx512")


@dataclass(frozen=True)
class Profile:
    name: str
    device: str = "cpu"
    threads: int | None = None
    channels_last: bool = False
    isa: str | None = None
    splitk: int | None = None  # seed of the permuted accumulation order; None = native order

    @classmethod
    def parse(cls, text: str) -> Profile:
        if text in PRESETS:
            return PRESETS[text]
        if "=" not in text:
            raise ConfigError(f"unknown profile {text!r}; presets: {', '.join(PRESETS)}; or "
                              f"key=value pairs with keys device, threads, memory, isa, splitk")
        fields: dict = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            fields.update(_parse_field(key.strip(), value.strip(), text))
        return cls(name=text, **fields)

    def describe(self) -> str:
        parts = [self.device, f"threads={self.threads or torch.get_num_threads()}"]
        if self.channels_last:
            parts.append("channels_last")
        if self.isa:
            parts.append(f"isa={self.isa}")
        if self.splitk is not None:
            parts.append(f"splitk={self.splitk}")
        return " ".join(parts)

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
    except ValueError:
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
    "cuda": Profile("cuda", device="cuda"),
}


def available_profiles(program_has_conv: bool) -> list[Profile]:
    """The presets that really perturb a program on this machine.

    channels_last changes nothing for a program without 4-D tensors, and `cuda` needs a GPU.
    """
    names = ["cpu-1t", "cpu-2t", "isa-default", "emulated-gpu"]
    if program_has_conv:
        names.insert(2, "channels-last")
    if torch.cuda.is_available():
        names.append("cuda")
    return [PRESETS[n] for n in names]

