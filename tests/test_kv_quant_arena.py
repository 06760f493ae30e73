"""Quantized arena storage: eviction and copy-on-write move codes with their own scales and biases, the arena
grows without losing rows, saved prompt caches round-trip exactly and refuse another storage, and attention over
codes agrees with attention over the dequantized rows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine.sampling import SamplingParams
from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.kv_dtype import parse_kv_dtype
from cortexstream.kv.prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache
from cortexstream.kv.quantized_attention import decode_attention
from cortexstream.kv.quantized_blocks import QuantizedRows
from cortexstream.kv.sequence_kv import SequenceKV
from tiny_models import tiny_model

HEADS, DIM, LAYERS, BS = 2, 32, 2, 4


def arena_for(kv_dtype: str, blocks: int = 64, **kwargs) -> KVArena:
    storage = parse_kv_dtype(kv_dtype, 32, model_dtype="float32")
    return KVArena(ArenaConfig(LAYERS, HEADS, DIM, blocks, BS, "float32", kv_dtype=storage), **kwargs)


def filled(arena: KVArena, n: int, seed: int, contiguous: bool = True) -> tuple[SequenceKV, list[mx.array]]:
    """A sequence of n random tokens in every layer; returns it and the rows as read back per layer (K, V)."""
    rng = np.random.default_rng(seed)
    seq = SequenceKV(arena, owner=seed, contiguous=contiguous)
    seq.ensure_capacity(n)
    for layer in range(LAYERS):
        k = mx.array(rng.normal(size=(HEADS, n, DIM)).astype(np.float32))
        v = mx.array(rng.normal(size=(HEADS, n, DIM)).astype(np.float32))
        arena.write(layer, seq.blocks, 0, k, v)
    seq.lengths = [n] * LAYERS
    seq.offsets = [n] * LAYERS
    mx.eval(arena.arrays())
    return seq, [arena.read(layer, seq.blocks, n) for layer in range(LAYERS)]


def assert_moved(got: mx.array, want: np.ndarray, arena: KVArena) -> None:
    """`got` is `want` moved as codes. Bit-identical unless a side is stored rotated: reading it back un-rotates
    by a matmul whose rounding may depend on how many rows are read at once (1e-6 here), while a requantized row
    would be off by a quantization step (1e-2 and more at these magnitudes)."""
    storage = arena.config.storage
    if storage.key_rotated or storage.value_rotated:
        np.testing.assert_allclose(np.array(got), want, rtol=0, atol=2e-5)
    else:
        assert np.array_equal(np.array(got), want)


@settings(max_examples=25, deadline=None)
@given(kv=st.sampled_from(["int8", "int4,keys=token", "int4,keys=token,rotate=off", "k=int8,v=int4",
                           "k=float32,v=int4"]), n=st.integers(2, 40),
       per_head=st.booleans(), paged=st.booleans(), seed=st.integers(0, 10_000))
def test_eviction_keeps_each_row_with_its_own_scales(kv, n, per_head, paged, seed):
    arena = arena_for(kv)
    if paged:  # a fragmented table: another sequence's blocks interleave
        filled(arena, 5, seed + 1, contiguous=False)
    seq, before = filled(arena, n, seed, contiguous=not paged)
    rng = np.random.default_rng(seed)
    kept = int(rng.integers(1, n + 1))
    if per_head:
        index = np.stack([np.sort(rng.choice(n, kept, replace=False)) for _ in range(HEADS)])
        index = np.broadcast_to(index, (LAYERS, HEADS, kept))
    else:
        index = np.sort(rng.choice(n, kept, replace=False))
    seq.keep(index)
    for layer in range(LAYERS):
        k, v = arena.read(layer, seq.blocks, kept)
        rows = index[layer] if per_head else np.broadcast_to(index, (HEADS, kept))
        for head in range(HEADS):
            # bit-identical: rows move as codes with their own scales and biases, never requantized
            assert_moved(k[head], np.array(before[layer][0][head])[rows[head]], arena)
            assert_moved(v[head], np.array(before[layer][1][head])[rows[head]], arena)


def test_copy_on_write_and_growth_move_codes_unchanged():
    arena = arena_for("int4", blocks=512, initial_blocks=4)
    seq, before = filled(arena, 14, 3)
    new = arena.allocator.allocate(len(seq.blocks), owner=9)
    arena.copy_blocks(seq.blocks, new)
    for layer in range(LAYERS):
        k, v = arena.read(layer, new, 14)
        assert_moved(k, np.array(before[layer][0]), arena)
    other, _ = filled(arena, 300, 4)  # past the 16 initial slots: every layer is padded
    assert arena.num_physical_blocks >= 75 and arena.num_growths > 0
    for layer in range(LAYERS):
        k, v = arena.read(layer, seq.blocks, 14)
        assert_moved(v, np.array(before[layer][1]), arena)
    assert arena.physical_bytes == sum(side.nbytes for side in (*arena.keys, *arena.values))


def test_quantized_arena_stats_report_storage_and_bytes():
    arena = arena_for("k=int8,v=int4")
    stats = arena.stats()
    assert stats["kv_dtype"] == "k=int8,v=int4"
    # per layer and head: K 32 int8 codes + 2 float32 (one group) = 40 bytes, V 16 + 8 = 24 bytes
    assert stats["bytes_per_token"] == LAYERS * HEADS * (40 + 24)


def test_float_sides_of_another_type_are_refused():
    with pytest.raises(InvalidArgumentError, match="float side"):
        parse = parse_kv_dtype("k=int8,v=float16", 32, model_dtype="float32")
        ArenaConfig(LAYERS, HEADS, DIM, 8, BS, "float32", kv_dtype=parse)
    with pytest.raises(InvalidArgumentError, match="K and V may differ only"):
        ArenaConfig.for_model(tiny_model(seed=1, head_dim=32), num_tokens=64, kv_dtype="k=float16,v=float32")


@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "k=int8,v=float32"])
def test_decode_attention_over_codes_matches_the_dequantized_rows(kv_dtype):
    storage = parse_kv_dtype(kv_dtype, 32, model_dtype="float32")
    rng = np.random.default_rng(0)
    k = mx.array(rng.normal(size=(1, HEADS, 50, DIM)).astype(np.float32))
    v = mx.array(rng.normal(size=(1, HEADS, 50, DIM)).astype(np.float32))
    sides = [QuantizedRows.from_rows(x, kind.bits, 32) if kind.quantized else x
             for x, kind in ((k, storage.key), (v, storage.value))]
    floats = [s.dequantize() if isinstance(s, QuantizedRows) else s for s in sides]
    q = mx.array(rng.normal(size=(1, 2 * HEADS, 1, DIM)).astype(np.float32))
    reference = mx.fast.scaled_dot_product_attention(q, *floats, scale=0.2)
    for dequantize in (False, True):
        out = decode_attention(q, *sides, 0.2, None, dequantize)
        assert np.allclose(np.array(out), np.array(reference), atol=2e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "k=int4,v=int8", "int4", "int4,rotate=off"])
def test_saved_quantized_cache_round_trips_exactly_and_refuses_other_storage(tmp_path, kv_dtype):
    model = tiny_model(seed=2, head_dim=32)
    cache = make_prompt_cache(model, kv_dtype=kv_dtype, kv_group_size=32)
    model(mx.array([list(range(3, 30))]), cache=cache)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert loaded[0].sequence.arena.config.cache_key == cache[0].sequence.arena.config.cache_key
    for a, b in zip(cache, loaded):
        assert a.offset == b.offset and a.size() == b.size()
        assert all(np.array_equal(np.array(x), np.array(y)) for x, y in zip(a.state, b.state))
    # the next token is the same from the loaded cache as from the original
    step = mx.array([[40]])
    assert np.array_equal(np.array(model(step, cache=cache)), np.array(model(step, cache=loaded)))
    others = {"int4": "int4,rotate=off", "int4,rotate=off": "int4"}  # the same bits, the other rotation
    for other in (None, "int4" if kv_dtype == "int8" else "int8", others.get(kv_dtype, "int8,rotate=on")):
        arena = KVArena(ArenaConfig.for_model(model, num_tokens=256, kv_dtype=other,
                                              kv_group_size=32 if other else None))
        with pytest.raises(ModelLoadError, match="stores K/V as"):
            load_prompt_cache(path, arena=arena)
    same = KVArena(ArenaConfig.for_model(model, num_tokens=256, kv_dtype=kv_dtype, kv_group_size=32))
    assert load_prompt_cache(path, arena=same)[1].size() == 27


def test_a_kv_dtype_that_contradicts_the_arena_is_refused(tiny):
    from cortexstream.engine.engine import Engine

    model = tiny_model(seed=2, head_dim=32)
    arena = KVArena(ArenaConfig.for_model(model, num_tokens=256, kv_dtype="int8", kv_group_size=32))
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        Engine(model, tiny[1], arena=arena, kv_dtype="int4", kv_group_size=32)
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        make_prompt_cache(model, arena=arena, kv_dtype="float32")


@pytest.mark.parametrize("kv", ["int8", "int4"])  # int4: keys grouped per channel (channel_quantized.py)
def test_mlx_lm_generate_step_runs_on_a_quantized_arena_cache(tiny, kv):
    from mlx_lm.generate import generate_step

    import cortexstream

    model = tiny_model(seed=4, head_dim=32)
    prompt = list(range(3, 28))
    cache = make_prompt_cache(model, kv_dtype=kv, kv_group_size=32)
    steps = generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=6)
    ours = [int(token) for token, _ in steps]
    # the engine on the same storage gives the same greedy tokens
    out = cortexstream.batch_generate(model, tiny[1], [prompt], max_tokens=6, return_token_ids=True,
                                      kv_dtype=kv, kv_group_size=32)
    assert len(ours) == 6 and out.token_ids[0] == ours[: len(out.token_ids[0])]


def test_prefix_hashes_depend_on_the_storage():
    roots = {BlockManager(arena_for("int8").allocator, BS, True, key).prefix_root(None)
             for key in ("float32,float=float32", "int8,group=64,float=float32", "int8,group=32,float=float32")}
    assert len(roots) == 3


def test_engine_read_and_write_kv_on_quantized_blocks(tiny):
    from cortexstream.engine.engine import Engine

    model = tiny_model(seed=5, head_dim=32)
    engine = Engine(model, tiny[1], kv_tokens=512, kv_dtype="int8", kv_group_size=32)
    rid = engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    layers = engine.read_kv(rid)
    assert layers[0][0].shape == (1, 2, 20, 32) and layers[0][0].dtype == mx.float32
    doubled = [(2 * k, 2 * v) for k, v in layers]
    engine.write_kv(rid, doubled)
    again = engine.read_kv(rid)
    for (k, _), (k2, _) in zip(doubled, again):
        spread = float(mx.max(k) - mx.min(k))
        assert float(mx.max(mx.abs(k - k2))) <= spread / 255 + 1e-6  # one int8 step of the widest group at most


def test_sequence_buffers_read_a_fragmented_quantized_sequence_through_the_identity_table():
    arena = arena_for("int4")
    filled(arena, 6, 8, contiguous=False)
    seq, before = filled(arena, 23, 9, contiguous=False)
    for layer in range(LAYERS):
        keys, values, table = arena.sequence_buffers(layer, seq.blocks, 23)
        assert table == list(range(6)) and keys.shape == (HEADS, 24, DIM)
        assert np.array_equal(np.array(keys[:, :23]), np.array(before[layer][0]))
        assert np.array_equal(np.array(values[:, :23]), np.array(before[layer][1]))


@pytest.mark.parametrize("kv_dtype", ["int8", "k=int4,v=float32"])
def test_strided_quantized_batch_equals_per_sequence_attention(kv_dtype):
    """Evenly spaced runs attend in one call over strided views of the codes; that equals each sequence alone."""
    from cortexstream.engine.batch_attention import quantized_attention
    from cortexstream.engine.batch_cache import DecodeBatch

    arena = arena_for(kv_dtype, blocks=64)
    sequences = []
    for i, n in enumerate((9, 15, 12)):  # equal reservations of 4 blocks: runs 16 slots apart
        seq = SequenceKV(arena, owner=i)
        seq.ensure_capacity(16)
        rng = np.random.default_rng(i)
        for layer in range(LAYERS):
            k, v = (mx.array(rng.normal(size=(HEADS, n + 1, DIM)).astype(np.float32)) for _ in "kv")
            arena.write(layer, seq.blocks, 0, k, v)
        seq.lengths, seq.offsets = [n] * LAYERS, [n] * LAYERS
        sequences.append(seq)
    batch = DecodeBatch(arena, sequences)
    assert batch.quantized_strided and batch.strided == (0, 16)
    q = mx.array(np.random.default_rng(5).normal(size=(3, 2 * HEADS, 1, DIM)).astype(np.float32))
    together = quantized_attention(batch, 1, q, 0.3)
    batch.quantized_strided = False
    alone = quantized_attention(batch, 1, q, 0.3)
    assert np.allclose(np.array(together), np.array(alone), atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["int8", "k=int4,v=float32"])
def test_per_head_decode_attention_equals_the_one_call_attention(kv_dtype):
    """Past the backend's crossover a run attends one KV head at a time (contiguous operands): same output."""
    from cortexstream.kv.quantized_attention import decode_attention_per_head

    arena = arena_for(kv_dtype, blocks=64)
    seq, _ = filled(arena, 37, 2)
    keys, values = arena.run_rows(1, seq.contiguous_first(), 37)
    q = mx.array(np.random.default_rng(6).normal(size=(1, 2 * HEADS, 1, DIM)).astype(np.float32))
    one_call = decode_attention(q, keys, values, 0.3)
    per_head = decode_attention_per_head(q, keys, values, 0.3)
    assert per_head.shape == one_call.shape == (1, 2 * HEADS, 1, DIM)
    assert np.allclose(np.array(per_head), np.array(one_call), atol=1e-5)
