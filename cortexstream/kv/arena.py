"""The KV arena: K and V storage for every layer and sequence, handed out in blocks by a `BlockAllocator`.

Layout: one buffer per layer for K and one for V, each `[1, kv_heads, num_slots, head_dim]` (head-major), where
slot `b * block_size + i` is token `i` of block `b`. Why this layout (see bench/results/arena_attention.md):
- a contiguous run of blocks is a plain strided slice `buf[..., start:end, :]`, which
  `scaled_dot_product_attention` consumes directly: the zero-copy view. The leading axis of 1 is the batch axis
  of mlx-lm's `[B, H, L, D]`: with it, a decode step's write and view are one op each, as in mlx-lm's KVCache
  (a `[H, S, D]` buffer needs a reshape of the new token and an expand of the view, a few % of a batch-1 step at
  short contexts);
- `buf.reshape(H, num_blocks, block_size, D)` is free, so paged sequences gather whole blocks, not single slots;
- one buffer per layer (not one for all layers) because MLX updates a buffer in place only when nothing else
  holds it: with a single all-layer buffer, layer l's write would find layer l-1's view still alive in the same
  forward pass and copy the whole arena.

Growth on demand (docs/design.md has the why). The budget is `config.num_blocks`: the allocator hands out ids from
all of it, but the buffers back only the blocks below its high water, starting at `MIN_PHYSICAL_SLOTS`. Every
allocation reports its high water before its ids reach anyone, and `ensure_blocks` pads the layers that fall short
(lazily, to twice the size, at most the budget; growth appends, so ids and slots stay valid, and a pad is ordered
after writes already in the graph). `grow_ahead`, once per forward pass, pads one layer at a time once the high
water passes `GROW_AHEAD_AT`, so layers may differ in size for a while: code that views a buffer takes its block
count from the buffer's own shape, never from the config. `preallocate=True` builds the whole budget up front.

Quantized storage (`config.kv_dtype`): a quantized side of a layer is a `QuantizedRows` (codes, scales, biases on
the same slot axis) instead of the float buffer, so `keys[layer]` / `values[layer]` are then not arrays: code that
touches the buffers directly (the batched decode strategies, the kernels) runs only on float sides, and everything
else goes through the methods here, which quantize on write, dequantize on read (`arena_sides.py`), and move
stored rows unchanged (`copy_blocks`, `move_rows`: arena_moves.py). `run_rows` / `table_rows` hand attention the
stored rows of a run or a block table, so that it can read codes directly (`mx.quantized_matmul`) instead of
dequantizing.
4-bit keys are grouped per channel over each block (`ChannelQuantizedRows`, channel_quantized.py): they read as
floats, whole blocks move exactly (`copy_blocks`, `table_blocks`), and the allocator's `on_allocate` tells the
arena which blocks start afresh.
"""

from __future__ import annotations

import threading
from typing import Sequence

import mlx.core as mx
import numpy as np

from cortexstream.kv.allocator import BlockAllocator
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.arena_moves import StoredMoves
from cortexstream.kv.arena_sides import (
    Side, as_dtype, full_float, new_side, pad_side, read_cells, read_side, read_side_per_head, side_arrays,
    side_nbytes, strided_side, take_side, write_side,
)
from cortexstream.kv.quantized_blocks import CodeView
from cortexstream.kv.kv_dtype import StorageType

_UNKNOWN = object()  # sentinel: contiguity of a block table not known by the caller
_MX_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
MIN_PHYSICAL_SLOTS = 1024  # token slots an arena starts with (unless its budget is smaller or preallocated)
GROW_AHEAD_AT = 0.75  # high water / physical blocks above which `grow_ahead` starts the next doubling


