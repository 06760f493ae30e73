"""Per-sequence policy runtime: accumulated scores, logical positions, and the eviction step after a forward pass.

`PolicyState` lives next to one `SequenceKV` (the engine's runner keeps one per request; the direct path keeps it
on the `PolicyKVCache` objects of a prompt cache, so it survives between chat turns). For every layer it holds
`scores[l]` `[kv_heads, n]` (float64: sums over thousands of queries) and `positions[l]` `[kv_heads, n]`, the
logical position of each physical slot, both aligned with the physical slots: `after_forward` appends the new
tokens' entries, then evicts through `SequenceKV.keep` and gathers scores/positions with the same indices, so
they stay aligned through compaction and block frees.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.sequence_kv import SequenceKV
from cortexstream.policies.attention_scores import attention_received, install_attention_hook, original_sdpa
from cortexstream.policies.base import KVPolicy


class PolicyState:
    """Scores and positions of one sequence's physical slots, and the policy that evicts them."""

    def __init__(self, policy: KVPolicy, num_layers: int, num_kv_heads: int, num_tokens: int = 0) -> None:
        self.policy = policy
        self.scores = [np.zeros((num_kv_heads, num_tokens)) for _ in range(num_layers)]
        self.positions = [np.broadcast_to(np.arange(num_tokens), (num_kv_heads, num_tokens)).copy()
                          for _ in range(num_layers)]
        self.pending: list[mx.array | None] = [None] * num_layers  # this forward's contributions, lazy
        self.num_evicted = 0
        self.num_evictions = 0

    @classmethod
    def for_sequence(cls, policy: KVPolicy, seq: SequenceKV) -> "PolicyState":
        """State for a sequence that already holds tokens; only valid while nothing has been evicted."""
        if seq.num_tokens != seq.logical_length:
            raise InvalidArgumentError(
                "kv_policy: this cache was already evicted by another runtime; its slots' positions are unknown"
            )
        cfg = seq.arena.config
        return cls(policy, cfg.num_layers, cfg.num_kv_heads, seq.num_tokens)

    @property
    def num_tokens(self) -> int:
        return self.positions[0].shape[1]

    # --- scores -----------------------------------------------------------------------------------------------
    def record(self, layer: int, received: mx.array) -> None:
        """Add one forward pass's attention `[kv_heads, keys]` for `layer` (keys: the physical slots after it)."""
        prior = self.pending[layer]
        self.pending[layer] = received if prior is None else prior + received

    def pending_arrays(self) -> list[mx.array]:
        return [p for p in self.pending if p is not None]

    def sync(self, seq: SequenceKV) -> None:
        """Append entries for the tokens the last forward pass added, and fold in its scores."""
        for layer in range(len(self.scores)):
            length, offset = seq.lengths[layer], seq.offsets[layer]
            new = length - self.positions[layer].shape[1]
            if new < 0:
                raise InvalidArgumentError(f"kv_policy: layer {layer} lost slots outside the policy ({length})")
            heads = self.scores[layer].shape[0]
            if new:
                fresh = np.broadcast_to(np.arange(offset - new, offset), (heads, new))
                self.positions[layer] = np.concatenate([self.positions[layer], fresh], axis=1)
                self.scores[layer] = np.concatenate([self.scores[layer], np.zeros((heads, new))], axis=1)
            received = self.pending[layer]
            if received is not None:
                self.scores[layer] += np.asarray(received[:, :length], dtype=np.float64)
                self.pending[layer] = None

    # --- eviction ---------------------------------------------------------------------------------------------
    def after_forward(self, seq: SequenceKV, context: int) -> int:
        """Sync, then let the policy evict down to its budget. Returns the physical tokens evicted."""
        self.sync(seq)
        n = seq.num_tokens
        scores = np.stack(self.scores) if self.policy.needs_attention_scores else None
        keep = self.policy.select(n, context, scores)
        if keep is None:
            return 0
        keep = np.asarray(keep, dtype=np.int64)
        seq.keep(keep)
        self.compact(keep)
        evicted = n - keep.shape[-1]
        self.num_evicted += evicted
        self.num_evictions += 1
        return evicted

    def compact(self, keep: np.ndarray) -> None:
        """Gather scores/positions exactly as `SequenceKV.keep` gathers the slots (sorted per row)."""
        keep = np.sort(keep, axis=-1)
        for layer in range(len(self.scores)):
            heads = self.scores[layer].shape[0]
            row = keep if keep.ndim == 1 else keep[layer]
            index = np.broadcast_to(row, (heads, row.shape[-1]))
            self.scores[layer] = np.take_along_axis(self.scores[layer], index, axis=1)
            self.positions[layer] = np.take_along_axis(self.positions[layer], index, axis=1)

    def trim(self, layer: int, n: int, offset: int) -> None:
        """Drop the last n slots of a layer, which must be the last n logical tokens in every head."""
        if n <= 0:
            return
        tail = self.positions[layer][:, -n:]
        if not (tail >= offset - n).all():
            raise InvalidArgumentError("trim: the last tokens were evicted; an evicted cache cannot be trimmed")
        self.positions[layer] = self.positions[layer][:, :-n]
        self.scores[layer] = self.scores[layer][:, :-n]

    def clone(self) -> "PolicyState":
        other = PolicyState(self.policy, 0, 0)
        other.scores = [s.copy() for s in self.scores]
        other.positions = [p.copy() for p in self.positions]
        other.pending = [None] * len(self.scores)
        other.num_evicted, other.num_evictions = self.num_evicted, self.num_evictions
        return other


