"""Keys quantized per channel over a block: the arena's layout for 4-bit keys (KIVI's, in paged blocks).

A few channels of a head's keys are far larger than the rest and nearly constant over tokens (RoPE's slow pairs,
a key bias), so one scale per group of channels of one token spends its 16 levels on them. One scale and bias per
channel per block of `block_size` tokens follows each channel's own range instead:
bench/results/kv_key_schemes.md, Qwen2.5-Coder-0.5B at 2048 tokens, 4-bit keys: +0.2% perplexity against +15.1%
for the per-token layout with its key bias taken out.

Storage, per layer (the slot axis is the arena's, so block tables, the allocator and growth are unchanged):
- `packed`  uint32 `[1, H, S, D * bits / 32]`: codes, packed low bits first;
- `scales`, `biases` `[1, H, S / block_size, D]` in the arena's float type: `x ~= code * scale + bias`, bias the
  block's minimum of that channel (a plain min/max quantizer: error at most half a step).

A block fills a token at a time while a sequence decodes, and its range is only known once it is full. So a block's
range grows: a write unions the block's stored range with its new rows' range and requantizes the whole block on
the new grid (codes of earlier rows move to it; when the range did not grow they come back unchanged). Decoding a
block token by token this way gives the same perplexity as quantizing it whole (kv_key_schemes.md: +0.2% both).
Rows written before the block was handed to its present owner must not count: the arena marks every block it
hands out `fresh` (`mark_fresh`), and the first write after that takes its new rows' range alone.

What this costs the rest of the arena: a row's stored value depends on its block, so rows cannot move between
blocks unchanged. Readers get floats (`read`, `read_per_head`, `strided`); a move is a read and a write (the
destination's range grows to hold the moved rows); whole blocks move exactly (`take_blocks` / `put_blocks`: copy-
on-write, the disk tier, saved caches).
"""

from __future__ import annotations

from typing import NamedTuple, Union

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError

Index = Union[slice, mx.array, np.ndarray]
CHANNEL_BITS = (4, 8)


class ChannelBlocks(NamedTuple):
    """Whole blocks as stored: codes `[1, H, n * bs, X]` and per-block `scales`, `biases` `[1, H, n, D]`."""

    packed: mx.array
    scales: mx.array
    biases: mx.array



def block_slots(blocks: np.ndarray, block_size: int) -> mx.array:
    """int32 slots of whole blocks, block after block."""
    blocks = np.asarray(blocks, dtype=np.int64)
    return mx.array((blocks[:, None] * block_size + np.arange(block_size)).reshape(-1).astype(np.int32))

def _shifts(bits: int) -> mx.array:
    return mx.arange(0, 32, bits, dtype=mx.uint32)


def unpack_codes(packed: mx.array, bits: int) -> mx.array:
    """float32 codes `[..., D]` of packed uint32 `[..., D * bits / 32]` (low bits first)."""
    mask = mx.array((1 << bits) - 1, mx.uint32)
    codes = (packed[..., None] >> _shifts(bits)) & mask
    return codes.reshape(*packed.shape[:-1], -1).astype(mx.float32)


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """uint32 `[..., D * bits / 32]` of integer-valued float codes `[..., D]` in [0, 2**bits)."""
    per_word = 32 // bits
    words = codes.astype(mx.uint32).reshape(*codes.shape[:-1], -1, per_word) << _shifts(bits)
    return words.sum(axis=-1).astype(mx.uint32)


