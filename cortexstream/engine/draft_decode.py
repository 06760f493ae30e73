"""The draft model's one-token passes (engine/draft_runner.py): the decode path, not a packed chunk.

After a drafting item's first pass (which feeds the tokens the draft model has not seen, a chunk), every later pass
of a proposal feeds one token per sequence: exactly a decode step. Run as one, it takes the path plain decoding
takes: one sequence attends through its own per-layer cache (a zero-copy view of a contiguous block table), several
through one `DecodeBatch` (the arena's batched decode attention), instead of the packed prefill of
`engine/mixed_batch.py`, which gathers each sequence's KV and attends row by row.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from cortexstream.engine.batch_cache import DecodeBatch
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


__all__ = ["one_token_pass"]
