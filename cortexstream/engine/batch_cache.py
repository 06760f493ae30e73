"""mlx-lm cache protocol for one decode step of several sequences of different lengths in one forward pass.

Each sequence's new token is written into its own arena slot (one write per buffer for the whole batch: a stepped
slice when the slots are evenly spaced, else a scatter). What `update_and_fetch` returns is the sequences'
blocks gathered into a padded `[B, H, max_blocks * block_size, D]` tensor with a boolean mask hiding the padding;
RoPE gets per-sequence offsets through `offset` being an array. A batch whose tables are contiguous and evenly
spaced (the `strided` strategy) gets strided views of the layer buffers instead, as wide as its longest
sequence, with the mask cut to match (none when all are equally long).

That gather is lazy and, on the default path, never computed: each layer cache carries an `attention_hook` (see
`batch_attention`) that attends straight from the arena: on CPU over the strided view, else block by block with
`gather_mm`; through the paged-attention kernel on Metal (the engine's compute backend chooses). The gather
(or view) is what attention falls back to when the runner replaces the hook with its own (KV policies that need
scores or logit biases), when the model passes learned sinks, or when the model's SDPA is not routed through
hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable

import mlx.core as mx
import numpy as np

from cortexstream.engine.batch_attention import (
    BLOCKS, GATHER, PAGED, PER_SEQUENCE, QUANTIZED, STRIDED, block_matmul_attention, evenly_spaced, hook_applies,
    paged_kernel_attention, per_sequence_attention, quantized_attention, strided_attention, strided_layout,
    strided_view,
)
from cortexstream.kv.arena import KVArena
from cortexstream.kv.sequence_kv import SequenceKV
from cortexstream.backend.attention import attention_for_device
from cortexstream.backend.sdpa import original_sdpa, route_loaded_modules

if TYPE_CHECKING:
    from cortexstream.backend.compute import ComputeBackend


@dataclass(frozen=True)
class PagedRows:
    """Batch rows with paged tables: positions in the batch, as an index array, their table and lengths."""

    rows: list[int]
    index: mx.array
    table: mx.array
    lengths: mx.array


class DecodeBatch:
    """Per-step addressing shared by all layers: write slots, padded block table, lengths and offsets.

    attention: None / `auto` (the backend's rule decides), or one of `batch_attention.STRATEGIES`.
    backend: the engine's compute backend: its `decode_attention()` rule picks the strategy, and it routed the
    model's SDPA when it was built. None (tests, benchmarks): the current device's rule
    (`backend.attention.attention_for_device`), and the SDPA of loaded mlx-lm modules is routed here.
    """

    def __init__(self, arena: KVArena, sequences: list[SequenceKV], attention: str | None = None,
                 backend: "ComputeBackend | None" = None) -> None:
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
        # Where update_and_fetch writes: a stepped slice when the new tokens' slots are evenly spaced (one slice
        # update, in place, cheaper to build than a scatter), else the slot array.
        self.write_at: slice | mx.array = evenly_spaced(slots.tolist()) or self.slots
        self.offsets = mx.array(np.array([s.offsets[0] for s in sequences], dtype=np.int32))
        positions = np.arange(max_blocks * bs)
        self.mask = mx.array(positions[None, :] < self.lengths_after[:, None])[:, None, None, :]
        # Contiguous start of each table (None: paged), for the per-sequence views; cached by SequenceKV.
        self.firsts = [s.contiguous_first() for s in sequences]
        # (first slot, spacing) when the batch is one strided view of each layer buffer as wide as the longest
        # sequence, else None
        longest = int(self.lengths_after.max())
        self.strided = strided_layout(self.firsts, longest, bs, arena.config.num_slots)
        rule = attention_for_device() if backend is None else backend.decode_attention()
        self.strategy = rule.choose(attention, arena.dtype, self.strided is not None, longest, arena.quantized)
        # A quantized arena's rows are read by dequantizing first where the platform's quantized matmul is slow.
        self.dequantize = arena.quantized and rule.dequantize_quantized(arena.dtype)
        # A quantized batch attends one KV head at a time past the backend's crossover (contiguous operands, no
        # copies); below it, evenly spaced runs attend in one call over strided views of the codes.
        self.quantized_per_head = self.strategy == QUANTIZED and rule.quantized_per_head(longest)
        self.quantized_strided = (self.strategy == QUANTIZED and not self.quantized_per_head
                                  and self.strided is not None and len(sequences) > 1)
        if self.strategy == STRIDED or self.quantized_strided:  # the last window may reach past the blocks in use
            first, pitch = self.strided
            arena.ensure_blocks(-(-(first + pitch * (len(sequences) - 1) + longest) // bs))
        # The mask make_mask hands the model. A strided batch's K/V are views only as wide as the longest sequence,
        # so its mask is cut to that width, and there is none at all when every sequence is that long.
        self.step_mask: mx.array | None = self.mask
        if self.strategy == STRIDED:
            self.step_mask = None if bool((self.lengths_after == longest).all()) else self.mask[..., :longest]
        self._table_np = table
        self._lengths_array: mx.array | None = None
        self._block_indices: dict[int, tuple[mx.array, mx.array, mx.array]] = {}
        if self.strategy != GATHER and backend is None:
            route_loaded_modules()  # no engine routed a model: route every loaded mlx-lm module (scans modules)
        # Built here, once for all layers (not inside the first layer's attention).
        if self.strategy == BLOCKS:  # per buffer size: layers differ while the arena grows a layer at a time
            for num_blocks in {k.shape[2] // bs for k in arena.keys}:
                self.block_indices(num_blocks)
        elif self.strategy == PER_SEQUENCE:
            _ = self.paged

    def lengths_array(self) -> mx.array:
        """Physical keys per sequence after this step, int32 [B] (for the paged kernel)."""
        if self._lengths_array is None:
            self._lengths_array = mx.array(self.lengths_after.astype(np.int32))
        return self._lengths_array

    @cached_property
    def paged(self) -> PagedRows | None:
        """The sequences whose block tables are not contiguous, with their own trimmed table; None if none.
        Built once per step for all layers."""
        rows = [b for b, first in enumerate(self.firsts) if first is None]
        if not rows:
            return None
        lengths = self.lengths_after[rows]
        used = int(max(-(-lengths // self.arena.config.block_size)))
        return PagedRows(rows, mx.array(np.asarray(rows, dtype=np.int32)), mx.array(self._table_np[rows, :used]),
                         mx.array(lengths.astype(np.int32)))

    def block_indices(self, num_blocks: int) -> tuple[mx.array, mx.array, mx.array]:
        """`gather_mm` indices of the `blocks` strategy over a layer buffer of `num_blocks` blocks, [B, H, MB]
        uint32 each: the query matrix (b * H + h), the K/V block matrix (h * num_blocks + table[b, j]) and the
        probability matrix ((b * H + h) * MB + j). Built once per step and buffer size."""
        cached = self._block_indices.get(num_blocks)
        if cached is not None:
            return cached
        cfg = self.arena.config
        batch, max_blocks = self._table_np.shape
        heads = np.arange(cfg.num_kv_heads, dtype=np.uint32)
        query = np.arange(batch * cfg.num_kv_heads, dtype=np.uint32).reshape(batch, -1, 1)
        block = heads[None, :, None] * num_blocks + self._table_np.astype(np.uint32)[:, None, :]
        probs = query * max_blocks + np.arange(max_blocks, dtype=np.uint32)
        query = np.broadcast_to(query, block.shape)
        indices = self._block_indices[num_blocks] = (mx.array(query), mx.array(block), mx.array(probs))
        return indices

    def caches(self) -> list["BatchLayerCache"]:
        return [BatchLayerCache(self, layer) for layer in range(self.arena.config.num_layers)]

    def commit(self) -> None:
        """Advance every sequence's counters once the forward pass has been built."""
        for seq in self.sequences:
            seq.advance(1)


class BatchLayerCache:
    # The batch's own arena attention (see __init__); the runner replaces it with its hook when a sequence's KV
    # policy needs attention scores or logit biases (engine.policy_batch_hook.batch_attention_hook), which then receives
    # the padded gather from update_and_fetch, exactly as before the arena strategies existed.
    attention_hook: Callable[..., mx.array] | None = None

    def __init__(self, batch: DecodeBatch, layer: int) -> None:
        self.batch = batch
        self.layer = layer
        if batch.strategy != GATHER:
            self.attention_hook = self.attend

    @property
    def offset(self) -> mx.array:
        return self.batch.offsets

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if n != 1:
            raise ValueError("DecodeBatch caches take exactly one new token per sequence")
        return self.batch.step_mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        arena, batch = self.batch.arena, self.batch
        size, heads, _, _ = keys.shape
        # [B, H, 1, D] -> [H, B, D] (broadcast into the [1, H, B, D] target), one write per buffer
        arena.write_slots(self.layer, batch.write_at, keys.reshape(size, heads, -1).swapaxes(0, 1),
                          values.reshape(size, heads, -1).swapaxes(0, 1))
        if batch.strategy == STRIDED:  # the batch is a view: no gather to build
            width = int(batch.lengths_after.max())
            keys_buf, values_buf = arena.keys[self.layer], arena.values[self.layer]
            return (strided_view(keys_buf, size, batch.strided, width),
                    strided_view(values_buf, size, batch.strided, width))
        # Lazy: only evaluated if attention does not go through `attend` (see the module docstring).
        return arena.gather_tables(self.layer, batch.table)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
               sinks: mx.array | None = None) -> mx.array:
        """The batch's attention (its strategy), as a `dispatch_sdpa` hook: attends from the arena and ignores the
        gathered `keys`/`values` from `update_and_fetch`, except when `hook_applies` says the call is not a plain
        decode step (then SDPA over them). A runner hook that only records scores can return this for its output,
        so that its tokens are exactly those of a batch without the hook."""
        batch = self.batch
        if not hook_applies(batch, queries, mask, sinks):
            return original_sdpa(queries, keys, values, None, scale=scale, mask=mask, sinks=sinks)
        if batch.strategy == PAGED:
            return paged_kernel_attention(batch, self.layer, queries, scale)
        if batch.strategy == BLOCKS:
            return block_matmul_attention(batch, self.layer, queries, scale)
        if batch.strategy == STRIDED:
            return strided_attention(queries, keys, values, scale, mask)
        if batch.strategy == QUANTIZED:
            return quantized_attention(batch, self.layer, queries, scale)
        return per_sequence_attention(batch, self.layer, queries, scale)
