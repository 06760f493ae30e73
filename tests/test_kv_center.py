"""Key centering (kv/kv_center.py): quantized keys stored minus the layer's key bias, read back with it, and
attention over the stored codes unchanged by the shift (softmax ignores a shift shared by all of a query's scores).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.kv_dtype import parse_kv_dtype
from cortexstream.kv.kv_rotation import rotation_signs
from cortexstream.kv.quantized_attention import decode_attention, decode_attention_per_head
from cortexstream.kv.quantized_blocks import QuantizedRows
from tiny_models import tiny_model

H, D = 2, 64


def biased_rows(seed: int = 0, slots: int = 48) -> tuple[mx.array, mx.array]:
    """Rows `[1, H, S, D]` like Qwen2's keys: unit noise plus a per-head bias with a few channels 100x larger."""
    rng = np.random.default_rng(seed)
    center = rng.normal(size=(H, D)).astype(np.float32)
    center[:, [31, 62, 63]] = [[140.0, -120.0, 75.0], [-90.0, 160.0, 60.0]]
    rows = rng.normal(size=(1, H, slots, D)).astype(np.float32) + center[None, :, None, :]
    return mx.array(rows), mx.array(center)


def relative_error(stored: QuantizedRows, rows: mx.array, center: mx.array) -> float:
    """Error of the read-back rows relative to the rows' spread around their center (what attention resolves)."""
    return float(mx.linalg.norm(stored.dequantize() - rows) / mx.linalg.norm(rows - center[None, :, None, :]))


@pytest.mark.parametrize("bits,rotated", [(8, False), (4, False), (4, True)])
def test_centering_cuts_the_error_of_biased_rows(bits, rotated):
    rows, center = biased_rows()
    signs = mx.array(rotation_signs(D)) if rotated else None
    plain = QuantizedRows.from_rows(rows, bits, 64, signs)
    centered = QuantizedRows.from_rows(rows, bits, 64, signs, center)
    assert centered.center is not None and plain.center is None
    plain_error, centered_error = relative_error(plain, rows, center), relative_error(centered, rows, center)
    assert centered_error < 0.25 * plain_error
    assert centered_error < (0.02 if bits == 8 else 0.25)
    # the stored values are the centered ones; dequantize adds the center back
    if not rotated:
        assert float(mx.abs(centered.dequantize_stored()).max()) < 10.0
    assert mx.allclose(centered.dequantize(), rows, atol=2.0 if bits == 4 else 0.2).item()


def test_moves_keep_the_center_and_refuse_mixing():
    rows, center = biased_rows()
    box = QuantizedRows.zeros(H, 64, D, 8, 64, mx.float32, None, center)
    box.write(slice(0, 48), rows)
    assert mx.array_equal(box.gather([3, 5]).dequantize(), box.dequantize()[:, :, mx.array([3, 5])]).item()
    picked = box.take_per_head(mx.array([[1, 2], [7, 9]], dtype=mx.int32))
    assert picked.center is not None and mx.allclose(picked.center, box.center).item()
    assert box.padded(16).center is not None
    # read_back equals a write followed by a read
    assert mx.allclose(box.read_back(rows[:, :, :4], mx.float32), box.dequantize()[:, :, :4]).item()
    with pytest.raises(InvalidArgumentError, match="centered and uncentered"):
        box.put([0, 1], QuantizedRows.from_rows(rows[:, :, :2], 8, 64))
    with pytest.raises(InvalidArgumentError, match="center: shape"):
        QuantizedRows.zeros(H, 8, D, 8, 64, mx.float32, None, mx.zeros((H + 1, D)))


@pytest.mark.parametrize("bits,rotated", [(8, False), (4, True)])
def test_attention_over_centered_codes_equals_attention_over_true_rows(bits, rotated):
    """Keys and values both centered (values' center is added back to the output): every reader gives SDPA over the
    rows the containers hold (their true, un-centered values)."""
    rows, center = biased_rows(1)
    values, value_center = biased_rows(2)
    signs = mx.array(rotation_signs(D)) if rotated else None
    keys_q = QuantizedRows.from_rows(rows, bits, 64, signs, center)
    values_q = QuantizedRows.from_rows(values, bits, 64, signs, value_center)
    queries = mx.random.normal((1, 2 * H, 1, D), key=mx.random.key(3)) * 0.05
    scale = D ** -0.5
    reference = mx.fast.scaled_dot_product_attention(queries, keys_q.dequantize(), values_q.dequantize(), scale=scale)
    for got in (decode_attention(queries, keys_q, values_q, scale),
                decode_attention(queries, keys_q, values_q, scale, dequantize=True),
                decode_attention_per_head(queries, keys_q, values_q, scale)):
        assert mx.allclose(got, reference, atol=1e-3, rtol=1e-4).item(), float(mx.abs(got - reference).max())


