"""The compute backend (cortexstream/backend/): selection, the small-batch kernel's holds, OpenBLAS's thread count
per pass, the decode-attention rules, SDPA routing, and that importing CortexStream changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from cortexstream import backend
from cortexstream.backend import (
    AttentionStrategy as S, BackendKind, ComputeBackend, CpuAttention, CpuBackend, MetalAttention, MetalBackend,
    choose_kind,
)
from cortexstream.backend import sdpa
from cortexstream.errors import InvalidArgumentError
from cortexstream.kernels import dispatch, small_gemm

needs_interposer = pytest.mark.skipif(small_gemm.interposer() is None,
                                      reason="the test process was not started with the interposer preloaded")
needs_threads = pytest.mark.skipif(backend.openblas_threads() < 2, reason="needs OpenBLAS with two or more threads")


def test_metal_only_when_mlx_computes_on_a_metal_device():
    assert choose_kind(metal_available=True, default_device_is_gpu=True) is BackendKind.METAL
    assert choose_kind(metal_available=True, default_device_is_gpu=False) is BackendKind.CPU
    assert choose_kind(metal_available=False, default_device_is_gpu=False) is BackendKind.CPU
    assert BackendKind("cuda") is BackendKind.CUDA  # named, never chosen today


def test_this_machine_gets_the_cpu_backend_described_in_one_line(monkeypatch):
    monkeypatch.delenv(backend.ATTENTION_ENV_VAR, raising=False)
    chosen = ComputeBackend.for_engine("auto")
    assert isinstance(chosen, CpuBackend) and chosen.kind is BackendKind.CPU
    line = chosen.describe()
    assert line.startswith("cpu (") and "\n" not in line and "attention strided up to 1024" in line
    assert chosen.small_batch_rows == (backend.DEFAULT_MAX_ROWS if small_gemm.interposer() is not None else 0)
    chosen.close()


@pytest.mark.parametrize("bad", [-1, "yes", True, 2.5])
def test_a_bad_small_batch_setting_is_refused_naming_the_argument(bad):
    with pytest.raises(InvalidArgumentError, match="small_batch_matmul"):
        ComputeBackend.for_engine(bad)


def test_a_bad_attention_override_is_refused_when_the_backend_is_built(monkeypatch):
    monkeypatch.setenv(backend.ATTENTION_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="CORTEXSTREAM_BATCH_ATTENTION='fast'"):
        ComputeBackend.for_engine(0)
    monkeypatch.setenv(backend.ATTENTION_ENV_VAR, "gather")  # read once, at build
    built = ComputeBackend.for_engine(0)
    monkeypatch.setenv(backend.ATTENTION_ENV_VAR, "blocks")
    assert built.decode_attention().choose(None, mx.float32, True, 10) is S.GATHER


@needs_interposer
def test_holds_are_counted_across_engines_and_released_explicitly():
    assert small_gemm.holders() == 0 and small_gemm.row_limit() == 0
    outer, inner, off = CpuBackend(8), CpuBackend(4), CpuBackend(0)
    outer.begin_step()
    outer.begin_step()  # a second begin while held is no second hold
    inner.begin_step()
    off.begin_step()  # rows 0: never holds
    assert small_gemm.holders() == 2 and small_gemm.row_limit() == 4  # the latest holder's limit
    inner.end_step(in_flight=False)
    assert small_gemm.holders() == 1 and small_gemm.row_limit() > 0
    outer.end_step(in_flight=True)  # a pipelined pass still evaluating: stays held
    assert outer.holds_kernel and small_gemm.holders() == 1
    outer.end_step(in_flight=False)
    assert small_gemm.holders() == 0 and small_gemm.row_limit() == 0
    outer.close()
    outer.close()  # idempotent: never below zero
    inner.close()
    assert small_gemm.holders() == 0


@needs_interposer
def test_a_step_that_raises_still_releases_and_close_releases_a_hold_left_in_flight():
    engine_backend = CpuBackend(6)

    def step() -> None:
        engine_backend.begin_step()
        try:
            raise RuntimeError("model failed")
        finally:
            engine_backend.end_step(in_flight=False)

    with pytest.raises(RuntimeError):
        step()
    assert small_gemm.holders() == 0 and small_gemm.row_limit() == 0
    engine_backend.begin_step()
    engine_backend.end_step(in_flight=True)
    assert small_gemm.holders() == 1
    engine_backend.close()  # Engine.close(): the explicit release
    assert small_gemm.holders() == 0 and small_gemm.row_limit() == 0


@needs_interposer
@needs_threads
def test_openblas_runs_one_thread_only_for_passes_the_kernel_covers():
    threads = backend.openblas_threads()
    holder, other = CpuBackend(4), CpuBackend(0)
    other.before_forward(1)  # holding nothing: nothing changes
    assert backend.openblas_threads() == threads
    holder.begin_step()
    holder.before_forward(4)
    assert backend.openblas_threads() == 1
    holder.before_forward(5)
    assert backend.openblas_threads() == threads
    holder.before_forward(1)
    holder.end_step(in_flight=False)
    assert backend.openblas_threads() == threads  # given back with the last hold


# (strided layout?, longest keys, arena dtype) -> the strategy the CPU engine ran before the backend existed
CPU_CASES = [
    (True, 1, mx.float32, S.STRIDED), (True, 1024, mx.float32, S.STRIDED), (True, 1025, mx.float32, S.BLOCKS),
    (True, 4096, mx.float32, S.BLOCKS), (True, 4097, mx.float32, S.STRIDED), (False, 100, mx.float32, S.BLOCKS),
    (False, 8000, mx.float32, S.BLOCKS), (False, 100, mx.float16, S.PER_SEQUENCE),
    (True, 2000, mx.bfloat16, S.PER_SEQUENCE), (True, 500, mx.float16, S.STRIDED),
]


@pytest.mark.parametrize("strided, keys, dtype, expected", CPU_CASES)
def test_cpu_strategy_choice_is_unchanged(strided, keys, dtype, expected, monkeypatch):
    from cortexstream.engine import batch_attention as ba

    monkeypatch.delenv(backend.ATTENTION_ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "metal_available", lambda: False)
    assert CpuAttention().choose(None, dtype, strided, keys) is expected
    assert ba.choose_strategy(None, dtype, strided=strided, num_keys=keys) is expected  # the backend-less path


def test_requests_override_the_rule_and_are_checked():
    rule = CpuAttention(override=S.GATHER)
    assert rule.choose(None, mx.float32, True, 10) is S.GATHER
    assert rule.choose("per_sequence", mx.float32, True, 10) is S.PER_SEQUENCE
    assert CpuAttention().choose("strided", mx.float32, False, 10) is S.BLOCKS  # layout does not allow: auto
    with pytest.raises(ValueError, match="attention='fast': must be auto or one of gather, per_sequence"):
        CpuAttention().choose("fast", mx.float32, True, 10)
    with pytest.raises(ValueError, match="needs a float32 arena"):
        CpuAttention().choose("blocks", mx.float16, False, 10)
    with pytest.raises(ValueError, match="strided_max_keys"):
        CpuAttention(strided_max_keys=5000, blocks_max_keys=4096)
    assert S.BLOCKS == "blocks" and json.dumps([S.PAGED]) == '["paged"]'  # results keep their strings


def test_metal_backend_logic_runs_here(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    monkeypatch.setattr(dispatch, "metal_available", lambda: True)
    metal = MetalBackend.create()
    assert metal.kind is BackendKind.METAL
    for strided, keys in ((True, 10), (False, 9000)):
        assert metal.decode_attention().choose(None, mx.float16, strided, keys) is S.PAGED
    metal.begin_step()
    metal.before_forward(3)
    metal.end_step(in_flight=True)
    metal.close()
    assert metal.describe() == "metal (attention paged (Metal kernel))"
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")  # the custom kernels off: block-wise attention
    assert MetalBackend.create().decode_attention().choose(None, mx.float32, True, 10) is S.BLOCKS
    assert MetalAttention(override=S.GATHER).choose(None, mx.float32, True, 10) is S.GATHER


def test_sdpa_is_routed_for_the_engines_model_only(tiny):
    import mlx_lm.models.base as base
    import mlx_lm.models.llama as llama
    import mlx_lm.models.qwen2 as qwen2

    model, _ = tiny
    original = base.scaled_dot_product_attention
    sdpa.unroute_sdpa()
    try:
        assert not sdpa.is_routed(model) and llama.scaled_dot_product_attention is original
        chosen = ComputeBackend.for_engine(0, model=model)
        assert sdpa.is_routed(model) and llama.scaled_dot_product_attention is sdpa.dispatch_sdpa
        assert "mlx_lm.models.llama" in sdpa.route_sdpa(model)  # idempotent
        assert qwen2.scaled_dot_product_attention is original  # another architecture: untouched
        assert base.scaled_dot_product_attention is original  # never patched
        chosen.close()

        class Hooked:
            def attention_hook(self, *args):
                return ("hook", args)

        q = mx.ones((1, 2, 1, 4))
        assert sdpa.dispatch_sdpa(q, q, q, Hooked(), 0.5, None)[0] == "hook"
        plain = sdpa.dispatch_sdpa(q, q, q, None, 0.5, None)
        assert mx.array_equal(plain, original(q, q, q, None, scale=0.5, mask=None))
    finally:
        sdpa.unroute_sdpa()
    assert llama.scaled_dot_product_attention is original


_PLAIN_IMPORT = r"""
import ctypes, json, os, sys
before_env = dict(os.environ)
import cortexstream, cortexstream.backend, cortexstream.engine.engine, cortexstream.generation
import mlx_lm.models.base as base, mlx_lm.models.llama as llama
routed = [n for n, m in list(sys.modules.items()) if n.startswith("mlx_lm.models.")
          and getattr(m, "scaled_dot_product_attention", None) is not getattr(base, "scaled_dot_product_attention")
          and hasattr(m, "scaled_dot_product_attention")]
print(json.dumps({"env_changed": sorted(k for k in set(before_env) | set(os.environ)
                                        if before_env.get(k) != os.environ.get(k)),
                  "routed": routed, "interposer": hasattr(ctypes.CDLL(None), "cs_small_gemm_interposed"),
                  "maps_small_gemm": "small_gemm" in open("/proc/self/maps").read()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_plain_import_changes_nothing_in_the_process():
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", backend.REEXEC_MARKER, "GOMP_SPINCOUNT", "TMPDIR")}
    proc = subprocess.run([sys.executable, "-c", _PLAIN_IMPORT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"env_changed": [], "routed": [], "interposer": False, "maps_small_gemm": False}, out
