"""mlx-lm cache protocol for one decode step of several sequences of different lengths in one forward pass.

Each sequence's new token is scattered into its own arena slot, then every layer gathers the sequences' blocks into
a padded `[B, H, max_blocks * block_size, D]` tensor; a boolean mask hides the padding. RoPE gets per-sequence
offsets through `offset` being an array.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from cortexstream.kv.arena import KVArena
from cortexstream.kv.sequence_kv import SequenceKV


class DecodeBatch:
    """Per-step addressing shared by all layers: write slots, padded block table, lengths and offsets."""

    def __init__(self, arena: KVArena, sequences: list[SequenceKV]) -> None:
        bs = arena.config.block_size
        self.arena = arena
        self.sequences = sequences
        lengths = np.array([s.num_tokens for s in sequences], dtype=np.int64)
        self.lengths_after = lengths + 1
        max_blocks = int(max(-(-self.lengths_after // bs)))
        table = np.zeros((len(sequences), max_blocks), dtype=np.int32)  # padding points at block 0, masked out
        slots = np.empty(len(sequences), dtype=np.int32)
        for i, seq in enumerate(sequences):
            used = -(-int(self.lengths_after[i]) // bs)
            table[i, :used] = seq.blocks[:used]
            slots[i] = seq.blocks[int(lengths[i]) // bs] * bs + int(lengths[i]) % bs
        self.table = mx.array(table)
        self.slots = mx.array(slots)
        self.offsets = mx.array(np.array([s.offsets[0] for s in sequences], dtype=np.int32))
        positions = np.arange(max_blocks * bs)
        self.mask = mx.array(positions[None, :] < self.lengths_after[:, None])[:, None, None, :]

    def caches(self) -> list["BatchLayerCache"]:
        return [BatchLayerCache(self, layer) for layer in range(self.arena.config.num_layers)]

    def commit(self) -> None:
        """Advance every sequence's counters once the forward pass has been built."""
        for seq in self.sequences:
            for layer in range(len(seq.lengths)):
                seq.lengths[layer] += 1
                seq.offsets[layer] += 1


class BatchLayerCache:
    # Set by the runner when a sequence's KV policy needs attention scores (see policies.attention_scores).
    attention_hook: Any = None

    def __init__(self, batch: DecodeBatch, layer: int) -> None:
        self.batch = batch
        self.layer = layer

    @property
    def offset(self) -> mx.array:
        return self.batch.offsets

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if n != 1:
            raise ValueError("DecodeBatch caches take exactly one new token per sequence")
        return self.batch.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        arena, batch = self.batch.arena, self.batch
        keys_buf, values_buf = arena.keys[self.layer], arena.values[self.layer]
        heads, _, dim = keys_buf.shape
        # [B, H, 1, D] -> [H, B, D], one scatter per buffer
        keys_buf[:, batch.slots, :] = keys[:, :, 0, :].transpose(1, 0, 2).astype(keys_buf.dtype)
        values_buf[:, batch.slots, :] = values[:, :, 0, :].transpose(1, 0, 2).astype(values_buf.dtype)
        arena.keys[self.layer], arena.values[self.layer] = keys_buf, values_buf
        return self._gather(keys_buf), self._gather(values_buf)

    def _gather(self, buffer: mx.array) -> mx.array:
        heads, _, dim = buffer.shape
        cfg = self.batch.arena.config
        blocked = buffer.reshape(heads, cfg.num_blocks, cfg.block_size, dim)
        gathered = blocked[:, self.batch.table]  # [H, B, max_blocks, bs, D]
        batch, max_blocks = self.batch.table.shape
        return gathered.transpose(1, 0, 2, 3, 4).reshape(batch, heads, max_blocks * cfg.block_size, dim)
