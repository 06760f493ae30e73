"""Keys grouped per channel over a block (kv/channel_quantized.py): the codec's error bounds, a block's range
growing as decode fills it, fresh blocks, every read path agreeing, whole blocks moving exactly, the spelling, and
the engine on such an arena (batched equals alone, prefix-cache hits, forks, eviction, saved caches)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.engine.engine import Engine
from cortexstream.engine.sampling import SamplingParams
from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.channel_quantized import ChannelQuantizedRows
from cortexstream.kv.kv_dtype import parse_kv_dtype
from cortexstream.kv.prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from tiny_models import tiny_model

HEADS, DIM, BS = 2, 32, 8


def rows(rng: np.random.Generator, n: int, outlier: float = 50.0) -> np.ndarray:
    """Keys with one large, nearly constant channel (as RoPE's slow pairs and a key bias give)."""
    x = rng.normal(size=(1, HEADS, n, DIM)).astype(np.float32)
    x[..., 3] += outlier
    return x


def steps(x: np.ndarray, bs: int) -> np.ndarray:
    """Each row's block quantization step per channel, `[1, H, n, D]` (a block's range / 15)."""
    n = x.shape[2]
    blocks = x.reshape(1, HEADS, n // bs, bs, DIM)
    step = (blocks.max(axis=3, keepdims=True) - blocks.min(axis=3, keepdims=True)) / 15
    return np.broadcast_to(step, blocks.shape).reshape(x.shape)


def test_a_whole_block_is_within_half_a_step_and_token_by_token_within_one_and_a_half():
    rng = np.random.default_rng(0)
    x = rows(rng, 4 * BS)
    whole = ChannelQuantizedRows.zeros(HEADS, 8 * BS, DIM, 4, BS, mx.float32)
    whole.write(slice(BS, 5 * BS), mx.array(x))
    error = np.abs(np.array(whole.read(slice(BS, 5 * BS), mx.float32)) - x)
    assert (error <= 0.5 * steps(x, BS) + 1e-5).all()
    grown = ChannelQuantizedRows.zeros(HEADS, 8 * BS, DIM, 4, BS, mx.float32)
    for i in range(x.shape[2]):  # decode: one token at a time, each block's range grows
        grown.write(mx.array(np.array([BS + i], dtype=np.int32)), mx.array(x[:, :, i:i + 1]))
    error = np.abs(np.array(grown.read(slice(BS, 5 * BS), mx.float32)) - x)
    assert (error <= 1.5 * steps(x, BS) + 1e-5).all()
    # the outlier channel keeps its own small range: far finer than one scale over all channels would be
    assert error[..., 3].max() < 0.5


def test_rewriting_a_block_unchanged_keeps_its_codes_and_a_fresh_block_forgets_its_range():
    rng = np.random.default_rng(1)
    side = ChannelQuantizedRows.zeros(HEADS, 4 * BS, DIM, 4, BS, mx.float32)
    side.write(slice(0, 2 * BS), mx.array(rows(rng, 2 * BS)))
    stored = np.array(side.read(slice(0, BS), mx.float32))
    before = [np.array(a) for a in side.arrays()]
    side.write(slice(0, BS), mx.array(stored))
    assert all(np.array_equal(a, np.array(b)) for a, b in zip(before, side.arrays()))
    small = rows(rng, 2, outlier=0.0) * 0.01
    side.write(slice(BS, BS + 2), mx.array(small))  # not fresh: the block's earlier range still counts
    coarse = np.abs(np.array(side.read(slice(BS, BS + 2), mx.float32)) - small).max()
    side.mark_fresh(np.array([1]))  # handed to a new owner: its earlier rows are not this one's
    side.write(slice(BS, BS + 2), mx.array(small))
    fine = np.abs(np.array(side.read(slice(BS, BS + 2), mx.float32)) - small).max()
    assert fine < 1e-3 < coarse


def test_every_read_path_agrees_and_whole_blocks_move_exactly():
    rng = np.random.default_rng(2)
    side = ChannelQuantizedRows.zeros(HEADS, 6 * BS, DIM, 4, BS, mx.float32)
    side.write(slice(0, 6 * BS), mx.array(rows(rng, 6 * BS)))
    everything = np.array(side.dequantize(mx.float32))
    slots = np.array([3, 17, 40, 9], dtype=np.int32)
    assert np.array_equal(np.array(side.read(mx.array(slots), mx.float32)), everything[:, :, slots])
    assert np.array_equal(np.array(side.read(slice(2 * BS, 3 * BS + 3), mx.float32)),
                          everything[:, :, 2 * BS:3 * BS + 3])
    per_head = np.array([[1, 30], [45, 2]], dtype=np.int32)
    got = np.array(side.read_per_head(mx.array(per_head), mx.float32))
    assert all(np.array_equal(got[0, h], everything[0, h, per_head[h]]) for h in range(HEADS))
    strided = np.array(side.strided(2, (BS, 3 * BS), 2 * BS, mx.float32))
    assert np.array_equal(strided[1], everything[0, :, 4 * BS:6 * BS])
    other = ChannelQuantizedRows.zeros(HEADS, 6 * BS, DIM, 4, BS, mx.float32)
    other.put_blocks(np.array([5, 0]), side.take_blocks(np.array([1, 4])))
    moved = np.array(other.dequantize(mx.float32))
    assert np.array_equal(moved[:, :, 5 * BS:], everything[:, :, BS:2 * BS])
    assert np.array_equal(moved[:, :, :BS], everything[:, :, 4 * BS:5 * BS])


def test_spelling_bytes_and_cache_keys():
    int4 = parse_kv_dtype("int4", model_dtype="float32")
    assert int4.key_channels and not int4.key_rotated and int4.value_rotated
    assert not parse_kv_dtype("int8", model_dtype="float32").key_channels
    int8 = parse_kv_dtype("int8,keys=channel", model_dtype="float32")
    assert int8.key_channels and int8.text == "int8,keys=channel"
    assert parse_kv_dtype(int8.text, model_dtype="float32") == int8
    token = parse_kv_dtype("int4,keys=token", model_dtype="float32")
    assert not token.key_channels and token.cache_key != int4.cache_key
    assert parse_kv_dtype("int4,rotate=off,keys=token", model_dtype="float32").text == "int4,rotate=off,keys=token"
    for bad, match in (("k=float32,v=int4,keys=channel", "keys= applies only"), ("int4,keys=diagonal", "keys"),
                       ("int4,keys=token,keys=channel", "twice")):
        with pytest.raises(InvalidArgumentError, match=match):
            parse_kv_dtype(bad, model_dtype="float32")
    config = ArenaConfig(2, HEADS, DIM, 16, BS, "float32", kv_dtype=parse_kv_dtype("int4", 32, model_dtype="float32"))
    assert config.cache_key.endswith(f"keys=channel,block={BS}")
    # K: 16 bytes of codes + (4 + 4) * 32 / 8 of scales per token; V: 16 + 8 (one group of 32)
    assert config.bytes_per_token == 2 * HEADS * (16 + 32 + 16 + 8)
    arena = KVArena(config, preallocate=True)
    assert arena.physical_bytes == config.total_bytes


@pytest.fixture(scope="module")
def model32():
    return tiny_model(seed=5, head_dim=32)


PROMPTS = [list(range(3, 3 + n)) for n in (5, 19, 40, 33)]


def greedy(engine: Engine, prompts: list[list[int]], max_tokens: int = 10, **kwargs) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, temperature=0.0), **kwargs) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished:
        for o in engine.step():
            if o.token is not None:
                out[o.request_id].append(o.token)
    return [out[i] for i in ids]