class ChannelQuantizedRows:
    """Per-channel, per-block quantized rows of every KV head of one layer (see the module docstring)."""

    def __init__(self, packed: mx.array, scales: mx.array, biases: mx.array, bits: int, block_size: int,
                 fresh: np.ndarray | None = None) -> None:
        if bits not in CHANNEL_BITS:
            raise InvalidArgumentError(f"bits: {bits!r} must be one of {CHANNEL_BITS}")
        if packed.ndim != 4 or packed.shape[0] != 1 or packed.dtype != mx.uint32:
            raise InvalidArgumentError(f"packed: {tuple(packed.shape)} {packed.dtype} must be uint32 "
                                       "[1, heads, slots, packed_dim]")
        if packed.shape[2] % block_size:
            raise InvalidArgumentError(f"packed: {packed.shape[2]} slots are not whole blocks of {block_size}")
        blocks = packed.shape[2] // block_size
        dim = packed.shape[-1] * 32 // bits
        if scales.shape != biases.shape or tuple(scales.shape) != (1, packed.shape[1], blocks, dim):
            raise InvalidArgumentError(f"scales/biases: {tuple(scales.shape)}, {tuple(biases.shape)} must be "
                                       f"[1, {packed.shape[1]}, {blocks}, {dim}] (one per channel per block)")
        self.packed, self.scales, self.biases = packed, scales, biases
        self.bits, self.block_size = bits, block_size
        self.fresh = np.ones(blocks, dtype=bool) if fresh is None else fresh

    @classmethod
    def zeros(cls, num_heads: int, num_slots: int, dim: int, bits: int, block_size: int,
              dtype: mx.Dtype) -> "ChannelQuantizedRows":
        if dim * bits % 32:
            raise InvalidArgumentError(f"head_dim: {dim} values of {bits} bits do not fill whole 32-bit words")
        blocks = -(-num_slots // block_size)
        return cls(mx.zeros((1, num_heads, blocks * block_size, dim * bits // 32), mx.uint32),
                   mx.zeros((1, num_heads, blocks, dim), dtype), mx.zeros((1, num_heads, blocks, dim), dtype),
                   bits, block_size)

    # --- shape ------------------------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return self.packed.shape[1]

    @property
    def num_slots(self) -> int:
        return self.packed.shape[2]

    @property
    def num_blocks(self) -> int:
        return self.scales.shape[2]

    @property
    def dim(self) -> int:
        return self.packed.shape[-1] * 32 // self.bits

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes

    def arrays(self) -> list[mx.array]:
        return [self.packed, self.scales, self.biases]

    def padded(self, extra_slots: int) -> "ChannelQuantizedRows":
        """`extra_slots` more slots (whole blocks), zero and fresh; lazy."""
        if extra_slots % self.block_size:
            raise InvalidArgumentError(f"extra_slots: {extra_slots} is not whole blocks of {self.block_size}")
        extra = extra_slots // self.block_size
        pad = lambda a, n: mx.pad(a, [(0, 0), (0, 0), (0, n), (0, 0)])  # noqa: E731
        return ChannelQuantizedRows(pad(self.packed, extra_slots), pad(self.scales, extra), pad(self.biases, extra),
                                    self.bits, self.block_size, np.concatenate([self.fresh, np.ones(extra, bool)]))

    def mark_fresh(self, blocks: np.ndarray) -> None:
        """Blocks handed to a new owner: their next write takes its own rows' range (see the module docstring)."""
        self.fresh[np.asarray(blocks, dtype=np.int64)] = True

    # --- reads ------------------------------------------------------------------------------------------------
    def read(self, index: Index, dtype: mx.Dtype) -> mx.array:
        """Float rows `[1, H, n, D]` at `index` (a slice or slot numbers)."""
        bs = self.block_size
        if isinstance(index, slice) and index.step in (None, 1):
            start, stop, _ = index.indices(self.num_slots)
            if start % bs == 0 and stop > start:
                used = -(-(stop - start) // bs)
                end = min(start + used * bs, self.num_slots)
                codes = unpack_codes(self.packed[:, :, start:end, :], self.bits)
                if codes.shape[2] < used * bs:
                    codes = mx.pad(codes, [(0, 0), (0, 0), (0, used * bs - codes.shape[2]), (0, 0)])
                first = start // bs
                rows = self._dequantize(codes.reshape(1, self.num_heads, used, bs, self.dim),
                                        self.scales[:, :, first:first + used, None, :],
                                        self.biases[:, :, first:first + used, None, :])
                return rows.reshape(1, self.num_heads, used * bs, self.dim)[:, :, :stop - start].astype(dtype)
        slots = _as_array(index, self.num_slots)
        blocks = slots // bs
        codes = unpack_codes(mx.take(self.packed, slots, axis=2), self.bits)
        return self._dequantize(codes, mx.take(self.scales, blocks, axis=2),
                                mx.take(self.biases, blocks, axis=2)).astype(dtype)

    def read_per_head(self, slots: mx.array, dtype: mx.Dtype) -> mx.array:
        """Float rows `[1, H, n, D]` where head h's row i is its slot `slots[h, i]` (`slots` int32 `[H, n]`)."""
        index = slots[None, :, :, None]
        blocks = index // self.block_size
        codes = unpack_codes(mx.take_along_axis(self.packed, index, axis=2), self.bits)
        return self._dequantize(codes, mx.take_along_axis(self.scales, blocks, axis=2),
                                mx.take_along_axis(self.biases, blocks, axis=2)).astype(dtype)

    def strided(self, batch_size: int, layout: tuple[int, int], width: int, dtype: mx.Dtype) -> mx.array:
        """Float rows `[B, H, width, D]`: window b starts at slot `first + b * pitch` (a gather: a row's value
        needs its block's scales)."""
        first, pitch = layout
        bs, heads, dim = self.block_size, self.num_heads, self.dim
        used = -(-width // bs)
        if first % bs == 0 and pitch % bs == 0 and first + (batch_size - 1) * pitch + used * bs <= self.num_slots:
            # block-aligned windows: strided views of the codes and of the scales, no gather
            words = self.packed.shape[-1]
            codes = mx.as_strided(self.packed, (batch_size, heads, used * bs, words),
                                  (pitch * words, self.num_slots * words, words, 1), first * words)
            codes = unpack_codes(codes, self.bits).reshape(batch_size, heads, used, bs, dim)

            def per_block(array: mx.array) -> mx.array:
                return mx.as_strided(array, (batch_size, heads, used, 1, dim),
                                     (pitch // bs * dim, self.num_blocks * dim, dim, dim, 1), first // bs * dim)

            rows = self._dequantize(codes, per_block(self.scales), per_block(self.biases))
            return rows.reshape(batch_size, heads, used * bs, dim)[:, :, :width].astype(dtype)
        slots = (first + pitch * np.arange(batch_size)[:, None] + np.arange(width)[None, :]).reshape(-1)
        slots = np.minimum(slots, self.num_slots - 1)  # a window may run past the last slot: masked by the caller
        rows = self.read(mx.array(slots.astype(np.int32)), dtype)  # [1, H, B * width, D]
        return rows.reshape(self.num_heads, batch_size, width, self.dim).transpose(1, 0, 2, 3)

    def dequantize(self, dtype: mx.Dtype | None = None) -> mx.array:
        """Every slot as floats `[1, H, S, D]`."""
        return self.read(slice(0, self.num_slots), dtype or self.dtype)

    @staticmethod
    def _dequantize(codes: mx.array, scales: mx.array, biases: mx.array) -> mx.array:
        return codes * scales.astype(mx.float32) + biases.astype(mx.float32)

    # --- writes -----------------------------------------------------------------------------------------------
    def write(self, index: Index, rows: mx.array) -> None:
        """Store float rows `[1, H, n, D]` at `index` (n distinct slots): each touched block's range grows to hold
        them and the block is requantized on it, in place."""
        bs, heads, dim = self.block_size, self.num_heads, self.dim
        slots = _as_numpy(index, self.num_slots)
        if tuple(rows.shape) != (1, heads, len(slots), dim):
            raise InvalidArgumentError(f"rows: shape {tuple(rows.shape)} must be {(1, heads, len(slots), dim)}")
        if len(slots) == 0:
            return
        touched, which = np.unique(slots // bs, return_inverse=True)
        fresh = self.fresh[touched].copy()
        self.fresh[touched] = False
        count = len(touched)
        block_ids = mx.array(touched.astype(np.int32))
        touched_slots = block_slots(touched, bs)
        scales = mx.take(self.scales, block_ids, axis=2).astype(mx.float32)[:, :, :, None, :]  # [1, H, u, 1, D]
        biases = mx.take(self.biases, block_ids, axis=2).astype(mx.float32)[:, :, :, None, :]
        stored = unpack_codes(mx.take(self.packed, touched_slots, axis=2), self.bits)
        values = self._dequantize(stored.reshape(1, heads, count, bs, dim), scales, biases)
        values = values.reshape(1, heads, count * bs, dim)
        position = which.reshape(-1) * bs + slots % bs
        values[:, :, mx.array(position.astype(np.int32)), :] = rows.astype(mx.float32)
        values = values.reshape(1, heads, count, bs, dim)
        new = np.zeros(count * bs, dtype=bool)
        new[position] = True
        new = mx.array(new.reshape(1, 1, count, bs, 1))
        low = mx.where(new, values, mx.inf).min(axis=3, keepdims=True)
        high = mx.where(new, values, -mx.inf).max(axis=3, keepdims=True)
        kept = mx.array(~fresh.reshape(1, 1, count, 1, 1))  # blocks whose earlier rows still count
        low = mx.where(kept, mx.minimum(low, biases), low)
        high = mx.where(kept, mx.maximum(high, biases + scales * self.levels), high)
        bias = low.astype(self.dtype)
        step = ((high - low) / self.levels).astype(self.dtype)
        # codes against the stored (rounded) scale and bias, so that a block read back and written unchanged keeps
        # its codes
        step32, bias32 = step.astype(mx.float32), bias.astype(mx.float32)
        codes = mx.clip(mx.round((values - bias32) / mx.maximum(step32, 1e-30)), 0, self.levels)
        self.packed[:, :, touched_slots, :] = pack_codes(codes.reshape(1, heads, count * bs, dim), self.bits)
        self.scales[:, :, block_ids, :] = step[:, :, :, 0, :]
        self.biases[:, :, block_ids, :] = bias[:, :, :, 0, :]

    # --- whole blocks -----------------------------------------------------------------------------------------
    def take_blocks(self, blocks: np.ndarray) -> ChannelBlocks:
        """Whole blocks as stored (exact)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        slots = block_slots(blocks, self.block_size)
        ids = mx.array(blocks.astype(np.int32))
        return ChannelBlocks(mx.take(self.packed, slots, axis=2), mx.take(self.scales, ids, axis=2),
                             mx.take(self.biases, ids, axis=2))

    def rows_of_blocks(self, slots: np.ndarray) -> ChannelBlocks:
        """The codes at `slots` (a sequence's first tokens, from the start of its first block) with the scales of
        the blocks they lie in, in order: exact, and smaller than whole blocks (a saved cache)."""
        slots = np.asarray(slots, dtype=np.int64)
        blocks = slots[::self.block_size] // self.block_size
        ids = mx.array(blocks.astype(np.int32))
        return ChannelBlocks(mx.take(self.packed, mx.array(slots.astype(np.int32)), axis=2),
                             mx.take(self.scales, ids, axis=2), mx.take(self.biases, ids, axis=2))

    def put_rows_of_blocks(self, slots: np.ndarray, stored: ChannelBlocks) -> None:
        """Store what `rows_of_blocks` returned at `slots` (a sequence's first tokens), unchanged."""
        slots = np.asarray(slots, dtype=np.int64)
        blocks = slots[::self.block_size] // self.block_size
        if stored.packed.shape[2] != len(slots) or stored.scales.shape[2] != len(blocks):
            raise InvalidArgumentError(f"stored: {stored.packed.shape[2]} rows in {stored.scales.shape[2]} blocks do "
                                       f"not fit {len(slots)} slots in {len(blocks)} blocks")
        ids = mx.array(blocks.astype(np.int32))
        self.packed[:, :, mx.array(slots.astype(np.int32)), :] = stored.packed
        self.scales[:, :, ids, :] = stored.scales.astype(self.dtype)
        self.biases[:, :, ids, :] = stored.biases.astype(self.dtype)
        self.fresh[blocks] = False

    def put_blocks(self, blocks: np.ndarray, stored: ChannelBlocks) -> None:
        """Store whole blocks `take_blocks` returned (from a container of the same layout) at `blocks`, unchanged."""
        blocks = np.asarray(blocks, dtype=np.int64)
        expected = (1, self.num_heads, len(blocks), self.dim)
        if tuple(stored.scales.shape) != expected or tuple(stored.packed.shape) != (
                1, self.num_heads, len(blocks) * self.block_size, self.packed.shape[-1]):
            raise InvalidArgumentError(f"stored: blocks of shape {tuple(stored.packed.shape)} / "
                                       f"{tuple(stored.scales.shape)} do not fit {len(blocks)} blocks here")
        slots = block_slots(blocks, self.block_size)
        ids = mx.array(blocks.astype(np.int32))
        self.packed[:, :, slots, :] = stored.packed
        self.scales[:, :, ids, :] = stored.scales.astype(self.dtype)
        self.biases[:, :, ids, :] = stored.biases.astype(self.dtype)
        self.fresh[blocks] = False


def _as_numpy(index: Index, num_slots: int) -> np.ndarray:
    if isinstance(index, slice):
        return np.arange(*index.indices(num_slots))
    slots = np.asarray(index).astype(np.int64).reshape(-1)
    if slots.size and (slots.min() < 0 or slots.max() >= num_slots):
        raise InvalidArgumentError(f"slots: every slot must be in [0, {num_slots})")
    if len(np.unique(slots)) != len(slots):
        raise InvalidArgumentError("slots: a write needs distinct slots")
    return slots


def _as_array(index: Index, num_slots: int) -> mx.array:
    if isinstance(index, slice):
        return mx.array(np.arange(*index.indices(num_slots)).astype(np.int32))
    if isinstance(index, np.ndarray):
        return mx.array(index.astype(np.int32))
    return index


__all__ = ["ChannelBlocks", "ChannelQuantizedRows", "pack_codes", "unpack_codes"]
