"""Moving stored K/V rows and whole blocks of the arena as they are: copy-on-write, relocation, eviction's
compaction, forks, a private cache's regrowth and saved caches (a mixin of `KVArena`, arena.py).

Rows grouped per token move as codes with their own scales and biases, so a moved row is bit-identical. Keys
grouped per channel share a scale with their block (channel_quantized.py): whole blocks move exactly
(`table_blocks`, `copy_blocks`), a single row moves by a read and a write.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from cortexstream.kv.arena_sides import (
    Side, put_blocks, put_side, side_arrays, take_blocks, take_side, take_side_per_head,
)


class StoredMoves:
    """Moves of stored rows and blocks; `KVArena` provides `config`, `keys`, `values`, `slot_indices` and `arrays`."""

    def table_blocks(self, layer: int, blocks: Sequence[int], length: int) -> tuple[object, object]:
        """K and V of the whole blocks that hold a sequence's first `length` tokens, exactly as stored (for
        `put_table_blocks`: forks, a private cache's regrowth, saved caches). Exact for every storage, keys grouped
        per channel too (their rows cannot move alone, channel_quantized.py)."""
        ids = np.asarray(blocks[:self.config.blocks_for_tokens(length)], dtype=np.int64)
        bs = self.config.block_size
        return take_blocks(self.keys[layer], ids, bs), take_blocks(self.values[layer], ids, bs)

    def key_rows_of_blocks(self, layer: int, blocks: Sequence[int], length: int) -> object:
        """Keys grouped per channel of a sequence's first `length` tokens: their codes and their blocks' scales
        (a saved cache; `put_rows` takes it back at the slots of a sequence's first `length` tokens)."""
        return self.keys[layer].rows_of_blocks(self.slot_indices(blocks, 0, length))

    def put_table_blocks(self, layer: int, blocks: Sequence[int], keys: object, values: object) -> None:
        """Store whole blocks `table_blocks` returned (from an arena of the same storage) at `blocks`, unchanged."""
        ids = np.asarray(blocks, dtype=np.int64)
        put_blocks(self.keys[layer], ids, self.config.block_size, keys)
        put_blocks(self.values[layer], ids, self.config.block_size, values)

    def put_rows(self, layer: int, where: int | slice | mx.array, keys: Side, values: Side) -> None:
        """Store rows an arena of the same storage returned (`run_rows` / `table_rows`, or a saved cache's) at
        slots `where` (an int: the n slots from there), unchanged."""
        if isinstance(where, int):
            n = keys.shape[2] if isinstance(keys, mx.array) else keys.num_slots
            where = slice(where, where + n)
        put_side(self.keys[layer], where, keys)
        put_side(self.values[layer], where, values)

    def move_rows(self, layer: int, source: mx.array, destination: slice | mx.array) -> None:
        """Move stored rows of one layer: `source` int32 slots `[n]` or per KV head `[H, n]` to `destination`
        (n slots), unchanged (no requantization; keys grouped per channel are read and written). Reads happen
        before the writes in the graph, but the caller evaluates the arena before anything else reads a
        destination slot that was also a source."""
        for sides in (self.keys, self.values):
            side = sides[layer]
            rows = take_side(side, source) if source.ndim == 1 else take_side_per_head(side, source)
            mx.eval(side_arrays(rows))  # materialise before the in-place write into the same storage
            put_side(side, destination, rows)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's slots, every layer (copy-on-write and relocation)."""
        self.copy_blocks([src], [dst])

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        if not src:
            return
        bs = self.config.block_size
        src_ids, dst_ids = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        for sides in (self.keys, self.values):
            for side in sides:
                put_blocks(side, dst_ids, bs, take_blocks(side, src_ids, bs))
        mx.eval(self.arrays())
