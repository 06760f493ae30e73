"""mlx-lm cache protocol for one forward pass that decodes some sequences and prefills chunks of others.

Without it, a step that decodes while a prompt is admitted runs two forward passes, and each pass pays the fixed
cost of reading every weight (on a CPU, a large part of a small model's decode step). Here the
decode tokens and the prompt chunks share one pass, packed one token per batch row: the input is `[T, 1]` with
the D decode tokens first, then each chunk's tokens in order. RoPE takes a per-row offset (`offset` is an array),
so every row, a decode token or a chunk token, is rotated to its own position; the projections and the MLP see
T rows, the same work as T tokens in any other layout, and no padding.

Per layer, `update_and_fetch` writes all T new keys/values into their arena slots with one scatter per buffer,
before anything reads the buffer (a read followed by a write of the same buffer would make MLX copy it). Then
attention, through the layer's `attention_hook` (see `attention_hook.dispatch_sdpa`), is split:
- the D decode queries attend exactly as in a decode-only step: the same `DecodeBatch` and strategy
  (`batch_cache.BatchLayerCache.attend`), over the same views;
- each chunk's queries, regrouped as `[1, Hq, n, Dh]`, attend with one causal SDPA over that sequence's earlier
  KV and the chunk (a zero-copy view when its table is contiguous, else a block gather), the same operation as
  its prefill alone (`ArenaKVCache`).

Used only for sequences on the arena without an evicting policy or a sequence hook, on the mlx-lm model families
whose attention goes through the hook (`runner.head_of` knows them); everything else keeps its own passes.

Speculative decoding verifies drafted tokens as chunks (the last token and the drafts, logits at every row) in the
same pass; when every decoding sequence drafts, the batch has chunks only (`decode` None).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from cortexstream.engine.batch_attention import GATHER, STRIDED, strided_view
from cortexstream.engine.batch_cache import BatchLayerCache, DecodeBatch
from cortexstream.kernels.fast_softmax import softmax
from cortexstream.kv.sequence_kv import SequenceKV


class MixedBatch:
    """Addressing for one packed decode + prefill forward; `commit()` advances every sequence's counters."""

    def __init__(self, decode: DecodeBatch | None, chunks: list[tuple[SequenceKV, list[int]]],
                 arena: Any = None) -> None:
        if not chunks or any(not ids for _, ids in chunks) or (decode is not None and not decode.sequences):
            raise ValueError("MixedBatch needs non-empty chunks and, when given, a decode batch with sequences")
        if decode is None and arena is None:
            raise ValueError("MixedBatch without a decode batch needs the arena")
        arena = decode.arena if decode is not None else arena
        self.decode = decode
        self.arena = arena
        self.chunks = [kv for kv, _ in chunks]
        self.chunk_lengths = [len(ids) for _, ids in chunks]
        self.num_decode = 0 if decode is None else len(decode.sequences)
        self.histories = [kv.num_tokens for kv in self.chunks]
        # rows [start, end) of each chunk in the packed batch
        ends = self.num_decode + np.cumsum(self.chunk_lengths)
        self.row_ranges = [(int(e - n), int(e)) for e, n in zip(ends, self.chunk_lengths)]
        self.chunk_tokens = mx.array(np.concatenate([np.asarray(ids, dtype=np.uint32) for _, ids in chunks]))
        chunk_offsets = np.concatenate([kv.offsets[0] + np.arange(n) for kv, n in zip(self.chunks, self.chunk_lengths)])
        chunk_offsets_array = mx.array(chunk_offsets.astype(np.int32))
        self.offsets = chunk_offsets_array if decode is None else mx.concatenate([decode.offsets, chunk_offsets_array])
        chunk_slots = np.concatenate([arena.slot_indices(kv.blocks, h, h + n)
                                      for kv, h, n in zip(self.chunks, self.histories, self.chunk_lengths)])
        chunk_slots_array = mx.array(chunk_slots.astype(np.int32))
        self.slots = chunk_slots_array if decode is None else mx.concatenate([decode.slots, chunk_slots_array])
        self.firsts = [kv.contiguous_first() for kv in self.chunks]

    @property
    def num_rows(self) -> int:
        return self.num_decode + sum(self.chunk_lengths)

    def tokens(self, decode_tokens: mx.array | None) -> mx.array:
        """The packed input `[T, 1]`: the decode tokens (`[D, 1]`, possibly lazy) then the chunks' tokens."""
        if decode_tokens is None:
            return self.chunk_tokens.reshape(-1, 1)
        return mx.concatenate([decode_tokens.astype(mx.uint32).reshape(-1), self.chunk_tokens]).reshape(-1, 1)

    def logit_rows(self, done: list[bool], every: list[bool] | None = None) -> list[int]:
        """Rows whose logits the step needs: every decode row, the last row of each chunk that ends its prompt,
        and every row of a chunk marked in `every` (drafted tokens being verified)."""
        rows = list(range(self.num_decode))
        for i, ((start, end), last) in enumerate(zip(self.row_ranges, done)):
            if every is not None and every[i]:
                rows += list(range(start, end))
            elif last:
                rows.append(end - 1)
        return rows

    def caches(self) -> list["MixedLayerCache"]:
        return [MixedLayerCache(self, layer) for layer in range(self.arena.config.num_layers)]

    def commit(self) -> None:
        """Advance the counters once the forward pass has been built."""
        if self.decode is not None:
            self.decode.commit()
        for kv, n in zip(self.chunks, self.chunk_lengths):
            kv.advance(n)


