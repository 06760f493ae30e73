"""Runs the scheduled step on the model: prefill chunks (one sequence each) and one batched decode forward."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cortexstream.engine.batch_cache import DecodeBatch
from cortexstream.engine.sequence import Sequence
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.sequence_kv import SequenceKV


class ModelRunner:
    def __init__(self, model: nn.Module, arena: KVArena) -> None:
        self.model = model
        self.arena = arena
        self._kv: dict[str, SequenceKV] = {}

    # --- per-sequence KV views --------------------------------------------------------------------------------
    def kv(self, seq: Sequence) -> SequenceKV:
        """The sequence's arena view, sharing its block table list with the scheduler's Sequence."""
        kv = self._kv.get(seq.request_id)
        if kv is None or kv.blocks is not seq.block_table:
            kv = SequenceKV(self.arena, owner=seq.owner, contiguous=False, blocks=seq.block_table)
            kv.lengths = [seq.num_physical] * len(kv.lengths)
            kv.offsets = [seq.num_computed] * len(kv.offsets)
            self._kv[seq.request_id] = kv
        return kv

    def drop(self, seq: Sequence) -> None:
        self._kv.pop(seq.request_id, None)

    # --- forward passes ---------------------------------------------------------------------------------------
    def prefill(self, seq: Sequence, num_tokens: int) -> mx.array | None:
        """Compute KV for the next `num_tokens` pending tokens; logits of the last one if the prompt is done."""
        kv = self.kv(seq)
        start = seq.num_computed
        tokens = mx.array(seq.all_ids[start : start + num_tokens], dtype=mx.uint32)
        kv.make_writable(kv.num_tokens, kv.num_tokens + num_tokens)
        caches = [ArenaKVCache(kv, layer) for layer in range(self.arena.config.num_layers)]
        logits = self.model(tokens[None], cache=caches)
        seq.num_computed += num_tokens
        seq.num_physical = kv.num_tokens
        if seq.num_pending > 0:
            mx.eval(self.arena.keys, self.arena.values)  # logits not needed: evaluate only the KV writes
            return None
        # Evaluate now: a later prefill in the same step writing the arena while this graph (holding views of
        # the layer buffers) is pending would make MLX copy every layer buffer instead of writing in place.
        last = logits[0, -1:, :]
        mx.eval(last)
        return last

    def decode(self, seqs: list[Sequence]) -> mx.array:
        """One forward for all `seqs` (each with exactly one pending token); returns logits [B, V]."""
        kvs = [self.kv(seq) for seq in seqs]
        for kv in kvs:
            kv.make_writable(kv.num_tokens, kv.num_tokens + 1)
        tokens = mx.array(np.array([[seq.all_ids[seq.num_computed]] for seq in seqs], dtype=np.uint32))
        if len(seqs) == 1:  # contiguous tables get zero-copy views through the single-sequence cache
            caches: list[Any] = [ArenaKVCache(kvs[0], layer) for layer in range(self.arena.config.num_layers)]
            logits = self.model(tokens, cache=caches)
        else:
            batch = DecodeBatch(self.arena, kvs)
            logits = self.model(tokens, cache=batch.caches())
            batch.commit()
        for seq, kv in zip(seqs, kvs):
            seq.num_computed += 1
            seq.num_physical = kv.num_tokens
        return logits[:, -1, :]
