"""How one layer of a batched decode step attends over the arena: the strategies behind `BatchLayerCache`.

mlx-lm models call `cache.update_and_fetch(k, v)` and then `scaled_dot_product_attention(q, k, v, cache=cache,
...)`; `engine.attention_hook.dispatch_sdpa` hands that second call to `cache.attention_hook` when the cache
has one. A `BatchLayerCache` always returns the padded gather of the batch from `update_and_fetch` (lazily: MLX
never computes it unless something uses it) and, for the strategies below, installs its own hook that attends
straight from the arena and ignores the gather. Anything unexpected at hook time (learned sinks, a different
mask) attends over the gather instead, and a model whose SDPA is not routed through the hook simply consumes it:
a strategy can be slower than planned, never wrong.

Strategies (`backend.attention.AttentionStrategy`; the engine's compute backend picks one per batch, see
backend/attention.py for the CPU and Metal rules; bench/results/arena_attention.md and strategy_crossover.md have
the measurements):
- `paged`: the paged-attention kernel (kernels/paged_attention.py) reads K/V through the block tables, GQA-aware,
  no copy. The Metal backend's choice when the kernels run on Metal.
- `strided`: when every table is contiguous and the sequences start at evenly spaced slots (a contiguous
  arena's equal reservations), the layer buffer [1, H, S, D] *is* a strided [B, H, L, D] array: `mx.as_strided`
  makes that view (batch stride = the spacing) and one SDPA attends over it, masked where a sequence is shorter
  than the longest. No copy and one op, like mlx-lm's dense batch cache. The CPU backend's choice when the layout
  allows it (`strided_layout`) and the longest sequence is short or long (in between `blocks` is faster).
  Requested where the layout does not allow it, the automatic choice runs instead.
- `per_sequence`: each sequence whose block table is contiguous gets one SDPA over a zero-copy view of its K/V:
  the same operands and operation as the unbatched decode (`ArenaKVCache`), so its output is bit-identical to
  it. The sequences with paged tables go together through `paged_attention` (on CPU its reference: a padded
  gather of only those rows + one masked SDPA, as the `gather` strategy does for all).
- `blocks`: attention block by block through the padded block table with `mx.gather_mm`: the queries of each
  (sequence, KV head) are multiplied with the K block of every table entry in place (no copy of K/V, GQA folded:
  a KV head's G query heads are G rows of one matmul), one softmax over the padded, masked scores, then the same
  block-wise product with V, summed over blocks. A fixed number of MLX ops whatever the batch, and paged tables
  cost the same as contiguous ones. The CPU backend's choice for paged tables and for contiguous ones of middle
  length. Not bit-identical to the unbatched decode (the sum over blocks adds in another order): equal to
  rounding. CPU `gather_mm` is float32 only: half-precision arenas get `per_sequence` instead.
- `gather`: the padded [B, H, max_blocks * bs, D] gather + one masked SDPA (no hook): kept to compare; also what
  the runner's own hook (KV policies: scores, logit biases) attends over.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, cast

import mlx.core as mx
import numpy as np

from cortexstream.backend.attention import ENV_VAR, AttentionStrategy, attention_for_device  # noqa: F401 (ENV_VAR)
from cortexstream.kernels.fast_softmax import softmax
from cortexstream.kernels.paged_attention import paged_attention
from cortexstream.kv.quantized_attention import decode_attention, decode_attention_per_head


class DecodeBatch(Protocol):
    """What the strategies read of a batch (`batch_cache.DecodeBatch` implements it). A protocol rather than an
    import, because `batch_cache` builds its batches with this module's strategy choice."""

    arena: Any  # KVArena
    sequences: Sequence[Any]  # SequenceKV per row
    firsts: list[int | None]  # contiguous start block per row (None: paged)
    dequantize: bool  # a quantized arena's rows are read by dequantizing first
    strided: tuple[int, int] | None  # (first slot, pitch) when the rows are evenly spaced runs
    quantized_strided: bool  # a quantized batch attends over strided views of its codes
    quantized_per_head: bool  # ... or one KV head at a time over each run's contiguous rows
    lengths_after: np.ndarray  # physical keys per row after this step
    table: mx.array  # padded block table [B, max_blocks]
    mask: mx.array  # padding mask [B, 1, 1, max_blocks * block_size]
    step_mask: mx.array | None  # the mask handed to the model (None: no padding)

    @property
    def paged(self) -> Any: ...  # `PagedRows` of the paged rows, or None

    def block_indices(self, num_blocks: int) -> tuple[mx.array, mx.array, mx.array]: ...

    def lengths_array(self) -> mx.array: ...


