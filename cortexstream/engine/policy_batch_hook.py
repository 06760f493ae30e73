"""The attention hook of a batched decode step whose rows have KV policies: scores recorded, logit biases added,
and rows whose heads share their budget (`engine.pooled_heads`) attended over the cells each head owns.

One hook per layer, set on the batch's layer caches by the runner when `needs_batch_hook` says a row needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
import numpy as np

from cortexstream.engine.attention_hook import attention_received, biased_mask, original_sdpa

if TYPE_CHECKING:
    from cortexstream.engine.policy_runtime import PolicyState


def needs_batch_hook(states: list[PolicyState | None]) -> bool:
    return any(s is not None and ((s.policy.needs_attention_scores and s.reconstruction is None) or s.has_bias()
                                  or s.any_pooled()) for s in states)


def batch_attention_hook(layer: int, lengths: np.ndarray, states: list[PolicyState | None],
                         attend: Callable[..., mx.array] | None = None) -> Callable[..., mx.array]:
    """Attention hook for one layer of a batched decode step: adds each row's logit bias (merged slots), scores
    the rows whose policy needs attention scores, and attends the rows with pooled heads cell by owner.

    `lengths[b]`: physical keys of row b after this step (the rest of the padded row is masked padding).
    `attend`: the batch's own attention (`BatchLayerCache.attend`); used for the output whenever no bias is
    added, so a batch that only records scores produces exactly the tokens of a batch without policies.
    """
    pooled = [b for b, s in enumerate(states) if s is not None and s.is_pooled(layer)]
    rows = [b for b, s in enumerate(states) if s is not None and b not in pooled
            and s.policy.needs_attention_scores and s.reconstruction is None]
    index = mx.array(np.asarray(rows, dtype=np.int32))
    biased = [b for b, s in enumerate(states) if s is not None and b not in pooled and s.has_bias()]

    def bias_for(num_keys: int, query_heads: int) -> mx.array:
        rows_bias = np.zeros((len(states), query_heads, 1, num_keys), np.float32)
        for b in biased:
            row = states[b].bias_row(layer, num_keys)
            if row is not None:
                rows_bias[b, :, 0, :] = np.repeat(row, query_heads // row.shape[0], axis=0)
        return mx.array(rows_bias)

    def hook(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
             sinks: mx.array | None) -> mx.array:
        plain_mask = mask
        if biased:
            mask = biased_mask(mask, bias_for(keys.shape[2], queries.shape[1]), queries.shape[2], keys.shape[2],
                               queries.dtype)
        if rows:
            row_mask = mask[index] if isinstance(mask, mx.array) and mask.shape[0] == queries.shape[0] else mask
            received = attention_received(queries[index], keys[index], scale, row_mask, sinks)
            for i, b in enumerate(rows):
                states[b].record(layer, received[i, :, : int(lengths[b])])
        if not biased and attend is not None:
            out = attend(queries, keys, values, scale, plain_mask, sinks)
        else:
            out = original_sdpa(queries, keys, values, None, scale=scale, mask=mask, sinks=sinks)
        if not pooled:
            return out
        parts = [out[b:b + 1] for b in range(out.shape[0])]
        for b in pooled:  # the plain output of these rows is discarded: their cells are not their columns
            row_mask = plain_mask[b:b + 1] if isinstance(plain_mask, mx.array) and plain_mask.shape[0] == len(parts) \
                else plain_mask
            parts[b] = states[b].attend_pooled(layer, queries[b:b + 1], keys[b:b + 1], values[b:b + 1], scale,
                                               row_mask, sinks, record_from=0, valid=int(lengths[b]))
        return mx.concatenate(parts, axis=0)

    return hook
