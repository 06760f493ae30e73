"""The attention each key received, for policies that need it (H2O), without touching model code.

Why this design. `mx.fast.scaled_dot_product_attention` returns only the attention output, and mlx-lm models call
`cache.update_and_fetch(keys, values)` and then `scaled_dot_product_attention(queries, keys, values, cache=cache,
...)` from `mlx_lm.models.base`, imported by name into every model module. Options considered:

1. Recompute attention from what the cache sees: the cache gets post-RoPE keys but never the queries, and
   rebuilding the queries needs the layer input and model-specific projections/RoPE: model code in disguise.
2. Wrap each model's attention module: model-specific attribute names, and it breaks `model.update()`/weights.
3. Route the SDPA function (chosen): `backend.sdpa.route_sdpa(model)` replaces it in the model's mlx-lm modules by
   `dispatch_sdpa`, which hands the call to `cache.attention_hook` when the cache has one and otherwise calls the
   original with the same arguments (bit-identical outputs). The engine's backend routes its model once, when
   the engine is built.

A hooked cache computes the attention output with the same original SDPA call (so tokens match the unhooked
path exactly) and, in addition, `attention_received`: softmax(q k^T * scale + mask) summed over its queries and
over the query heads of each GQA group, giving `[B, kv_heads, keys]`. Queries are processed in blocks of
`query_block` so a prefill chunk needs O(query_block * keys) memory per head, not O(chunk * keys); a decode step
is one query: a single `[heads, keys]` matmul. Batched decode works the same way (the batch cache carries the
hook; padding is hidden by the batch's boolean mask).
"""

from __future__ import annotations

from typing import Any, Iterator

import mlx.core as mx

from cortexstream.backend.sdpa import (  # noqa: F401  (re-exported: the names callers import from here)
    dispatch_sdpa, original_sdpa, route_loaded_modules, route_sdpa, routed_modules, unroute_sdpa,
)

def additive_mask(mask: Any, start: int, stop: int, num_queries: int, num_keys: int) -> mx.array | None:
    """Mask rows of queries [start, stop) as an additive float32 array broadcastable to `[B, Hq, n, K]`."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"attention scores: unsupported mask {mask!r}")
        rows = mx.arange(start, stop) + (num_keys - num_queries)  # bottom-right aligned, as mx.fast does
        block = rows[:, None] >= mx.arange(num_keys)[None, :]
    else:
        block = mask[..., start:stop, :]
    if block.dtype == mx.bool_:
        block = mx.where(block, mx.array(0.0, mx.float32), mx.array(-mx.inf, mx.float32))
    block = block.astype(mx.float32)
    while block.ndim < 4:
        block = block[None]
    return block


def biased_mask(mask: Any, bias: mx.array, num_queries: int, num_keys: int, dtype: mx.Dtype) -> mx.array:
    """mlx-lm's mask (None, "causal", bool or additive) plus an additive per-key bias, as one additive array."""
    base = additive_mask(mask, 0, num_queries, num_queries, num_keys)
    out = bias if base is None else base + bias
    return out.astype(dtype)


def attention_blocks(queries: mx.array, keys: mx.array, scale: float, mask: Any = None,
                     sinks: mx.array | None = None, query_block: int = 128) -> Iterator[mx.array]:
    """The attention probabilities of `query_block` queries at a time, float32 `[B, H, G * n, K]` (each KV head's
    GQA group of query heads stacked as rows): the softmax the model computes, for callers that reduce it per key
    (`attention_received` sums, `reconstruction.attention_max` takes the maximum)."""
    batch, q_heads, num_queries, dim = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    group = q_heads // kv_heads
    k_t = keys.astype(mx.float32).swapaxes(-1, -2)  # [B, H, D, K]
    for start in range(0, num_queries, query_block):
        stop = min(num_queries, start + query_block)
        n = stop - start
        q = (queries[:, :, start:stop].astype(mx.float32) * scale).reshape(batch, kv_heads, group * n, dim)
        logits = (q @ k_t).reshape(batch, q_heads, n, num_keys)
        block = additive_mask(mask, start, stop, num_queries, num_keys)
        if block is not None:
            logits = logits + block
        if sinks is None:
            probs = mx.softmax(logits, axis=-1, precise=True)
        else:  # learned per-head sink logits take part in the normalisation only
            norm = mx.logaddexp(mx.logsumexp(logits, axis=-1, keepdims=True),
                                sinks.astype(mx.float32).reshape(1, q_heads, 1, 1))
            probs = mx.exp(logits - norm)
        yield probs.reshape(batch, kv_heads, group * n, num_keys)


def attention_received(queries: mx.array, keys: mx.array, scale: float, mask: Any = None,
                       sinks: mx.array | None = None, query_block: int = 128) -> mx.array:
    """Attention probability each key received, summed over queries and over each GQA group's query heads.

    queries `[B, Hq, N, D]`, keys `[B, H, K, D]` (post-RoPE, as the model attends), mask as mlx-lm passes it
    (None, "causal", bool or additive array). Returns float32 `[B, H, K]`. One plain batched matmul per block
    (the group's query heads stacked as rows) and a fused softmax: about the cost of the SDPA itself.
    """
    total = mx.zeros((keys.shape[0], keys.shape[1], keys.shape[2]), mx.float32)
    for probs in attention_blocks(queries, keys, scale, mask, sinks, query_block):
        total = total + probs.sum(axis=2)
    return total