class KVArena(StoredMoves):
    """Block-granular KV storage shared by all sequences of one model."""

    def __init__(self, config: ArenaConfig, *, preallocate: bool = False, initial_blocks: int | None = None) -> None:
        """`initial_blocks`: blocks the buffers start with (default `MIN_PHYSICAL_SLOTS` worth; at most the
        budget); `preallocate`: the whole budget at once, never grown."""
        if initial_blocks is not None and (not isinstance(initial_blocks, int) or initial_blocks <= 0):
            raise ValueError(f"initial_blocks: {initial_blocks!r} must be a positive integer")
        self.config = config
        # Serialises buffer mutation from several sequences (e.g. an engine thread and a stats reader).
        self.lock = threading.RLock()
        if preallocate:
            initial = config.num_blocks
        else:
            initial = initial_blocks or max(1, MIN_PHYSICAL_SLOTS // config.block_size)
        initial = min(initial, config.num_blocks)
        dtype = _MX_DTYPES[config.dtype]
        heads, slots = config.num_kv_heads, initial * config.block_size
        storage = config.storage
        self.key_type, self.value_type = storage.key, storage.value
        group = storage.group_size
        centers = config.key_centers or [None] * config.num_layers  # kv_center.py
        channel_block = config.block_size if storage.key_channels else None  # channel_quantized.py
        self.keys: list[Side] = [new_side(storage.key, heads, slots, config.head_dim, dtype, group,
                                          storage.key_rotated, None if c is None else mx.array(c, dtype=dtype),
                                          channel_block)
                                 for c in centers]
        self.values: list[Side] = [new_side(storage.value, heads, slots, config.value_head_dim, dtype, group,
                                            storage.value_rotated) for _ in range(config.num_layers)]
        mx.eval(self.arrays())
        self._layer_blocks = [initial] * config.num_layers  # blocks each layer's buffers hold
        self._physical = initial  # min(_layer_blocks): every block id below it is backed in every layer
        self._target = initial  # the size layers are being grown to
        self.num_growths = 0  # layer buffers padded so far (K and V of one layer count once)
        self.allocator = BlockAllocator(config.num_blocks, on_high_water=self.ensure_blocks)
        if channel_block is not None:
            self.allocator.on_allocate = self._mark_fresh
        self.num_evicted_tokens = 0
        self.num_compressed_tokens = 0

    def _mark_fresh(self, blocks: list[int]) -> None:
        """Blocks just handed out: keys grouped per channel forget their earlier range (channel_quantized.py)."""
        ids = np.asarray(blocks, dtype=np.int64)
        for side in self.keys:
            side.mark_fresh(ids)

    @property
    def dtype(self) -> mx.Dtype:
        """The float type rows are written and read in (a quantized side's scales are in it too)."""
        return _MX_DTYPES[self.config.dtype]

    @property
    def quantized(self) -> bool:
        """Whether K or V is stored quantized (then `keys`/`values` hold `QuantizedRows` for that side)."""
        return self.config.quantized

    @property
    def storage_types(self) -> tuple[StorageType, StorageType]:
        return self.key_type, self.value_type

    def arrays(self) -> list[mx.array]:
        """Every array of the K and V storage (for `mx.eval`)."""
        out: list[mx.array] = []
        for side in (*self.keys, *self.values):
            out.extend(side_arrays(side))
        return out

    # --- physical size ---------------------------------------------------------------------------------------
    @property
    def num_physical_blocks(self) -> int:
        """Blocks backed by every layer's buffers (block ids below it may be written and read)."""
        return self._physical

    @property
    def physical_bytes(self) -> int:
        """Bytes of the K and V buffers as they are now (the budget is `config.total_bytes`)."""
        return sum(side_nbytes(k) + side_nbytes(v) for k, v in zip(self.keys, self.values))

    def ensure_blocks(self, num_blocks: int) -> None:
        """Back block ids [0, num_blocks) in every layer, padding the layers that fall short to twice the present
        size (at least `num_blocks`, at most the budget). The allocator calls this with its high water after every
        allocation, so no id it hands out lies beyond the buffers. Lazy: costs nothing until the next evaluation."""
        if num_blocks <= self._physical:
            return
        if num_blocks > self.config.num_blocks:
            raise ValueError(f"ensure_blocks: {num_blocks} blocks exceed the arena's {self.config.num_blocks}")
        with self.lock:
            self._target = max(self._target, min(self.config.num_blocks, max(num_blocks, 2 * self._physical)))
            for layer, blocks in enumerate(self._layer_blocks):
                if blocks < num_blocks:
                    self._grow_layer(layer)

    def grow_ahead(self, max_layers: int = 1) -> int:
        """Pad up to `max_layers` more layers towards the next size once the high water has passed `GROW_AHEAD_AT`
        of the buffers (the engine calls this once per forward pass); returns how many layers it padded."""
        if self._target == self._physical and (
            self._physical >= self.config.num_blocks
            or self.allocator.high_water <= GROW_AHEAD_AT * self._physical
        ):
            return 0
        with self.lock:
            if self._target == self._physical:
                self._target = min(self.config.num_blocks, 2 * self._physical)
            short = [layer for layer, blocks in enumerate(self._layer_blocks) if blocks < self._target]
            for layer in short[:max_layers]:
                self._grow_layer(layer)
            return min(len(short), max_layers)

    def _grow_layer(self, layer: int) -> None:
        """Pad one layer's K and V buffers to `_target` blocks (lazily, zeros at the end). Caller holds the lock."""
        extra = (self._target - self._layer_blocks[layer]) * self.config.block_size
        self.keys[layer] = pad_side(self.keys[layer], extra)
        self.values[layer] = pad_side(self.values[layer], extra)
        self._layer_blocks[layer] = self._target
        self._physical = min(self._layer_blocks)
        self.num_growths += 1

    def layer_buffers(self, layer: int) -> tuple[mx.array, mx.array]:
        """This layer's K and V storage as `[H, S, D]` (free reshapes; S: its physical slots, at least
        `num_physical_blocks * block_size`) for kernels and gathers to read.
        Writes go through the arena's methods, which update the `[1, H, S, D]` buffers in place.
        A quantized side is dequantized in full here (every slot): hot paths read `run_rows`/`table_rows`."""
        keys, values = full_float(self.keys[layer], self.dtype), full_float(self.values[layer], self.dtype)
        return keys.reshape(keys.shape[1:]), values.reshape(values.shape[1:])

    def sequence_buffers(self, layer: int, blocks: Sequence[int], length: int
                         ) -> tuple[mx.array, mx.array, list[int]]:
        """(K `[H, S, D]`, V, block table) for kernels that gather a sequence's first `length` tokens through a
        block table: the layer's buffers and `blocks` for float sides; for a quantized arena only that sequence's
        rows, dequantized, with the identity table (not the whole layer dequantized)."""
        if not self.quantized:
            keys, values = self.layer_buffers(layer)
            return keys, values, list(blocks)
        keys, values = self.read(layer, blocks, length)
        used = -(-length // self.config.block_size)
        pad = used * self.config.block_size - length
        if pad:
            keys, values = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (keys, values))
        return keys, values, list(range(used))

    # --- addressing -------------------------------------------------------------------------------------------
    def slot_indices(self, blocks: Sequence[int], start: int, end: int) -> np.ndarray:
        """Arena slots of a sequence's tokens [start, end) given its block table."""
        bs = self.config.block_size
        positions = np.arange(start, end)
        table = np.asarray(blocks, dtype=np.int64)
        return table[positions // bs] * bs + positions % bs

    @staticmethod
    def contiguous_start(blocks: Sequence[int]) -> int | None:
        """First block of the table if its blocks are consecutive (a zero-copy view is possible), else None."""
        if not blocks:
            return None
        first = blocks[0]
        if blocks[-1] - first + 1 != len(blocks):  # O(1) rejection for most paged tables
            return None
        if all(b == first + i for i, b in enumerate(blocks)):
            return first
        return None

    # --- reads ------------------------------------------------------------------------------------------------
    def read(
        self, layer: int, blocks: Sequence[int], length: int, first: int | None | object = _UNKNOWN
    ) -> tuple[mx.array, mx.array]:
        """K, V of a sequence's first `length` tokens as `[H, length, D]`: a view if contiguous, else a gather.

        `first`: the table's contiguous start if the caller already knows it (see `SequenceKV.contiguous_first`).
        """
        bs = self.config.block_size
        if first is _UNKNOWN:
            first = self.contiguous_start(blocks)
        if first is not None:
            lo = first * bs
            where = slice(lo, lo + length)
            return (read_side(self.keys[layer], where, self.dtype)[0],
                    read_side(self.values[layer], where, self.dtype)[0])
        if self.quantized:
            slots = self.slots_array(blocks, length)
            return (read_side(self.keys[layer], slots, self.dtype)[0],
                    read_side(self.values[layer], slots, self.dtype)[0])
        used = -(-length // bs)
        table = mx.array(np.asarray(blocks[:used], dtype=np.int32))
        return self._gather_blocks(self.keys[layer], table, length), self._gather_blocks(self.values[layer], table, length)

    def slots_array(self, blocks: Sequence[int], length: int) -> mx.array:
        """int32 arena slots of a sequence's first `length` tokens."""
        return mx.array(self.slot_indices(blocks, 0, length).astype(np.int32))

    def _gather_blocks(self, buffer: mx.array, table: mx.array, length: int) -> mx.array:
        _, heads, _, dim = buffer.shape
        bs = self.config.block_size
        blocked = buffer.reshape(heads, -1, bs, dim)  # the buffer's own block count (see the module docstring)
        return blocked[:, table, :, :].reshape(heads, -1, dim)[:, :length, :]

    def gather_tables(self, layer: int, table: mx.array) -> tuple[mx.array, mx.array]:
        """K and V of a batch's padded block tables `[B, MB]` as floats `[B, H, MB * bs, D]` (padding entries
        read whatever block they name; the batch's mask hides them)."""
        bs = self.config.block_size
        batch, max_blocks = table.shape
        if self.quantized:
            slots = (table[:, :, None] * bs + mx.arange(bs, dtype=mx.int32)).reshape(-1)
            out = []
            for side in (self.keys[layer], self.values[layer]):
                rows = read_side(side, slots, self.dtype)[0]  # [H, B * MB * bs, D]
                heads, _, dim = rows.shape
                out.append(rows.reshape(heads, batch, max_blocks * bs, dim).transpose(1, 0, 2, 3))
            return out[0], out[1]
        out = []
        for buffer in (self.keys[layer], self.values[layer]):
            _, heads, _, dim = buffer.shape
            blocked = buffer.reshape(heads, -1, bs, dim)  # the buffer's own size (the arena grows)
            gathered = blocked[:, table]  # [H, B, max_blocks, bs, D]
            out.append(gathered.transpose(1, 0, 2, 3, 4).reshape(batch, heads, max_blocks * bs, dim))
        return out[0], out[1]

    def strided_rows(self, layer: int, batch_size: int, layout: tuple[int, int], width: int
                     ) -> tuple[mx.array | CodeView, mx.array | CodeView]:
        """K and V of `batch_size` runs evenly spaced (`layout`: first slot, pitch) as `[B, H, width, ...]` views
        of the stored rows (floats, or codes with scales and biases), for one batched attention call."""
        return (strided_side(self.keys[layer], batch_size, layout, width),
                strided_side(self.values[layer], batch_size, layout, width))

    def run_rows(self, layer: int, first: int, length: int) -> tuple[Side, Side]:
        """The stored K and V rows of the first `length` tokens of the run that begins at block `first`: slices
        of the float buffers (views) or of the quantized rows, for attention that reads codes directly."""
        lo = first * self.config.block_size
        where = slice(lo, lo + length)
        return take_side(self.keys[layer], where), take_side(self.values[layer], where)

    def table_rows(self, layer: int, blocks: Sequence[int], length: int) -> tuple[Side, Side]:
        """The stored K and V rows of a sequence's first `length` tokens through its block table (a gather)."""
        first = self.contiguous_start(blocks)
        if first is not None:
            return self.run_rows(layer, first, length)
        slots = self.slots_array(blocks, length)
        return take_side(self.keys[layer], slots), take_side(self.values[layer], slots)

    def gather_slots(self, layer: int, slots: np.ndarray | mx.array) -> tuple[mx.array, mx.array]:
        """K, V at arbitrary slots; `slots` is [n] or [H, n] (per-head selection)."""
        slots = mx.array(np.asarray(slots, dtype=np.int32)) if isinstance(slots, np.ndarray) else slots
        keys, values = self.keys[layer], self.values[layer]
        if slots.ndim == 1:
            return read_side(keys, slots, self.dtype)[0], read_side(values, slots, self.dtype)[0]
        return read_side_per_head(keys, slots, self.dtype), read_side_per_head(values, slots, self.dtype)

    def gather_cells(self, layer: int, columns: mx.array, slots: mx.array) -> tuple[mx.array, mx.array]:
        """K `[n, D]` and V `[n, Dv]` of single cells: column (KV head) `columns[i]` at arena slot `slots[i]`."""
        return (read_cells(self.keys[layer], columns, slots, self.dtype),
                read_cells(self.values[layer], columns, slots, self.dtype))

    # --- writes -----------------------------------------------------------------------------------------------
    def write(
        self, layer: int, blocks: Sequence[int], start: int, keys: mx.array, values: mx.array,
        first: int | None | object = _UNKNOWN,
    ) -> None:
        """Write `[H, n, D]` keys/values at a sequence's token positions [start, start+n), in place."""
        n = keys.shape[1]
        if n == 0:
            return
        bs = self.config.block_size
        if first is _UNKNOWN:
            first = self.contiguous_start(blocks)
        k, v = as_dtype(keys, self.dtype), as_dtype(values, self.dtype)
        if first is not None or (start // bs == (start + n - 1) // bs):
            lo = (first * bs + start) if first is not None else blocks[start // bs] * bs + start % bs
            self.write_slots(layer, slice(lo, lo + n), k, v)
            return
        slots = mx.array(self.slot_indices(blocks, start, start + n).astype(np.int32))
        self.write_slots(layer, slots, k, v)

    def write_slots(self, layer: int, where: slice | mx.array, keys: mx.array, values: mx.array) -> None:
        """Write K/V rows `[H, n, D]` (or `[1, H, n, D]`) at arena slots `where` (a slice or n distinct slots),
        in place: one update per side (quantized on the way in for a quantized side)."""
        write_side(self.keys[layer], where, keys)
        write_side(self.values[layer], where, values)

    def append_to_run(
        self, layer: int, first: int, start: int, keys: mx.array, values: mx.array
    ) -> tuple[mx.array, mx.array]:
        """Write one sequence's `[1, H, n, D]` keys/values at tokens [start, start+n) of the contiguous run that
        begins at block `first`, and return its tokens [0, start+n) as `[1, H, start+n, D]` views (no copy)."""
        lo = first * self.config.block_size + start
        if self.quantized:
            self.write_slots(layer, slice(lo, lo + keys.shape[2]), keys, values)
            return self.run_view(layer, first, start + keys.shape[2])
        self.keys[layer][..., lo : lo + keys.shape[2], :] = as_dtype(keys, self.dtype)
        self.values[layer][..., lo : lo + keys.shape[2], :] = as_dtype(values, self.dtype)
        return self.run_view(layer, first, start + keys.shape[2])

    def run_view(self, layer: int, first: int, length: int) -> tuple[mx.array, mx.array]:
        """The first `length` tokens of the contiguous run that begins at block `first`, as `[1, H, length, D]`
        views of this layer's buffers: what SDPA reads, no copy."""
        lo = first * self.config.block_size
        where = slice(lo, lo + length)
        return read_side(self.keys[layer], where, self.dtype), read_side(self.values[layer], where, self.dtype)

    # --- stats ------------------------------------------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        return self.allocator.num_used_blocks * self.config.bytes_per_block

    @property
    def bytes_free(self) -> int:
        return self.allocator.num_free_blocks * self.config.bytes_per_block

    def format_block_map(self, width: int = 64) -> str:
        """Text dump of the block map (one character per block), with a summary line."""
        return self.allocator.format_block_map(width)

    def stats(self) -> dict[str, float | int]:
        alloc = self.allocator
        return {
            "num_blocks": alloc.num_total_blocks,
            "num_free_blocks": alloc.num_free_blocks,
            "num_used_blocks": alloc.num_used_blocks,
            "block_size": self.config.block_size,
            "bytes_used": self.bytes_used,
            "bytes_free": self.bytes_free,
            "num_physical_blocks": self.num_physical_blocks,
            "physical_bytes": self.physical_bytes,
            "fragmentation": alloc.fragmentation(),
            "kv_dtype": self.config.storage.text,
            "bytes_per_token": self.config.bytes_per_token,
            "evicted_tokens": self.num_evicted_tokens,
            "compressed_tokens": self.num_compressed_tokens,
        }