@pytest.mark.parametrize("policy", [None, "h2o:budget=0.5,sinks=2", "meanpool:window=4,sinks=4,recent=8"])
def test_engine_batched_equals_alone_on_keys_grouped_per_channel(model32, tiny, policy):
    def engine():
        return Engine(model32, tiny[1], kv_tokens=2048, block_size=8, kv_dtype="int4", kv_group_size=32,
                      kv_policy=policy, prefill_tokens_while_decoding=None)

    together = greedy(engine(), PROMPTS, 12)
    assert together == [greedy(engine(), [p], 12)[0] for p in PROMPTS]


def test_prefix_cache_hits_and_forks_are_exact_on_keys_grouped_per_channel(model32, tiny):
    engine = Engine(model32, tiny[1], kv_tokens=2048, block_size=8, kv_dtype="int4", kv_group_size=32)
    prompt = list(range(5, 45))
    runs = [greedy(engine, [prompt])[0] for _ in range(3)]
    assert engine.stats()["prefix_hit_blocks"] > 0 and runs[0] == runs[1] == runs[2]
    engine.fork(prompt, SamplingParams(max_tokens=10, temperature=0.0), ["a", "b"])
    forks: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            if o.token is not None:
                forks.setdefault(o.request_id, []).append(o.token)
    assert forks["a"] == forks["b"] == runs[0]


def test_saved_cache_round_trips_exactly_and_keeps_its_block_size(model32, tmp_path):
    ids = mx.array(np.arange(3, 40, dtype=np.uint32))[None]
    cache = make_prompt_cache(model32, kv_dtype="int4", kv_group_size=32)
    mx.eval(model32(ids, cache=cache))
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    seq, back = cache[0].sequence, loaded[0].sequence
    assert back.arena.config.cache_key == seq.arena.config.cache_key
    for layer in range(len(cache)):
        for a, b in zip(seq.arena.read(layer, seq.blocks, 37), back.arena.read(layer, back.blocks, 37)):
            assert np.array_equal(np.array(a), np.array(b))
    follow = mx.array(np.array([[7, 8, 9]], dtype=np.uint32))
    assert np.array_equal(np.array(model32(follow, cache=cache)), np.array(model32(follow, cache=loaded)))
    token_arena = KVArena(ArenaConfig.for_model(model32, num_tokens=256, kv_dtype="int4,keys=token",
                                                kv_group_size=32))
    with pytest.raises(ModelLoadError, match="keys=channel"):
        load_prompt_cache(path, arena=token_arena)


def test_strided_windows_read_the_same_whether_block_aligned_or_not():
    rng = np.random.default_rng(3)
    side = ChannelQuantizedRows.zeros(HEADS, 8 * BS, DIM, 4, BS, mx.float32)
    side.write(slice(0, 8 * BS), mx.array(rows(rng, 8 * BS)))
    everything = np.array(side.dequantize(mx.float32))[0]
    for first, pitch, width in ((BS, 2 * BS, BS + 3), (0, 3 * BS, 3 * BS), (3, 2 * BS, 5), (BS, 2 * BS, 7 * BS)):
        got = np.array(side.strided(3 if width < 3 * BS else 1, (first, pitch), width, mx.float32))
        for b in range(got.shape[0]):
            start = first + b * pitch
            want = everything[:, start:start + width]
            assert np.array_equal(got[b, :, :want.shape[1]], want)
