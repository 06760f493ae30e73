"""KVDtype and parse_kv_dtype: the spellings users give, the bytes a token costs, and every bad input refused
with an error naming the argument."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.kv_dtype import KVDtype, StorageType, parse_kv_dtype

SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64


def test_single_types_apply_to_both_sides():
    d = parse_kv_dtype("int8", model_dtype="float16")
    assert (d.key, d.value, d.group_size) == (StorageType.INT8, StorageType.INT8, 64)
    assert d.float_type == StorageType.FLOAT16
    assert d.quantized and (d.key_bits, d.value_bits) == (8, 8)
    d = parse_kv_dtype("int4", 32, model_dtype="bfloat16")
    assert (d.key, d.value, d.group_size) == (StorageType.INT4, StorageType.INT4, 32)
    assert d.float_type == StorageType.BFLOAT16
    assert (d.key_bits, d.value_bits) == (4, 4)
    d = parse_kv_dtype("float16", model_dtype="float32")
    assert (d.key, d.value, d.float_type) == (StorageType.FLOAT16, StorageType.FLOAT16, StorageType.FLOAT32)
    assert not d.quantized and d.key_bits == 16


def test_separate_key_and_value_types():
    d = parse_kv_dtype("k=int8,v=int4", model_dtype="float16")
    assert (d.key, d.value) == (StorageType.INT8, StorageType.INT4)
    assert (d.key_bits, d.value_bits) == (8, 4) and d.quantized
    assert parse_kv_dtype(" K = INT8 , v=int4 ", model_dtype="float16") == d
    mixed = parse_kv_dtype("k=auto,v=int4", model_dtype="bfloat16")
    assert (mixed.key, mixed.value) == (StorageType.BFLOAT16, StorageType.INT4) and mixed.quantized


@pytest.mark.parametrize("text", [None, "auto", " AUTO "])
def test_auto_is_the_models_float_type(text):
    for model in ("float32", "float16", "bfloat16"):
        d = parse_kv_dtype(text, model_dtype=model)
        assert d.key == d.value == d.float_type == StorageType(model)
        assert not d.quantized


@settings(max_examples=60, deadline=None)
@given(
    key=st.sampled_from(list(StorageType)),
    value=st.sampled_from(list(StorageType)),
    group=st.sampled_from([32, 64]),
    model=st.sampled_from(["float32", "float16", "bfloat16"]),
)
def test_text_round_trips_through_the_parser(key, value, group, model):
    d = KVDtype(key, value, model, group)
    quantized = key.quantized or value.quantized
    again = parse_kv_dtype(d.text, group if quantized else None, model_dtype=model)
    assert again == (d if quantized else KVDtype(key, value, model))
    assert again.cache_key == (d.cache_key if quantized else again.cache_key)
    assert ("group=" in d.cache_key) == quantized and f"float={model}" in d.cache_key


def test_cache_key_separates_what_changes_the_stored_bytes():
    keys = {
        parse_kv_dtype("int8", model_dtype="float16").cache_key,
        parse_kv_dtype("int8", 32, model_dtype="float16").cache_key,
        parse_kv_dtype("int8", model_dtype="bfloat16").cache_key,
        parse_kv_dtype("int4", model_dtype="float16").cache_key,
        parse_kv_dtype("k=int8,v=int4", model_dtype="float16").cache_key,
        parse_kv_dtype("k=int4,v=int8", model_dtype="float16").cache_key,
        parse_kv_dtype("float16", model_dtype="float16").cache_key,
    }
    assert len(keys) == 7


def test_bytes_per_token_for_smollm2_by_hand():
    # 30 layers x 3 KV heads = 90 (layer, head) pairs, each storing one K and one V row of 64 values.
    def bytes_of(text, group=None, model="float16", block_size=16):
        return parse_kv_dtype(text, group, model_dtype=model).bytes_per_token(**SMOLLM2, block_size=block_size)

    assert bytes_of("float32", model="float32") == 46080  # 90 * 2 rows * 64 values * 4 bytes
    assert bytes_of("float16") == 23040  # 90 * 2 * 64 * 2
    assert bytes_of("bfloat16", model="bfloat16") == 23040
    # int8, group 64, float16 scales: a row is 64 one-byte codes + 1 group * (2-byte scale + 2-byte bias) = 68
    assert bytes_of("int8") == 12240  # 90 * 2 * 68
    # int4, group 64: 64 codes * 0.5 byte = 32, + 4 = 36 per row
    assert bytes_of("int4,keys=token") == 6480  # 90 * 2 * 36
    # int4 keys grouped per channel (the default for 4-bit keys): 32 bytes of codes, and per block of 16 tokens
    # one 2-byte scale and bias per channel: 64 * 4 / 16 = 16 bytes per token; values as above, 36
    assert bytes_of("int4") == 90 * (32 + 16 + 36)
    assert bytes_of("int4", block_size=32) == 90 * (32 + 8 + 36)
    # group 32: two groups per row, 8 bytes of scales and biases
    assert bytes_of("int8", 32) == 12960  # 90 * 2 * (64 + 8)
    assert bytes_of("int4,keys=token", 32) == 7200  # 90 * 2 * (32 + 8)
    # a float32 model keeps float32 scales and biases: 64 + 1 * (4 + 4) = 72 per row
    assert bytes_of("int8", model="float32") == 12960
    # K int8 (68) and V int4 (36)
    assert bytes_of("k=int8,v=int4") == 9360  # 90 * (68 + 36)
    # the budget multipliers the feature exists for: a bit under 2x and 4x because of scales and biases
    assert 1.8 < 23040 / 12240 < 2 and 3.5 < 23040 / 6480 < 4


def test_float_bytes_agree_with_the_arena_config():
    for name in ("float32", "float16", "bfloat16"):
        d = parse_kv_dtype(name, model_dtype=name)
        arena = ArenaConfig(30, 3, 64, num_blocks=1, dtype=name)
        assert d.bytes_per_token(**SMOLLM2) == arena.bytes_per_token
        arena = ArenaConfig(4, 2, 64, num_blocks=1, dtype=name, v_head_dim=128)
        assert d.bytes_per_token(4, 2, 64, 128) == arena.bytes_per_token


def test_value_head_dim_may_differ():
    d = parse_kv_dtype("int8", model_dtype="float16")
    # K: 64 + 4; V: 128 codes + 2 groups * 4 = 136; 2 layers * 1 head
    assert d.bytes_per_token(2, 1, 64, 128) == 2 * (68 + 136)


def _refused(argument, call, *args, **kwargs):
    with pytest.raises(InvalidArgumentError) as caught:
        call(*args, **kwargs)
    assert argument in str(caught.value), str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("text", ["int3", "fp16", "q8", "", "int8;int4", "float64", "k=int9,v=int8"])
def test_unknown_dtype_is_refused_listing_the_choices(text):
    message = _refused("kv_dtype", parse_kv_dtype, text, model_dtype="float16")
    assert "int8" in message and "int4" in message and "float16" in message and "k=<type>,v=<type>" in message


def test_non_string_dtype_is_refused():
    _refused("kv_dtype", parse_kv_dtype, 8, model_dtype="float16")


@pytest.mark.parametrize(
    "text",
    ["k=int8", "v=int4", "k=int8,v=int4,k=int8", "x=int8,v=int8", "k=int8,,v=int8", "k=,v=int8", "k:int8,v:int4",
     "k=int8,v"],
)
def test_bad_key_value_syntax_is_refused(text):
    _refused("kv_dtype", parse_kv_dtype, text, model_dtype="float16")


@pytest.mark.parametrize("group", [16, 128, 0, -64, 48, True, "64", 64.0])
def test_bad_group_size_is_refused_listing_the_choices(group):
    message = _refused("kv_group_size", parse_kv_dtype, "int8", group, model_dtype="float16")
    assert "32" in message and "64" in message


def test_group_size_without_a_quantized_side_is_refused():
    _refused("kv_group_size", parse_kv_dtype, "float16", 32, model_dtype="float16")
    _refused("kv_group_size", parse_kv_dtype, "auto", 64, model_dtype="float16")


def test_model_dtype_must_be_a_float_type():
    _refused("model_dtype", parse_kv_dtype, "int8", model_dtype="int8")
    _refused("model_dtype", parse_kv_dtype, "int8", model_dtype="float64")


def test_direct_construction_validates_too():
    _refused("kv_dtype", KVDtype, "int2", "int8", "float16")
    _refused("kv_dtype", KVDtype, "int8", "float8", "float16")
    _refused("model_dtype", KVDtype, "int8", "int8", "int4")
    _refused("kv_group_size", KVDtype, "int8", "int8", "float16", 128)


def test_head_dim_not_divisible_by_the_group_is_refused():
    d = parse_kv_dtype("int8", model_dtype="float16")
    message = _refused("kv_group_size", d.bytes_per_token, 24, 2, 96)  # head_dim 96, group 64
    assert "96" in message and "kv_group_size=32" in message
    message = _refused("kv_group_size", d.check_head_dims, 48)  # no supported group divides 48
    assert "float kv_dtype" in message
    _refused("kv_group_size", d.check_head_dims, 64, 96)  # the value head dim is checked too
    # a float side is not grouped: only the quantized side's head dim must divide
    parse_kv_dtype("k=float16,v=int8", model_dtype="float16").check_head_dims(96, 64)
    parse_kv_dtype("float16", model_dtype="float16").check_head_dims(96)
    assert parse_kv_dtype("int8", 32, model_dtype="float16").bytes_per_token(1, 1, 96) == 2 * (96 + 3 * 4)


def test_bad_shape_arguments_are_refused():
    d = parse_kv_dtype("int8", model_dtype="float16")
    _refused("num_layers", d.bytes_per_token, 0, 3, 64)
    _refused("num_kv_heads", d.bytes_per_token, 30, -1, 64)
    _refused("head_dim", d.bytes_per_token, 30, 3, 0)
