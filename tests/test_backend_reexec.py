"""`backend.enable_linux_cpu_tuning` (the CLI's re-exec): the environment the process is re-executed with (no real
exec here)."""

from __future__ import annotations

import sys

import pytest

from cortexstream import backend
from cortexstream.backend import tuning

KERNEL, BLAS = "/x/small_gemm-omp.so", "/x/openblas/libblas.so.3"


class Exec(Exception):
    pass


@pytest.fixture
def reexec(monkeypatch):
    """Calls enable_linux_cpu_tuning as a fresh Linux process would and returns the env it would exec with."""
    captured = {}

    def fake_execve(path, argv, env):
        captured["env"] = env
        raise Exec

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delitem(sys.modules, "mlx.core")  # as before MLX is imported; restored after the test
    monkeypatch.setattr(tuning.os, "execve", fake_execve)
    monkeypatch.delenv(backend.REEXEC_MARKER, raising=False)
    monkeypatch.delenv(backend.DISABLE_ENV, raising=False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setattr(tuning, "find_openblas", lambda: BLAS)

    def run(libraries):
        monkeypatch.setattr(tuning, "preload_libraries", lambda: libraries)
        captured.clear()
        try:
            backend.enable_linux_cpu_tuning()
        except Exec:
            return captured["env"]
        return None
    return run


def test_the_kernel_brings_a_short_openmp_spin(reexec):
    env = reexec([KERNEL, BLAS])
    assert env["LD_PRELOAD"] == f"{KERNEL}:{BLAS}"
    assert env["GOMP_SPINCOUNT"] == backend.OPENMP_SPIN[1]
    assert "OMP_WAIT_POLICY" not in env
    assert env[backend.REEXEC_MARKER] == "1"


def test_openblas_alone_leaves_openmp_alone(reexec):
    env = reexec([BLAS])
    assert env["LD_PRELOAD"] == BLAS
    assert "GOMP_SPINCOUNT" not in env


def test_a_users_openmp_settings_are_kept(reexec, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    assert reexec([KERNEL, BLAS])["GOMP_SPINCOUNT"] == "7"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # libgomp ignores GOMP_SPINCOUNT then: nothing is added
    env = reexec([KERNEL, BLAS])
    assert env["OMP_WAIT_POLICY"] == "active" and "GOMP_SPINCOUNT" not in env


def test_nothing_to_preload_means_no_exec(reexec):
    assert reexec([]) is None
