"""The cache object an evicting policy's sequence hands the model: an `ArenaKVCache` plus the SDPA hook that records
attention scores, adds merged slots' logit biases and attends pooled heads by owner (`engine.policy_runtime` holds
the state it reads and writes)."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from cortexstream.engine.attention_hook import attention_received, biased_mask, original_sdpa
from cortexstream.engine.policy_runtime import PolicyState
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.sequence_kv import SequenceKV


class PolicyKVCache(ArenaKVCache):
    """An `ArenaKVCache` that carries its sequence's `PolicyState` and, when the policy needs attention scores,
    an `attention_hook` (see `engine.attention_hook`): same K/V, same output, plus the scores recorded."""

    attention_hook: Callable[..., mx.array] | None = None

    def __init__(self, sequence: SequenceKV, layer: int, state: PolicyState) -> None:
        super().__init__(sequence, layer)
        self.policy_state = state
        policy = state.policy
        if policy.needs_attention_hook:
            self.attention_hook = self._hook  # reached once the model's SDPA is routed (engine or attach_policy)

    def _hook(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
              sinks: mx.array | None) -> mx.array:
        state = self.policy_state
        if state.is_pooled(self.layer):
            return state.attend_pooled(self.layer, queries, keys, values, scale, mask, sinks,
                                       record_from=state.voting_row(self.offset, queries.shape[2]))
        bias = state.logit_bias(self.layer, keys.shape[2], queries.shape[1])
        if bias is not None:
            mask = biased_mask(mask, bias, queries.shape[2], keys.shape[2], queries.dtype)
        state.add_queries(self.layer, queries[0], self.offset)
        if state.reconstruction is not None:  # records during a reconstruction pass only
            out = state.reconstruction.attend(self.layer, queries, keys, values, scale, mask, sinks)
            if out is not None:
                return out
        elif state.policy.needs_attention_scores:
            first = state.voting_row(self.offset, queries.shape[2])
            if first is not None:
                rows_mask = mask[..., first:, :] if first and isinstance(mask, mx.array) else mask
                state.record(self.layer, attention_received(queries[:, :, first:], keys, scale, rows_mask, sinks)[0])
        return original_sdpa(queries, keys, values, self, scale=scale, mask=mask, sinks=sinks)

    def trim(self, n: int) -> int:
        n = max(0, min(self.size(), int(n)))
        self.policy_state.trim(self.layer, n, self.offset)
        return super().trim(n)


def policy_caches(seq: SequenceKV, state: PolicyState) -> list[PolicyKVCache]:
    state.bind(seq)  # the state reads cells lent across layers through this sequence
    return [PolicyKVCache(seq, layer, state) for layer in range(seq.arena.config.num_layers)]
