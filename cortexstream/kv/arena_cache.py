"""mlx-lm cache protocol over one layer of a `SequenceKV`: any mlx-lm model runs on it unchanged."""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from cortexstream.backend.attention import attention_for_device
from cortexstream.backend.sdpa import original_sdpa
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.quantized_attention import decode_attention, decode_attention_per_head
from cortexstream.kv.sequence_kv import SequenceKV, private_sequence


class ArenaKVCache:
    """Per-layer view of a sequence's KV in the arena (batch size 1).

    `offset` is the logical position (RoPE); `size()` the physical slots; they differ after eviction or compression.

    On a quantized arena, `update_and_fetch` returns the dequantized K/V (lazily) and the cache carries an
    `attention_hook` (reached once the model's SDPA is routed, see `backend.sdpa`) that attends a decode step's one
    query over the stored codes instead (`kv.quantized_attention`); any other call (a prefill chunk, a mask,
    learned sinks) attends over the dequantized K/V. An unrouted model simply consumes those: slower, never wrong.
    The cache has no `bits` attribute, so mlx-lm's own SDPA never takes its K/V for mlx-lm's quantized tuples.
    """

    attention_hook: Callable[..., mx.array] | None = None

    def __init__(self, sequence: SequenceKV, layer: int) -> None:
        self.sequence = sequence
        self.layer = layer
        self._rows: tuple[Any, Any] | None = None  # a quantized arena's stored rows from the last update
        if sequence.arena.quantized:
            self._rule = attention_for_device()
            self._dequantize = self._rule.dequantize_quantized(sequence.arena.dtype)
            self._contiguous = False  # whether the last update's rows are a run's slices (else a gather)
            self.attention_hook = self._quantized_attend

    # --- protocol: positions ----------------------------------------------------------------------------------
    @property
    def offset(self) -> int:
        return self.sequence.offsets[self.layer]

    @offset.setter
    def offset(self, value: int) -> None:
        self.sequence.offsets[self.layer] = int(value)

    def size(self) -> int:
        return self.sequence.lengths[self.layer]

    def empty(self) -> bool:
        return self.sequence.lengths[self.layer] == 0

    # --- protocol: attention ----------------------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the new `[1, H, n, D]` keys/values in place; return all of this layer's K/V as `[1, H, len, D]`.

        Contiguous sequences get a strided view of the arena (no copy); paged ones a block gather.
        """
        if keys.shape[0] != 1:
            raise InvalidArgumentError(
                f"ArenaKVCache holds one sequence; got batch {keys.shape[0]} (use the engine for batches)"
            )
        seq, layer = self.sequence, self.layer
        start = seq.lengths[layer]
        n = keys.shape[2]
        end = start + n
        if end > seq.capacity:
            seq.ensure_capacity(end)
        if layer == 0:  # blocks span all layers: one copy-on-write check per forward pass
            seq.make_writable(start, end)
        arena = seq.arena
        first = seq.contiguous_first()
        seq.lengths[layer] = end
        seq.offsets[layer] += n
        if first is not None:
            # The decode hot path, run per layer per token: one slice update (in place) and one slice per buffer,
            # the same graph as mlx-lm's KVCache.
            fetched = arena.append_to_run(layer, first, start, keys, values)
            if arena.quantized:  # taken after the write: an array taken before it would not see the new rows
                self._rows, self._contiguous = arena.run_rows(layer, first, end), True
            return fetched
        arena.write(layer, seq.blocks, start, keys[0], values[0], first)
        if arena.quantized:
            self._rows, self._contiguous = arena.table_rows(layer, seq.blocks, end), False
        k, v = arena.read(layer, seq.blocks, end, first)
        return k[None], v[None]

    def _quantized_attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                          sinks: mx.array | None = None) -> mx.array:
        if self._rows is None or sinks is not None or mask is not None or queries.shape[2] != 1:
            return original_sdpa(queries, keys, values, None, scale=scale, mask=mask, sinks=sinks)
        if self._contiguous and not self._dequantize and self._rule.quantized_per_head(self.size()):
            return decode_attention_per_head(queries, *self._rows, scale)
        return decode_attention(queries, *self._rows, scale, None, self._dequantize)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """Causal mask for n new queries over the physical keys (prior slots are all visible)."""
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(n, offset=self.size(), return_array=return_array, window_size=window_size)

    # --- protocol: state --------------------------------------------------------------------------------------
    @property
    def state(self) -> tuple[mx.array, mx.array] | list:
        length = self.size()
        if length == 0:
            return []
        k, v = self.sequence.arena.read(self.layer, self.sequence.blocks, length)
        return k[None], v[None]

    @state.setter
    def state(self, value: tuple[mx.array, mx.array]) -> None:
        keys, values = value
        seq = self.sequence
        n = keys.shape[2]
        seq.ensure_capacity(n)
        seq.make_writable(0, n)
        seq.arena.write(self.layer, seq.blocks, 0, keys[0], values[0])
        seq.lengths[self.layer] = n

    @property
    def meta_state(self) -> tuple[str, str]:
        return str(self.offset), str(self.size())

    @meta_state.setter
    def meta_state(self, value: tuple[str, str]) -> None:
        self.offset = int(value[0])
        if int(value[1]) != self.size():
            raise InvalidArgumentError(f"meta_state: physical length {value[1]} != stored {self.size()}")

    @classmethod
    def from_state(cls, state: tuple[mx.array, mx.array], meta_state: tuple[str, str] | None = None) -> "ArenaKVCache":
        """A single-layer cache in a private arena holding `state` (mlx-lm's `load_prompt_cache` hook)."""
        keys, values = state
        seq = private_sequence(1, keys.shape[1], keys.shape[3], values.shape[3], keys.shape[2], str(keys.dtype))
        cache = cls(seq, 0)
        cache.state = state
        cache.offset = int(meta_state[0]) if meta_state else keys.shape[2]
        return cache

    # --- protocol: trimming and size --------------------------------------------------------------------------
    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n tokens (physical and logical); returns how many were dropped."""
        n = max(0, min(self.size(), int(n)))
        self.sequence.lengths[self.layer] -= n
        self.sequence.offsets[self.layer] -= n
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of arena storage this layer of the sequence occupies (allocated blocks, K and V)."""
        cfg = self.sequence.arena.config
        return len(self.sequence.blocks) * cfg.bytes_per_block // cfg.num_layers