GATHER, PER_SEQUENCE, BLOCKS, STRIDED, PAGED, QUANTIZED = (
    AttentionStrategy.GATHER, AttentionStrategy.PER_SEQUENCE, AttentionStrategy.BLOCKS, AttentionStrategy.STRIDED,
    AttentionStrategy.PAGED, AttentionStrategy.QUANTIZED)
STRATEGIES = tuple(s for s in AttentionStrategy if s is not QUANTIZED)  # what a float arena can be asked for


def choose_strategy(requested: str | None = None, dtype: mx.Dtype = mx.float32, strided: bool = False,
                    num_keys: int = 0) -> AttentionStrategy:
    """The strategy for a batch built without an engine's backend (tests, benchmarks): `requested` if set and
    not `auto`, else the rule of the current device (`backend.attention.attention_for_device`, which also reads
    $CORTEXSTREAM_BATCH_ATTENTION). strided: whether the batch's layout allows the strided view; num_keys: its
    longest sequence's keys; dtype: the arena's."""
    return attention_for_device().choose(requested, dtype, strided, num_keys)


def evenly_spaced(positions: Sequence[int]) -> slice | None:
    """`positions` as a stepped slice when they increase by a constant step (one position: step 1), else None."""
    if len(positions) == 0:
        return None
    first = int(positions[0])
    if len(positions) == 1:
        return slice(first, first + 1)
    step = int(positions[1]) - first
    if step <= 0 or any(int(b) - int(a) != step for a, b in zip(positions, positions[1:])):
        return None
    return slice(first, int(positions[-1]) + 1, step)


def strided_layout(firsts: list[int | None], width: int, block_size: int, num_slots: int) -> tuple[int, int] | None:
    """(first slot, spacing in slots) when every sequence's table is contiguous (`firsts`: first blocks) and the
    starts are evenly spaced in increasing order, so that a window of `width` slots from each start is one
    strided view of the layer buffer that stays inside it; else None. One sequence: spacing 0."""
    if not firsts or any(f is None for f in firsts):
        return None
    starts = evenly_spaced([int(f) * block_size for f in firsts])  # type: ignore[arg-type]
    if starts is None or starts.stop - 1 + width > num_slots:
        return None
    return starts.start, starts.step if len(firsts) > 1 else 0


def hook_applies(batch: "DecodeBatch", queries: mx.array, mask: Any, sinks: mx.array | None) -> bool:
    """True when the call is the plain decode step the arena strategies implement: one query per sequence, the
    batch's own padding mask, no learned sinks (neither strategy models those)."""
    return sinks is None and queries.ndim == 4 and queries.shape[2] == 1 and mask is batch.step_mask


def per_sequence_attention(batch: "DecodeBatch", layer: int, queries: mx.array, scale: float) -> mx.array:
    """One SDPA per contiguous sequence over a zero-copy view of its K/V; the paged sequences (if any) together
    through `paged_attention` (on CPU its reference: one padded gather of just those rows + a masked SDPA).
    Outputs in batch order: [B, Hq, 1, DV].

    All sequences' new tokens were scattered by `update_and_fetch` before this runs, so the views see them and no
    write follows a read of the same buffer within the graph (which would make MLX copy the whole buffer).
    """
    arena = batch.arena
    size = queries.shape[0]
    paged = batch.paged
    if paged is not None and len(paged.rows) == size:  # nothing contiguous: one call for all
        return paged_kernel_attention(batch, layer, queries, scale)
    paged_out = None
    if paged is not None:
        paged_out = cast(mx.array, paged_attention(
            queries[paged.index], *arena.layer_buffers(layer), paged.table, paged.lengths, scale,
            arena.config.block_size))
    outs, row = [], 0
    for b, seq in enumerate(batch.sequences):
        first = batch.firsts[b]
        if first is None:  # the next paged row, in batch order
            outs.append(paged_out[row : row + 1])
            row += 1
            continue
        k, v = arena.run_view(layer, first, int(batch.lengths_after[b]))
        # mask None: every query of a decode step sees every key; exactly what the unbatched decode computes
        outs.append(mx.fast.scaled_dot_product_attention(queries[b : b + 1], k, v, scale=scale))
    return mx.concatenate(outs, axis=0)