def qwen_like(seed: int = 3):
    """A tiny qwen2 model (k_proj with a bias) whose key bias has Qwen2-sized channels, in RoPE's slowest pair
    (channels 15 and 31 of a 32-wide head, non-traditional RoPE with Qwen2's base), where Qwen2's are."""
    model = tiny_model(seed=seed, model_type="qwen2", head_dim=None, hidden_size=128, num_attention_heads=4,
                       num_key_value_heads=2, rope_traditional=False, rope_theta=1000000.0)
    rng = np.random.default_rng(seed)
    for layer in model.model.layers:
        bias = rng.normal(size=(2, 32)).astype(np.float32)
        bias[:, [15, 31]] = [[120.0, -80.0], [90.0, 150.0]]
        layer.self_attn.k_proj.bias = mx.array(bias.reshape(-1))
    mx.eval(model.parameters())
    return model


def test_arena_config_takes_the_key_bias_for_quantized_keys_only():
    model = qwen_like()
    config = ArenaConfig.for_model(model, num_tokens=64, kv_dtype="int8", kv_group_size=32)
    bias = np.array(model.model.layers[1].self_attn.k_proj.bias).reshape(2, 32)
    assert np.array_equal(np.array(config.key_centers[1], dtype=np.float32), bias)
    assert config.cache_key.endswith(",center=k_bias")
    assert ArenaConfig.for_model(model, num_tokens=64).key_centers is None
    assert ArenaConfig.for_model(model, num_tokens=64, kv_dtype="k=float32,v=int8",
                                 kv_group_size=32).key_centers is None
    assert ArenaConfig.for_model(tiny_model(seed=1, head_dim=32), num_tokens=64, kv_dtype="int8",
                                 kv_group_size=32).key_centers is None  # llama: no key bias
    with pytest.raises(InvalidArgumentError, match="key_centers: only a quantized key side"):
        ArenaConfig(2, 2, 32, 4, 16, key_centers=config.key_centers)
    with pytest.raises(InvalidArgumentError, match="key_centers"):
        ArenaConfig(2, 2, 32, 4, 16, kv_dtype=parse_kv_dtype("int8", 32, model_dtype="float32"),
                    key_centers=config.key_centers[:1])


def test_centered_int8_logits_stay_close_where_uncentered_ones_do_not():
    """On a model with Qwen2-sized key-bias channels, int8 keys without centering move the logits far more than
    with it (the codes spend their range on the bias channels)."""
    from dataclasses import replace

    from cortexstream.kv.arena import KVArena
    from cortexstream.kv.arena_cache import ArenaKVCache
    from cortexstream.kv.prompt_cache import make_prompt_cache
    from cortexstream.kv.sequence_kv import SequenceKV

    model = qwen_like()
    ids = mx.array([list(range(3, 83))])
    reference = model(ids, cache=make_prompt_cache(model))
    centered_cache = make_prompt_cache(model, kv_dtype="int8", kv_group_size=32)
    assert centered_cache[0].sequence.arena.config.key_centers is not None
    config = ArenaConfig.for_model(model, num_tokens=128, kv_dtype="int8", kv_group_size=32)
    seq = SequenceKV(KVArena(replace(config, key_centers=None)), owner=0)
    plain_cache = [ArenaKVCache(seq, layer) for layer in range(config.num_layers)]
    centered = float(mx.abs(model(ids, cache=centered_cache) - reference).max())
    plain = float(mx.abs(model(ids, cache=plain_cache) - reference).max())
    assert 0 < centered < 0.3 * plain, (centered, plain)


def test_engine_on_centered_int8_gives_the_float_arenas_greedy_tokens(tiny):
    from cortexstream.engine.engine import Engine
    from cortexstream.engine.sampling import SamplingParams

    model = qwen_like()
    prompts = [list(range(3, 3 + n)) for n in (7, 30, 52)]

    def run(**kwargs):
        engine = Engine(model, tiny[1], kv_tokens=1024, **kwargs)
        ids = [engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.0)) for p in prompts]
        out = {rid: [] for rid in ids}
        while engine.has_unfinished:
            for step in engine.step():
                if step.token is not None:
                    out[step.request_id].append(step.token)
        return [out[rid] for rid in ids], engine

    floats, _ = run()
    quantized, engine = run(kv_dtype="int8", kv_group_size=32)
    assert engine.arena.config.key_centers is not None
    assert quantized == floats


