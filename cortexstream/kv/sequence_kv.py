"""One sequence's KV inside a `KVArena`: its block table, per-layer lengths, and the editing primitives.

Each layer keeps two counters: `offsets[l]`, the logical position (what RoPE sees), and `lengths[l]`, the number of
physical slots in use. They start equal and part ways when a policy evicts (`keep`) or compresses (`replace`).
All layers must hold the same number of physical tokens between forward passes, because mlx-lm models build one
attention mask (from layer 0's cache) for every layer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError, OutOfBlocksError
from cortexstream.kernels.evict_gather import compact_layer
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.arena_sides import write_side
from cortexstream.kv.kv_center import KeyCenters
from cortexstream.kv.kv_dtype import KVDtype


class SequenceKV:
    """Block table + counters for one sequence. Mutations take the arena lock."""

    def __init__(
        self,
        arena: KVArena,
        *,
        owner: int = -1,
        contiguous: bool = True,
        private: bool = False,
        blocks: list[int] | None = None,
        managed: bool = False,
    ) -> None:
        self.arena = arena
        self.owner = owner
        self.contiguous = contiguous
        self.private = private  # the arena exists only for this sequence and may be regrown
        # Managed: an engine's block manager owns the table (allocation, copy-on-write, freeing) and hands it over
        # with every step (`sync`); this view only reads and writes the slots, and never allocates or frees.
        self.managed = managed
        # The block table, only ever mutated in place.
        self.blocks: list[int] = blocks if blocks is not None else []
        # Cached contiguity of `blocks`: (len, first, last, epoch) -> contiguous start. Every in-place change that
        # keeps len/first/last (copy-on-write, regrowth) bumps the epoch.
        self._table_epoch = 0
        self._contiguity: tuple[tuple[int, int, int, int], int | None] | None = None
        self._synced: tuple[int, ...] | None = None  # the table `sync` last took (managed views)
        self.lengths = [0] * arena.config.num_layers
        self.offsets = [0] * arena.config.num_layers

    # --- sizes ------------------------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.arena.config.block_size

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def num_tokens(self) -> int:
        """Physical tokens held (the maximum over layers; equal between forward passes)."""
        return max(self.lengths)

    def advance(self, num_tokens: int) -> None:
        """Count `num_tokens` new tokens in every layer (physical and logical) once a forward pass that writes them
        has been built; the batched passes write the arena themselves and call this."""
        for layer in range(len(self.lengths)):
            self.lengths[layer] += num_tokens
            self.offsets[layer] += num_tokens

    @property
    def logical_length(self) -> int:
        return max(self.offsets)

    def stats(self) -> dict[str, int]:
        """Per-sequence figures for the UI and benchmarks."""
        cfg = self.arena.config
        return {
            "owner": self.owner,
            "blocks": len(self.blocks),
            "logical_tokens": self.logical_length,
            "physical_tokens": self.num_tokens,
            "bytes": len(self.blocks) * cfg.bytes_per_block,
        }

    def contiguous_first(self) -> int | None:
        """First block if the table is one consecutive run (zero-copy views possible), else None. Cached."""
        blocks = self.blocks
        if not blocks:
            return None
        key = (len(blocks), blocks[0], blocks[-1], self._table_epoch)
        if self._contiguity is None or self._contiguity[0] != key:
            self._contiguity = (key, self.arena.contiguous_start(blocks))
        return self._contiguity[1]

    def sync(self, blocks: Sequence[int], num_physical: int, num_logical: int) -> None:
        """A managed view takes the step's block table and counters from its owner (see `managed`)."""
        blocks = tuple(blocks)
        if blocks != self._synced:  # one C-level comparison per step, not a Python loop over the table
            self.blocks[:] = blocks
            self._synced = blocks
            self._table_epoch += 1
        self.lengths = [num_physical] * len(self.lengths)
        self.offsets = [num_logical] * len(self.offsets)

    # --- growth -----------------------------------------------------------------------------------------------
    def ensure_capacity(self, num_tokens: int) -> None:
        """Make room for `num_tokens` physical tokens. Raises OutOfBlocksError and changes nothing if impossible."""
        need = self.arena.config.blocks_for_tokens(num_tokens) - len(self.blocks)
        if need <= 0:
            return
        if self.managed:
            raise RuntimeError(f"internal: {num_tokens} tokens exceed the {len(self.blocks)} blocks planned for "
                               "this sequence")
        with self.arena.lock:
            try:
                self._grow(need)
            except OutOfBlocksError:
                if not self.private:
                    raise
                self._regrow_private_arena(num_tokens)

    def _grow(self, need: int) -> None:
        alloc = self.arena.allocator
        if not self.contiguous:
            self.blocks.extend(alloc.allocate(need, owner=self.owner))
            return
        if not self.blocks:
            self.blocks.extend(alloc.allocate(need, owner=self.owner, contiguous=True))
            return
        extra = alloc.extend_contiguous(self.blocks, need, owner=self.owner)
        if extra is not None:
            self.blocks.extend(extra)
            return
        # Relocate: the run behind us is taken. Copy what is used, then release the old run.
        new = alloc.allocate(len(self.blocks) + need, owner=self.owner, contiguous=True)
        used = self.arena.config.blocks_for_tokens(self.num_tokens)
        self.arena.copy_blocks(self.blocks[:used], new[:used])
        alloc.free(self.blocks)
        self.blocks[:] = new

    def _regrow_private_arena(self, num_tokens: int) -> None:
        old = self.arena
        cfg = old.config
        blocks = max(cfg.blocks_for_tokens(num_tokens), 2 * cfg.num_blocks)
        arena = KVArena(replace(cfg, num_blocks=blocks), preallocate=True)
        new_blocks = arena.allocator.allocate(cfg.blocks_for_tokens(num_tokens), owner=self.owner, contiguous=True)
        used = self.num_tokens
        moved = new_blocks[:cfg.blocks_for_tokens(used)]
        for layer in range(cfg.num_layers):  # whole blocks move as they are (a quantized arena's are not requantized)
            arena.put_table_blocks(layer, moved, *old.table_blocks(layer, self.blocks, used))
        mx.eval(arena.arrays())
        self.arena = arena
        self.blocks[:] = new_blocks
        self._table_epoch += 1

    # --- copy-on-write ----------------------------------------------------------------------------------------
    def make_writable(self, start: int, end: int) -> None:
        """Give this sequence private copies of shared blocks (ref count > 1) covering tokens [start, end).

        Blocks hold every layer, so one call before a forward pass covers all layers' writes.
        """
        if end <= start:
            return
        bs = self.block_size
        alloc = self.arena.allocator
        first_index, stop_index = start // bs, min(-(-end // bs), len(self.blocks))
        if not alloc.any_shared(self.blocks[first_index:stop_index]):
            return
        if self.managed:
            raise RuntimeError("internal: a shared block was not copied on write by the plan")
        with self.arena.lock:
            for index in range(first_index, stop_index):
                new, copied = alloc.copy_on_write(self.blocks[index], owner=self.owner)
                if copied:
                    self.arena.copy_block(self.blocks[index], new)
                    self.blocks[index] = new
                    self._table_epoch += 1

    def adopt_prefix(self, blocks: Sequence[int], num_tokens: int) -> None:
        """Start from blocks already holding a prompt prefix (the caller has taken a reference on each)."""
        if self.blocks or self.num_tokens:
            raise InvalidArgumentError("adopt_prefix: the sequence already holds tokens")
        self.blocks[:] = blocks
        self.lengths = [num_tokens] * len(self.lengths)
        self.offsets = [num_tokens] * len(self.offsets)

    # --- editing primitives -----------------------------------------------------------------------------------
    def keep(self, indices: np.ndarray | Sequence[int]) -> int:
        """Keep only the physical tokens at `indices` (eviction), compacted to the front in ascending order.

        indices: [n] for every layer and head, [L, n] per layer, or [L, H, n] per layer and KV head. Every row
        must have the same n. Logical offsets do not change. Returns the number of blocks freed.
        """
        cfg = self.arena.config
        index = np.asarray(indices, dtype=np.int64)
        if index.ndim == 1:
            index = np.broadcast_to(index, (cfg.num_layers, index.shape[0]))
        if index.ndim not in (2, 3) or index.shape[0] != cfg.num_layers or (
            index.ndim == 3 and index.shape[1] != cfg.num_kv_heads
        ):
            raise InvalidArgumentError(
                f"keep: indices shape {index.shape} must be [n], [layers={cfg.num_layers}, n] or "
                f"[layers, kv_heads={cfg.num_kv_heads}, n]"
            )
        index = np.sort(index, axis=-1)
        kept = index.shape[-1]
        for layer in range(cfg.num_layers):
            row = index[layer]
            if row.size and (row.min() < 0 or row.max() >= self.lengths[layer]):
                raise InvalidArgumentError(f"keep: layer {layer} index out of range [0, {self.lengths[layer]})")
            if (np.diff(row, axis=-1) == 0).any():
                raise InvalidArgumentError(f"keep: layer {layer} has duplicate indices")
        with self.arena.lock:
            self.make_writable(0, kept)
            for layer in range(cfg.num_layers):
                # The eviction-gather kernel (Metal) or its pure-MLX reference: gathers the kept rows through the
                # block table ([n] or per-head [H, n]), materialises them, writes them to positions 0..n-1.
                compact_layer(self.arena, layer, self.blocks, index[layer])
                self.arena.num_evicted_tokens += self.lengths[layer] - kept
                self.lengths[layer] = kept
            mx.eval(self.arena.arrays())
            return self._free_unused_blocks()

    def replace(self, start: int, end: int, new_keys: Sequence[mx.array], new_values: Sequence[mx.array],
                evicts: bool = False) -> int:
        """Replace physical tokens [start, end) of every layer by M new tokens (compression, M <= end - start).

        new_keys/new_values: per layer `[H, M, D]` (a list, or one array `[L, H, M, D]`). `evicts`: the new tokens
        are some of the old ones rearranged (cells moved between heads, `engine.pooled_heads`), so the tokens gone
        count as evicted, as `keep` counts them, not as compressed. Returns blocks freed.
        """
        cfg = self.arena.config
        if len(new_keys) != cfg.num_layers or len(new_values) != cfg.num_layers:
            raise InvalidArgumentError(f"replace: need keys/values for all {cfg.num_layers} layers")
        m = int(new_keys[0].shape[1])
        for layer in range(cfg.num_layers):
            if not 0 <= start <= end <= self.lengths[layer]:
                raise InvalidArgumentError(f"replace: range [{start}, {end}) outside layer {layer}'s 0..{self.lengths[layer]}")
            expected_k = (cfg.num_kv_heads, m, cfg.head_dim)
            expected_v = (cfg.num_kv_heads, m, cfg.value_head_dim)
            if tuple(new_keys[layer].shape) != expected_k or tuple(new_values[layer].shape) != expected_v:
                raise InvalidArgumentError(f"replace: layer {layer} new keys/values must be {expected_k}/{expected_v}")
        if m > end - start:
            raise InvalidArgumentError(f"replace: {m} new tokens exceed the {end - start} replaced (it only shrinks)")
        with self.arena.lock:
            for layer in range(cfg.num_layers):
                length = self.lengths[layer]
                new_length = length - (end - start) + m
                self.make_writable(start, new_length)
                tail_k, tail_v = self.arena.read(layer, self.blocks, length)
                tail_k, tail_v = tail_k[:, end:, :], tail_v[:, end:, :]
                k = mx.concatenate([new_keys[layer].astype(self.arena.dtype), tail_k], axis=1)
                v = mx.concatenate([new_values[layer].astype(self.arena.dtype), tail_v], axis=1)
                mx.eval(k, v)
                self.arena.write(layer, self.blocks, start, k, v)
                self.lengths[layer] = new_length
                if evicts:
                    self.arena.num_evicted_tokens += end - start - m
            if not evicts:
                self.arena.num_compressed_tokens += end - start - m
            mx.eval(self.arena.arrays())
            return self._free_unused_blocks()

    def write_values(self, layer: int, start: int, values: mx.array) -> None:
        """Overwrite one layer's values `[H, n, D]` at physical tokens [start, start+n), keys untouched (values
        that absorbed others: `engine.evict_merge`). The caller evaluates the arena."""
        n = int(values.shape[1])
        if start < 0 or start + n > self.lengths[layer]:
            raise InvalidArgumentError(f"write_values: tokens [{start}, {start + n}) outside layer {layer}'s "
                                       f"{self.lengths[layer]}")
        slots = mx.array(self.arena.slot_indices(self.blocks, start, start + n).astype(np.int32))
        with self.arena.lock:
            self.make_writable(start, start + n)
            write_side(self.arena.values[layer], slots, values)

    def write_kv(self, layer: int, start: int, keys: mx.array, values: mx.array) -> None:
        """Overwrite one layer's keys and values `[H, n, D]` at physical tokens [start, start+n) (kept slots a
        learned fold rewrote: `engine.evict_merge.folded_kv`). The caller evaluates the arena."""
        n = int(keys.shape[1])
        if start < 0 or start + n > self.lengths[layer] or values.shape[1] != n:
            raise InvalidArgumentError(f"write_kv: tokens [{start}, {start + n}) outside layer {layer}'s "
                                       f"{self.lengths[layer]} (or keys/values of different lengths)")
        with self.arena.lock:
            self.make_writable(start, start + n)
            self.arena.write(layer, self.blocks, start, keys.astype(self.arena.dtype),
                             values.astype(self.arena.dtype))

    def _free_unused_blocks(self) -> int:
        if self.managed:
            return 0  # the block manager frees them when the runner reports the new length
        used = self.arena.config.blocks_for_tokens(self.num_tokens)
        surplus = self.blocks[used:]
        if not surplus:
            return 0
        del self.blocks[used:]
        return self.arena.allocator.free(surplus)

    def release(self) -> int:
        """Return every block to the allocator (shared blocks just lose a reference)."""
        with self.arena.lock:
            freed = self.arena.allocator.free(self.blocks) if self.blocks else 0
            self.blocks.clear()
            self.lengths = [0] * len(self.lengths)
            self.offsets = [0] * len(self.offsets)
            return freed


def private_sequence(
    num_layers: int, kv_heads: int, head_dim: int, v_head_dim: int, num_tokens: int, dtype: str,
    block_size: int = 16, kv_dtype: KVDtype | None = None, key_centers: KeyCenters | None = None,
) -> SequenceKV:
    """A sequence in an arena of its own, sized for `num_tokens` and regrown (doubling) when exceeded.
    `kv_dtype`: quantized storage (None: `dtype` floats); `key_centers`: see ArenaConfig."""
    dtype = dtype.split(".")[-1]
    blocks = max(1, -(-max(num_tokens, 1) // block_size))
    config = ArenaConfig(num_layers, kv_heads, head_dim, blocks, block_size, dtype,
                         None if v_head_dim == head_dim else v_head_dim, kv_dtype, key_centers)
    # Preallocated: the sequence takes the whole arena at once (below), so growing it would only add a copy.
    seq = SequenceKV(KVArena(config, preallocate=True), owner=0, contiguous=True, private=True)
    seq.ensure_capacity(num_tokens)
    return seq
