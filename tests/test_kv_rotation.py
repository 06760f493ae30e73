"""Rotated quantized storage (kv/kv_rotation.py): the rotation is orthogonal and applied as the reference matrix
says, it cuts 4-bit error on rows with outlier channels, attention over rotated codes equals attention over the
true rows, and the spelling, cache keys and head-dim checks say what is stored."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.kv_dtype import parse_kv_dtype
from cortexstream.kv.kv_rotation import rotation_matrix, rotation_signs
from cortexstream.kv.prompt_cache_check import storage_from_metadata
from cortexstream.kv.quantized_attention import decode_attention, decode_attention_per_head
from cortexstream.kv.quantized_blocks import QuantizedRows, rotate, unrotate


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_rotation_is_orthogonal_and_the_transform_is_the_matrix(dim):
    matrix = rotation_matrix(dim)
    assert np.allclose(matrix @ matrix.T, np.eye(dim), atol=1e-5)
    rows = np.random.default_rng(dim).normal(size=(3, 5, dim)).astype(np.float32)
    signs = mx.array(rotation_signs(dim))
    assert np.allclose(np.array(rotate(mx.array(rows), signs)), rows @ matrix, atol=1e-5)
    assert np.allclose(np.array(unrotate(mx.array(rows), signs)), rows @ matrix.T, atol=1e-5)
    assert np.allclose(np.array(unrotate(rotate(mx.array(rows), signs), signs)), rows, atol=1e-5)
    assert np.array_equal(rotation_signs(dim), rotation_signs(dim))  # fixed: stored blocks depend on it


def outlier_rows(seed: int, dim: int = 64) -> np.ndarray:
    """Key-like rows: most channels small, a few channels an order of magnitude larger."""
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(1, 2, 200, dim)).astype(np.float32)
    rows[..., [3, 17, 40]] *= 12.0
    return rows


def test_rotation_cuts_int4_error_on_rows_with_outlier_channels():
    rows = outlier_rows(0)
    errors = {}
    for rotated in (False, True):
        signs = mx.array(rotation_signs(64)) if rotated else None
        stored = QuantizedRows.from_rows(mx.array(rows), 4, 64, signs)
        errors[rotated] = float(np.sqrt(np.mean((np.array(stored.dequantize()) - rows) ** 2)))
    assert errors[True] < 0.6 * errors[False]


def test_writes_rotate_and_reads_give_the_true_rows_back():
    rows = mx.array(outlier_rows(1))
    signs = mx.array(rotation_signs(64))
    box = QuantizedRows.zeros(2, 200, 64, 8, 64, mx.float32, signs)
    box.write(slice(0, 200), rows)
    assert np.allclose(np.array(box.dequantize()), np.array(rows), atol=0.15)  # 8-bit error, not rotated space
    assert not np.allclose(np.array(box.dequantize_stored()), np.array(rows), atol=1.0)
    moved = box.gather([5, 7])
    assert moved.rotation is box.rotation
    assert np.allclose(np.array(box.read_back(rows[:, :, [5, 7]], mx.float32)), np.array(moved.dequantize()),
                       atol=1e-5)
    plain = QuantizedRows.zeros(2, 4, 64, 8, 64, mx.float32)
    with pytest.raises(InvalidArgumentError, match="rotated and unrotated"):
        plain.put([0, 1], moved)


@pytest.mark.parametrize("dequantize", [False, True])
def test_attention_over_rotated_codes_equals_attention_over_the_true_rows(dequantize):
    rng = np.random.default_rng(3)
    signs = mx.array(rotation_signs(64))
    keys = QuantizedRows.from_rows(mx.array(outlier_rows(4)), 4, 64, signs)
    values = QuantizedRows.from_rows(mx.array(outlier_rows(5)), 4, 32, signs)
    q = mx.array(rng.normal(size=(1, 4, 1, 64)).astype(np.float32))
    reference = mx.fast.scaled_dot_product_attention(q, keys.dequantize(), values.dequantize(), scale=0.125)
    out = decode_attention(q, keys, values, 0.125, None, dequantize)
    assert np.allclose(np.array(out), np.array(reference), atol=1e-4)
    per_head = decode_attention_per_head(q, keys, values, 0.125)
    assert np.allclose(np.array(per_head), np.array(reference), atol=1e-4)


def test_spelling_cache_key_and_defaults():
    int4 = parse_kv_dtype("int4,keys=token", model_dtype="float32")
    assert int4.key_rotated and int4.value_rotated and "rot=" in int4.cache_key
    channels = parse_kv_dtype("int4", model_dtype="float32")  # 4-bit keys grouped per channel: not rotated
    assert not channels.key_rotated and channels.value_rotated and "keys=channel" in channels.cache_key
    int8 = parse_kv_dtype("int8", model_dtype="float32")
    assert not int8.key_rotated and "rot=" not in int8.cache_key
    off = parse_kv_dtype("int4,rotate=off", model_dtype="float32")
    assert not off.key_rotated and off.cache_key != int4.cache_key and off.text == "int4,rotate=off"
    mixed = parse_kv_dtype("k=int8,v=int4", model_dtype="float32")
    assert (mixed.key_rotated, mixed.value_rotated) == (False, True)
    on = parse_kv_dtype("k=int8,v=int4,rotate=on", model_dtype="float32")
    assert on.key_rotated and on.value_rotated and parse_kv_dtype(on.text, model_dtype="float32") == on
    for bad, match in (("float16,rotate=on", "quantizes nothing"), ("int4,rotate=sideways", "rotate"),
                       ("rotate=on", "without a storage type"), ("int4,rotate=on,k=int8", "must come after")):
        with pytest.raises(InvalidArgumentError, match=match):
            parse_kv_dtype(bad, model_dtype="float32")


def test_a_head_dim_the_rotation_cannot_take_is_refused_with_the_way_out():
    with pytest.raises(InvalidArgumentError, match="head_dim is 96.*rotate=off"):
        ArenaConfig(2, 2, 96, 16, 4, "float32", kv_dtype=parse_kv_dtype("int4", 32, model_dtype="float32"))
    ArenaConfig(2, 2, 96, 16, 4, "float32", kv_dtype=parse_kv_dtype("int4,rotate=off", 32, model_dtype="float32"))


def test_saved_metadata_without_rotation_reads_as_unrotated_and_a_foreign_rotation_is_refused():
    old = {"key": "int4", "value": "int4", "group_size": 64, "float_type": "float32"}
    assert not storage_from_metadata("f", old).key_rotated
    new = dict(old, rotation="auto", rotation_matrix="hadamard0")
    with pytest.raises(ModelLoadError, match="rotated by 'hadamard0'"):
        storage_from_metadata("f", new)
    assert json.dumps(new)  # metadata is plain JSON
