"""mlx-lm cache protocol for one forward pass over several sequences' prefill chunks (batched prefill).

The chunks are left-padded to the longest, `[B, L]`, so every row's last real token sits at position L - 1 and
one head call on the last position gives each sequence's next-token logits. RoPE gets per-row offsets (`offset`
is an array): row i's first real token, at padded index L - len_i, must land on its logical position.

Each layer's `update_and_fetch` writes only the real tokens into the rows' arena slots (one scatter per buffer)
and returns, per row, its earlier KV (gathered from the arena, right-aligned) followed by the chunk's own keys:
`[B, H, hist_max + L, D]`. A boolean mask hides the left padding of both parts and keeps the chunk causal. When
no row has earlier KV (fresh prompts, the common case) nothing is gathered: attention runs on the new keys.

Padded query rows compute garbage that is never read; each may attend to itself so that no softmax row is
empty (an all-masked row would give NaN, and NaN values multiplied by a zero weight in the next layer are NaN).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from cortexstream.kv.arena import KVArena, as_dtype
from cortexstream.kv.arena_sides import as_read_back, per_row_codec, read_side
from cortexstream.kv.sequence_kv import SequenceKV


class PrefillBatch:
    """Addressing shared by all layers for one batched prefill forward; `commit()` advances the counters."""

    def __init__(self, arena: KVArena, sequences: list[SequenceKV], chunks: list[list[int]]) -> None:
        if not sequences or len(sequences) != len(chunks) or any(not c for c in chunks):
            raise ValueError("PrefillBatch needs one non-empty chunk per sequence")
        self.arena = arena
        self.sequences = sequences
        self.chunk_lengths = [len(c) for c in chunks]
        batch, width = len(chunks), max(self.chunk_lengths)
        self.width = width
        history = [s.num_tokens for s in sequences]
        self.history_width = max(history)
        tokens = np.zeros((batch, width), dtype=np.uint32)  # padding id 0: any valid embedding row will do
        pads = [width - n for n in self.chunk_lengths]
        for i, chunk in enumerate(chunks):
            tokens[i, pads[i]:] = chunk
        self.tokens = mx.array(tokens)
        self.offsets = mx.array(np.array([s.offsets[0] - pad for s, pad in zip(sequences, pads)], dtype=np.int32))
        # Where the real tokens go: their flat index in the [B * L] chunk and their arena slot.
        source = np.concatenate([i * width + np.arange(pads[i], width) for i in range(batch)])
        slots = np.concatenate([arena.slot_indices(s.blocks, h, h + n)
                                for s, h, n in zip(sequences, history, self.chunk_lengths)])
        self.source = None if len(source) == batch * width else mx.array(source.astype(np.int32))
        self.slots = mx.array(slots.astype(np.int32))
        self.history_slots = self._history_slots(history) if self.history_width else None
        self.mask = self._mask(history, pads)

    def _history_slots(self, history: list[int]) -> mx.array:
        """[B, hist_max] arena slots of each row's earlier KV, right-aligned (padding reads slot 0, masked)."""
        index = np.zeros((len(history), self.history_width), dtype=np.int32)
        for i, (seq, n) in enumerate(zip(self.sequences, history)):
            if n:
                index[i, self.history_width - n:] = self.arena.slot_indices(seq.blocks, 0, n)
        return mx.array(index)

    def _mask(self, history: list[int], pads: list[int]) -> Any:
        if self.history_width == 0 and not any(pads):
            return "causal"  # equal fresh chunks: SDPA's own causal path
        width = self.width
        query = np.arange(width)[:, None]
        key = np.arange(width)[None, :]
        causal = key <= query
        rows = []
        for n, pad in zip(history, pads):
            chunk_part = (causal & (key >= pad)) | (key == query)
            history_part = np.broadcast_to(np.arange(self.history_width)[None, :] >= self.history_width - n,
                                           (width, self.history_width))
            rows.append(np.concatenate([history_part, chunk_part], axis=1))
        return mx.array(np.stack(rows)[:, None])

    def caches(self) -> list["PrefillLayerCache"]:
        return [PrefillLayerCache(self, layer) for layer in range(self.arena.config.num_layers)]

    def commit(self) -> None:
        """Advance every sequence's counters once the forward pass has been built."""
        for seq, n in zip(self.sequences, self.chunk_lengths):
            seq.advance(n)


