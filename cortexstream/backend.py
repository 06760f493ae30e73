"""Which compute backend and BLAS this process runs on, and how to get the fast one on Linux.

The Linux `mlx[cpu]` wheel links the reference (netlib) BLAS, which is 7-50x slower for float32 matmul than
OpenBLAS. MLX resolves BLAS symbols when it is imported, so the only way to switch without rebuilding MLX is
to start the process with OpenBLAS in LD_PRELOAD. The CLI re-executes itself once with it preloaded.
"""

from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from functools import lru_cache

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
# Set in the child so a failed preload can never turn into an exec loop.
REEXEC_MARKER = "CORTEXSTREAM_BLAS_REEXEC"
DISABLE_ENV = "CORTEXSTREAM_NO_OPENBLAS"
# How long the small-batch kernel's idle OpenMP worker spins before it sleeps (libgomp's GOMP_SPINCOUNT; its
# default is 300,000). On a 2-core machine a spinning OpenMP worker takes a core from
# OpenBLAS's threads (and they from it) whenever kernel calls and multi-threaded BLAS calls alternate, as in a
# decode pass carrying a prefill chunk; sleeping at once (OMP_WAIT_POLICY=passive) makes every back-to-back kernel
# call of a decode step pay a wake-up. Measured (8 decode + 4 chunk rows at 1,500 keys, and `generate`):
# the default spin made that pass 2.9x a decode step, 20,000 spins 1.7-1.9x; passive cost single-stream `generate`
# 1.31x -> 1.01-1.12x of mlx-lm's speed, 20,000 spins kept it (1.28-1.32x). Only a default: a user's
# GOMP_SPINCOUNT or OMP_WAIT_POLICY stays.
OPENMP_SPIN = ("GOMP_SPINCOUNT", "20000")


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


def preload_libraries() -> list[str]:
    """The libraries this process should start with in LD_PRELOAD, in order: the small-batch matmul interposer
    (kernels/small_gemm.py; it must come before the BLAS whose cblas_sgemm it wraps), then OpenBLAS."""
    from cortexstream.kernels.small_gemm import library_path

    return [lib for lib in (library_path(), find_openblas()) if lib is not None]


def maybe_reexec_with_openblas() -> None:
    """Replace this process with the same command line plus OpenBLAS and the small-batch matmul interposer in
    LD_PRELOAD, when that helps and is possible, and with MLX's CPU JIT compiler wrapped (`mlx_jit.jit_environment`).

    Must run before `mlx.core` is imported (the CLI's entry point, the test suite's conftest). Returns normally when
    there is nothing to do: not Linux, already done, opted out (CORTEXSTREAM_NO_OPENBLAS=1 for both, or
    CORTEXSTREAM_NO_SMALL_GEMM=1 for the interposer), or neither library here.
    """
    if not sys.platform.startswith("linux") or os.environ.get(REEXEC_MARKER) or os.environ.get(DISABLE_ENV):
        return
    if "mlx.core" in sys.modules:
        return
    preload = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if p]
    wanted = preload_libraries()
    if all(lib in preload for lib in wanted):
        return
    from cortexstream.kernels.mlx_jit import jit_environment

    env = dict(os.environ)
    # The wanted libraries first, in their order, so the interposer precedes the BLAS even if the BLAS was there.
    env["LD_PRELOAD"] = ":".join(wanted + [p for p in preload if p not in wanted])
    env[REEXEC_MARKER] = "1"
    kernel = wanted and wanted[0] != find_openblas()  # the interposer (first when present) runs OpenMP threads
    if kernel and "OMP_WAIT_POLICY" not in env:
        env.setdefault(*OPENMP_SPIN)
    env.update(jit_environment(env))  # MLX's fused elementwise kernels vectorised (kernels/mlx_jit.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


@dataclass(frozen=True)
class BackendInfo:
    device: str
    metal: bool
    blas: str
    mlx_version: str


def backend_info() -> BackendInfo:
    import mlx.core as mx

    metal = bool(mx.metal.is_available())
    return BackendInfo(
        device=str(mx.default_device()),
        metal=metal,
        blas="Metal (GPU)" if metal else loaded_blas(),
        mlx_version=getattr(mx, "__version__", "unknown"),
    )


def on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.cpu or not mx.metal.is_available()


def ensure_buffer_cache(min_bytes: int = 1 << 30) -> None:
    """Raise MLX's buffer-cache limit to at least `min_bytes` (capped at 10% of the memory limit).

    On the CPU backend the default is 32 MiB; a batched decode step allocates and frees more than that (gathered
    K/V, logits), so without this every step gives its buffers back to the OS and page-faults them in again
    (measured: 3.5-4.3x slower batched attention at 2k-8k context, bench/results/arena_attention.md).
    """
    import mlx.core as mx

    target = min(min_bytes, mx.get_memory_limit() // 10)
    current = mx.set_cache_limit(target)  # returns the previous limit
    if current > target:
        mx.set_cache_limit(current)


@lru_cache(maxsize=1)
def _openblas() -> ctypes.CDLL | None:
    """OpenBLAS's thread controls when it is loaded in this process (preloaded or linked), else None."""
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
