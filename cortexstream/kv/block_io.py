"""Whole arena blocks as bytes and back: what the disk tier (kv/disk) stores for a block.

A block's payload is every layer's K and V rows of its `block_size` slots exactly as the arena stores them (float
rows, or packed codes with their scales and biases), so a block restored from its payload is bit-identical to the
one exported. The layout (layer, then K before V, then the side's arrays in `side_arrays` order, each `[H, bs, X]`
row-major) is fixed by the arena's configuration; the disk tier keys blocks by a namespace that includes that
configuration, so a payload is only ever read back into an arena of the same layout (its length is checked too).

Export is lazy: `BlockExport` gathers the rows in one graph per call and converts them to bytes when `payloads()` is
called, so an engine can start it after a step and read it after the next one, when the forward pass that wrote the
blocks has finished anyway.
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_sides import block_arrays, put_blocks, take_blocks
from cortexstream.kv.channel_quantized import ChannelBlocks, ChannelQuantizedRows
from cortexstream.kv.quantized_blocks import QuantizedRows


def _as_block_major(array: mx.array, num_blocks: int) -> mx.array:
    """`[1, H, n*r, X]` (r rows per block) -> bytes `[n, H*r*X*itemsize]` (one row per block)."""
    _, heads, rows, width = array.shape
    per_block = array.reshape(heads, num_blocks, rows // num_blocks, width).transpose(1, 0, 2, 3)
    return per_block.reshape(num_blocks, -1).view(mx.uint8)


def _block_parts(arena: KVArena) -> list[tuple[int, int, int, mx.Dtype]]:
    """(heads, rows per block, width, dtype) of every array of one block's payload, in payload order."""
    parts = []
    for layer in range(arena.config.num_layers):
        for side in (arena.keys[layer], arena.values[layer]):
            for array in block_arrays(take_blocks(side, np.zeros(1, dtype=np.int64), arena.config.block_size)):
                _, heads, rows, width = array.shape
                parts.append((heads, rows, width, array.dtype))
    return parts


def block_bytes(arena: KVArena) -> int:
    """Bytes of one block's payload in this arena."""
    return sum(heads * rows * width * dtype.size for heads, rows, width, dtype in _block_parts(arena))


class BlockExport:
    """The payloads of some arena blocks, gathered lazily (see the module docstring)."""

    def __init__(self, arena: KVArena, blocks: Sequence[int]) -> None:
        self.blocks = list(blocks)
        self._rows: mx.array | None = None
        if not self.blocks:
            return
        n, bs = len(self.blocks), arena.config.block_size
        ids = np.asarray(self.blocks, dtype=np.int64)
        parts = []
        for layer in range(arena.config.num_layers):
            for side in (arena.keys[layer], arena.values[layer]):
                for array in block_arrays(take_blocks(side, ids, bs)):
                    parts.append(_as_block_major(array, n))
        self._rows = mx.concatenate(parts, axis=1)
        mx.async_eval(self._rows)

    def payloads(self) -> list[bytes]:
        """One `bytes` per block, in the order given (waits for the gather if it is still running)."""
        if self._rows is None:
            return []
        rows = np.array(self._rows, copy=False)
        return [rows[i].tobytes() for i in range(rows.shape[0])]


def import_blocks(arena: KVArena, blocks: Sequence[int], payloads: Sequence[bytes]) -> None:
    """Write `payloads` (from `BlockExport` on an arena of the same configuration) into `blocks`, unchanged."""
    if len(blocks) != len(payloads):
        raise ValueError(f"import_blocks: {len(blocks)} blocks but {len(payloads)} payloads")
    if not blocks:
        return
    expected = block_bytes(arena)
    for i, payload in enumerate(payloads):
        if len(payload) != expected:
            raise ValueError(f"import_blocks: payload {i} has {len(payload)} bytes, a block of this arena has "
                             f"{expected}")
    n, bs = len(blocks), arena.config.block_size
    rows = mx.array(np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(n, expected))
    ids = np.asarray(blocks, dtype=np.int64)
    shapes = iter(_block_parts(arena))
    offset = 0
    for layer in range(arena.config.num_layers):
        for sides in (arena.keys, arena.values):
            side = sides[layer]
            stored = []
            for _ in range(3 if isinstance(side, (QuantizedRows, ChannelQuantizedRows)) else 1):
                heads, per_block, width, dtype = next(shapes)
                size = heads * per_block * width * dtype.size
                part = rows[:, offset:offset + size].view(dtype).reshape(n, heads, per_block, width)
                stored.append(part.transpose(1, 0, 2, 3).reshape(1, heads, n * per_block, width))
                offset += size
            if isinstance(side, ChannelQuantizedRows):
                put_blocks(side, ids, bs, ChannelBlocks(*stored))
            elif isinstance(side, QuantizedRows):
                put_blocks(side, ids, bs, QuantizedRows(*stored, side.bits, side.group_size, side.rotation,
                                                        side.center))
            else:
                put_blocks(side, ids, bs, stored[0])
    mx.eval(arena.arrays())


__all__ = ["BlockExport", "block_bytes", "import_blocks"]
