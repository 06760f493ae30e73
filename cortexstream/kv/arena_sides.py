"""One side (K or V) of one arena layer: a float buffer or quantized rows, and the operations the arena needs on it.

A float side is the `[1, H, S, D]` array the arena has always held: the hot paths (strided views, `gather_mm`
blocks, the paged kernel) read it directly. A quantized side is a `QuantizedRows` over the same slot axis (codes
with per-group scales and biases, see `quantized_blocks.py`). The functions here give both one vocabulary:
- `write_side`: float rows in, stored at slots (quantized on the way in);
- `read_side`: float rows out (dequantized; lazy, so a read nothing consumes costs nothing);
- `take_side` / `put_side`: move stored rows as they are (codes with their own scales and biases; a float row is
  a float row), for copy-on-write, relocation and eviction's compaction: a moved row is bit-identical, never
  requantized.
Keys grouped per channel (`ChannelQuantizedRows`, channel_quantized.py) share a scale with their block, so a row
cannot move alone unchanged: `take_side` reads them as floats (what attention reads too) and `put_side` writes
them (the destination block's range grows to hold them); whole blocks move exactly (`take_blocks` / `put_blocks`).
"""

from __future__ import annotations

from typing import Union

import mlx.core as mx

import numpy as np

from cortexstream.kv.channel_quantized import ChannelBlocks, ChannelQuantizedRows, block_slots
from cortexstream.kv.kv_dtype import StorageType
from cortexstream.kv.kv_rotation import rotation_signs
from cortexstream.kv.quantized_blocks import CodeView, QuantizedRows

Side = Union[mx.array, QuantizedRows, ChannelQuantizedRows]
_CODED = (QuantizedRows, ChannelQuantizedRows)
Index = Union[slice, mx.array]
MX_FLOAT = {StorageType.FLOAT32: mx.float32, StorageType.FLOAT16: mx.float16, StorageType.BFLOAT16: mx.bfloat16}


def as_dtype(array: mx.array, dtype: mx.Dtype) -> mx.array:
    """`array` in `dtype`; astype even to the same dtype adds a copy to the graph, and every decode step writes
    every layer."""
    return array if array.dtype == dtype else array.astype(dtype)


def new_side(kind: StorageType, heads: int, slots: int, dim: int, float_type: mx.Dtype, group_size: int,
             rotated: bool = False, center: mx.array | None = None, channel_block: int | None = None) -> Side:
    """Zeroed storage for `slots` slots of `heads` heads of width `dim` (a quantized side stored rotated when
    `rotated`, kv_rotation.py, and centered by `center` `[H, D]` when given, kv_center.py; a float side ignores
    `center`: it stores values as they are). `channel_block`: group a quantized side per channel over blocks of
    that many slots instead (channel_quantized.py)."""
    if kind.quantized and channel_block is not None:
        return ChannelQuantizedRows.zeros(heads, slots, dim, kind.bits, channel_block, float_type)
    if kind.quantized:
        signs = mx.array(rotation_signs(dim)) if rotated else None
        return QuantizedRows.zeros(heads, slots, dim, kind.bits, group_size, float_type, signs, center)
    return mx.zeros((1, heads, slots, dim), MX_FLOAT[kind])


def side_slots(side: Side) -> int:
    return side.num_slots if isinstance(side, _CODED) else side.shape[2]


def side_dim(side: Side) -> int:
    return side.dim if isinstance(side, _CODED) else side.shape[3]


def side_arrays(side: Side) -> list[mx.array]:
    return side.arrays() if isinstance(side, _CODED) else [side]


def side_nbytes(side: Side) -> int:
    return side.nbytes


def pad_side(side: Side, extra_slots: int) -> Side:
    """`side` with `extra_slots` zero slots appended (lazy)."""
    if isinstance(side, _CODED):
        return side.padded(extra_slots)
    return mx.pad(side, [(0, 0), (0, 0), (0, extra_slots), (0, 0)])


def write_side(side: Side, index: Index, rows: mx.array) -> None:
    """Store float rows `[1, H, n, D]` (or `[H, n, D]`) at `index` (n distinct slots), in place."""
    if rows.ndim == 3:
        rows = rows[None]
    if isinstance(side, _CODED):
        side.write(index, rows)
    else:
        side[:, :, index, :] = as_dtype(rows, side.dtype)


def read_side(side: Side, index: Index, dtype: mx.Dtype) -> mx.array:
    """Float rows `[1, H, n, D]` at `index` (a slice is a view of a float side), in `dtype` for quantized sides."""
    if isinstance(side, ChannelQuantizedRows):
        return side.read(index, dtype)
    if isinstance(side, QuantizedRows):
        return side.gather(index).dequantize(dtype)
    return side[:, :, index, :]


def read_side_per_head(side: Side, slots: mx.array, dtype: mx.Dtype) -> mx.array:
    """Float rows `[H, n, D]` where head h's row i is its slot `slots[h, i]` (`slots`: int32 `[H, n]`)."""
    if isinstance(side, ChannelQuantizedRows):
        return side.read_per_head(slots, dtype)[0]
    if isinstance(side, QuantizedRows):
        return side.take_per_head(slots).dequantize(dtype)[0]
    return mx.take_along_axis(side[0], slots[:, :, None], axis=1)


