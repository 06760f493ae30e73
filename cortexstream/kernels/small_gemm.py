"""The CPU small-batch matmul (small_gemm.c): built with the system C compiler, preloaded as a BLAS interposer.

MLX's CPU backend multiplies float32 with `cblas_sgemm`. The library built from small_gemm.c defines its own
`cblas_sgemm`; preloaded ahead of the BLAS (`backend.enable_linux_cpu_tuning` puts it in LD_PRELOAD), it takes
the Linear layers' few-row calls while its row limit is above zero and passes every other call on to the real BLAS.
The limit starts at 0, so a process that preloads it computes exactly as before until an engine's CPU backend
holds it around its steps (`acquire` / `release`, backend/small_batch.py). The count of holders, the limit and
OpenBLAS's saved thread count live in the C library, the one copy per process, not in Python. Working inside
MLX's own evaluation keeps the graph lazy: no synchronisation per layer.

The build is cached per source, compiler and flags (a changed source or ABI is never loaded from an old build)
under $CORTEXSTREAM_KERNEL_CACHE (default: a per-user folder in the temp dir). No compiler, a failed build, or
CORTEXSTREAM_NO_SMALL_GEMM=1: `library_path()` is None and MLX's matmul stays the only path. `small_gemm(x, w)`
calls the kernel directly (tests, benchmarks); its arguments are checked here, before any pointer reaches C.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).resolve().parent / "small_gemm.c"
CACHE_ENV = "CORTEXSTREAM_KERNEL_CACHE"
DISABLE_ENV = "CORTEXSTREAM_NO_SMALL_GEMM"
MAX_ROWS = 4096  # the C side's own limit on direct calls
_ABI_VERSION = 3  # cs_small_gemm_abi_version() of a build this module can drive
_build_lock = threading.Lock()


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "0") not in ("", "0")


def native_arch_flag() -> str:
    """gcc's flag for this machine's own instruction set (`-march` on x86, `-mcpu` on Arm)."""
    return "-march=native" if platform.machine().lower() in ("x86_64", "amd64") else "-mcpu=native"


def _flags() -> list[str]:
    return ["-O3", "-fPIC", "-shared", "-std=gnu11", "-Wall", "-pthread", native_arch_flag()]


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), f"cortexstream-kernels-{os.getuid()}")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compile(cc: str, out: Path, openmp: bool) -> bool:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [cc, *_flags(), *(["-fopenmp"] if openmp else []), str(SOURCE), "-o", str(tmp_out), "-ldl"]
        if subprocess.run(cmd, capture_output=True).returncode != 0:
            return False
        os.replace(tmp_out, out)  # atomic: a concurrent process never loads a half-written library
    return True


@lru_cache(maxsize=1)
def library_path() -> str | None:
    """Path of the built library (built now if needed), or None where it cannot be built or is disabled.
    Linux only: elsewhere the BLAS is not interposed (on a Mac, MLX runs on Metal)."""
    if disabled() or not sys.platform.startswith("linux"):
        return None
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([cc, *_flags()]).encode()).hexdigest()[:20]
    with _build_lock:
        for openmp in (True, False):  # without OpenMP: one thread
            lib_path = cache_dir() / f"small_gemm-{digest}-{'omp' if openmp else 'st'}.so"
            if lib_path.exists() or _compile(cc, lib_path, openmp):
                return str(lib_path)
    return None


@lru_cache(maxsize=1)
def _direct() -> ctypes.CDLL | None:
    path = library_path()
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    if lib.cs_small_gemm_abi_version() != _ABI_VERSION:
        return None
    lib.cs_small_gemm.restype = ctypes.c_int
    lib.cs_small_gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    return lib


@lru_cache(maxsize=1)
def interposer() -> ctypes.CDLL | None:
    """The preloaded interposer's controls when this process started with it in LD_PRELOAD, else None (what a
    process preloaded never changes, so this is looked up once, not at every engine step). A preloaded build of
    another ABI (an older source) counts as absent: its functions are not the ones called here."""
    process = ctypes.CDLL(None)
    if not hasattr(process, "cs_small_gemm_interposed") or not hasattr(process, "cs_small_gemm_abi_version"):
        return None
    if process.cs_small_gemm_abi_version() != _ABI_VERSION:
        return None
    process.cs_small_gemm_call_count.restype = ctypes.c_longlong
    return process


def acquire(rows: int) -> int:
    """One more holder of the kernel (an engine inside its step); its row limit becomes `rows`. Returns the number
    of holders in the process; 0 (nothing done) without the interposer."""
    lib = interposer()
    return int(lib.cs_small_gemm_acquire(int(rows))) if lib is not None else 0


def release() -> int:
    """One holder fewer; the last one sets the limit back to 0 and restores OpenBLAS's thread count. Returns the
    holders left; 0 without the interposer."""
    lib = interposer()
    return int(lib.cs_small_gemm_release()) if lib is not None else 0


def before_pass(rows: int) -> int:
    """While held: one OpenBLAS thread for a pass of `rows` rows the kernel covers, else OpenBLAS's own count.
    Returns the count set, 0 when nothing was done (not held, no OpenBLAS, no interposer)."""
    lib = interposer()
    return int(lib.cs_small_gemm_before_pass(int(rows))) if lib is not None else 0


def holders() -> int:
    """How many holds are open in this process (0 without the interposer)."""
    lib = interposer()
    return int(lib.cs_small_gemm_holders()) if lib is not None else 0


def set_row_limit(rows: int) -> int:
    """Set the interposer's row limit (0: off) and return the previous one; a no-op returning 0 without it.
    For benchmarks and tests that time the kernel directly; engines go through `acquire` / `release`."""
    lib = interposer()
    if lib is None:
        return 0
    previous = row_limit()
    lib.cs_set_small_gemm_rows(int(rows))
    return previous


def row_limit() -> int:
    """The interposer's current row limit (0 without it)."""
    lib = interposer()
    return int(lib.cs_get_small_gemm_rows()) if lib is not None else 0


