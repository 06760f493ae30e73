"""An arena whose buffers grow on demand (kv/arena.py): the budget is allocated lazily, growth keeps every K/V.

Growth must be invisible: every read path (views, gathers, slot gathers, the batched decode strategies) returns
exactly what was written before and after any number of growths, including while the layers differ in size (the
engine grows one layer per forward pass), and an engine whose arena starts tiny and grows mid-generation produces
the same greedy tokens as one whose arena is preallocated, with concurrent requests, shared prefixes and
preemption. Building an arena with a large budget must not allocate it. The allocator's high water, which drives
growth, is tested without MLX in test_allocator.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.engine import batch_attention as ba
from cortexstream.engine.engine import Engine
from cortexstream.kv import arena as arena_module
from cortexstream.kv.arena import MIN_PHYSICAL_SLOTS, KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.sequence_kv import SequenceKV
from test_batch_attention import DIM, KV_HEADS, LAYERS, LENGTHS, batched_step, fill, reference

BS = 4  # test_batch_attention's block size


def sizes(arena: KVArena) -> list[int]:
    """Blocks each layer's K buffer holds (V always matches)."""
    assert [k.shape[2] for k in arena.keys] == [v.shape[2] for v in arena.values]
    return [k.shape[2] // arena.config.block_size for k in arena.keys]


def test_a_new_arena_backs_only_its_first_blocks_and_reports_the_budget():
    config = ArenaConfig(LAYERS, KV_HEADS, DIM, 4096, BS)
    arena = KVArena(config)
    start = MIN_PHYSICAL_SLOTS // BS
    assert sizes(arena) == [start] * LAYERS and arena.num_physical_blocks == start
    stats = arena.stats()
    assert stats["num_blocks"] == 4096 and stats["bytes_free"] == config.total_bytes and stats["bytes_used"] == 0
    assert stats["num_physical_blocks"] == start and stats["physical_bytes"] == start * config.bytes_per_block
    assert sizes(KVArena(config, preallocate=True)) == [4096] * LAYERS
    assert sizes(KVArena(ArenaConfig(LAYERS, KV_HEADS, DIM, 10, BS))) == [10] * LAYERS  # a budget below the start
    with pytest.raises(ValueError, match="initial_blocks"):
        KVArena(config, initial_blocks=0)


def test_building_a_large_budget_allocates_a_small_fraction_of_it(tiny):
    config = ArenaConfig(24, 8, 128, 1 << 16, 16)  # 6.4 GB of float32 K and V
    mx.synchronize()
    base = mx.get_active_memory()
    arena = KVArena(config)
    grown = mx.get_active_memory() - base
    assert grown <= arena.physical_bytes < config.total_bytes / 1000
    model, tokenizer = tiny
    base = mx.get_active_memory()
    engine = Engine(model, tokenizer, kv_tokens=1 << 24)
    assert engine.arena.config.total_bytes > 1000 * (mx.get_active_memory() - base)
    assert engine.stats()["num_blocks"] == 1 << 20


def test_every_id_the_allocator_hands_out_is_backed_and_growth_doubles_within_the_budget():
    arena = KVArena(ArenaConfig(LAYERS, KV_HEADS, DIM, 40, BS), initial_blocks=3)
    assert arena.allocator.allocate(3) == [0, 1, 2] and sizes(arena) == [3] * LAYERS
    arena.allocator.allocate(1)
    assert sizes(arena) == [6] * LAYERS  # twice the size, not just the block asked for
    arena.allocator.allocate(10, contiguous=True)
    assert sizes(arena) == [14] * LAYERS  # what is needed when that is more than twice
    arena.allocator.allocate(26)
    assert sizes(arena) == [40] * LAYERS and arena.num_physical_blocks == 40  # capped at the budget
    with pytest.raises(ValueError, match="exceed"):
        arena.ensure_blocks(41)


def test_growth_keeps_every_written_kv_through_every_read_path():
    """Sequences grow (contiguous ones relocate, paged ones scatter), the arena grows under them, partly one layer
    at a time; after every write, all read paths return the mirror's contents."""
    rng = np.random.default_rng(0)
    arena = KVArena(ArenaConfig(LAYERS, KV_HEADS, DIM, 96, BS), initial_blocks=1)
    seqs = [SequenceKV(arena, owner=i, contiguous=i % 2 == 0) for i in range(4)]
    mirror = [[np.zeros((2, KV_HEADS, 0, DIM), np.float32) for _ in range(LAYERS)] for _ in seqs]
    unequal = 0
    for round_ in range(24):
        i = int(rng.integers(len(seqs)))
        seq, n = seqs[i], int(rng.integers(1, 9))
        start = seq.num_tokens
        seq.ensure_capacity(start + n)
        for layer in range(LAYERS):
            kv = rng.standard_normal((2, KV_HEADS, n, DIM)).astype(np.float32)
            arena.write(layer, seq.blocks, start, mx.array(kv[0]), mx.array(kv[1]))  # lazy: growth comes later
            mirror[i][layer] = np.concatenate([mirror[i][layer], kv], axis=2)
            seq.lengths[layer] += n
        if round_ % 3 == 0:
            arena.grow_ahead()
        unequal += len(set(sizes(arena))) > 1
        for seq, expected in zip(seqs, mirror):
            check_reads(arena, seq, expected)
    assert arena.num_growths >= 3 * LAYERS and arena.num_physical_blocks < 96
    assert unequal  # some reads ran while the layers differed in size


def check_reads(arena: KVArena, seq: SequenceKV, expected: list[np.ndarray]) -> None:
    length = seq.num_tokens
    if length == 0:
        return
    slots = arena.slot_indices(seq.blocks, 0, length)
    per_head = np.stack([slots] * KV_HEADS)
    first = arena.contiguous_start(seq.blocks)
    for layer in range(LAYERS):
        want_k, want_v = expected[layer]
        reads = [arena.read(layer, seq.blocks, length), arena.read(layer, seq.blocks, length, first=None),
                 arena.gather_slots(layer, slots), arena.gather_slots(layer, per_head)]
        if first is not None:
            k, v = arena.run_view(layer, first, length)
            reads.append((k[0], v[0]))
        keys, values = arena.layer_buffers(layer)
        reads.append((keys[:, mx.array(slots.astype(np.int32))], values[:, mx.array(slots.astype(np.int32))]))
        for k, v in reads:
            np.testing.assert_array_equal(np.array(k), want_k)
            np.testing.assert_array_equal(np.array(v), want_v)


def build_batch(seed: int, layout: list[bool], initial_blocks: int = 1, capacities: list[int] | None = None,
                lengths: list[int] = LENGTHS) -> tuple[KVArena, list[SequenceKV], dict]:
    """test_batch_attention's batch (`lengths` tokens; paged tables shuffled, contiguous ones `capacities` tokens
    long) in an arena of 64 blocks that started at `initial_blocks` and grew as they were allocated."""
    arena = KVArena(ArenaConfig(LAYERS, KV_HEADS, DIM, 64, BS), initial_blocks=initial_blocks)
    seqs, step = fill(arena, np.random.default_rng(seed), layout, lengths, capacities)
    return arena, seqs, step


def build_grown(seed: int, layout: list[bool]) -> tuple[KVArena, list[SequenceKV], dict]:
    """The batch halfway through a growth: layer 0's buffers twice as large as layer 1's."""
    arena, seqs, step = build_batch(seed, layout)
    assert arena.grow_ahead() == 1 and sizes(arena) == [32, 16]
    return arena, seqs, step


@pytest.mark.parametrize("layout", [[False, True, False, True], [False] * 4], ids=["mixed", "contiguous"])
@pytest.mark.parametrize("strategy", ba.STRATEGIES)
def test_batched_decode_strategies_read_a_growing_arena_exactly(strategy, layout):
    arena, seqs, step = build_grown(1, layout)
    outs = batched_step(arena, seqs, step, strategy)
    for out, expected in zip(outs, reference(arena, seqs, step)):
        np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)
    # the same batch in an arena grown to its whole budget gives bit-identical outputs
    full, full_seqs, full_step = build_grown(1, layout)
    full.ensure_blocks(64)
    assert sizes(full) == [64] * LAYERS
    for got, want in zip(outs, batched_step(full, full_seqs, full_step, strategy)):
        assert np.array_equal(np.array(got), np.array(want))


