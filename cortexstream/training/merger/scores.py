"""What the eviction policy keeps in each training prefix: H2O's scores from the teacher's own prefill.

H2O ranks a key by the attention probability it received, summed over every query that saw it and over the query
heads of its GQA group. For a training prefix of P tokens that is the column sum of each layer's causal softmax
over the prefix: `prefix_scores` captures it through the SDPA hook (`backend.sdpa.route_sdpa`) while the model
prefills the prefix at the pool's position offsets, without changing the forward pass. `keep_slots` then asks the
real `H2O` policy which slots it keeps at the training budget, so the merger learns on the choices it will fold
at run time. (At run time H2O chooses as the prompt arrives, chunk by chunk; here it chooses once, over the whole
prefix.)
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from cortexstream.backend.sdpa import original_sdpa, route_sdpa
from cortexstream.policies.h2o import H2O
from cortexstream.kv.arena_config import model_kv_shape
from cortexstream.training.compression.data import Segments
from cortexstream.training.compression.objective import PrefixCache


class _ScoringCache(PrefixCache):
    """A prefix cache whose SDPA hook also sums each key's attention over the queries and GQA heads."""

    def attention_hook(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                       sinks: mx.array | None = None) -> mx.array:
        out = original_sdpa(queries, keys, values, self, scale=scale, mask=mask, sinks=sinks)
        b, hq, t, d = queries.shape
        heads = keys.shape[1]
        group = hq // heads
        q = queries.reshape(b, heads, group * t, d).astype(mx.float32)  # a GQA group's queries side by side
        logits = scale * (q @ keys.astype(mx.float32).swapaxes(-1, -2))  # [B, H, G * T, T]: one plain matmul
        causal = mx.tile(mx.tril(mx.ones((t, t), dtype=mx.bool_)), (group, 1))
        probs = mx.softmax(mx.where(causal, logits, -mx.inf), axis=-1, precise=True)
        self.scores = probs.sum(axis=2)  # [B, H, T]
        return out


def prefix_scores(model: Any, segments: Segments, prefix: int, offsets: np.ndarray, *, batch_size: int = 4,
                  progress: bool = True) -> np.ndarray:
    """H2O's scores `[S, L, H, prefix]` of every segment's prefix, run at each segment's position offset."""
    route_sdpa(model)
    tokens = segments.tokens[:, :prefix]
    _, heads, head_dim, _ = model_kv_shape(model)
    dtype = model.model.embed_tokens.weight.dtype
    out = []
    starts = range(0, len(tokens), batch_size)
    for lo in tqdm(starts, desc="h2o scores", unit="batch", disable=not progress):
        rows = np.arange(lo, min(lo + batch_size, len(tokens)))
        for offset in sorted(set(int(o) for o in offsets[rows])):
            part = rows[offsets[rows] == offset]
            caches = [_ScoringCache.empty(len(part), heads, head_dim, offset, dtype) for _ in model.model.layers]
            model.model(mx.array(tokens[part]), cache=caches)
            scores = mx.stack([c.scores for c in caches], axis=1)  # [B, L, H, P]
            mx.eval(scores)
            out.extend(zip(part, np.asarray(scores)))
    out.sort(key=lambda pair: pair[0])
    return np.stack([s for _, s in out]).astype(np.float64)


def keep_slots(scores: np.ndarray, policy: H2O) -> np.ndarray:
    """`[S, L, H, k]` slots the policy keeps (ascending) in each prefix, from `scores` `[S, L, H, P]`."""
    n = scores.shape[-1]
    keep = []
    for sample in scores:
        chosen = policy.select(n, n, sample)
        if chosen is None:
            raise ValueError(f"keep_slots: {policy.describe()} keeps all {n} prefix tokens; nothing to fold")
        chosen = np.asarray(chosen)
        if chosen.ndim != 3:
            chosen = np.broadcast_to(chosen, sample.shape[:2] + chosen.shape[-1:])
        keep.append(np.sort(chosen, axis=-1))
    return np.stack(keep).astype(np.int32)
