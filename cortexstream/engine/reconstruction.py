"""Reconstruction scores (KVzip, `policies.kvzip`): the most attention each cached key gets while the model
repeats its context.

A policy with `reconstructs` gets a `ReconstructionScores` in its `PolicyState`. Outside a reconstruction pass
nothing is recorded (prompt chunks and decode steps add no scores). During one (`context` set to the number of
physical slots that hold the context), the attention hook hands every layer's queries and keys here, and each
context key's score becomes the maximum of its attention probability over the pass's queries and over the query
heads of its GQA group (`attention_max`); a pass's maxima are folded into the state's scores with a maximum too, so
a context scored in several chunks keeps, per key, the largest attention any chunk paid it. Slots added since the
last reconstruction carry +inf (`FRESH`) until a pass scores them: the policy keeps them first.

Eviction waits for the reconstruction: until the prompt being prefilled (`prompt_end`) has been reconstructed
(`scored_end`), nothing is evicted. The passes themselves (running the model, rolling its K/V back) are
`engine.reconstruction_pass`; the scheduler's side, which plans them as steps, is `engine.reconstruction_plan`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from cortexstream.engine.attention_hook import attention_blocks

FRESH = np.inf  # the score of a slot no reconstruction has scored yet


def attention_max(queries: mx.array, keys: mx.array, scale: float, mask: Any = None,
                  sinks: mx.array | None = None, query_block: int = 128) -> mx.array:
    """The largest attention probability each key received from any query and any query head of its GQA group.

    queries `[B, Hq, N, D]`, keys `[B, H, K, D]` (post-RoPE), mask as mlx-lm passes it. Returns float32
    `[B, H, K]`. Same softmax as `attention_hook.attention_received` (which sums instead)."""
    best = mx.zeros((keys.shape[0], keys.shape[1], keys.shape[2]), mx.float32)
    for probs in attention_blocks(queries, keys, scale, mask, sinks, query_block):
        best = mx.maximum(best, probs.max(axis=2))
    return best


def attend_and_max(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any = None,
                   sinks: mx.array | None = None, query_block: int = 128) -> tuple[mx.array, mx.array]:
    """A reconstruction pass's attention output and `attention_max` from one computation of the probabilities.

    The scores need the probabilities explicitly; the output is their product with the values, so the pass does
    not run the model's SDPA over the whole context a second time. Returns the output `[B, Hq, N, Dv]` in the
    queries' dtype and the maxima float32 `[B, H, K]`. The output equals the SDPA's up to float rounding: it feeds
    the pass's next layers only (a pass is scoring work, rolled back; nothing of it is sampled)."""
    batch, q_heads, num_queries, _ = queries.shape
    kv_heads, num_keys = keys.shape[1], keys.shape[2]
    v = values.astype(mx.float32)  # [B, H, K, Dv]
    best = mx.zeros((batch, kv_heads, num_keys), mx.float32)
    outs = []
    for start, probs in zip(range(0, num_queries, query_block),
                            attention_blocks(queries, keys, scale, mask, sinks, query_block)):
        n = min(num_queries, start + query_block) - start
        best = mx.maximum(best, probs.max(axis=2))
        outs.append((probs @ v).reshape(batch, q_heads, n, values.shape[-1]))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
    return out.astype(queries.dtype), best


class ReconstructionScores:
    """The reconstruction side of one sequence's `PolicyState` (see the module docstring)."""

    def __init__(self, num_layers: int) -> None:
        self.context: int | None = None  # physical context slots while a pass runs, else None (nothing recorded)
        self.pending: list[mx.array | None] = [None] * num_layers
        self.scored_end = 0  # logical end of the context the last completed reconstruction covered
        self.num_passes = 0

    def attend(self, layer: int, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
               sinks: mx.array | None) -> mx.array | None:
        """The attention hook's call for one layer: during a pass, the layer's attention output with the maxima
        recorded (`attend_and_max`); outside a reconstruction pass None (the caller attends as usual)."""
        if self.context is None:
            return None
        out, best = attend_and_max(queries, keys, values, scale, mask, sinks)
        self.add(layer, best[0])
        return out

    @property
    def recording(self) -> bool:
        """Whether a reconstruction pass is running (its attention is recorded)."""
        return self.context is not None

    def add(self, layer: int, received: mx.array) -> None:
        """One layer's maxima `[H, K]` of a pass (the pooled-heads hook computes them per owned cell)."""
        received = received[:, : self.context]
        prior = self.pending[layer]
        self.pending[layer] = received if prior is None else mx.maximum(prior, received)

    def arrays(self) -> list[mx.array]:
        return [p for p in self.pending if p is not None]

    def fold(self, scores: list[np.ndarray]) -> None:
        """Fold the pass's maxima into the per-layer scores `[H, n]` (in place): unscored slots start from 0."""
        for layer, received in enumerate(self.pending):
            if received is None:
                continue
            n = received.shape[-1]
            head = scores[layer][:, :n]
            head[np.isinf(head)] = 0.0
            np.maximum(head, np.asarray(received, dtype=np.float64), out=head)
            self.pending[layer] = None
        self.num_passes += 1

    def may_evict(self, prompt_end: int | None, logical_length: int) -> bool:
        """Whether the context (up to the prompt being prefilled) has been reconstructed."""
        end = logical_length if prompt_end is None else min(logical_length, prompt_end)
        return self.scored_end >= end

    def clone(self) -> "ReconstructionScores":
        other = ReconstructionScores(len(self.pending))
        other.scored_end, other.num_passes = self.scored_end, self.num_passes
        return other