def test_a_strided_window_past_the_blocks_in_use_is_backed_first():
    # Three runs of 4 blocks and one of 1 block, evenly spaced: 13 blocks, all the arena holds. The last window
    # is as wide as the longest sequence (16 slots), so it reaches 3 blocks past the end of the buffers.
    arena, seqs, step = build_batch(2, [False] * 4, initial_blocks=13, capacities=[16, 16, 16, 2],
                                    lengths=[15, 15, 15, 1])
    assert sizes(arena) == [13] * LAYERS
    outs = batched_step(arena, seqs, step, ba.STRIDED)
    assert min(sizes(arena)) >= 16
    for out, expected in zip(outs, reference(arena, seqs, step)):
        np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)


def run_waves(engine: Engine, waves: list[list[tuple[list[int], int]]], growths: list[int]) -> list[list[int]]:
    """Submit the waves a few steps apart (arrivals mid-generation) and run to the end: tokens per request.
    `growths` gets the arena's growth count after each wave's steps."""
    tokens: dict[str, list[int]] = {}
    ids: list[str] = []
    for wave in waves:
        ids += [engine.add_request(prompt, max_tokens=n) for prompt, n in wave]
        for _ in range(3):
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend([] if out.token is None else [out.token])
        growths.append(engine.arena.num_growths)
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend([] if out.token is None else [out.token])
    return [tokens[i] for i in ids]


