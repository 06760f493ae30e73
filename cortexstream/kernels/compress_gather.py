"""Kernel (b): the compressor's grouped gather fused with its first layer, and the sidecar's window packing.

The compressor turns F consecutive tokens of a layer and KV head ([H, S, D]) into one ([H, S/F, D*F]) and feeds
that to Linear(D*F -> D), ReLU, ... The gather is the part that touches the arena, and the first Linear is the
part whose input is F times bigger than its output, so the kernel fuses exactly those: it reads each group's F
rows through the block table and writes ReLU(W1 x + b1) directly, never materialising the grouped tensor. The
remaining small layers stay in MLX. The sidecar's window packing is the same gather without the matmul.

Token range: the groups cover logical positions [start, start + num_groups * F) of the sequence whose block
table is `table`. W1 is [D_out, F * D] (PyTorch Linear layout), b1 [D_out]; the result has W1's dtype.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from cortexstream.kernels.dispatch import METAL, resolve_backend
from cortexstream.kernels.launch import (
    KernelLaunch, KernelSpec, arena_slots, as_index_array, execute, run_metal, threadgroup_for,
)

COMPRESS_SPEC = KernelSpec(
    name="cs_compress_gather",
    input_names=("buf", "table", "start", "w1", "b1"),
    output_names=("out",),
    source_file="compress_gather.metal",
)
PACK_SPEC = KernelSpec(
    name="cs_pack_windows",
    input_names=("buf", "table", "start"),
    output_names=("out",),
    source_file="pack_windows.metal",
)


def _grouped(buf: mx.array, table: Any, start: int, num_groups: int, group: int, block_size: int) -> mx.array:
    """Reference grouped gather: [H, num_groups, group * D], token-major within a group (like a reshape)."""
    heads, _, dim = buf.shape
    positions = mx.arange(start, start + num_groups * group, dtype=mx.int32)
    rows = buf[:, arena_slots(as_index_array(table), positions, block_size), :]
    return rows.reshape(heads, num_groups, group * dim)


def compress_gather_reference(
    buf: mx.array, table: Any, start: int, num_groups: int, factor: int, w1: mx.array, b1: mx.array,
    block_size: int,
) -> mx.array:
    """ReLU(grouped(buf) @ W1^T + b1) in float32, returned as W1's dtype: [H, num_groups, D_out]."""
    x = _grouped(buf, table, start, num_groups, factor, block_size).astype(mx.float32)
    y = x @ w1.astype(mx.float32).T + b1.astype(mx.float32)
    return mx.maximum(y, 0.0).astype(w1.dtype)


def compress_gather_launch(
    buf: mx.array, table: Any, start: int, num_groups: int, factor: int, w1: mx.array, b1: mx.array,
    block_size: int,
) -> KernelLaunch:
    heads, _, dim = buf.shape
    out_dim = w1.shape[0]
    if tuple(w1.shape) != (out_dim, factor * dim) or tuple(b1.shape) != (out_dim,):
        raise ValueError(f"compress_gather: W1 must be [D_out, {factor}*{dim}] and b1 [D_out], "
                         f"got {tuple(w1.shape)} and {tuple(b1.shape)}")
    return KernelLaunch(
        inputs=[buf, as_index_array(table), mx.array(start, dtype=mx.int32), w1, b1],
        template=[("T", buf.dtype), ("TW", w1.dtype), ("F", factor), ("BS", block_size)],
        grid=(out_dim, num_groups, heads),
        threadgroup=threadgroup_for(out_dim, num_groups),
        output_shapes=[(heads, num_groups, out_dim)],
        output_dtypes=[w1.dtype],
        finish=lambda outs: outs[0],
    )


def compress_gather_metal(
    buf: mx.array, table: Any, start: int, num_groups: int, factor: int, w1: mx.array, b1: mx.array,
    block_size: int,
) -> mx.array:
    return execute(COMPRESS_SPEC, compress_gather_launch(buf, table, start, num_groups, factor, w1, b1, block_size),
                   run_metal)


def compress_gather(
    buf: mx.array, table: Any, start: int, num_groups: int, factor: int, w1: mx.array, b1: mx.array,
    block_size: int, *, backend: str | None = None,
) -> mx.array:
    """Grouped gather + first Linear + ReLU of the compressor; Metal or reference per `resolve_backend`."""
    fn = compress_gather_metal if resolve_backend(backend) == METAL else compress_gather_reference
    return fn(buf, table, start, num_groups, factor, w1, b1, block_size)


def pack_windows_reference(
    buf: mx.array, table: Any, start: int, num_windows: int, window: int, block_size: int
) -> mx.array:
    """Windows of `window` consecutive tokens side by side: [H, num_windows, window * D], buf's dtype."""
    return _grouped(buf, table, start, num_windows, window, block_size)


def pack_windows_launch(
    buf: mx.array, table: Any, start: int, num_windows: int, window: int, block_size: int
) -> KernelLaunch:
    heads, _, dim = buf.shape
    width = window * dim
    return KernelLaunch(
        inputs=[buf, as_index_array(table), mx.array(start, dtype=mx.int32)],
        template=[("T", buf.dtype), ("W", window), ("BS", block_size)],
        grid=(width, num_windows, heads),
        threadgroup=threadgroup_for(width, num_windows),
        output_shapes=[(heads, num_windows, width)],
        output_dtypes=[buf.dtype],
        finish=lambda outs: outs[0],
    )


def pack_windows_metal(
    buf: mx.array, table: Any, start: int, num_windows: int, window: int, block_size: int
) -> mx.array:
    return execute(PACK_SPEC, pack_windows_launch(buf, table, start, num_windows, window, block_size), run_metal)


def pack_windows(
    buf: mx.array, table: Any, start: int, num_windows: int, window: int, block_size: int, *,
    backend: str | None = None,
) -> mx.array:
    """Sidecar window packing; Metal or reference per `resolve_backend`."""
    fn = pack_windows_metal if resolve_backend(backend) == METAL else pack_windows_reference
    return fn(buf, table, start, num_windows, window, block_size)
