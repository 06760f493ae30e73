"""Softmax over the last axis with its exp in a JIT-compiled MLX kernel: vectorised on a Linux CPU.

MLX's CPU `mx.softmax` computes exp inside libmlx, which the Linux wheel builds for generic x86-64: one element at
a time, with a libm `fmaf` call per polynomial step (about 15 ns an element here). The same exp in a kernel MLX
compiles at run time (`mx.compile`) is built by kernels/mlx_jit.py's wrapped g++ with vectorising flags. So here
the reductions (max, sum) stay MLX's own ops and only the elementwise part is compiled; the result equals
`mx.softmax(x, axis=-1, precise=True)` to float rounding (same max shift and exp; the sum and the division may
round differently), which tests/test_fast_softmax.py checks.

Used by the engine's own CPU attention paths (`batch_attention.block_matmul_attention`,
`mixed_batch.chunk_attention`); elsewhere, or for other dtypes, `softmax` is `mx.softmax` itself.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx


@partial(mx.compile, shapeless=True)
def _compiled_softmax(x: mx.array) -> mx.array:
    exps = mx.exp(x - mx.max(x, axis=-1, keepdims=True))
    return exps / mx.sum(exps, axis=-1, keepdims=True)


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis: the compiled form for float32 on the CPU, `mx.softmax(precise=True)` else."""
    # A last axis of one element goes to mx.softmax: MLX 0.32's shapeless compile corrupts memory on a reduction
    # over a size-1 axis (measured: a segfault or "malloc(): corrupted top size" for shapes (1, 1), (2, 1)).
    if x.dtype != mx.float32 or mx.default_device() != mx.cpu or x.ndim == 0 or x.shape[-1] == 1:
        return mx.softmax(x, axis=-1, precise=True)
    return _compiled_softmax(x)