def test_an_engine_that_grows_mid_generation_matches_a_preallocated_one(tiny, monkeypatch):
    model, tokenizer = tiny
    monkeypatch.delenv(ba.ENV_VAR, raising=False)
    rng = np.random.default_rng(3)
    prefixes = [[int(x) for x in rng.integers(3, 250, size=n)] for n in (12, 21)]
    # A short first request, then waves of longer ones sharing two prefixes: the arena grows as they arrive.
    waves = [[([5, 6, 7], 5)]] + [[(prefixes[int(rng.integers(2))] + [int(x) for x in rng.integers(
        3, 250, size=int(rng.integers(0, 9)))], int(rng.integers(8, 40))) for _ in range(size)] for size in (1, 2, 5, 5)]
    ahead: list[int] = []
    original = KVArena.grow_ahead
    monkeypatch.setattr(KVArena, "grow_ahead", lambda self, max_layers=1: ahead.append(original(self, max_layers))
                        or ahead[-1])
    results = []
    for arena_kwargs in ({"preallocate": True}, {"initial_blocks": 1}):
        config = ArenaConfig.for_model(model, num_tokens=160, block_size=4)  # 40 blocks: preemption
        engine = Engine(model, tokenizer, arena=KVArena(config, **arena_kwargs), block_size=4, max_num_seqs=8,
                        prefill_step_size=16, prefill_tokens_while_decoding=8)
        growths: list[int] = []
        results.append(run_waves(engine, waves, growths))
        stats = engine.stats()
        assert stats["preemptions"] > 0 and stats["prefix_hit_blocks"] > 0
    assert results[0] == results[1]
    arena = engine.arena
    assert arena.num_growths >= 4 * arena.config.num_layers  # every layer grew at least four times
    assert sum(ahead) > 0  # some of them a layer at a time, between forward passes
    assert growths[0] < growths[1] < growths[-1], growths  # while earlier requests were generating
    assert arena.stats()["num_blocks"] == 40


def test_growth_is_spread_one_layer_per_call_once_the_high_water_nears_the_end(monkeypatch):
    arena = KVArena(ArenaConfig(4, KV_HEADS, DIM, 100, BS), initial_blocks=8)
    arena.allocator.allocate(6)
    assert arena.grow_ahead() == 0  # 6 of 8: below GROW_AHEAD_AT
    arena.allocator.allocate(1)
    assert [arena.grow_ahead() for _ in range(5)] == [1, 1, 1, 1, 0]
    assert sizes(arena) == [16] * 4 and arena.num_physical_blocks == 16
    monkeypatch.setattr(arena_module, "GROW_AHEAD_AT", 0.25)
    assert arena.grow_ahead(max_layers=3) == 3 and sizes(arena) == [32, 32, 32, 16]
    arena.allocator.allocate(20)  # needs 27: the last layer is padded at once
    assert sizes(arena) == [32] * 4
