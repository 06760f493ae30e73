"""Kernel (a): eviction gather, the compaction step of `SequenceKV.keep`, per layer and KV head.

After a policy picks the tokens to keep, each layer's kept K/V rows are gathered (through the block table, so a
fragmented sequence needs no host-side slot arithmetic) and written back to the front of the sequence. The
reference is two `take_along_axis` gathers; the Metal kernel (metal/evict_gather.metal) gathers K and V in one
launch, one thread per element. `compact_layer` is the whole step on a `KVArena`.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from cortexstream.kernels.dispatch import METAL, resolve_backend
from cortexstream.kernels.launch import (
    KernelLaunch, KernelSpec, arena_slots, as_index_array, execute, run_metal, threadgroup_for,
)

SPEC = KernelSpec(
    name="cs_evict_gather",
    input_names=("keys", "values", "table", "keep"),
    output_names=("out_keys", "out_values"),
    source_file="evict_gather.metal",
)


def _keep_rows(keep: Any, heads: int) -> mx.array:
    """`keep` as int32 [H, n]: a 1-D list applies to every KV head (the same tokens kept in all heads)."""
    rows = as_index_array(keep)
    if rows.ndim == 1:
        rows = mx.broadcast_to(rows[None, :], (heads, rows.shape[0]))
    if rows.ndim != 2 or rows.shape[0] != heads:
        raise ValueError(f"evict_gather: keep must be [n] or [kv_heads={heads}, n], got {tuple(rows.shape)}")
    return rows


def evict_gather_reference(
    keys: mx.array, values: mx.array, table: Any, keep: Any, block_size: int
) -> tuple[mx.array, mx.array]:
    """K, V rows at logical positions `keep` ([n] or [H, n]) of a sequence with block table `table`: [H, n, D]."""
    rows = _keep_rows(keep, keys.shape[0])
    slots = arena_slots(as_index_array(table), rows, block_size)[:, :, None]
    return mx.take_along_axis(keys, slots, axis=1), mx.take_along_axis(values, slots, axis=1)


def evict_gather_launch(keys: mx.array, values: mx.array, table: Any, keep: Any, block_size: int) -> KernelLaunch:
    """The Metal launch for `evict_gather` (also what the C++ shim executes in the tests)."""
    heads, _, dk = keys.shape
    dv = values.shape[2]
    if values.shape[:2] != keys.shape[:2] or values.dtype != keys.dtype:
        raise ValueError("evict_gather: keys and values must share heads, slots and dtype")
    rows = _keep_rows(keep, heads)
    n = rows.shape[1]
    width = max(dk, dv)
    return KernelLaunch(
        inputs=[keys, values, as_index_array(table), rows],
        template=[("T", keys.dtype), ("BS", block_size)],
        grid=(width, n, heads),
        threadgroup=threadgroup_for(width, n),
        output_shapes=[(heads, n, dk), (heads, n, dv)],
        output_dtypes=[keys.dtype, keys.dtype],
        finish=lambda outs: (outs[0], outs[1]),
    )


def evict_gather_metal(
    keys: mx.array, values: mx.array, table: Any, keep: Any, block_size: int
) -> tuple[mx.array, mx.array]:
    """Same contract as `evict_gather_reference`, on the GPU (macOS only)."""
    return execute(SPEC, evict_gather_launch(keys, values, table, keep, block_size), run_metal)


def evict_gather(
    keys: mx.array, values: mx.array, table: Any, keep: Any, block_size: int, *, backend: str | None = None
) -> tuple[mx.array, mx.array]:
    """Gather kept tokens' K, V ([H, n, D] each); Metal or reference per `dispatch.resolve_backend`."""
    fn = evict_gather_metal if resolve_backend(backend) == METAL else evict_gather_reference
    return fn(keys, values, table, keep, block_size)


def compact_layer(arena: Any, layer: int, blocks: Sequence[int], keep: Any, *, backend: str | None = None) -> int:
    """Keep only positions `keep` ([n] or [H, n], ascending, unique, in range) of one layer of a sequence,
    moved to positions 0..n-1 of its block table. Returns n. The caller owns locking, copy-on-write and lengths.

    A quantized arena moves the kept rows' codes with their own scales and biases (`arena.move_rows`): no
    requantization, so a kept row is bit-identical to what it was. Only rows from the first position that changes
    are moved (a token evicted while decoding moves the tokens after it, not the whole cache).
    """
    keep = np.asarray(keep)
    n = int(keep.shape[-1])
    first = unchanged_prefix(keep)
    if first == n:
        return n
    keep = keep[..., first:]
    if arena.quantized:
        bs = arena.config.block_size
        table = as_index_array(list(blocks))
        rows = as_index_array(keep)
        slots = arena_slots(table, rows[None, :] if rows.ndim == 1 else rows, bs)  # [1 or H, n - first]
        destination = arena_slots(table, mx.arange(first, n, dtype=mx.int32)[None, :], bs)[0]
        arena.move_rows(layer, slots[0] if rows.ndim == 1 else slots, destination)
        return n
    keys, values = evict_gather(*arena.layer_buffers(layer), list(blocks), keep,
                                arena.config.block_size, backend=backend)
    mx.eval(keys, values)  # materialise before the in-place write into the same buffers
    arena.write(layer, blocks, first, keys, values)
    return n


def unchanged_prefix(keep: Any) -> int:
    """How many leading positions `keep` ([n] or [H, n], ascending, unique) leaves where they are: position i stays
    while every row keeps i at i."""
    rows = np.asarray(keep)
    n = rows.shape[-1]
    same = rows == np.arange(n)
    if same.ndim == 2:
        same = same.all(axis=0)
    return n if bool(same.all()) else int(np.argmin(same))
