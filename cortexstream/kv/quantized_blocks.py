"""The codec for quantized K or V rows in the arena's layout, and the container that holds them per layer.

The arena keeps, per layer, K and V as `[1, kv_heads, num_slots, head_dim]` (slot `b * block_size + i` is token
`i` of block `b`). A quantized side keeps the same slot axis in three arrays that always move together:
- `packed`  uint32 `[1, H, S, D * bits / 32]`: `bits`-bit codes, packed low bits first (mx.quantize's format);
- `scales`  `[1, H, S, D / group_size]` and
- `biases`  `[1, H, S, D / group_size]`, in the float type the rows were quantized from,
so that `x ~= code * scale + bias` per group of `group_size` values along the head dim. This is MLX's affine
quantization (`mx.quantize` / `mx.dequantize`, the layout of mlx-lm's `QuantizedKVCache`), so the arena's
attention can later read the blocks through `mx.quantized_matmul` as well as by dequantizing them.

How the arena will use it: one `QuantizedRows` per layer for each quantized side, in place of the float buffer.
A decode or prefill write quantizes the new rows and scatters them to their slots (`write`, in place, as the
float arena's `buf[..., idx, :] = rows`); a block gather, eviction or copy-on-write moves codes with their scales
and biases (`gather`), so a row never meets another row's scale; attention dequantizes the gathered rows
(`dequantize`) or feeds the three arrays to a quantized matmul. Sizes come from `KVDtype.bytes_per_token`; `nbytes`
is what the buffers really hold.

Rotation: a container may hold its rows rotated (`rotation`: the signs `[D]` of the orthogonal rotation in
kv_rotation.py): `write` rotates rows before quantizing and `dequantize` rotates them back after, so callers see
the true values; `dequantize_stored` gives the rotated values, for readers that rotate the query instead
(quantized_attention.py). Moving codes (`gather`, `put`, `take_per_head`) never rotates anything.

Centering: a container may also subtract a fixed vector per KV head (`center`, `[H, D]`) before it rotates and
quantizes, and add it back when it dequantizes (kv_center.py says why: models with a key bias, Qwen2's, have key
channels far larger than the rest, which a shared per-group scale cannot resolve). Readers of stored values
(`dequantize_stored`, attention over codes) see centered values: for keys that shifts every score of a query by the
same amount, which softmax ignores; a value side's output gets the center added back (quantized_attention.py).

Note on accuracy: MLX's affine quantizer anchors each group at its endpoint of larger magnitude and rounds the
step so that zero is exactly representable, so the far endpoint can be clipped: the error per value is up to
`(max - min) / 2**bits` (about a full step), not the half step `(max - min) / (2**bits - 1) / 2` of a plain
min/max quantizer.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence, Union

import math

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.kv_dtype import GROUP_SIZES

QUANTIZED_BITS = (4, 8)
Slots = Union[slice, Sequence[int], np.ndarray, mx.array]


def _check_codec(bits: int, group_size: int) -> None:
    if type(bits) is not int or bits not in QUANTIZED_BITS:
        raise InvalidArgumentError(f"bits: {bits!r} must be one of {', '.join(map(str, QUANTIZED_BITS))}")
    if type(group_size) is not int or group_size not in GROUP_SIZES:
        raise InvalidArgumentError(
            f"kv_group_size: {group_size!r} must be one of {', '.join(map(str, GROUP_SIZES))}"
        )


def quantize_rows(x: mx.array, bits: int, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """(packed, scales, biases) of float rows `x` `[1, H, S, D]`, grouped along D; scales and biases in x's dtype."""
    _check_codec(bits, group_size)
    if x.ndim != 4 or x.shape[0] != 1:
        raise InvalidArgumentError(f"x: shape {tuple(x.shape)} must be [1, heads, slots, dim]")
    if not mx.issubdtype(x.dtype, mx.floating):
        raise InvalidArgumentError(f"x: dtype {x.dtype} must be a float type")
    if x.shape[-1] % group_size:
        raise InvalidArgumentError(
            f"kv_group_size: {group_size} does not divide the rows' last axis {x.shape[-1]} (the head dim)"
        )
    if x.size == 0:  # mx.quantize cannot reshape an empty array
        heads_slots = tuple(x.shape[:-1])
        groups = x.shape[-1] // group_size
        return (mx.zeros((*heads_slots, x.shape[-1] * bits // 32), mx.uint32),
                mx.zeros((*heads_slots, groups), x.dtype), mx.zeros((*heads_slots, groups), x.dtype))
    return affine_quantize(x, bits, group_size)


def affine_quantize(x: mx.array, bits: int, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """The codec's quantizer, any leading shape: `mx.quantize` (the one place it is called)."""
    return mx.quantize(x, group_size=group_size, bits=bits)


def dequantize_rows(
    packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int, dtype: mx.Dtype
) -> mx.array:
    """Float rows `[1, H, S, D]` in `dtype` from the arrays `quantize_rows` returned."""
    _check_codec(bits, group_size)
    dim = packed.shape[-1] * 32 // bits
    if scales.shape != biases.shape or scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * group_size != dim:
        raise InvalidArgumentError(
            f"packed/scales/biases: shapes {tuple(packed.shape)}, {tuple(scales.shape)}, {tuple(biases.shape)} "
            f"do not match {bits}-bit codes in groups of {group_size}"
        )
    if packed.size == 0:  # mx.dequantize cannot reshape an empty array
        return mx.zeros((*packed.shape[:-1], dim), dtype)
    return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits, dtype=dtype)


class CodeView(NamedTuple):
    """Quantized rows seen with a batch axis `[B, H, L, ...]` (e.g. strided views of a layer's arrays, one window
    per sequence): what attention reads; not a container (no writes)."""

    packed: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    rotation: mx.array | None = None  # the signs of the rotation rows are stored in (None: as they are)
    center: mx.array | None = None  # `[1, H, 1, D]` subtracted before storing (None: nothing)

    @property
    def num_heads(self) -> int:
        return self.packed.shape[1]

    def dequantize_stored(self, dtype: mx.Dtype) -> mx.array:
        """The stored values (centered and rotated when the rows are)."""
        return mx.dequantize(self.packed, self.scales, self.biases, group_size=self.group_size, bits=self.bits,
                             dtype=dtype)

    def dequantize(self, dtype: mx.Dtype) -> mx.array:
        """The rows' values (un-rotated, center added back)."""
        return uncenter(unrotate(self.dequantize_stored(dtype), self.rotation), self.center)


def rotate(rows: mx.array, signs: mx.array | None) -> mx.array:
    """`rows @ R` with `R = diag(signs) H / sqrt(D)` (into the stored space, kv_rotation.py), or `rows` when there
    is no rotation."""
    if signs is None:
        return rows
    return mx.hadamard_transform(rows * signs.astype(rows.dtype), scale=1.0 / math.sqrt(rows.shape[-1]))


def unrotate(rows: mx.array, signs: mx.array | None) -> mx.array:
    """`rows @ R^T` (out of the stored space; H is symmetric), or `rows` when there is no rotation."""
    if signs is None:
        return rows
    return mx.hadamard_transform(rows, scale=1.0 / math.sqrt(rows.shape[-1])) * signs.astype(rows.dtype)


def uncenter(rows: mx.array, center: mx.array | None) -> mx.array:
    """Stored-space rows (after un-rotating) with the container's center added back."""
    return rows if center is None else rows + center.astype(rows.dtype)


class QuantizedRows:
    """Packed codes with their per-group scales and biases for `num_slots` slots of every KV head of one layer.

    Mutable like the arena's buffers: `write` replaces the arrays with scattered copies (MLX updates them in place
    when nothing else holds them)."""

    def __init__(self, packed: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int,
                 rotation: mx.array | None = None, center: mx.array | None = None) -> None:
        _check_codec(bits, group_size)
        if packed.dtype != mx.uint32:
            raise InvalidArgumentError(f"packed: dtype {packed.dtype} must be uint32")
        if packed.ndim != 4 or packed.shape[0] != 1:
            raise InvalidArgumentError(f"packed: shape {tuple(packed.shape)} must be [1, heads, slots, packed_dim]")
        dim = packed.shape[-1] * 32 // bits
        if scales.shape != biases.shape or scales.dtype != biases.dtype:
            raise InvalidArgumentError(
                f"scales/biases: {tuple(scales.shape)} {scales.dtype} vs {tuple(biases.shape)} {biases.dtype} differ"
            )
        if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * group_size != dim:
            raise InvalidArgumentError(
                f"scales: shape {tuple(scales.shape)} does not match packed {tuple(packed.shape)} "
                f"({bits}-bit codes, groups of {group_size})"
            )
        if not mx.issubdtype(scales.dtype, mx.floating):
            raise InvalidArgumentError(f"scales: dtype {scales.dtype} must be a float type")
        if rotation is not None and tuple(rotation.shape) != (dim,):
            raise InvalidArgumentError(f"rotation: shape {tuple(rotation.shape)} must be [{dim}] (the head dim)")
        if center is not None:
            if tuple(center.shape) == (packed.shape[1], dim):
                center = center[None, :, None, :]
            if tuple(center.shape) != (1, packed.shape[1], 1, dim):
                raise InvalidArgumentError(f"center: shape {tuple(center.shape)} must be [{packed.shape[1]}, {dim}] "
                                           "(KV heads, head dim)")
        self.rotation = rotation
        self.center = center
        self.packed = packed
        self.scales = scales
        self.biases = biases
        self.bits = bits
        self.group_size = group_size

    @classmethod
    def zeros(
        cls, num_heads: int, num_slots: int, dim: int, bits: int, group_size: int, dtype: mx.Dtype,
        rotation: mx.array | None = None, center: mx.array | None = None,
    ) -> "QuantizedRows":
        """Preallocated storage for `num_slots` slots of `num_heads` heads of width `dim`; scales in `dtype`; rows
        stored rotated when `rotation` (signs) is given, centered when `center` (`[H, D]`) is."""
        _check_codec(bits, group_size)
        for name, value in (("num_heads", num_heads), ("num_slots", num_slots), ("dim", dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"{name}: {value!r} must be a positive integer")
        if dim % group_size:
            raise InvalidArgumentError(f"kv_group_size: {group_size} does not divide the head dim {dim}")
        shape = (1, num_heads, num_slots)
        return cls(
            mx.zeros((*shape, dim * bits // 32), mx.uint32),
            mx.zeros((*shape, dim // group_size), dtype),
            mx.zeros((*shape, dim // group_size), dtype),
            bits,
            group_size,
            None if rotation is None else rotation.astype(dtype),
            None if center is None else center.astype(dtype),
        )

    @classmethod
    def from_rows(cls, rows: mx.array, bits: int, group_size: int, rotation: mx.array | None = None,
                  center: mx.array | None = None) -> "QuantizedRows":
        """Quantize float rows `[1, H, S, D]` into a new container (scales in the rows' dtype)."""
        empty = cls.zeros(rows.shape[1], 1, rows.shape[-1], bits, group_size, rows.dtype, rotation, center)
        return cls(*quantize_rows(empty.to_stored(rows), bits, group_size), bits, group_size, empty.rotation,
                   empty.center)

    def to_stored(self, rows: mx.array) -> mx.array:
        """Float rows `[..., H, n, D]` in the space they are quantized in: centered, then rotated."""
        if self.center is not None:
            rows = rows - self.center.astype(rows.dtype)
        return rotate(rows, self.rotation)

    @property
    def num_heads(self) -> int:
        return self.packed.shape[1]

    @property
    def num_slots(self) -> int:
        return self.packed.shape[2]

    @property
    def dim(self) -> int:
        """Float values per row (the head dim)."""
        return self.packed.shape[-1] * 32 // self.bits

    @property
    def dtype(self) -> mx.Dtype:
        """Float type of the scales and biases, which rows are quantized from and dequantized to by default."""
        return self.scales.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by codes, scales and biases."""
        return self.packed.nbytes + self.scales.nbytes + self.biases.nbytes

    def gather(self, slots: Slots) -> "QuantizedRows":
        """A new container of the rows at `slots` (in that order), codes with their own scales and biases."""
        index = self._index(slots)
        if isinstance(index, slice):
            parts = [a[:, :, index, :] for a in (self.packed, self.scales, self.biases)]
        else:
            parts = [mx.take(a, index, axis=2) for a in (self.packed, self.scales, self.biases)]
        return QuantizedRows(*parts, self.bits, self.group_size, self.rotation, self.center)

    def write(self, slots: Slots, rows: mx.array) -> None:
        """Quantize float rows `[1, H, n, D]` and store them at `slots` (n of them, distinct), in place."""
        index = self._index(slots)
        if not isinstance(slots, (slice, mx.array)) and len(set(np.asarray(slots).tolist())) != len(slots):
            raise InvalidArgumentError(f"slots: {slots!r} repeats a slot; a write needs distinct slots")
        count = len(range(*index.indices(self.num_slots))) if isinstance(index, slice) else index.shape[0]
        expected = (1, self.num_heads, count, self.dim)
        if tuple(rows.shape) != expected:
            raise InvalidArgumentError(f"rows: shape {tuple(rows.shape)} must be {expected} for these slots")
        if rows.dtype != self.dtype:
            rows = rows.astype(self.dtype)  # scales come out in the input's dtype; keep the container's
        packed, scales, biases = quantize_rows(self.to_stored(rows), self.bits, self.group_size)
        self.packed[:, :, index, :] = packed
        self.scales[:, :, index, :] = scales
        self.biases[:, :, index, :] = biases

    def put(self, slots: Slots, rows: "QuantizedRows") -> None:
        """Store already quantized `rows` (codes with their scales and biases, as `gather` returns them) at
        `slots`, in place: moving rows never requantizes them, so a moved row is bit-identical."""
        if (rows.bits, rows.group_size, rows.dim, rows.num_heads) != (self.bits, self.group_size, self.dim,
                                                                       self.num_heads):
            raise InvalidArgumentError(
                f"rows: {rows.bits}-bit groups of {rows.group_size}, dim {rows.dim}, {rows.num_heads} heads do not "
                f"match this container's {self.bits}-bit groups of {self.group_size}, dim {self.dim}, "
                f"{self.num_heads} heads")
        if (rows.rotation is None) != (self.rotation is None):
            raise InvalidArgumentError("rows: stored rotated and unrotated rows cannot be mixed in one container")
        if (rows.center is None) != (self.center is None):
            raise InvalidArgumentError("rows: centered and uncentered rows cannot be mixed in one container")
        index = self._index(slots)
        self.packed[:, :, index, :] = rows.packed
        self.scales[:, :, index, :] = rows.scales.astype(self.dtype)
        self.biases[:, :, index, :] = rows.biases.astype(self.dtype)

    def take_per_head(self, slots: mx.array) -> "QuantizedRows":
        """The rows at `slots` int32 `[H, n]`: head h's row i is head h's slot `slots[h, i]` (per-head selection,
        as eviction keeps different tokens in different KV heads)."""
        if slots.ndim != 2 or slots.shape[0] != self.num_heads:
            raise InvalidArgumentError(f"slots: shape {tuple(slots.shape)} must be [heads={self.num_heads}, n]")
        index = slots[None, :, :, None]
        parts = [mx.take_along_axis(a, index, axis=2) for a in (self.packed, self.scales, self.biases)]
        return QuantizedRows(*parts, self.bits, self.group_size, self.rotation, self.center)

    def padded(self, extra_slots: int) -> "QuantizedRows":
        """A container with `extra_slots` more (zero) slots at the end; lazy, like the float arena's `mx.pad`."""
        widths = [(0, 0), (0, 0), (0, extra_slots), (0, 0)]
        return QuantizedRows(*(mx.pad(a, widths) for a in (self.packed, self.scales, self.biases)), self.bits,
                             self.group_size, self.rotation, self.center)

    def arrays(self) -> list[mx.array]:
        """The three arrays (for `mx.eval`)."""
        return [self.packed, self.scales, self.biases]

    def dequantize(self, dtype: mx.Dtype | None = None) -> mx.array:
        """All rows as floats `[1, H, S, D]`, in `dtype` (default: the scales' float type), un-rotated and
        un-centered."""
        return uncenter(unrotate(self.dequantize_stored(dtype), self.rotation), self.center)

    def dequantize_stored(self, dtype: mx.Dtype | None = None) -> mx.array:
        """All rows as stored (centered and rotated when the container is), in `dtype`."""
        return dequantize_rows(
            self.packed, self.scales, self.biases, self.bits, self.group_size, dtype or self.dtype
        )

    def view(self) -> CodeView:
        """The container's arrays as a CodeView (what attention reads)."""
        return CodeView(self.packed, self.scales, self.biases, self.bits, self.group_size, self.rotation,
                        self.center)

    def read_back(self, rows: mx.array, dtype: mx.Dtype) -> mx.array:
        """Float rows `[..., D]` as this container would return them after storing them (the codec is per row, so
        this equals a write followed by a read)."""
        rows = self.to_stored(rows if rows.dtype == self.dtype else rows.astype(self.dtype))
        packed, scales, biases = affine_quantize(rows, self.bits, self.group_size)
        stored = mx.dequantize(packed, scales, biases, group_size=self.group_size, bits=self.bits, dtype=dtype)
        return uncenter(unrotate(stored, self.rotation), self.center)

    def _index(self, slots: Slots) -> Union[slice, mx.array]:
        """`slots` as a slice or an int32 index. Python and numpy slot lists are range-checked; an mx.array index
        is trusted (checking it would force evaluation on every decode step; the arena's slots come from its
        allocator)."""
        if isinstance(slots, slice):
            if slots.step is not None and slots.step < 1:
                raise InvalidArgumentError(f"slots: slice step {slots.step!r} must be positive")
            return slots
        if isinstance(slots, mx.array):
            if slots.ndim != 1 or not mx.issubdtype(slots.dtype, mx.integer):
                raise InvalidArgumentError(f"slots: must be a 1-D integer array, got {slots.dtype} {slots.shape}")
            return slots
        values = np.asarray(slots)
        if values.ndim != 1 or (values.size and not np.issubdtype(values.dtype, np.integer)):
            raise InvalidArgumentError(f"slots: {slots!r} must be a 1-D sequence of slot numbers")
        if values.size and (values.min() < 0 or values.max() >= self.num_slots):
            raise InvalidArgumentError(f"slots: every slot must be in [0, {self.num_slots}), got {slots!r}")
        return mx.array(values.astype(np.int32))