def call_count() -> int:
    """How many sgemm calls the interposer's kernel has taken in this process (0 without it)."""
    lib = interposer()
    return int(lib.cs_small_gemm_call_count()) if lib is not None else 0


def default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def small_gemm(x: np.ndarray, w: np.ndarray, num_threads: int | None = None) -> np.ndarray:
    """`x @ w.T` through the kernel, for float32 C-contiguous `x` [M, K] and `w` [N, K]; returns a new [M, N]."""
    lib = _direct()
    if lib is None:
        raise RuntimeError("small_gemm is not available here (no C compiler, not Linux, disabled, or build failed)")
    for name, arr in (("x", x), ("w", w)):
        if not isinstance(arr, np.ndarray) or arr.dtype != np.float32 or arr.ndim != 2:
            raise ValueError(f"small_gemm: {name} must be a 2-d float32 ndarray, got "
                             f"{getattr(arr, 'dtype', type(arr))} with shape {getattr(arr, 'shape', None)}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"small_gemm: {name} must be C-contiguous")
    (m, k), (n, k_w) = x.shape, w.shape
    if k != k_w or m < 1 or n < 1 or k < 1:
        raise ValueError(f"small_gemm: x {x.shape} and w {w.shape} do not multiply as x @ w.T")
    if m > MAX_ROWS:
        raise ValueError(f"small_gemm: x has {m} rows, at most {MAX_ROWS}")
    y = np.empty((m, n), dtype=np.float32)
    if lib.cs_small_gemm(x.ctypes.data, w.ctypes.data, y.ctypes.data, m, n, k, num_threads or default_threads()):
        raise ValueError(f"small_gemm: the kernel refused shapes x {x.shape}, w {w.shape}")
    return y