def read_cells(side: Side, columns: mx.array, slots: mx.array, dtype: mx.Dtype) -> mx.array:
    """Float rows `[n, D]`: cell i is column `columns[i]` at arena slot `slots[i]` (int32 `[n]` each)."""
    if isinstance(side, _CODED):  # codes are read for every column at those slots, then picked
        rows = read_side(side, slots, dtype)[0]
        return rows[columns, mx.arange(rows.shape[1])]
    _, heads, num_slots, dim = side.shape  # one gather from the flat rows: indexing side[0] first copies it
    return side.reshape(heads * num_slots, dim)[columns * num_slots + slots]


def take_side(side: Side, index: Index) -> Side:
    """The stored rows at `index`, as stored (for `put_side`); floats for keys grouped per channel."""
    if isinstance(side, ChannelQuantizedRows):
        return side.read(index, side.dtype)
    if isinstance(side, QuantizedRows):
        return side.gather(index)
    return side[:, :, index, :]


def take_side_per_head(side: Side, slots: mx.array) -> Side:
    """The stored rows at per-head `slots` int32 `[H, n]`, as stored (for `put_side`)."""
    if isinstance(side, ChannelQuantizedRows):
        return side.read_per_head(slots, side.dtype)
    if isinstance(side, QuantizedRows):
        return side.take_per_head(slots)
    return mx.take_along_axis(side, slots[None, :, :, None], axis=2)


def put_side(side: Side, index: Index, rows: Side) -> None:
    """Store rows `take_side` returned at `index`, in place and unchanged (keys grouped per channel: written)."""
    if isinstance(side, ChannelQuantizedRows):
        if isinstance(rows, ChannelBlocks):  # a saved cache's codes and block scales, at a sequence's first slots
            side.put_rows_of_blocks(np.asarray(index), rows)
        elif isinstance(rows, mx.array):
            side.write(index, rows)
        else:
            raise TypeError("put_side: keys grouped per channel take float rows or ChannelBlocks")
    elif isinstance(side, QuantizedRows):
        if not isinstance(rows, QuantizedRows):
            raise TypeError("put_side: a quantized side takes quantized rows (write_side quantizes floats)")
        side.put(index, rows)
    else:
        side[:, :, index, :] = rows


def per_row_codec(side: Side) -> bool:
    """Whether a row reads back the same whatever else its block holds (false for keys grouped per channel: read
    them back after the write instead of `as_read_back`)."""
    return not isinstance(side, ChannelQuantizedRows)


def as_read_back(side: Side, rows: mx.array, dtype: mx.Dtype) -> mx.array:
    """Float rows `[..., D]` as `side` would return them after storing them: quantized and dequantized for a
    quantized side (the codec is per row, so this equals a write followed by a read), unchanged for a float side."""
    if isinstance(side, ChannelQuantizedRows):
        raise TypeError("as_read_back: a row of keys grouped per channel depends on its block: read it back after "
                        "writing it (read_side)")
    if not isinstance(side, QuantizedRows):
        return rows
    return side.read_back(rows, dtype)


def strided_side(side: Side, batch_size: int, layout: tuple[int, int], width: int) -> mx.array | CodeView:
    """A side `[1, H, S, ...]` seen as `[B, H, width, ...]`: window b starts at slot `first + b * pitch` (no copy;
    every array of a quantized side gets the same view)."""
    first, pitch = layout

    def view(array: mx.array) -> mx.array:
        _, heads, slots, dim = array.shape
        return mx.as_strided(array, (batch_size, heads, width, dim), (pitch * dim, slots * dim, dim, 1), first * dim)

    if isinstance(side, ChannelQuantizedRows):
        return side.strided(batch_size, layout, width, side.dtype)
    if isinstance(side, QuantizedRows):
        return CodeView(view(side.packed), view(side.scales), view(side.biases), side.bits, side.group_size,
                        side.rotation, side.center)
    return view(side)


def full_float(side: Side, dtype: mx.Dtype) -> mx.array:
    """The whole side as float `[1, H, S, D]` (a quantized side is dequantized in full: readers that need every
    slot as floats, such as the compressor's and sidecar's gathers, pay for it)."""
    if isinstance(side, _CODED):
        return side.dequantize(dtype)
    return side


def take_blocks(side: Side, blocks: np.ndarray, block_size: int) -> Side | ChannelBlocks:
    """Whole blocks as stored, exactly (copy-on-write, the disk tier, saved caches)."""
    if isinstance(side, ChannelQuantizedRows):
        return side.take_blocks(blocks)
    return take_side(side, block_slots(blocks, block_size))


def put_blocks(side: Side, blocks: np.ndarray, block_size: int, stored: Side | ChannelBlocks) -> None:
    """Store whole blocks `take_blocks` returned at `blocks`, unchanged."""
    if isinstance(side, ChannelQuantizedRows):
        if not isinstance(stored, ChannelBlocks):
            raise TypeError("put_blocks: keys grouped per channel take ChannelBlocks")
        side.put_blocks(blocks, stored)
    else:
        put_side(side, block_slots(blocks, block_size), stored)


def block_arrays(stored: Side | ChannelBlocks) -> list[mx.array]:
    """The arrays of whole blocks `take_blocks` returned, in a fixed order (the disk tier's payload)."""
    return list(stored) if isinstance(stored, ChannelBlocks) else side_arrays(stored)
