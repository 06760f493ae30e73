"""The CPU small-batch matmul: the kernel's sums, its argument checks, the BLAS interposer, and the engine's use.

The test process itself runs with the interposer preloaded (the pytest plugin re-executes into it, as the CLI
does), so the engine tests here exercise the real path; the interposer's pass-through rules are checked in a
subprocess with a controlled LD_PRELOAD.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cortexstream import backend
from cortexstream.kernels import small_gemm

needs_kernel = pytest.mark.skipif(small_gemm.library_path() is None, reason="no C compiler or not Linux")
needs_interposer = pytest.mark.skipif(small_gemm.interposer() is None,
                                      reason="the test process was not started with the interposer preloaded")


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_matches_numpy_on_awkward_shapes(threads):
    rng = np.random.default_rng(0)
    for m in (1, 2, 3, 5, 8, 13):
        for n in (1, 3, 4, 63, 64, 130):
            for k in (1, 7, 8, 17, 576):
                x = rng.standard_normal((m, k), dtype=np.float32)
                w = rng.standard_normal((n, k), dtype=np.float32)
                got = small_gemm.small_gemm(x, w, num_threads=threads)
                want = x.astype(np.float64) @ w.T.astype(np.float64)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k), err_msg=f"{m}x{n}x{k}")


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Batch invariance: each output is one dot product summed in a fixed order, so row i of an M-row product is
    bit-identical to the 1-row product (BLAS does not promise this)."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((1536, 576), dtype=np.float32)
    x = rng.standard_normal((12, 576), dtype=np.float32)
    together = small_gemm.small_gemm(x, w)
    for i in range(12):
        alone = small_gemm.small_gemm(np.ascontiguousarray(x[i : i + 1]), w)
        assert np.array_equal(together[i : i + 1], alone)


@needs_kernel
def test_bad_arguments_are_refused_before_c():
    w = np.ones((64, 8), dtype=np.float32)
    with pytest.raises(ValueError, match="x must be a 2-d float32"):
        small_gemm.small_gemm(np.ones((2, 8)), w)  # float64
    with pytest.raises(ValueError, match="w must be C-contiguous"):
        small_gemm.small_gemm(np.ones((2, 8), np.float32), np.ones((8, 64), np.float32).T)
    with pytest.raises(ValueError, match="do not multiply"):
        small_gemm.small_gemm(np.ones((2, 9), np.float32), w)
    with pytest.raises(ValueError, match="at most"):
        small_gemm.small_gemm(np.ones((small_gemm.MAX_ROWS + 1, 8), np.float32), w)


_PROBE = r"""
import json, mlx.core as mx, mlx.nn as nn, numpy as np
from cortexstream.kernels import small_gemm as sg
mx.random.seed(0)
out = {"interposed": sg.interposer() is not None}
lin = nn.Linear(384, 160)           # bias: MLX issues addmm (beta = 1 on a bias-filled output)
head = nn.Linear(384, 200, bias=False)
narrow = nn.Linear(64, 160)         # K = 64: shaped like attention's q @ k^T, left to BLAS
x8, x40, n8 = mx.random.normal((8, 384)), mx.random.normal((40, 384)), mx.random.normal((8, 64))
ref = lambda l, x: np.asarray(x, np.float64) @ np.asarray(l.weight, np.float64).T + (
    np.asarray(l.bias, np.float64) if "bias" in l else 0)
def run(limit, l, x):
    sg.set_row_limit(limit); before = sg.call_count(); y = l(x); mx.eval(y); sg.set_row_limit(0)
    return float(np.abs(np.asarray(y) - ref(l, x)).max()), sg.call_count() - before
