"""Run the Metal kernel bodies on a machine without Metal: compiled as C++ against a small Metal shim.

See metal_shim.h (the emulated language subset), driver.h (the dispatchThreads-style launcher) and runner.py
(signature generation, compilation with sanitizers, I/O). metal/README.md says what this proves and what not.
"""

from cortexstream.kernels.cpp_shim.runner import (
    ShimError, build, compiler, run_launch, sanitizers_available, translation_unit,
)

__all__ = ["ShimError", "build", "compiler", "run_launch", "sanitizers_available", "translation_unit"]