def quantized_attention(batch: "DecodeBatch", layer: int, queries: mx.array, scale: float) -> mx.array:
    """The `quantized` strategy: each sequence attends over its stored rows (codes with scales and biases; a
    contiguous table's are slices, a paged one's a gather of its slots), reading the codes as the batch's
    backend says (`kv.quantized_attention.decode_attention`). Outputs in batch order: [B, Hq, 1, DV]."""
    arena = batch.arena
    if batch.quantized_strided:  # one call over strided views of the codes, masked where a row is shorter
        width = int(batch.lengths_after.max())
        keys, values = arena.strided_rows(layer, queries.shape[0], batch.strided, width)
        mask = None if bool((batch.lengths_after == width).all()) else batch.mask[..., :width]
        return decode_attention(queries, keys, values, scale, mask, batch.dequantize)
    outs = []
    for b, seq in enumerate(batch.sequences):
        length = int(batch.lengths_after[b])
        first = batch.firsts[b]
        if first is not None:
            keys, values = arena.run_rows(layer, first, length)
            if batch.quantized_per_head and not batch.dequantize:
                outs.append(decode_attention_per_head(queries[b : b + 1], keys, values, scale))
                continue
        else:  # a gather: contiguous already
            keys, values = arena.table_rows(layer, seq.blocks, length)
        outs.append(decode_attention(queries[b : b + 1], keys, values, scale, None, batch.dequantize))
    return mx.concatenate(outs, axis=0)


def paged_kernel_attention(batch: "DecodeBatch", layer: int, queries: mx.array, scale: float) -> mx.array:
    """The paged-attention kernel over the layer's arena buffers through the batch's block table: [B, Hq, 1, D]."""
    arena = batch.arena
    out = paged_attention(queries, *arena.layer_buffers(layer), batch.table, batch.lengths_array(),
                          scale, arena.config.block_size)
    return cast(mx.array, out)  # colsum=False: the output alone


def strided_view(buffer: mx.array, batch_size: int, layout: tuple[int, int], width: int) -> mx.array:
    """The layer buffer [1, H, S, D] seen as [B, H, width, D]: sequence b's slots from `first + b * pitch` on."""
    first, pitch = layout
    _, heads, slots, dim = buffer.shape
    return mx.as_strided(buffer, (batch_size, heads, width, dim), (pitch * dim, slots * dim, dim, 1), first * dim)


def strided_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: mx.array | None) -> mx.array:
    """One SDPA over the batch's strided views ([B, H, longest, D], from `BatchLayerCache.update_and_fetch`);
    `mask` hides the shorter sequences' tails (None when all are equally long). Those slots (spare room, the next
    sequence) hold finite values (the arena starts zeroed), so their zero probabilities contribute nothing."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def block_matmul_attention(batch: "DecodeBatch", layer: int, queries: mx.array, scale: float) -> mx.array:
    """Decode attention through the block table with two `gather_mm`s, K/V read in place: [B, Hq, 1, DV].

    The layer's buffers [1, H, S, D] are viewed as H * NB matrices of one block each (free reshapes; NB = S / bs,
    the buffer's own size, which can be below the arena's budget while it grows), so
    `batch.block_indices(NB)[1][b, h, j]` = h * NB + table[b, j] picks KV head h's rows of block j of sequence b.
    """
    cfg = batch.arena.config
    size, q_heads, _, dim = queries.shape
    heads, bs = cfg.num_kv_heads, cfg.block_size
    blocks = batch.arena.keys[layer].shape[2] // bs
    group, max_blocks = q_heads // heads, batch.table.shape[1]
    keys = batch.arena.keys[layer].reshape(heads * blocks, bs, dim).swapaxes(-1, -2)  # [H * NB, D, bs] view
    values = batch.arena.values[layer].reshape(heads * blocks, bs, -1)
    # query head h * G + g reads KV head h (mlx-lm's GQA mapping); scaled first, as mx.fast's SDPA does
    q = (queries * scale).astype(keys.dtype).reshape(size * heads, group, dim)
    query_index, block_index, prob_index = batch.block_indices(blocks)
    scores = mx.gather_mm(q, keys, query_index, block_index)  # [B, H, MB, G, bs]
    scores = scores.transpose(0, 1, 3, 2, 4).reshape(size, heads, group, max_blocks * bs)
    scores = mx.where(batch.mask, scores, mx.array(-mx.inf, scores.dtype))  # padding and unused slots
    probs = softmax(scores).reshape(size, heads, group, max_blocks, bs).transpose(0, 1, 3, 2, 4)
    out = mx.gather_mm(probs.reshape(-1, group, bs), values, prob_index, block_index)  # [B, H, MB, G, DV]
    return out.sum(axis=2).reshape(size, q_heads, 1, -1).astype(queries.dtype)