def test_saved_centered_cache_round_trips_and_refuses_other_centers(tmp_path):
    from cortexstream.kv.arena import KVArena
    from cortexstream.kv.prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    model = qwen_like()
    cache = make_prompt_cache(model, kv_dtype="int4,keys=token", kv_group_size=32)
    model(mx.array([list(range(3, 40))]), cache=cache)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    config = loaded[0].sequence.arena.config
    assert config.key_centers == cache[0].sequence.arena.config.key_centers
    for layer in range(2):
        assert mx.array_equal(loaded[layer].state[0], cache[layer].state[0]).item()
    # into an arena of the same model: fine; of a model with another key bias: refused
    same = KVArena(ArenaConfig.for_model(model, num_tokens=256, kv_dtype="int4,keys=token", kv_group_size=32))
    assert load_prompt_cache(path, arena=same)[0].size() == 37
    other = KVArena(ArenaConfig.for_model(qwen_like(seed=9), num_tokens=256, kv_dtype="int4,keys=token", kv_group_size=32))
    with pytest.raises(ModelLoadError, match="centered by another model"):
        load_prompt_cache(path, arena=other)
    uncentered = KVArena(ArenaConfig(2, 2, 32, 16, 16, kv_dtype=parse_kv_dtype("int4,keys=token", 32, model_dtype="float32")))
    with pytest.raises(ModelLoadError, match="stores K/V as"):
        load_prompt_cache(path, arena=uncentered)


def test_auto_does_not_rotate_centered_keys_but_rotates_the_rest():
    """AUTO rotates 4-bit sides except centered keys; rotate=on still rotates them; the cache key names the sides."""
    model = qwen_like()
    auto = ArenaConfig.for_model(model, num_tokens=64, kv_dtype="int4,keys=token", kv_group_size=32)
    assert auto.storage.centered_keys and not auto.storage.key_rotated and auto.storage.value_rotated
    assert ",rot=hadamard1:v," in auto.cache_key + ","
    forced = ArenaConfig.for_model(model, num_tokens=64, kv_dtype="int4,keys=token,rotate=on", kv_group_size=32)
    assert forced.storage.key_rotated and ",rot=hadamard1:kv" in forced.cache_key
    plain = ArenaConfig.for_model(tiny_model(seed=1, head_dim=32), num_tokens=64, kv_dtype="int4,keys=token", kv_group_size=32)
    assert not plain.storage.centered_keys and plain.storage.key_rotated  # no key bias: rotated as before
    # the arena's key side follows the rule
    from cortexstream.kv.arena import KVArena

    arena = KVArena(auto)
    assert arena.keys[0].rotation is None and arena.values[0].rotation is not None
    from dataclasses import replace

    with pytest.raises(InvalidArgumentError, match="centered_keys"):
        replace(parse_kv_dtype("k=float32,v=int4", 32, model_dtype="float32"), centered_keys=True)


def test_saved_cache_records_its_rotated_sides_and_old_centered_int4_files_are_refused(tmp_path):
    import json

    from cortexstream.kv.prompt_cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

    model = qwen_like()
    cache = make_prompt_cache(model, kv_dtype="int4,keys=token", kv_group_size=32)
    model(mx.array([list(range(3, 30))]), cache=cache)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    arrays, metadata = mx.load(path, return_metadata=True)
    key = next(k for k in metadata if "kv_dtype" in metadata[k])
    info = json.loads(metadata[key])
    assert info["kv_dtype"]["rotated"] == "v"
    for layer in range(2):  # what was written is what is read back: keys unrotated, values rotated
        assert mx.array_equal(load_prompt_cache(path)[layer].state[0], cache[layer].state[0]).item()
    for rewrite, match in ((lambda d: d.pop("rotated"), "earlier version"),
                           (lambda d: d.update(rotated="kv"), "rotated")):
        edited = json.loads(metadata[key])
        rewrite(edited["kv_dtype"])
        other = str(tmp_path / f"edited_{match.replace(' ', '_')}.safetensors")
        mx.save_safetensors(other, arrays, metadata={**metadata, key: json.dumps(edited)})
        with pytest.raises(ModelLoadError, match=match):
            load_prompt_cache(other)
