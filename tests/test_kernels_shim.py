"""The C++ shim must have teeth: it has to catch the bugs it exists to catch (out-of-bounds reads, unwritten
outputs, divergent collectives) and emulate Metal's launch and simdgroup semantics. Also: the backend dispatch,
the generated signature's MLX conventions, and a lint of the Metal bodies for C++-only constructs.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.kernels import dispatch
from cortexstream.kernels.cpp_shim import ShimError, compiler, run_launch, sanitizers_available, translation_unit
from cortexstream.kernels.evict_gather import SPEC as EVICT_SPEC
from cortexstream.kernels.evict_gather import evict_gather, evict_gather_launch, evict_gather_reference
from cortexstream.kernels.launch import METAL_DIR_ENV, KernelLaunch, KernelSpec, metal_dir

needs_gxx = pytest.mark.skipif(compiler() is None, reason="no C++ compiler (g++): the kernel shim cannot build")


def body(monkeypatch, tmp_path, name: str, source: str, inputs=("inp",), outputs=("out",)) -> KernelSpec:
    (tmp_path / f"{name}.metal").write_text(source)
    monkeypatch.setenv(METAL_DIR_ENV, str(tmp_path))
    return KernelSpec(name, tuple(inputs), tuple(outputs), f"{name}.metal")


def launch(inputs, grid, threadgroup, shape, dtype=mx.float32, template=()) -> KernelLaunch:
    return KernelLaunch(inputs=list(inputs), template=list(template), grid=grid, threadgroup=threadgroup,
                        output_shapes=[shape], output_dtypes=[dtype])


# --- the shim catches bugs -------------------------------------------------------------------------------------
@needs_gxx
@pytest.mark.skipif(not sanitizers_available(), reason="AddressSanitizer is not available with this compiler")
def test_out_of_bounds_read_is_reported(monkeypatch, tmp_path):
    spec = body(monkeypatch, tmp_path, "oob", "uint i = thread_position_in_grid.x;\nout[i] = inp[i + 1];\n")
    with pytest.raises(ShimError, match="AddressSanitizer"):
        run_launch(spec, launch([mx.arange(16, dtype=mx.float32)], (16, 1, 1), (8, 1, 1), (16,)))


@needs_gxx
def test_unwritten_output_elements_are_nan(monkeypatch, tmp_path):
    source = "uint i = thread_position_in_grid.x;\nif (i % 2 == 0) out[i] = inp[i];\n"
    spec = body(monkeypatch, tmp_path, "half", source)
    out = np.array(run_launch(spec, launch([mx.arange(8, dtype=mx.float32)], (8, 1, 1), (8, 1, 1), (8,)))[0])
    assert (out[::2] == np.arange(0, 8, 2)).all() and np.isnan(out[1::2]).all()


@needs_gxx
def test_divergent_simd_sum_is_reported(monkeypatch, tmp_path):
    source = ("uint i = thread_position_in_grid.x;\n"
              "out[i] = thread_index_in_simdgroup < 16 ? simd_sum(inp[i]) : 0.0f;\n")
    spec = body(monkeypatch, tmp_path, "diverge", source)
    with pytest.raises(ShimError, match="divergent"):
        run_launch(spec, launch([mx.ones(32)], (32, 1, 1), (32, 1, 1), (32,)))


@needs_gxx
def test_mismatched_collectives_are_reported(monkeypatch, tmp_path):
    source = ("uint i = thread_position_in_grid.x;\n"
              "if (i < 16) { threadgroup_barrier(mem_flags::mem_threadgroup); out[i] = 0.0f; }\n"
              "else { out[i] = simd_sum(inp[i]); }\n")
    spec = body(monkeypatch, tmp_path, "mismatch", source)
    with pytest.raises(ShimError, match="different collectives|divergent"):
        run_launch(spec, launch([mx.ones(32)], (32, 1, 1), (32, 1, 1), (32,)))


@needs_gxx
def test_compile_errors_name_the_metal_file(monkeypatch, tmp_path):
    spec = body(monkeypatch, tmp_path, "broken", "out[0] = undefined_name;\n")
    with pytest.raises(ShimError, match="broken.metal"):
        run_launch(spec, launch([mx.ones(4)], (1, 1, 1), (1, 1, 1), (1,)))


# --- the shim emulates Metal's semantics ---------------------------------------------------------------------------
@needs_gxx
def test_simd_sum_over_truncated_edge_threadgroup(monkeypatch, tmp_path):
    """dispatchThreads: grid 40 with threadgroups of 64 gives one group of 40 threads, simdgroups of 32 and 8."""
    source = ("uint i = thread_position_in_grid.x;\n"
              "out[i] = simd_sum(inp[i]) + 1000.0f * float(simdgroup_index_in_threadgroup)"
              " + 100000.0f * float(threads_per_threadgroup.x);\n")
    spec = body(monkeypatch, tmp_path, "simd", source)
    for reverse in (False, True):
        out = np.array(run_launch(spec, launch([mx.ones(40)], (40, 1, 1), (64, 1, 1), (40,)), reverse=reverse)[0])
        assert (out[:32] == 32 + 4_000_000).all() and (out[32:] == 8 + 1000 + 4_000_000).all()


@needs_gxx
def test_threadgroup_memory_is_shared_across_a_barrier(monkeypatch, tmp_path):
    source = ("threadgroup float tile[64];\n"
              "uint l = thread_index_in_threadgroup;\n"
              "uint n = threads_per_threadgroup.x;\n"
              "tile[l] = inp[thread_position_in_grid.x];\n"
              "threadgroup_barrier(mem_flags::mem_threadgroup);\n"
              "out[thread_position_in_grid.x] = tile[n - 1 - l];\n")
    spec = body(monkeypatch, tmp_path, "reverse", source)
    out = np.array(run_launch(spec, launch([mx.arange(100, dtype=mx.float32)], (100, 1, 1), (64, 1, 1), (100,)))[0])
    expected = np.concatenate([np.arange(64)[::-1], np.arange(64, 100)[::-1]])
    assert (out == expected).all()


@needs_gxx
def test_scalar_inputs_templates_and_shapes(monkeypatch, tmp_path):
    source = "uint i = thread_position_in_grid.x;\nout[i] = T(float(inp[i]) * k + K + inp_shape[0]);\n"
    spec = body(monkeypatch, tmp_path, "scalars", source, inputs=("inp", "k"))
    inputs = [mx.arange(10).astype(mx.float16), mx.array(2.0, mx.float32)]
    got = run_launch(spec, launch(inputs, (10, 1, 1), (4, 1, 1), (10,), mx.float16, [("T", mx.float16), ("K", 3)]))
    assert np.array_equal(np.array(got[0]), np.arange(10) * 2.0 + 3 + 10)


def test_signature_follows_mlx_rules():
    keys, values = mx.zeros((2, 8, 4)), mx.zeros((2, 8, 4))
    unit = translation_unit(EVICT_SPEC, evict_gather_launch(keys, values, [1, 0], [[0, 1], [1, 2]], 4))
    assert "const device float* keys,\n    const constant int* keys_shape" in unit
    assert "const constant int32_t* table" in unit  # fewer than 8 elements: constant address space, like MLX
    assert "keys_strides" not in unit and "table_shape" not in unit  # only what the body names
    assert "template <typename T, int BS>" in unit and "custom_kernel_cs_evict_gather<float, 4>(" in unit
    assert unit.rstrip().endswith("}") and f'#include "{metal_dir() / "evict_gather.metal"}"' in unit


def test_metal_bodies_avoid_cpp_only_constructs():
    """The shim compiles C++; these would compile there and fail (or mean something else) in Metal."""
    sources = sorted(metal_dir().glob("*.metal"))
    assert {p.name for p in sources} >= {"evict_gather.metal", "compress_gather.metal", "pack_windows.metal",
                                         "paged_attention.metal"}
    banned = [r"\bstd::", r"\bdouble\b", r"\bprintf\b", r"\bmalloc\b", r"\bnew\b", r"#\s*include", r"\bthrow\b",
              r"\bthreadgroup\s+\w+\s*\*", r"\bINFINITY\b", r"\bauto\s*&", r"\blong double\b"]
    for path in sources:
        text = re.sub(r"//.*", "", path.read_text())
        for pattern in banned:
            assert not re.search(pattern, text), f"{path.name}: {pattern} is not portable Metal"


# --- dispatch ---------------------------------------------------------------------------------------------------
def test_dispatch_defaults_to_reference_without_metal(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    expected = "metal" if dispatch.metal_available() else "reference"
    assert dispatch.kernel_backend() == expected
    assert dispatch.kernel_backend_description().startswith(expected)


def test_env_var_forces_reference(monkeypatch):
    monkeypatch.setattr(dispatch, "metal_available", lambda: True)
    monkeypatch.setenv(dispatch.ENV_VAR, "reference")
    assert dispatch.kernel_backend() == "reference"
    assert "forced" in dispatch.kernel_backend_description()
    monkeypatch.setenv(dispatch.ENV_VAR, "auto")
    assert dispatch.kernel_backend() == "metal"
    assert dispatch.resolve_backend("reference") == "reference"


def test_metal_demanded_without_metal_fails_loudly(monkeypatch):
    monkeypatch.setattr(dispatch, "metal_available", lambda: False)
    monkeypatch.setenv(dispatch.ENV_VAR, "metal")
    with pytest.raises(RuntimeError, match="Metal"):
        dispatch.kernel_backend()
    monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="CORTEXSTREAM_KERNELS"):
        dispatch.kernel_backend()


def test_public_function_uses_reference_here():
    if dispatch.metal_available():
        pytest.skip("Metal is available: the public function runs the kernel")
    keys, values = mx.random.normal((2, 16, 4)), mx.random.normal((2, 16, 4))
    got = evict_gather(keys, values, [3, 1, 0, 2], [0, 5, 6, 9], 4)
    want = evict_gather_reference(keys, values, [3, 1, 0, 2], [0, 5, 6, 9], 4)
    assert all(mx.array_equal(g, w).item() for g, w in zip(got, want))
