"""Builds the fused passes of the rounding engine (`protocol/engine/csrc/fused.cpp`, issue 13)
with the machine's C++ compiler; everything else is in pyproject.toml. The extension is
optional: where it cannot be built (no compiler, or one torch cannot use), the install goes on
and ovt computes the same with torch ops instead (the same bits, slower), warning each time it
starts (`protocol.engine.fused`)."""

import hashlib
import subprocess
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension


class OptionalBuildExtension(BuildExtension.with_options(use_ninja=False)):
    def build_extensions(self) -> None:
        if not _shares_torchs_openmp(self.compiler.compiler_so[0]):
            _drop_openmp(self.extensions)
        try:
            super().build_extensions()
        except Exception as exc:  # the compiler check and the compile itself raise their own
            self.extensions = []  # nothing to copy into place or list as built
            print(f"WARNING: ovt's fused passes were not built ({exc}); ovt will use torch ops "
                  f"instead (same bits, slower record steps)", file=sys.stderr)


# at::parallel_for is inline code: with ATen's OpenMP backend it runs on torch's threads only in
# code compiled with OpenMP (else serially). Built by GCC and linked by soname against the
# libgomp.so.1 torch ships, the runtime is the one torch has loaded, and torch.set_num_threads
# governs these passes too; any other runtime (clang's libomp, a system libgomp beside a
# renamed one of torch's) would be a second thread pool, so then the passes run serially.
OPENMP = ["-fopenmp"]


def _shares_torchs_openmp(compiler: str) -> bool:
    if not (torch._C.has_openmp and sys.platform.startswith("linux")):
        return False
    if not (Path(torch.__file__).parent / "lib" / "libgomp.so.1").exists():
        return False
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "clang" not in version.lower() and ("gcc" in version.lower()
                                               or "free software foundation" in version.lower())


def _drop_openmp(extensions) -> None:
    for extension in extensions:
        extension.extra_compile_args = [a for a in extension.extra_compile_args
                                        if a not in OPENMP]
        extension.extra_link_args = [a for a in extension.extra_link_args if a not in OPENMP]


SOURCE = "protocol/engine/csrc/fused.cpp"
# the library carries its source's hash; protocol.engine.fused refuses one built from another
DIGEST = hashlib.sha256((Path(__file__).parent / SOURCE).read_bytes()).hexdigest()

setup(
    ext_modules=[CppExtension(
        "protocol.engine._fused", [SOURCE],
        define_macros=[("OVT_FUSED_SOURCE", f'"{DIGEST}"')],
        # two roundings for a*b + c, as torch computes it, and no fast-math shortcuts; a square
        # root is the IEEE instruction, vectorised (no errno: a negative input gives NaN)
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno",
                            *OPENMP],
        # dladdr (the OWN_STANDARD_LIBRARY check) is in libdl before glibc 2.34
        libraries=["dl"] if sys.platform.startswith("linux") else [],
        extra_link_args=OPENMP)],
    cmdclass={"build_ext": OptionalBuildExtension},
)