class PolicyKVCache(ArenaKVCache):
    """An `ArenaKVCache` that carries its sequence's `PolicyState` and, when the policy needs attention scores,
    an `attention_hook` (see `attention_scores`): same K/V, same output, plus the scores recorded."""

    attention_hook: Callable[..., mx.array] | None = None

    def __init__(self, sequence: SequenceKV, layer: int, state: PolicyState) -> None:
        super().__init__(sequence, layer)
        self.policy_state = state
        if state.policy.needs_attention_scores:
            install_attention_hook()
            self.attention_hook = self._hook

    def _hook(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
              sinks: mx.array | None) -> mx.array:
        self.policy_state.record(self.layer, attention_received(queries, keys, scale, mask, sinks)[0])
        return original_sdpa(queries, keys, values, self, scale=scale, mask=mask, sinks=sinks)

    def trim(self, n: int) -> int:
        n = max(0, min(self.size(), int(n)))
        self.policy_state.trim(self.layer, n, self.offset)
        return super().trim(n)


def policy_caches(seq: SequenceKV, state: PolicyState) -> list[PolicyKVCache]:
    return [PolicyKVCache(seq, layer, state) for layer in range(seq.arena.config.num_layers)]


def batch_score_hook(layer: int, lengths: np.ndarray, states: list[PolicyState | None]) -> Callable[..., mx.array]:
    """Attention hook for one layer of a batched decode step: scores only the rows whose state needs them.

    `lengths[b]`: physical keys of row b after this step (the rest of the padded row is masked padding).
    """
    rows = [b for b, s in enumerate(states) if s is not None and s.policy.needs_attention_scores]
    index = mx.array(np.asarray(rows, dtype=np.int32))

    def hook(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
             sinks: mx.array | None) -> mx.array:
        row_mask = mask[index] if isinstance(mask, mx.array) and mask.shape[0] == queries.shape[0] else mask
        received = attention_received(queries[index], keys[index], scale, row_mask, sinks)
        for i, b in enumerate(rows):
            states[b].record(layer, received[i, :, : int(lengths[b])])
        return original_sdpa(queries, keys, values, None, scale=scale, mask=mask, sinks=sinks)

    install_attention_hook()
    return hook