class MixedLayerCache:
    def __init__(self, batch: MixedBatch, layer: int) -> None:
        self.batch = batch
        self.layer = layer
        self._decode = BatchLayerCache(batch.decode, layer) if batch.decode is not None else None
        self._decode_kv: tuple[mx.array, mx.array] | None = None
        self._chunk_kv: list[tuple[mx.array, mx.array]] = []

    @property
    def offset(self) -> mx.array:
        return self.batch.offsets

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> Any:
        if n != 1 or window_size is not None:
            raise ValueError("MixedBatch caches take one token per row and no sliding window")
        return None if self.batch.decode is None else self.batch.decode.step_mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        batch, arena = self.batch, self.batch.arena
        rows, heads = keys.shape[0], keys.shape[1]
        # [T, H, 1, D] -> [H, T, D], broadcast into the [1, H, T, D] target: every write before any read
        arena.write_slots(self.layer, batch.slots, keys.reshape(rows, heads, -1).swapaxes(0, 1),
                          values.reshape(rows, heads, -1).swapaxes(0, 1))
        decode = batch.decode
        if decode is None:
            pass
        elif decode.strategy == STRIDED:
            width = int(decode.lengths_after.max())
            keys_buf, values_buf = arena.keys[self.layer], arena.values[self.layer]
            self._decode_kv = (strided_view(keys_buf, batch.num_decode, decode.strided, width),
                               strided_view(values_buf, batch.num_decode, decode.strided, width))
        else:  # lazy: read only by the `gather` strategy
            self._decode_kv = arena.gather_tables(self.layer, decode.table)
        self._chunk_kv = []
        for kv, first, history, n in zip(batch.chunks, batch.firsts, batch.histories, batch.chunk_lengths):
            if first is not None:
                self._chunk_kv.append(arena.run_view(self.layer, first, history + n))
            else:
                k, v = arena.read(self.layer, kv.blocks, history + n)
                self._chunk_kv.append((k[None], v[None]))
        return keys, values  # what attention reads comes from the views above, through the hook

    def attention_hook(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                       sinks: mx.array | None = None) -> mx.array:
        batch = self.batch
        if sinks is not None or queries.ndim != 4 or queries.shape[0] != batch.num_rows or queries.shape[2] != 1:
            raise RuntimeError("MixedBatch: the model's attention is not the plain one-token-per-row call it packs "
                               f"(queries {tuple(queries.shape)}, sinks {sinks is not None})")
        outs = []
        if batch.num_decode:
            decode_keys, decode_values = self._decode_kv  # type: ignore[misc]
            decode_queries = queries[: batch.num_decode]
            if batch.decode.strategy == GATHER:  # the padded gather + one masked SDPA, as without the hook
                outs.append(mx.fast.scaled_dot_product_attention(decode_queries, decode_keys, decode_values,
                                                                 scale=scale, mask=batch.decode.step_mask))
            else:
                outs.append(self._decode.attend(decode_queries, decode_keys, decode_values, scale,
                                                batch.decode.step_mask))
        for (start, end), (k, v) in zip(batch.row_ranges, self._chunk_kv):
            q = queries[start:end].transpose(2, 1, 0, 3)  # [n, Hq, 1, D] -> [1, Hq, n, D]
            outs.append(chunk_attention(q, k, v, scale).transpose(2, 1, 0, 3))
        return mx.concatenate(outs, axis=0)


# Chunk tokens up to which `chunk_attention` folds grouped query heads into matmul rows (the adaptive budget's
# floor-size chunks at long contexts; bench/results/throughput_itl.md).
FOLD_MAX_TOKENS = 4


def chunk_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal attention of a chunk's n queries `[1, Hq, n, D]`, the last n positions of `keys`/`values`
    `[1, H, L, D]`: what `mx.fast.scaled_dot_product_attention(..., mask="causal")` computes.

    On the CPU that call has no kernel of its own: with grouped query heads it broadcasts K and V to every query
    head of a group, a copy of each per layer. Up to FOLD_MAX_TOKENS queries on the CPU, the G query heads of a KV
    head are instead rows of one matmul, with no copy: the same operations (scale, q @ k^T, causal fill with the dtype's minimum, softmax with its
    exp compiled, kernels/fast_softmax.py, @ v), equal to the fused call's output to float rounding (BLAS may sum
    in another order for another row count), as the `blocks` decode strategy is to the unbatched decode."""
    _, q_heads, n, dim = queries.shape
    heads, length = keys.shape[1], keys.shape[2]
    if n > FOLD_MAX_TOKENS or mx.default_device() != mx.cpu or q_heads % heads:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask="causal")
    group = q_heads // heads
    scaled = (mx.array(scale, queries.dtype) * queries).reshape(1, heads, group * n, dim)
    scores = (scaled @ keys.swapaxes(-1, -2)).reshape(1, heads, group, n, length)
    visible = mx.arange(length)[None, :] <= mx.arange(length - n, length)[:, None]  # [n, L]
    scores = mx.where(visible, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
    probs = softmax(scores).reshape(1, heads, group * n, length)
    return (probs @ values).reshape(1, q_heads, n, -1)
