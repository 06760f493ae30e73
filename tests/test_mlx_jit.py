"""kernels/mlx_jit.py: MLX's CPU JIT kernels built with vectorising flags give the same bits as MLX's own build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cortexstream.kernels import mlx_jit

# Compiled elementwise functions models use; each runs through MLX's CPU JIT (mx.compile).
FUNCTIONS = """
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models.activations import swiglu
FUNCTIONS = {
    "swiglu": lambda x, y: swiglu(x, y),
    "silu": lambda x, y: nn.silu(x) + y,
    "gelu": lambda x, y: nn.gelu(x) * y,
    "gelu_approx": lambda x, y: nn.gelu_approx(x) - y,
    "softplus": lambda x, y: mx.compile(lambda a, b: mx.log1p(mx.exp(a)) * b)(x, y),
    "sigmoid_exp": lambda x, y: mx.compile(lambda a, b: mx.sigmoid(a) + mx.exp(b / 4))(x, y),
    "tanh": lambda x, y: mx.compile(lambda a, b: mx.tanh(a) * b + a)(x, y),
}
"""
CHILD = FUNCTIONS + """
import sys, numpy as np
data = np.load(sys.argv[1])
out = {}
for dtype in ("float32", "bfloat16"):
    x, y = (mx.array(data[k]).astype(getattr(mx, dtype)) for k in ("x", "y"))
    for name, f in FUNCTIONS.items():
        out[f"{name}:{dtype}"] = np.array(f(x, y).astype(mx.float32))
np.savez(sys.argv[2], **out)
"""
SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 88.5, -88.5, 87.9, -87.9, 88.72, -103.9, 1e-40, -1e-40, 100.0,
           -100.0, 0.5, -0.5, 1e-7, 3.4e38, -3.4e38]


def _inputs(path: Path) -> None:
    rng = np.random.default_rng(0)
    size = 100_003  # odd: the vector loop's remainder runs too
    x = (rng.standard_normal(size) * rng.choice([0.1, 1, 10, 60], size)).astype(np.float32)
    y = rng.standard_normal(size).astype(np.float32)
    x[: len(SPECIAL)] = SPECIAL
    y[len(SPECIAL): 2 * len(SPECIAL)] = SPECIAL
    np.savez(path, x=x, y=y)


def _run(env: dict[str, str], inputs: Path, outputs: Path) -> dict[str, np.ndarray]:
    subprocess.run([sys.executable, "-c", CHILD, str(inputs), str(outputs)], env=env, check=True, timeout=600)
    with np.load(outputs) as data:
        return {k: data[k] for k in data.files}


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def _real_gxx() -> str | None:
    return shutil.which("g++", path=_path_without_wrapper())


def _path_without_wrapper() -> str:
    folders = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(p for p in folders if not mlx_jit.is_wrapper(os.path.join(p, "g++")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's CPU JIT flags are wrapped on Linux only")
def test_the_test_process_builds_with_the_flags():
    """The suite re-executes itself like the CLI (pytest_openblas), so with g++ here the wrapper must be active."""
    if _real_gxx() is None or mlx_jit.disabled() or os.environ.get("CORTEXSTREAM_NO_OPENBLAS"):
        pytest.skip("no g++ on PATH, or the re-exec is switched off")
    assert mlx_jit.active()


@pytest.mark.skipif(_real_gxx() is None, reason="needs g++ (MLX's CPU JIT compiler)")
def test_flagged_builds_give_the_same_bits_as_mlxs_own(tmp_path):
    inputs = tmp_path / "inputs.npz"
    _inputs(inputs)
    base = {k: v for k, v in os.environ.items() if k not in ("PATH", "TMPDIR")}
    base["PATH"] = _path_without_wrapper()
    plain_tmp, flagged_root = tmp_path / "plain", tmp_path / "flagged"
    plain_tmp.mkdir()
    plain = _run({**base, "TMPDIR": str(plain_tmp)}, inputs, tmp_path / "plain.npz")
    flagged_env = {**base, **mlx_jit.jit_environment(base)}
    # a fresh JIT cache of its own, so both builds are made by this test
    flagged_env["TMPDIR"] = str(flagged_root)
    flagged_root.mkdir()
    flagged = _run(flagged_env, inputs, tmp_path / "flagged.npz")
    assert list((flagged_root / "mlx").glob("*/cpu/lib*.so")), "the flagged run built no JIT kernel"
    assert list((plain_tmp / "mlx").glob("*/cpu/lib*.so")), "the plain run built no JIT kernel"
    assert plain.keys() == flagged.keys() and len(plain) == 14
    different = [k for k in plain if not _same_bits(plain[k], flagged[k])]
    assert not different, f"flagged JIT kernels differ from MLX's own build: {different}"


def test_the_wrapper_appends_the_flags_to_the_real_compiler(tmp_path):
    fake = tmp_path / "bin" / "g++"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done\n")
    fake.chmod(0o755)
    env = {"PATH": str(fake.parent), "HOME": "/nowhere"}
    extra = mlx_jit.jit_environment(env)
    if not sys.platform.startswith("linux"):
        assert extra == {}
        return
    wrapper_bin = extra["PATH"].split(os.pathsep)[0]
    assert extra["PATH"].split(os.pathsep)[1] == str(fake.parent)
    assert Path(extra["TMPDIR"]).is_dir() and Path(extra["TMPDIR"]).parent == Path(wrapper_bin).parent
    args = subprocess.run([str(Path(wrapper_bin) / "g++"), "-O3", "a file.cpp"], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    assert args == ["-O3", "a file.cpp", *mlx_jit.flags()]
    from cortexstream.kernels.small_gemm import CACHE_ENV, cache_dir

    assert extra[CACHE_ENV] == str(cache_dir())  # where the preloaded interposer was built stays the cache
    # a re-exec from inside: the wrapper is found first, nothing changes
    assert mlx_jit.jit_environment({**env, **extra}) == {}


def test_no_compiler_or_opted_out_changes_nothing(tmp_path):
    assert mlx_jit.jit_environment({"PATH": str(tmp_path)}) == {}
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert mlx_jit.jit_environment({"PATH": str(tmp_path), mlx_jit.DISABLE_ENV: "1"}) == {}


def test_a_users_kernel_cache_is_kept(tmp_path):
    from cortexstream.kernels.small_gemm import CACHE_ENV

    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    extra = mlx_jit.jit_environment({"PATH": str(tmp_path), CACHE_ENV: "/users/cache"})
    if sys.platform.startswith("linux"):
        assert CACHE_ENV not in extra and "TMPDIR" in extra


def test_an_unwritable_temp_dir_falls_back_to_mlxs_flags(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)

    def read_only(compiler, folder):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(mlx_jit, "write_wrapper", read_only)
    monkeypatch.setattr(mlx_jit.sys, "platform", "linux")
    assert mlx_jit.jit_environment({"PATH": str(tmp_path)}) == {}
    assert "MLX JIT flags not applied" in capsys.readouterr().err


def test_the_cache_folder_follows_the_compiler_and_the_cpu(monkeypatch, tmp_path):
    here = mlx_jit.wrapper_dir("/usr/bin/g++", str(tmp_path))
    assert here == mlx_jit.wrapper_dir("/usr/bin/g++", str(tmp_path))
    assert here != mlx_jit.wrapper_dir("/opt/gcc/bin/g++", str(tmp_path))
    monkeypatch.setattr(mlx_jit, "_cpu_identity", lambda: "model name : another CPU\nflags : sse2\n")
    assert here != mlx_jit.wrapper_dir("/usr/bin/g++", str(tmp_path))
