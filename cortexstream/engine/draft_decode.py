"""The draft model's passes on the engine's plain paths (engine/draft_runner.py), not as packed chunks.

- One-token passes. After a drafting item's first pass (which feeds the tokens the draft model has not seen),
  every later pass of a proposal feeds one token per sequence: exactly a decode step, run the way plain decoding
  runs one: one sequence through its own per-layer cache (a zero-copy view of a contiguous block table), several
  through one `DecodeBatch` (the arena's batched decode attention).
- Prompt chunks. A prompt chunk the target prefills is fed to the draft model in the same step (`feed_chunks`),
  so its KV is ready when decoding starts: without it, the first drafting pass would compute the whole prompt in
  the draft model between two output tokens, a stall as long as the draft model's prefill. No logits.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from cortexstream.engine.batch_cache import DecodeBatch
from cortexstream.engine.forward import body_of
from cortexstream.engine.prefill_batch import PrefillBatch
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.sequence_kv import SequenceKV


def one_token_pass(model: Any, arena: KVArena, sequences: Sequence[SequenceKV], tokens: Sequence[int]) -> mx.array:
    """One decode step of `model` for each sequence (its KV in `arena`) fed its token; returns logits `[B, V]`
    (unevaluated). Each sequence's lengths advance by one."""
    if not sequences or len(sequences) != len(tokens):
        raise InvalidArgumentError(f"draft pass: {len(sequences)} sequences for {len(tokens)} tokens")
    arena.grow_ahead()
    ids = mx.array([[int(t)] for t in tokens], dtype=mx.uint32)
    if len(sequences) == 1:
        caches = [ArenaKVCache(sequences[0], layer) for layer in range(arena.config.num_layers)]
        return model(ids, cache=caches)[:, -1, :]
    batch = DecodeBatch(arena, list(sequences))
    logits = model(ids, cache=batch.caches())
    batch.commit()
    return logits[:, -1, :]


def feed_chunks(model: Any, arena: KVArena, sequences: Sequence[SequenceKV], chunks: Sequence[Sequence[int]]) -> None:
    """Compute each sequence's chunk in `model` (its K/V written to `arena`, no logits), evaluated; each
    sequence's lengths advance by its chunk."""
    if not sequences or len(sequences) != len(chunks) or any(not chunk for chunk in chunks):
        raise InvalidArgumentError(f"draft feed: {len(sequences)} sequences for {len(chunks)} chunks, each non-empty")
    arena.grow_ahead()
    runs = body_of(model)  # no logits needed
    if len(sequences) == 1:
        ids = mx.array([int(t) for t in chunks[0]], dtype=mx.uint32)[None]
        out = runs(ids, cache=[ArenaKVCache(sequences[0], layer) for layer in range(arena.config.num_layers)])
    else:
        batch = PrefillBatch(arena, list(sequences), [[int(t) for t in chunk] for chunk in chunks])
        out = runs(batch.tokens, cache=batch.caches())
        batch.commit()
    mx.eval(out, arena.arrays())


__all__ = ["feed_chunks", "one_token_pass"]
