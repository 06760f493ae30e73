"""Which BLAS this process runs MLX's CPU matmuls on, and OpenBLAS's thread control when it is the one."""

from __future__ import annotations

import ctypes
import os
import sys
from functools import lru_cache

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


def find_openblas() -> str | None:
    """Path of an installed OpenBLAS that can stand in for libblas.so.3, or None."""
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return None


def loaded_blas() -> str:
    """Name the BLAS actually mapped into this process (Linux), or the platform's default elsewhere."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            mapped = maps.read()
    except OSError:
        return "unknown"
    # numpy wheels map their own libscipy_openblas; only the system OpenBLAS standing in for libblas counts.
    if "openblas-pthread/libblas" in mapped or "openblas-openmp/libblas" in mapped or "/libopenblas" in mapped:
        return "OpenBLAS"
    if "mlx_cpu.libs/libblas" in mapped or "libblas" in mapped:
        return "reference BLAS (netlib, from the mlx[cpu] wheel)"
    return "not loaded yet"


@lru_cache(maxsize=1)
def _openblas() -> ctypes.CDLL | None:
    """OpenBLAS's thread controls when it is loaded in this process (preloaded or linked), else None. What a
    process loaded at start never changes, so this is looked up once."""
    process = ctypes.CDLL(None)
    if not (hasattr(process, "openblas_set_num_threads") and hasattr(process, "openblas_get_num_threads")):
        return None
    process.openblas_get_num_threads.restype = ctypes.c_int
    process.openblas_set_num_threads.argtypes = [ctypes.c_int]
    return process


def openblas_threads() -> int:
    """How many threads OpenBLAS currently uses per call; 0 when OpenBLAS is not in this process."""
    lib = _openblas()
    return int(lib.openblas_get_num_threads()) if lib is not None else 0


def set_openblas_threads(threads: int) -> int:
    """Set OpenBLAS's threads per call (>= 1) and return the previous count; a no-op returning 0 without it."""
    lib = _openblas()
    if lib is None:
        return 0
    previous = openblas_threads()
    if threads != previous:
        lib.openblas_set_num_threads(int(threads))
    return previous
