"""The merger's objective: the model run on query tokens over a prefix cache as the eviction policy leaves it.

For each training prefix the eviction policy has chosen its slots per layer and KV head (`scores.keep_slots`).
The student cache holds exactly those slots, each kept slot with a group of dropped tokens folded in by `fold`
(`compression.evicted_merger`): nothing (plain eviction: H2O), D2O's fixed average of the values, or the learned
merger. The queries get their real positions (the cache's offset is the prefix length). Loss: KL(full-cache
next-token distribution || this cache's), as the compressor is trained, so the three folds are compared on one
scale and the learned one is trained on what a user reads: the next token.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from cortexstream.compression.evicted_merger import Fold, Merger, d2o_fold, group_means, learned_fold
from cortexstream.training.compression.objective import PrefixCache, distillation_loss, hidden_over_offsets


def evict_fold(layer: int, anchor_k: mx.array, anchor_v: mx.array, mean_k: mx.array, mean_v: mx.array,
               weight: mx.array) -> tuple[mx.array, mx.array]:
    """Plain eviction: the kept slots as they are."""
    return anchor_k, anchor_v


def d2o(layer: int, anchor_k: mx.array, anchor_v: mx.array, mean_k: mx.array, mean_v: mx.array,
        weight: mx.array) -> tuple[mx.array, mx.array]:
    """D2O: values averaged with their group (weights = cosines), keys unchanged."""
    return anchor_k, d2o_fold(anchor_v, mean_v, weight)


def learned(merger: Merger) -> Fold:
    def fold(layer: int, anchor_k: mx.array, anchor_v: mx.array, mean_k: mx.array, mean_v: mx.array,
             weight: mx.array) -> tuple[mx.array, mx.array]:
        return learned_fold(merger, layer, anchor_k, anchor_v, mean_k, mean_v, weight)

    return fold


def merger_loss(model: Any, batch: dict[str, Any], fold: Fold, *,
                threshold: float) -> tuple[mx.array, mx.array]:
    """(loss, kl) for a batch of the teacher pool plus `keep` `[B, L, H, k]` (the policy's slots per prefix)."""
    keep = batch["keep"]

    def forward(idx: mx.array | None, offset: int) -> mx.array:
        caches = []
        for layer, (k, v) in enumerate(batch["prefix_kv"]):
            slots = keep[:, layer] if idx is None else keep[idx, layer]
            if idx is not None:
                k, v = k[idx], v[idx]
            anchor_k, anchor_v, mean_k, mean_v, weight, _ = group_means(k, v, slots, threshold)
            new_k, new_v = fold(layer, anchor_k, anchor_v, mean_k, mean_v, weight)
            caches.append(PrefixCache(new_k.astype(k.dtype), new_v.astype(v.dtype), offset + k.shape[2]))
        queries = batch["queries"] if idx is None else batch["queries"][idx]
        return model.model(queries, cache=caches)

    loss, kl, _ = distillation_loss(model, batch, hidden_over_offsets(batch, forward))
    return loss, kl
