"""Kernel (c): paged decode attention straight from the arena, GQA-aware, with the H2O column sums (d) fused.

A decode step has one query per sequence. Today (engine/batch_cache.py) every layer gathers each sequence's
blocks into a padded [B, H, max_blocks * bs, D] copy and calls `mx.fast.scaled_dot_product_attention` with a
mask: that gather-then-SDPA is the reference here. The Metal kernel (metal/paged_attention.metal) reads K/V rows
through the block tables instead, one threadgroup per (sequence, KV head) serving the G query heads that share
it, so K/V are read once per KV head and never copied. With `colsum=True` it also returns, per KV head, the
attention each cached position received summed over the group's query heads: the statistic H2O accumulates,
which SDPA cannot return.

Shapes: queries [B, Hq, 1, D] (mlx-lm's decode layout), keys [Hkv, S, D], values [Hkv, S, DV] (a layer's arena
buffers), tables [B, MB] int32 (padding entries may hold any valid block), lengths [B] (<= MB * block_size).
Query head h reads KV head h // (Hq // Hkv). Output [B, Hq, 1, DV] in the queries' dtype; colsum
[B, Hkv, MB * block_size] float32, zero past each length. A length-0 sequence gives zeros.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from cortexstream.kernels.dispatch import METAL, resolve_backend
from cortexstream.kernels.launch import KernelLaunch, KernelSpec, as_index_array, execute, run_metal

SPEC = KernelSpec(
    name="cs_paged_attention",
    input_names=("queries", "keys", "values", "tables", "lengths", "scale"),
    output_names=("out", "colsum", "scores"),
    source_file="paged_attention.metal",
)

Result = mx.array | tuple[mx.array, mx.array]


def _gather(buffer: mx.array, tables: mx.array, block_size: int) -> mx.array:
    """[Hkv, S, D] -> [B, Hkv, MB * bs, D], exactly as BatchLayerCache._gather does."""
    heads, slots, dim = buffer.shape
    batch, max_blocks = tables.shape
    blocked = buffer.reshape(heads, slots // block_size, block_size, dim)[:, tables]
    return blocked.transpose(1, 0, 2, 3, 4).reshape(batch, heads, max_blocks * block_size, dim)


def paged_attention_reference(
    queries: mx.array, keys: mx.array, values: mx.array, tables: Any, lengths: Any, scale: float, block_size: int,
    *, colsum: bool = False,
) -> Result:
    """Gather the blocks, then masked `scaled_dot_product_attention` (+ explicit softmax for the column sums)."""
    tables, lengths = as_index_array(tables), as_index_array(lengths)
    batch, q_heads, _, dim = queries.shape
    kv_heads = keys.shape[0]
    k = _gather(keys, tables, block_size).astype(queries.dtype)
    v = _gather(values, tables, block_size).astype(queries.dtype)
    span = k.shape[2]
    valid = mx.arange(span)[None, :] < lengths[:, None]  # [B, L]
    mask = valid[:, None, None, :]
    out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
    out = mx.where((lengths > 0)[:, None, None, None], out, mx.zeros_like(out))  # all-masked rows are NaN
    if not colsum:
        return out
    group = q_heads // kv_heads
    q = queries.astype(mx.float32).reshape(batch, kv_heads, group, dim)
    scores = (q @ k.astype(mx.float32).transpose(0, 1, 3, 2)) * scale  # [B, Hkv, G, L]
    scores = mx.where(mask, scores, -mx.inf)
    probs = mx.where(mask, mx.softmax(scores, axis=-1), 0.0)
    return out, probs.sum(axis=2)


def default_simdgroups(span: int) -> int:
    """Simdgroups per threadgroup: enough to spread a long context, few for short ones (they merge at the end)."""
    return 1 if span <= 64 else 4 if span <= 1024 else 8


def paged_attention_launch(
    queries: mx.array, keys: mx.array, values: mx.array, tables: Any, lengths: Any, scale: float, block_size: int,
    *, colsum: bool = False, simdgroups: int | None = None,
) -> KernelLaunch:
    tables, lengths = as_index_array(tables), as_index_array(lengths)
    batch, q_heads, one, dim = queries.shape
    kv_heads, _, key_dim = keys.shape
    value_dim = values.shape[2]
    if one != 1 or key_dim != dim or q_heads % kv_heads or values.shape[:2] != keys.shape[:2]:
        raise ValueError(f"paged_attention: queries {tuple(queries.shape)} must be [B, Hq, 1, D] with Hq a multiple "
                         f"of the KV heads of keys {tuple(keys.shape)} / values {tuple(values.shape)}")
    if keys.dtype != values.dtype or tables.ndim != 2 or tables.shape[0] != batch or lengths.shape != (batch,):
        raise ValueError("paged_attention: keys/values dtypes differ or tables/lengths do not match the batch")
    max_blocks = tables.shape[1]
    span = max_blocks * block_size
    nsg = simdgroups or default_simdgroups(span)
    if not 1 <= nsg <= 32:
        raise ValueError(f"paged_attention: simdgroups={nsg} must be in 1..32 (1024 threads per threadgroup)")
    stats = [(batch, kv_heads, span), (batch, q_heads, span)] if colsum else [(1,), (1,)]

    def finish(outs: list[mx.array]) -> Result:
        out = outs[0].reshape(batch, q_heads, 1, value_dim)
        return (out, outs[1]) if colsum else out

    return KernelLaunch(
        inputs=[queries.reshape(batch, q_heads, dim), keys, values, tables, lengths, mx.array(scale, mx.float32)],
        template=[("TQ", queries.dtype), ("T", keys.dtype), ("G", q_heads // kv_heads), ("D", dim),
                  ("DV", value_dim), ("BS", block_size), ("NSG", nsg), ("COLSUM", colsum)],
        # No positions at all (MB == 0): nothing to attend to, outputs stay zero and nothing is dispatched.
        grid=(32 * nsg, kv_heads, batch if max_blocks else 0),
        threadgroup=(32 * nsg, 1, 1),
        output_shapes=[(batch, q_heads, value_dim), *stats],
        output_dtypes=[queries.dtype, mx.float32, mx.float32],
        finish=finish,
    )


def paged_attention_metal(
    queries: mx.array, keys: mx.array, values: mx.array, tables: Any, lengths: Any, scale: float, block_size: int,
    *, colsum: bool = False,
) -> Result:
    """Same contract as `paged_attention_reference`, on the GPU (macOS only)."""
    launch = paged_attention_launch(queries, keys, values, tables, lengths, scale, block_size, colsum=colsum)
    return execute(SPEC, launch, run_metal)


def paged_attention(
    queries: mx.array, keys: mx.array, values: mx.array, tables: Any, lengths: Any, scale: float, block_size: int,
    *, colsum: bool = False, backend: str | None = None,
) -> Result:
    """Decode attention over paged K/V (+ H2O column sums); Metal or reference per `resolve_backend`."""
    fn = paged_attention_metal if resolve_backend(backend) == METAL else paged_attention_reference
    return fn(queries, keys, values, tables, lengths, scale, block_size, colsum=colsum)