class PrefillLayerCache:
    def __init__(self, batch: PrefillBatch, layer: int) -> None:
        self.batch = batch
        self.layer = layer

    @property
    def offset(self) -> mx.array:
        return self.batch.offsets

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if n != self.batch.width:
            raise ValueError(f"PrefillBatch caches expect chunks of width {self.batch.width}, got {n}")
        if window_size is not None:
            raise ValueError("PrefillBatch does not support sliding-window attention")
        mask = self.batch.mask
        if isinstance(mask, str) and return_array:
            width = self.batch.width
            return mx.array(np.tril(np.ones((width, width), dtype=bool)))
        return mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        batch, arena = self.batch, self.batch.arena
        arena.write_slots(self.layer, batch.slots, self._real_tokens(keys), self._real_tokens(values))
        # What a read of the arena returns once written (a quantized side's rows through the quantizer and back),
        # so the chunk attends over the values every other path sees.
        keys = self._read_back(arena.keys[self.layer], keys)
        values = self._read_back(arena.values[self.layer], values)
        if batch.history_slots is None:
            return keys, values
        history_keys, history_values = self._history(keys.dtype)
        return (mx.concatenate([history_keys, keys], axis=2), mx.concatenate([history_values, values], axis=2))

    def _read_back(self, side: Any, rows: mx.array) -> mx.array:
        """`rows` `[B, H, L, D]` as the arena returns them once written: through the codec for a per-row codec,
        else read from the arena (keys grouped per channel: a row's value depends on its block); padding as is."""
        arena = self.batch.arena
        if per_row_codec(side):
            return as_read_back(side, rows, arena.dtype)
        stored = read_side(side, self.batch.slots, arena.dtype)[0]  # [H, real tokens, D] in slot order
        size, heads, width, dim = rows.shape
        if self.batch.source is None:
            flat = stored
        else:
            flat = rows.astype(arena.dtype).transpose(1, 0, 2, 3).reshape(heads, size * width, dim)
            flat[:, self.batch.source] = stored
        return flat.reshape(heads, size, width, dim).transpose(1, 0, 2, 3)

    def _real_tokens(self, array: mx.array) -> mx.array:
        """[B, H, L, D] -> [H, real tokens, D] in slot order (rows in order, padding dropped)."""
        size, heads, width, dim = array.shape
        flat = array.transpose(1, 0, 2, 3).reshape(heads, size * width, dim)
        return flat if self.batch.source is None else flat[:, self.batch.source]

    def _history(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """Each row's earlier K and V, right-aligned: [B, H, hist_max, D] each."""
        slots = self.batch.history_slots
        batch, width = slots.shape
        keys, values = self.batch.arena.gather_slots(self.layer, slots.reshape(-1))  # [H, B * hist_max, D]
        return tuple(as_dtype(x.reshape(x.shape[0], batch, width, -1).transpose(1, 0, 2, 3), dtype)
                     for x in (keys, values))  # type: ignore[return-value]


def group_chunks(items: list[Any], batch_prefill: bool = True, max_padding: float = 1.25) -> list[list[Any]]:
    """Prefill chunks (`WorkItem`s) grouped into batched passes: chunks of similar length together (a group's
    padded size stays within `max_padding` x its real tokens); an item that must be alone (`alone`), and every
    item without `batch_prefill`, in a pass of its own."""
    if not batch_prefill:
        return [[item] for item in items]
    groups: list[list[Any]] = [[item] for item in items if item.alone]
    batched: list[list[Any]] = []
    for item in sorted((i for i in items if not i.alone), key=lambda i: -i.num_tokens):
        group = batched[-1] if batched else None
        if group is not None and (len(group) + 1) * group[0].num_tokens <= max_padding * (
                sum(i.num_tokens for i in group) + item.num_tokens):
            group.append(item)
        else:
            batched.append([item])
    return groups + batched
