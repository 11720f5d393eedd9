"""Builds the fused passes of the rounding engine (`protocol/engine/csrc/fused.cpp`, issue 13)
with the machine's C++ compiler, as the module `protocol.engine._fused`, and their CUDA kernels
(`fused_cuda.cu`) with nvcc, as `protocol.engine._fused_cuda`, where torch is a CUDA build and
nvcc is found (`OVT_CUDA=0` skips them); everything else is in pyproject.toml. Each module is
optional: where one cannot be built (no compiler, or one torch cannot use), the install goes on
without it, and ovt computes the same with torch ops instead (the same bits, slower): on every
device without `_fused`, which ovt warns of each time it starts (`protocol.engine.fused`), and
on CUDA devices without `_fused_cuda`."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


class OptionalBuildExtension(BuildExtension.with_options(use_ninja=False)):
    """torch's build, each module on its own: one that fails to build is left out (a warning
    says why) and the others are built and installed all the same."""

    def build_extensions(self) -> None:
        self.failed: list = []
        try:
            if not _shares_torchs_openmp(self.compiler.compiler_so[0]):
                _drop_openmp(self.extensions)
            try:
                super().build_extensions()
            except Exception as exc:  # torch's checks of the toolchain, before any module
                if not self._drop_cuda_kernels(exc):
                    raise
                super().build_extensions()  # (the checks again, without CUDA's)
        except Exception as exc:
            self.failed = list(self.extensions)
            print(f"WARNING: ovt's fused passes were not built ({exc}); ovt will use torch ops "
                  f"instead (same bits, slower record steps)", file=sys.stderr)
        # nothing to copy into place or list as built for a module that failed
        self.extensions = [e for e in self.extensions if e not in self.failed]

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # the compile or the link of this module
            self.failed.append(ext)
            what = "CUDA kernels" if CUDA_SOURCE in ext.sources else "passes"
            print(f"WARNING: ovt's fused {what} were not built ({exc}); ovt will use torch ops "
                  f"instead there (same bits, slower steps)", file=sys.stderr)

    def _drop_cuda_kernels(self, exc: Exception) -> bool:
        """Leave the CUDA kernels out, where torch's check of the CUDA toolchain failed (nvcc's
        version against torch's CUDA, or the host compiler against nvcc's range); whether
        there were any to leave out."""
        cuda = [e for e in self.extensions if CUDA_SOURCE in e.sources]
        if not cuda:
            return False
        print(f"WARNING: ovt's fused CUDA kernels were not built ({exc}); CUDA sites will use "
              f"torch ops instead (same bits, slower steps)", file=sys.stderr)
        self.extensions = [e for e in self.extensions if e not in cuda]
        return True


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
    for extension in extensions:  # (the CPU passes': the CUDA kernels' are nvcc's, without it)
        if isinstance(extension.extra_compile_args, list):
            extension.extra_compile_args = [a for a in extension.extra_compile_args
                                            if a not in OPENMP]
        extension.extra_link_args = [a for a in extension.extra_link_args if a not in OPENMP]


CSRC = Path(__file__).parent / "protocol" / "engine" / "csrc"
SOURCE = "protocol/engine/csrc/fused.cpp"
CUDA_SOURCE = "protocol/engine/csrc/fused_cuda.cu"
# Every source of the library (csrc's .cpp, .cu and .h files, by name): each module carries
# their hash, and protocol.engine.fused refuses one built from other sources, so each module
# depends on all of them (an edit to any rebuilds both).
SOURCES = [f"protocol/engine/csrc/{p.name}" for p in sorted(CSRC.iterdir())
           if p.is_file() and p.suffix in (".cpp", ".cu", ".h")]
DIGEST = hashlib.sha256(b"".join((Path(__file__).parent / p).read_bytes()
                                 for p in SOURCES)).hexdigest()
# two roundings for a*b + c, as torch computes it, and no fast-math shortcuts; a square root is
# the IEEE instruction, vectorised (no errno: a negative input gives NaN)
CXX_ARGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", *OPENMP]
NVCC_ARGS = ["-O3", "--fmad=false"]  # (no fused multiply-add on the device either)
MACROS = [("OVT_FUSED_SOURCE", f'"{DIGEST}"')]
# dladdr (the OWN_STANDARD_LIBRARY check) is in libdl before glibc 2.34
LIBRARIES = ["dl"] if sys.platform.startswith("linux") else []


def extensions() -> list:
    """`_fused`, and `_fused_cuda` where it may be built (the module docstring)."""
    modules = [CppExtension("protocol.engine._fused", [SOURCE], define_macros=list(MACROS),
                            libraries=list(LIBRARIES), extra_compile_args=list(CXX_ARGS),
                            extra_link_args=list(OPENMP), depends=list(SOURCES))]
    if torch.version.cuda is not None and CUDA_HOME is not None and \
            Path(CUDA_HOME, "bin", "nvcc").exists() and os.environ.get("OVT_CUDA") != "0":
        modules.append(CUDAExtension("protocol.engine._fused_cuda", [CUDA_SOURCE],
                                     define_macros=list(MACROS), libraries=list(LIBRARIES),
                                     extra_compile_args={"nvcc": list(NVCC_ARGS)},
                                     depends=list(SOURCES)))
    return modules


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": OptionalBuildExtension},
)
