"""Builds the fused band pass (`protocol/engine/csrc/band.cpp`, issue 13) with the machine's
C++ compiler; everything else is in pyproject.toml. The extension is optional: where it cannot
be built, the install goes on and ovt rounds through torch ops instead (same bits, slower),
saying so when it starts (`protocol.engine.fused`)."""

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

setup(
    ext_modules=[CppExtension(
        "protocol.engine._band", ["protocol/engine/csrc/band.cpp"],
        # two roundings for a*b + c, as torch computes it, and no fast-math shortcuts
        extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
        optional=True)],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
