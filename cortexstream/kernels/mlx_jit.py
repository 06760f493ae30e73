"""Vectorised MLX CPU kernels: the compiler flags MLX's Linux CPU backend leaves out of its JIT builds.

MLX compiles every fused elementwise kernel (anything under `mx.compile`: mlx-lm's `swiglu`, `gelu`, ...) at run
time with `g++ -std=c++17 -O3 -Wall -fPIC -shared` and keeps the library under `<temp dir>/mlx/<version>/cpu`.
Without a target ISA flag its `simd::exp` stays an out-of-line scalar function (a PLT call per element) that calls
libm's `fmaf` (another PLT call), so an activation like swiglu costs a large share of a layer's time on one core.
With `FLAGS` gcc inlines `exp` and vectorises the loop (how much faster: docs/linux-cpu.md).

The values are bit for bit the same: no fast-math; `-ffp-contract=off` fuses no multiply-add that MLX's own build
does not fuse; the `fma` calls MLX writes are exactly rounded either way; `-fno-trapping-math` only lets the
compiler evaluate both sides of a select (it changes FP exception flags, which MLX never reads).
tests/test_mlx_jit.py compares the kernels of both builds bit for bit, special values included.

MLX takes no compiler option, so the CLI's re-exec (`backend.enable_linux_cpu_tuning`) starts the process
with a `g++` wrapper that appends the flags first on PATH, and TMPDIR at a folder of its own: kernels built
without the flags (by any other process) are never loaded, and ours never reach another process. The temp-dir
caches of our own kernels stay where they were (`pinned_caches`). CORTEXSTREAM_NO_JIT_FLAGS=1 opts out.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Mapping

DISABLE_ENV = "CORTEXSTREAM_NO_JIT_FLAGS"
FLAGS = ("-fno-semantic-interposition", "-finline-limit=10000", "-fno-trapping-math", "-ffp-contract=off")
_WRAPPER_VERSION = 1
_WRAPPER_PREFIX = "cortexstream-mlx-jit-"


def disabled(env: Mapping[str, str] | None = None) -> bool:
    return (os.environ if env is None else env).get(DISABLE_ENV, "0") not in ("", "0")


def flags() -> list[str]:
    """FLAGS plus this machine's own instruction set (the builds are cached on this machine only)."""
    from cortexstream.kernels.small_gemm import native_arch_flag

    return [native_arch_flag(), *FLAGS]


def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux): `-march=native` builds must never run on another CPU (a temp dir
    carried over in an image or shared between machines would otherwise crash MLX with an illegal instruction)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags", "Features", "CPU part"))]
    except OSError:
        return platform.processor()
    return "".join(sorted(set(lines)))


def wrapper_dir(compiler: str, root: str | None = None) -> Path:
    """The folder holding this compiler's wrapper (`bin/g++`) and its JIT temp dir (`tmp`), keyed by compiler,
    flags and CPU, so a change of any of them never loads an old build."""
    key = " ".join([compiler, *flags(), platform.machine(), _cpu_identity(), str(_WRAPPER_VERSION)]).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return Path(root or tempfile.gettempdir()) / f"{_WRAPPER_PREFIX}{os.getuid()}-{digest}"


def is_wrapper(path: str) -> bool:
    """Whether `path` is a compiler wrapper written by `write_wrapper` (`<wrapper_dir>/bin/g++`)."""
    folder = Path(path).parent
    return folder.name == "bin" and folder.parent.name.startswith(_WRAPPER_PREFIX)


def write_wrapper(compiler: str, folder: Path) -> Path:
    """`folder/bin/g++`: runs `compiler` with the caller's arguments followed by `flags()`. Written atomically."""
    script = "#!/bin/sh\n# cortexstream.kernels.mlx_jit: MLX's CPU JIT compiler, with the flags that vectorise it\n"
    script += f"exec {shlex.quote(compiler)} \"$@\" {' '.join(shlex.quote(f) for f in flags())}\n"
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (folder / "tmp").mkdir(exist_ok=True)
    target = bin_dir / "g++"
    if not target.exists() or target.read_text() != script:
        partial = bin_dir / f".g++.{os.getpid()}"
        partial.write_text(script)
        partial.chmod(0o755)
        os.replace(partial, target)
    return target


def pinned_caches() -> dict[str, str]:
    """Our own temp-dir kernel caches as they resolve now, so that a changed TMPDIR does not move them: the
    preloaded small-batch interposer must be the same file `small_gemm.library_path()` returns afterwards."""
    from cortexstream.kernels.small_gemm import CACHE_ENV, cache_dir

    return {CACHE_ENV: str(cache_dir())}


def jit_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables to set for a process whose MLX should build its CPU kernels with `flags()`: PATH with the
    wrapper's folder first, TMPDIR at the wrapper's own temp dir, and `pinned_caches()` unless already set.
    Empty where it does not apply: not Linux, no g++ on PATH, opted out, or the wrapper cannot be written."""
    if not sys.platform.startswith("linux") or disabled(env):
        return {}
    compiler = shutil.which("g++", path=env.get("PATH"))
    if compiler is None or is_wrapper(compiler):  # none, or already ours
        return {}
    compiler = os.path.realpath(compiler)
    folder = wrapper_dir(compiler)
    try:
        wrapper = write_wrapper(compiler, folder)
    except OSError as error:  # a read-only or full temp dir: MLX's own flags, never a failed start
        print(f"cortexstream: MLX JIT flags not applied ({folder}: {error})", file=sys.stderr)
        return {}
    result = {key: value for key, value in pinned_caches().items() if key not in env}
    result["PATH"] = os.pathsep.join([str(wrapper.parent), env.get("PATH", os.defpath)])
    result["TMPDIR"] = str(folder / "tmp")
    return result


def active() -> bool:
    """Whether MLX in this process builds its CPU kernels with `flags()` (g++ on PATH is our wrapper and TMPDIR is
    its temp dir)."""
    compiler = shutil.which("g++")
    if compiler is None or not is_wrapper(compiler):
        return False
    return os.environ.get("TMPDIR") == str(Path(compiler).parent.parent / "tmp")
