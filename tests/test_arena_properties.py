"""Property tests: random allocate/append/free/keep/replace over several sequences in one small arena.

A plain-numpy model of every sequence's K/V is kept alongside; after every operation the arena must hold exactly
those contents, no block may be owned twice, free + used == total, and everything is free at the end.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortexstream.errors import OutOfBlocksError
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.sequence_kv import SequenceKV

LAYERS, HEADS, DIM, BLOCK, NUM_BLOCKS = 2, 2, 3, 4, 24

op = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 3), st.integers(1, 9)),
    st.tuples(st.just("keep"), st.integers(0, 3), st.integers(0, 2**31)),
    st.tuples(st.just("replace"), st.integers(0, 3), st.integers(0, 2**31)),
    st.tuples(st.just("free"), st.integers(0, 3), st.just(0)),
)


def stored(seq: SequenceKV, layer: int) -> np.ndarray:
    k, _ = seq.arena.read(layer, seq.blocks, seq.lengths[layer])
    return np.array(k)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=25), contiguous=st.lists(st.booleans(), min_size=4, max_size=4))
def test_random_operations_keep_contents_and_accounting(ops, contiguous):
    arena = KVArena(ArenaConfig(LAYERS, HEADS, DIM, NUM_BLOCKS, BLOCK))
    alloc = arena.allocator
    seqs = [SequenceKV(arena, owner=i, contiguous=contiguous[i]) for i in range(4)]
    model = [[np.zeros((HEADS, 0, DIM), np.float32) for _ in range(LAYERS)] for _ in range(4)]
    counter = [0.0]

    def fresh(n: int) -> np.ndarray:
        values = counter[0] + np.arange(LAYERS * HEADS * n * DIM, dtype=np.float32).reshape(LAYERS, HEADS, n, DIM)
        counter[0] += values.size
        return values

    for kind, i, arg in ops:
        seq, rng = seqs[i], np.random.default_rng(arg)
        length = seq.num_tokens
        before = alloc.block_map().copy()
        if kind == "append":
            new = fresh(arg)
            try:
                seq.ensure_capacity(length + arg)
            except OutOfBlocksError:
                np.testing.assert_array_equal(alloc.block_map(), before)  # fail fast, nothing changed
                continue
            for layer in range(LAYERS):
                arena.write(layer, seq.blocks, length, mx.array(new[layer]), mx.array(-new[layer]))
                seq.lengths[layer] += arg
                seq.offsets[layer] += arg
                model[i][layer] = np.concatenate([model[i][layer], new[layer]], axis=1)
        elif kind == "keep" and length:
            keep = np.sort(rng.choice(length, size=int(rng.integers(0, length + 1)), replace=False))
            seq.keep(keep)
            for layer in range(LAYERS):
                model[i][layer] = model[i][layer][:, keep]
        elif kind == "replace" and length:
            start = int(rng.integers(0, length))
            end = int(rng.integers(start, length + 1))
            m = int(rng.integers(0, end - start + 1))
            new = fresh(m)
            seq.replace(start, end, [mx.array(new[l]) for l in range(LAYERS)],
                        [mx.array(-new[l]) for l in range(LAYERS)])
            for layer in range(LAYERS):
                old = model[i][layer]
                model[i][layer] = np.concatenate([old[:, :start], new[layer], old[:, end:]], axis=1)
        elif kind == "free":
            seq.release()
            model[i] = [np.zeros((HEADS, 0, DIM), np.float32) for _ in range(LAYERS)]
        # invariants after every operation
        assert alloc.num_free_blocks + alloc.num_used_blocks == alloc.num_total_blocks
        owned = [b for s in seqs for b in s.blocks]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert alloc.num_used_blocks == len(owned)
        alloc.check_invariants()
        for j, s in enumerate(seqs):
            assert len(s.blocks) >= arena.config.blocks_for_tokens(s.num_tokens)
            if s.contiguous:
                assert s.blocks == list(range(s.blocks[0], s.blocks[0] + len(s.blocks))) if s.blocks else True
            for layer in range(LAYERS):
                np.testing.assert_array_equal(stored(s, layer), model[j][layer])
                _, v = arena.read(layer, s.blocks, s.lengths[layer])
                np.testing.assert_array_equal(np.array(v), -model[j][layer])
    for seq in seqs:
        seq.release()
    assert alloc.num_free_blocks == alloc.num_total_blocks and alloc.fragmentation() == 0.0
