"""Builds the fused passes of the rounding engine (`protocol/engine/csrc/fused.cpp`, issue 13)
with the machine's C++ compiler; everything else is in pyproject.toml. The extension is
optional: where it cannot be built (no compiler, or one torch cannot use), the install goes on
and ovt computes the same with torch ops instead (the same bits, slower), warning each time it
starts (`protocol.engine.fused`)."""

import hashlib
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


class OptionalBuildExtension(BuildExtension.with_options(use_ninja=False)):
    def build_extensions(self) -> None:
        try:
            super().build_extensions()
        except Exception as exc:  # the compiler check and the compile itself raise their own
            self.extensions = []  # nothing to copy into place or list as built
            print(f"WARNING: ovt's fused passes were not built ({exc}); ovt will use torch ops "
                  f"instead (same bits, slower record steps)", file=sys.stderr)


SOURCE = "protocol/engine/csrc/fused.cpp"
# the library carries its source's hash; protocol.engine.fused refuses one built from another
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

# at::parallel_for is inline code: with ATen's OpenMP backend it runs on torch's threads only in
# code compiled with OpenMP (else serially). Linked by soname, the libgomp torch has loaded is
# the one used, so torch.set_num_threads governs these passes too.
OPENMP = ["-fopenmp"] if torch._C.has_openmp and sys.platform.startswith("linux") else []

setup(
    ext_modules=[CppExtension(
        "protocol.engine._fused", [SOURCE],
        define_macros=[("OVT_FUSED_SOURCE", f'"{DIGEST}"')],
        # two roundings for a*b + c, as torch computes it, and no fast-math shortcuts
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", *OPENMP],
        extra_link_args=OPENMP)],
    cmdclass={"build_ext": OptionalBuildExtension},
)
