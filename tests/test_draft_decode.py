"""The draft model's one-token passes (engine/draft_decode.py) compute what the packed chunk pass computes: the
same logits and the same K/V written, for one sequence (its own cache) and for several (a decode batch), on
contiguous and paged block tables."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.backend.sdpa import route_sdpa
from cortexstream.engine.draft_decode import feed_chunks, one_token_pass
from cortexstream.engine.forward import head_of
from cortexstream.engine.mixed_batch import MixedBatch
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.sequence_kv import SequenceKV

BS = 8


def _sequences(model, tables, prompts):
    """A fresh arena whose sequences hold `prompts` (fed as one packed chunk pass). The model's SDPA is routed, as
    the engine routes it (the packed pass attends through its caches' hooks)."""
    route_sdpa(model)
    arena = KVArena(ArenaConfig.for_model(model, num_tokens=256, block_size=BS))
    arena.ensure_blocks(32)
    seqs = []
    for table in tables:
        seq = SequenceKV(arena, contiguous=False, managed=True)
        seq.sync(tuple(table), 0, 0)
        seqs.append(seq)
    _chunk_pass(model, arena, seqs, prompts)
    return arena, seqs


def _chunk_pass(model, arena, seqs, feeds):
    batch = MixedBatch(None, list(zip(seqs, feeds)), arena=arena)
    hidden = model.model(batch.tokens(None), cache=batch.caches())
    batch.commit()
    rows = batch.logit_rows([True] * len(seqs))
    return head_of(model)(hidden[mx.array(np.asarray(rows, dtype=np.int32))])[:, 0, :]


def _assert_same_kv(want_arena, want_seqs, got_arena, got_seqs):
    """Both arenas hold the same K/V for each pair of sequences, of the same lengths."""
    for a, b in zip(want_seqs, got_seqs):
        assert (a.num_tokens, a.logical_length) == (b.num_tokens, b.logical_length)
        for layer in range(want_arena.config.num_layers):
            ka, va = want_arena.read(layer, a.blocks, a.num_tokens)
            kb, vb = got_arena.read(layer, b.blocks, b.num_tokens)
            np.testing.assert_allclose(np.array(kb), np.array(ka), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.array(vb), np.array(va), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tables", [
    [(0, 1, 2, 3)],  # one sequence, contiguous
    [(5, 2, 9, 4)],  # one sequence, paged
    [(0, 1, 2, 3), (7, 4, 12, 10)],  # two: contiguous and paged
    [(3, 8, 1, 6), (11, 13, 2, 20), (14, 15, 16, 17)],
])
def test_one_token_passes_equal_the_packed_chunk_pass(tiny, tables):
    model, _ = tiny
    rng = np.random.default_rng(len(tables))
    prompts = [[int(x) for x in rng.integers(3, 250, size=n)] for n in rng.integers(5, 20, size=len(tables))]
    packed, packed_seqs = _sequences(model, tables, prompts)
    decoded, decoded_seqs = _sequences(model, tables, prompts)
    for step in range(3):  # several steps: the later ones read what the earlier ones wrote
        tokens = [int(x) for x in rng.integers(3, 250, size=len(tables))]
        want = _chunk_pass(model, packed, packed_seqs, [[t] for t in tokens])
        got = one_token_pass(model, decoded, decoded_seqs, tokens)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
        assert np.abs(np.array(want)).max() > 0.1  # logits, not zeros
    _assert_same_kv(packed, packed_seqs, decoded, decoded_seqs)


def test_a_token_per_sequence(tiny):
    model, _ = tiny
    arena, seqs = _sequences(model, [(0, 1, 2, 3)], [[5, 6, 7]])
    with pytest.raises(InvalidArgumentError, match="1 sequences for 2 tokens"):
        one_token_pass(model, arena, seqs, [1, 2])


@pytest.mark.parametrize("tables", [[(5, 2, 9, 4)], [(0, 1, 2, 3), (7, 4, 12, 10)]])
def test_feeding_chunks_writes_what_the_packed_pass_writes(tiny, tables):
    """`feed_chunks` (a prompt chunk the draft model computes in the target's prefill step), after earlier tokens:
    the same K/V and lengths as the packed chunk pass."""
    model, _ = tiny
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(3, 250, size=n)] for n in (6, 9)[: len(tables)]]
    chunks = [[int(x) for x in rng.integers(3, 250, size=n)] for n in (7, 4)[: len(tables)]]
    packed, packed_seqs = _sequences(model, tables, prompts)
    fed, fed_seqs = _sequences(model, tables, prompts)
    _chunk_pass(model, packed, packed_seqs, chunks)
    feed_chunks(model, fed, fed_seqs, chunks)
    _assert_same_kv(packed, packed_seqs, fed, fed_seqs)
    with pytest.raises(InvalidArgumentError, match="each non-empty"):
        feed_chunks(model, fed, fed_seqs, [[]] * len(tables))
