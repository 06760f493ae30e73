"""Key centering for quantized key storage: subtract each KV head's key bias before quantizing.

Why. Models whose key projection has a bias (Qwen2 and Qwen2.5: `k_proj` with `bias=True`) add to every key a
vector whose largest channels are tens to hundreds of times the typical key value, and these channels sit in
RoPE's slowest pairs, so they stay nearly constant over thousands of positions. A quantizer with one scale per
group of 64 channels then spends its whole range on those few channels: on Qwen2.5-Coder-0.5B, int8 keys cost
+7% perplexity and 4-bit keys make it useless, in mlx-lm's QuantizedKVCache as in a plain arena, while the
same storage is within rounding on SmolLM2 (no bias). Rotation (kv_rotation.py) does not help there: it spreads
one huge channel over all of a group's channels.

What. A quantized key side stores `k - c` (then rotated, then quantized), where `c` `[H, D]` is the layer's key bias
per KV head, and adds `c` back wherever true keys are read (`QuantizedRows.dequantize`). Attention over the stored
codes needs nothing: every key a query attends to is shifted by the same `c`, so each of its scores moves by the
same `q . c`, which softmax ignores (exact, not an approximation; learned attention sinks, where a fixed logit
would not move with them, are read from true keys). The bias is taken before RoPE; for the slow pairs where it
dominates, RoPE barely turns it, and for the fast ones it is small.

The centers are a function of the model's weights, so every process (and every rank, from its own heads after the
split) derives the same ones from the same model; the arena's cache key names them, and saved prompt caches carry
them and are refused by an arena whose centers differ. Models without a key bias get none (nothing changes).
"""

from __future__ import annotations

from typing import Any

CENTER_NAME = "k_bias"  # how stored keys are centered, in cache keys and saved caches' metadata

KeyCenters = tuple[tuple[tuple[float, ...], ...], ...]  # [layer][kv head][channel]


def model_key_centers(model: Any, num_kv_heads: int, head_dim: int) -> KeyCenters | None:
    """Each layer's key bias as `[kv_heads][head_dim]` floats, or None when the model's key projections have no
    bias (or a layer's is not that shape: then centering is not used at all)."""
    import mlx.core as mx
    import numpy as np

    layers = getattr(model, "layers", None) or []
    centers = []
    for layer in layers:
        projection = getattr(getattr(layer, "self_attn", None), "k_proj", None)
        bias = getattr(projection, "bias", None) if projection is not None else None
        if bias is None or bias.size != num_kv_heads * head_dim:
            return None
        values = np.array(bias.astype(mx.float32), dtype=np.float32)
        centers.append(tuple(tuple(float(x) for x in row) for row in values.reshape(num_kv_heads, head_dim)))
    return tuple(centers) if centers else None


def check_key_centers(centers: Any, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    """Refuse centers that are not `[num_layers][num_kv_heads][head_dim]` finite floats, naming the field."""
    import math

    def fail(why: str) -> None:
        from cortexstream.errors import InvalidArgumentError

        raise InvalidArgumentError(f"ArenaConfig.key_centers: {why}; expected [{num_layers}][{num_kv_heads}]"
                                   f"[{head_dim}] floats (kv_center.model_key_centers) or None")

    if not isinstance(centers, tuple) or len(centers) != num_layers:
        fail(f"{type(centers).__name__} of {len(centers) if isinstance(centers, tuple) else '?'} layers")
    for layer in centers:
        if not isinstance(layer, tuple) or len(layer) != num_kv_heads:
            fail("a layer does not have one row per KV head")
        for row in layer:
            if not isinstance(row, tuple) or len(row) != head_dim or not all(
                    isinstance(x, float) and math.isfinite(x) for x in row):
                fail("a head's row is not head_dim finite floats")