out["off"] = run(0, lin, x8)
out["bias"] = run(12, lin, x8)
out["no_bias"] = run(12, head, x8)
out["too_many_rows"] = run(12, lin, x40)
out["narrow"] = run(12, narrow, n8)
sg.set_row_limit(12); b = sg.call_count(); y = x8.T @ mx.random.normal((8, 400)); mx.eval(y)  # transposed A
out["other_layout_calls"] = sg.call_count() - b; sg.set_row_limit(0)
print(json.dumps(out))
"""


@needs_kernel
def test_interposer_takes_only_small_linear_calls_and_only_when_on():
    from cortexstream.backend import find_openblas

    libs = [small_gemm.library_path()] + [lib for lib in [find_openblas()] if lib]
    env = {**os.environ, "LD_PRELOAD": ":".join(libs), "CORTEXSTREAM_NO_OPENBLAS": "1"}
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["interposed"]
    for case in ("off", "bias", "no_bias", "too_many_rows", "narrow"):
        assert out[case][0] < 1e-3, (case, out[case])
    assert out["off"][1] == 0 and out["too_many_rows"][1] == 0 and out["narrow"][1] == 0
    assert out["bias"][1] == 1 and out["no_bias"][1] == 1
    assert out["other_layout_calls"] == 0


@needs_interposer
def test_engine_uses_the_kernel_only_inside_its_steps(tiny):
    import mlx.core as mx
    from tiny_models import tiny_model

    import cortexstream
    from cortexstream.engine.engine import Engine

    # Wide enough (K >= 320) for the kernel to take its weight products; the tiny tokenizer.
    model, tok = tiny_model(seed=3, hidden_size=384, intermediate_size=512, head_dim=96), tiny[1]
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 3]]
    before = small_gemm.call_count()
    with_kernel = cortexstream.batch_generate(model, tok, prompts, max_tokens=12, return_token_ids=True)
    assert small_gemm.call_count() > before
    engine = Engine(model, tok, kv_tokens=512, small_batch_matmul=0)
    assert engine.backend.small_batch_rows == 0
    ids = [engine.add_request(p, max_tokens=12, temperature=0.0) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    before = small_gemm.call_count()
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens[out.request_id].append(out.token)
    assert small_gemm.call_count() == before  # off: BLAS only
    # Same greedy tokens with and without the kernel (float sums in another order; the tiny model has no ties).
    assert with_kernel.token_ids == [tokens[i] for i in ids]
    # Between calls the limit is back to 0: mlx-lm on the same model gets MLX's matmul.
    before = small_gemm.call_count()
    mx.eval(model(mx.array([[1, 2, 3]])))
    assert small_gemm.call_count() == before


@needs_interposer
@pytest.mark.skipif(backend.openblas_threads() < 2, reason="needs OpenBLAS with two or more threads")
def test_openblas_runs_one_thread_only_in_passes_the_kernel_covers(tiny, monkeypatch):
    from cortexstream.backend import CpuBackend
    from cortexstream.engine.engine import Engine

    model, tok = tiny
    threads = backend.openblas_threads()
    seen: list[tuple[int, int]] = []  # (rows of the pass, OpenBLAS threads while it is built)
    choose = CpuBackend.before_forward

    def spy(self, rows):
        choose(self, rows)
        seen.append((rows, backend.openblas_threads()))

    monkeypatch.setattr(CpuBackend, "before_forward", spy)
    engine = Engine(model, tok, kv_tokens=1024, small_batch_matmul=4, prefill_tokens_while_decoding=2)
    for prompt in ([1, 2, 3, 4, 5, 6], [7, 8, 9], [5, 6, 7, 8, 9, 10, 11, 12, 13]):
        engine.add_request(prompt, max_tokens=5)
    while engine.has_unfinished:
        engine.step()
    assert any(rows <= 4 for rows, _ in seen) and any(rows > 4 for rows, _ in seen)
    assert all(used == (1 if rows <= 4 else threads) for rows, used in seen), seen
    assert backend.openblas_threads() == threads  # given back once no engine holds the kernel
    seen.clear()
    engine_off = Engine(model, tok, kv_tokens=512, small_batch_matmul=0)
    engine_off.add_request([1, 2, 3], max_tokens=3)
    while engine_off.has_unfinished:
        engine_off.step()
    assert seen and all(used == threads for _, used in seen)  # no kernel, no contention: OpenBLAS keeps its threads


def test_engine_refuses_a_bad_small_batch_setting(tiny):
    from cortexstream.engine.engine import Engine
    from cortexstream.errors import InvalidArgumentError

    model, tok = tiny
    for bad in (-1, "yes", True, 2.5):
        with pytest.raises(InvalidArgumentError, match="small_batch_matmul"):
            Engine(model, tok, kv_tokens=256, small_batch_matmul=bad)
