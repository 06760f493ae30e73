"""Arena-backed caches under real mlx-lm models: exactness, zero-copy, editing primitives, save/load, errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

import cortexstream
from cortexstream.errors import InvalidArgumentError, OutOfBlocksError
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from tiny_models import tiny_model


def greedy(model, prompt, n, cache):
    out = []
    for (token, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache), range(n)):
        out.append(int(token))
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5)


def arena_for(model, num_blocks=64, block_size=4):
    return KVArena(ArenaConfig.for_model(model, num_tokens=num_blocks * block_size, block_size=block_size))


PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 250, size=37)]


def test_private_contiguous_cache_matches_mlx_lm(model):
    expected = greedy(model, PROMPT, 30, mlx_lm_cache(model))
    assert greedy(model, PROMPT, 30, make_prompt_cache(model)) == expected
    # a private arena far too small must regrow transparently
    assert greedy(model, PROMPT, 30, make_prompt_cache(model, max_tokens=3)) == expected


def test_paged_and_relocated_sequences_in_a_shared_arena_match_mlx_lm(model):
    expected = greedy(model, PROMPT, 30, mlx_lm_cache(model))
    arena = arena_for(model)
    # Interleave growth of three sequences so paged block tables are non-contiguous and a contiguous one relocates.
    blocker = make_prompt_cache(model, arena=arena, contiguous=False, owner=9)
    paged = make_prompt_cache(model, arena=arena, contiguous=False, owner=1)
    contiguous = make_prompt_cache(model, arena=arena, contiguous=True, owner=2)
    for _ in range(3):
        blocker[0].sequence.ensure_capacity(blocker[0].sequence.capacity + 1)
        paged[0].sequence.ensure_capacity(paged[0].sequence.capacity + 1)
        contiguous[0].sequence.ensure_capacity(contiguous[0].sequence.capacity + 1)
    assert arena.contiguous_start(paged[0].sequence.blocks) is None
    assert greedy(model, PROMPT, 30, paged) == expected
    assert greedy(model, PROMPT, 30, contiguous) == expected
    assert arena.contiguous_start(contiguous[0].sequence.blocks) is not None
    for cache in (blocker, paged, contiguous):
        cache[0].sequence.release()
    assert arena.allocator.num_free_blocks == arena.allocator.num_total_blocks


def test_contiguous_decode_reads_views_not_copies(model):
    """With a large arena, a copy of the layer buffers per step would show up in peak memory."""
    arena = KVArena(ArenaConfig.for_model(model, num_tokens=1 << 20, block_size=16), preallocate=True)  # 128 MiB
    buffer_bytes = arena.keys[0].nbytes
    cache = make_prompt_cache(model, arena=arena, max_tokens=64)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    token = mx.array([[5]])
    for _ in range(8):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
        del logits
    growth = mx.get_peak_memory() - base
    assert growth < buffer_bytes / 8, f"peak grew {growth} bytes; a layer buffer is {buffer_bytes}"


def test_keep_compacts_selected_tokens_and_frees_blocks(model):
    arena = arena_for(model)
    cache = make_prompt_cache(model, arena=arena, contiguous=False)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    seq = cache[0].sequence
    before = [np.array(c.state[0]) for c in cache]
    used_before = arena.allocator.num_used_blocks
    keep = [0, 1, 2, 3, 10, 20, 30, 36]
    freed = seq.keep(keep)
    assert freed == used_before - arena.config.blocks_for_tokens(len(keep)) and freed > 0
    for layer, c in enumerate(cache):
        assert c.size() == len(keep) and c.offset == len(PROMPT)  # logical position continues
        np.testing.assert_array_equal(np.array(c.state[0]), before[layer][:, :, keep, :])
    # per layer and KV head selections
    heads = arena.config.num_kv_heads
    per_head = np.stack([np.stack([np.sort(np.random.default_rng(h + 7 * l).choice(8, 5, replace=False))
                                   for h in range(heads)]) for l in range(arena.config.num_layers)])
    snapshot = [np.array(c.state[0]) for c in cache]
    seq.keep(per_head)
    for layer, c in enumerate(cache):
        got = np.array(c.state[0])[0]
        for h in range(heads):
            np.testing.assert_array_equal(got[h], snapshot[layer][0, h, per_head[layer, h]])
    with pytest.raises(InvalidArgumentError, match="out of range"):
        seq.keep([0, 99])
    with pytest.raises(InvalidArgumentError, match="duplicate"):
        seq.keep([1, 1])


def test_generation_continues_after_keep_with_logical_positions(model):
    """Keeping every token is a no-op; generation after it must equal the unedited run."""
    arena = arena_for(model)
    cache = make_prompt_cache(model, arena=arena, contiguous=False)
    reference = greedy(model, PROMPT, 12, mlx_lm_cache(model))
    mx.eval(model(mx.array([PROMPT[:-1]]), cache=cache))
    cache[0].sequence.keep(np.arange(len(PROMPT) - 1))
    assert greedy(model, PROMPT[-1:], 12, cache) == reference


def test_replace_shrinks_a_range_and_keeps_the_tail(model):
    arena = arena_for(model)
    cache = make_prompt_cache(model, arena=arena, contiguous=False)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    seq = cache[0].sequence
    old = [c.state for c in cache]
    old_k = [np.array(k) for k, _ in old]
    cfg = arena.config
    new_k = [mx.full((cfg.num_kv_heads, 2, cfg.head_dim), float(l + 1)) for l in range(cfg.num_layers)]
    new_v = [mx.full((cfg.num_kv_heads, 2, cfg.head_dim), -float(l + 1)) for l in range(cfg.num_layers)]
    seq.replace(4, 20, new_k, new_v)
    for layer, c in enumerate(cache):
        k, v = (np.array(x) for x in c.state)
        assert c.size() == len(PROMPT) - 16 + 2 and c.offset == len(PROMPT)
        np.testing.assert_array_equal(k[:, :, :4], old_k[layer][:, :, :4])
        assert (k[:, :, 4:6] == layer + 1).all() and (v[:, :, 4:6] == -(layer + 1)).all()
        np.testing.assert_array_equal(k[:, :, 6:], old_k[layer][:, :, 20:])
    with pytest.raises(InvalidArgumentError, match="only shrinks"):
        seq.replace(0, 1, new_k, new_v)


def test_out_of_blocks_is_clear_and_changes_nothing(model):
    arena = arena_for(model, num_blocks=12, block_size=4)
    other = make_prompt_cache(model, arena=arena, contiguous=False, owner=1)
    mx.eval(model(mx.array([PROMPT[:10]]), cache=other))
    other_state = np.array(other[0].state[0])
    victim = make_prompt_cache(model, arena=arena, contiguous=False, owner=2)
    block_map = arena.allocator.block_map().copy()
    with pytest.raises(OutOfBlocksError):
        victim[0].update_and_fetch(mx.zeros((1, 2, 40, 16)), mx.zeros((1, 2, 40, 16)))
    np.testing.assert_array_equal(arena.allocator.block_map(), block_map)
    assert victim[0].size() == 0 and victim[0].sequence.blocks == []
    np.testing.assert_array_equal(np.array(other[0].state[0]), other_state)


def test_shared_prefix_blocks_copy_on_write(model):
    arena = arena_for(model)
    first = make_prompt_cache(model, arena=arena, contiguous=False, owner=1)
    mx.eval(model(mx.array([PROMPT[:16]]), cache=first))
    shared = list(first[0].sequence.blocks)
    arena.allocator.share(shared)
    second = make_prompt_cache(model, arena=arena, contiguous=False, owner=2)
    second[0].sequence.adopt_prefix(shared, 16)
    before = np.array(first[0].state[0])
    for c in second:  # rewrite the last prefix token: must not touch `first`
        c.trim(1)
    mx.eval(model(mx.array([[7, 8]]), cache=second))
    np.testing.assert_array_equal(np.array(first[0].state[0]), before)
    assert second[0].sequence.blocks[:3] == shared[:3] and second[0].sequence.blocks[3] != shared[3]


def test_save_and_load_prompt_cache_roundtrip(model, tmp_path):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    cache[0].sequence.keep(np.arange(0, len(PROMPT), 2))
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache, {"note": "hello"})
    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta["note"] == "hello"
    for a, b in zip(cache, loaded):
        assert (a.offset, a.size()) == (b.offset, b.size())
        np.testing.assert_array_equal(np.array(a.state[0]), np.array(b.state[0]))
    assert greedy(model, [9], 8, loaded) == greedy(model, [9], 8, cache)
    (tmp_path / "bad.safetensors").write_bytes(b"junk")
    with pytest.raises(cortexstream.errors.ModelLoadError, match="bad.safetensors"):
        load_prompt_cache(str(tmp_path / "bad.safetensors"))


def test_protocol_odds_and_ends(model):
    cache = make_prompt_cache(model, max_tokens=40)
    assert cache[0].empty() and cache[0].is_trimmable()
    mx.eval(model(mx.array([PROMPT[:10]]), cache=cache))
    assert not cache[0].empty() and cache[0].nbytes > 0
    assert cache[0].make_mask(1) is None and cache[0].make_mask(3) == "causal"
    assert cache[0].make_mask(3, return_array=True).shape == (3, 13)
    assert cache[0].trim(4) == 4 and cache[0].offset == 6 and cache[0].size() == 6
    heads, dim = cache[0].state[0].shape[1], cache[0].state[0].shape[3]
    k, v = cache[0].update_and_fetch(mx.zeros((1, heads, 0, dim)), mx.zeros((1, heads, 0, dim)))  # no new tokens
    assert k.shape == (1, heads, 6, dim) and cache[0].offset == 6 and cache[0].size() == 6
    np.testing.assert_array_equal(np.array(k), np.array(cache[0].state[0]))
    restored = type(cache[1]).from_state(cache[1].state, cache[1].meta_state)
    np.testing.assert_array_equal(np.array(restored.state[0]), np.array(cache[1].state[0]))
    with pytest.raises(InvalidArgumentError, match="batch"):
        cache[0].update_and_fetch(mx.zeros((2, 2, 1, 16)), mx.zeros((2, 2, 1, 16)))


def test_stats_and_block_map(model):
    arena = arena_for(model, num_blocks=16, block_size=4)
    cache = make_prompt_cache(model, arena=arena, contiguous=False, owner=3)
    mx.eval(model(mx.array([PROMPT[:10]]), cache=cache))
    seq = cache[0].sequence
    assert seq.stats() == {"owner": 3, "blocks": 3, "logical_tokens": 10, "physical_tokens": 10,
                           "bytes": 3 * arena.config.bytes_per_block}
    stats = arena.stats()
    assert stats["num_used_blocks"] == 3 and stats["bytes_used"] == 3 * arena.config.bytes_per_block
    assert stats["bytes_used"] + stats["bytes_free"] == arena.config.total_bytes
    dump = arena.format_block_map(width=8)
    assert dump.count("3") >= 3 and "." in dump
