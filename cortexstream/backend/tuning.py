"""The only process-wide changes CortexStream makes: a re-exec with OpenBLAS, the small-batch interposer and MLX's
wrapped JIT compiler on Linux. Made by the `cortexstream` command, the test suite's pytest plugin, and scripts
that call `enable_linux_cpu_tuning()` first; a plain `import cortexstream` (or of any module) changes nothing.

Why a re-exec: the Linux `mlx[cpu]` wheel links the reference (netlib) BLAS, much slower for float32 matmul than
OpenBLAS (`cortexstream info` says which is loaded). MLX resolves BLAS symbols when it is imported, so the only way
to switch without rebuilding MLX is to start the process with OpenBLAS in LD_PRELOAD; the small-batch interposer
(kernels/small_gemm.py) must precede it there, and MLX's CPU JIT compiler is replaced through PATH and TMPDIR
(kernels/mlx_jit.py). All three are decided before `mlx.core` is imported, hence one re-exec of the same command.
"""

from __future__ import annotations

import os
import sys

from cortexstream.backend.blas import find_openblas

# Set in the child so a failed preload can never turn into an exec loop.
REEXEC_MARKER = "CORTEXSTREAM_BLAS_REEXEC"
DISABLE_ENV = "CORTEXSTREAM_NO_OPENBLAS"
# How long the small-batch kernel's idle OpenMP worker spins before it sleeps (libgomp's GOMP_SPINCOUNT). libgomp's
# default spin takes a core from OpenBLAS's threads whenever kernel calls and multi-threaded BLAS calls alternate
# (a decode pass carrying a prefill chunk); sleeping at once (OMP_WAIT_POLICY=passive) makes every back-to-back
# kernel call pay a wake-up. A short spin avoids both (docs/linux-cpu.md, bench/results/throughput_itl*.md).
# Only a default: a user's GOMP_SPINCOUNT or OMP_WAIT_POLICY stays.
OPENMP_SPIN = ("GOMP_SPINCOUNT", "20000")


def preload_libraries() -> list[str]:
    """The libraries this process should start with in LD_PRELOAD, in order: the small-batch matmul interposer
    (kernels/small_gemm.py; it must come before the BLAS whose cblas_sgemm it wraps), then OpenBLAS."""
    from cortexstream.kernels.small_gemm import library_path

    return [lib for lib in (library_path(), find_openblas()) if lib is not None]


def tuned_environment(env: dict[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with, from `env`: the wanted libraries first in LD_PRELOAD, the OpenMP spin
    default when the interposer is among them, MLX's JIT wrapper; None when everything is already preloaded."""
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    wanted = preload_libraries()
    if all(lib in preload for lib in wanted):
        return None
    from cortexstream.kernels.mlx_jit import jit_environment

    env = dict(env)
    # The wanted libraries first, in their order, so the interposer precedes the BLAS even if the BLAS was there.
    env["LD_PRELOAD"] = ":".join(wanted + [p for p in preload if p not in wanted])
    env[REEXEC_MARKER] = "1"
    kernel = wanted and wanted[0] != find_openblas()  # the interposer (first when present) runs OpenMP threads
    if kernel and "OMP_WAIT_POLICY" not in env:
        env.setdefault(*OPENMP_SPIN)
    env.update(jit_environment(env))  # MLX's fused elementwise kernels vectorised (kernels/mlx_jit.py)
    return env


def enable_linux_cpu_tuning() -> None:
    """Opt in to the Linux CPU tuning the `cortexstream` command gets: replace this process with the same command
    line plus OpenBLAS and the small-batch matmul interposer in LD_PRELOAD and MLX's CPU JIT compiler wrapped
    (`tuned_environment`). For scripts: call it first, before anything imports `mlx.core`:

        from cortexstream.backend import enable_linux_cpu_tuning
        enable_linux_cpu_tuning()  # re-executes the script once; returns at once in the re-executed process

    Returns normally when there is nothing to do: not Linux, already done, `mlx.core` already imported, opted out
    (CORTEXSTREAM_NO_OPENBLAS=1 for all of it, CORTEXSTREAM_NO_SMALL_GEMM=1 for the interposer,
    CORTEXSTREAM_NO_JIT_FLAGS=1 for the JIT wrapper), or nothing to preload.
    """
    if not sys.platform.startswith("linux") or os.environ.get(REEXEC_MARKER) or os.environ.get(DISABLE_ENV):
        return
    if "mlx.core" in sys.modules:
        return
    env = tuned_environment(dict(os.environ))
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


# The CLI's and the pytest plugin's name for the same call (kept: other tools and docs use it).
maybe_reexec_with_openblas = enable_linux_cpu_tuning
