"""The quantized-rows codec: round-trip error per group, codes moving with their scales and biases through writes
and gathers, the bytes it really holds, and bad input refused."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.kv_dtype import parse_kv_dtype
from cortexstream.kv.quantized_blocks import QuantizedRows, dequantize_rows, quantize_rows

UNIT_ROUNDOFF = {mx.float32: 2.0**-24, mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8}


def _rows(kind: str, seed: int, heads: int = 3, slots: int = 64, dim: int = 64) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, heads, slots, dim)).astype(np.float32)
    if kind == "outliers":  # a few huge values per row, as in real keys' outlier channels
        x[..., ::13] *= 80.0
    elif kind == "constant":  # every group one value (zero, positive, negative, tiny, large)
        values = np.array([0.0, 1.0, -3.5, 1e-3, 100.0], np.float32)
        x = np.broadcast_to(values[rng.integers(0, 5, size=(1, heads, slots, 1))], x.shape).copy()
    elif kind == "offset":  # all one sign, narrow range far from zero
        x = 5.0 + 1e-2 * x
    elif kind == "scaled":  # rows of very different magnitudes
        x = x * rng.uniform(0.01, 100.0, size=(1, heads, slots, 1)).astype(np.float32)
    return x


def _groups(a: mx.array, group: int) -> np.ndarray:
    values = np.array(a.astype(mx.float32))
    return values.reshape(*values.shape[:-1], -1, group)


@pytest.mark.parametrize("kind", ["normal", "outliers", "constant", "offset", "scaled"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_error_is_bounded_per_group(bits, group, dtype, kind):
    """Bound: (max - min) / 2**bits per group, plus rounding in the float type.

    Not the half step (max - min) / (2**bits - 1) / 2 of a plain min/max quantizer: mx.quantize anchors the
    group's endpoint of larger magnitude as the bias and rounds the step so that zero is a code, which can clip
    the other endpoint by up to about one step (bits b, n = 2**b - 1 steps: the error is at most n/(n+1) of a
    step of (max - min) / n)."""
    x = mx.array(_rows(kind, seed=bits * 1000 + group)).astype(dtype)
    packed, scales, biases = quantize_rows(x, bits, group)
    assert packed.dtype == mx.uint32 and packed.shape == (1, 3, 64, 64 * bits // 32)
    assert scales.dtype == biases.dtype == dtype and scales.shape == biases.shape == (1, 3, 64, 64 // group)
    back = dequantize_rows(packed, scales, biases, bits, group, dtype)
    assert back.dtype == dtype and back.shape == x.shape
    xs, ys = _groups(x, group), _groups(back, group)
    spread = xs.max(-1) - xs.min(-1)
    rounding = 4 * UNIT_ROUNDOFF[dtype] * np.abs(xs).max(-1)
    error = np.abs(xs - ys).max(-1)
    assert np.all(error <= spread / 2**bits + rounding), float((error - spread / 2**bits - rounding).max())
    if kind == "constant":
        assert np.all(error <= rounding)


def test_more_bits_give_smaller_errors():
    x = mx.array(_rows("normal", seed=7))
    errors = {}
    for bits in (8, 4):
        back = dequantize_rows(*quantize_rows(x, bits, 64), bits, 64, mx.float32)
        errors[bits] = float(mx.abs(back - x).mean())
    assert errors[8] * 8 < errors[4]


def test_dequantize_returns_the_requested_float_type():
    x = mx.array(_rows("normal", seed=3)).astype(mx.float16)
    parts = quantize_rows(x, 8, 64)
    assert dequantize_rows(*parts, 8, 64, mx.float32).dtype == mx.float32
    rows = QuantizedRows(*parts, 8, 64)
    assert rows.dtype == mx.float16 and rows.dequantize().dtype == mx.float16
    assert rows.dequantize(mx.float32).dtype == mx.float32


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    bits=st.sampled_from([8, 4]),
    group=st.sampled_from([32, 64]),
    dtype=st.sampled_from([mx.float32, mx.float16]),
    num_slots=st.integers(1, 40),
)
def test_gather_and_write_keep_scales_with_their_rows(data, bits, group, dtype, num_slots):
    """Rows written at arbitrary slots (twice, the second write overwriting some) and gathered in any order
    dequantize to exactly what quantizing those same rows on their own gives."""
    dim, heads = 64, 2
    store = QuantizedRows.zeros(heads, num_slots, dim, bits, group, dtype)
    expected: dict[int, mx.array] = {}  # slot -> float row [1, H, 1, D] last written there
    seed = data.draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    for _ in range(2):
        slots = data.draw(st.permutations(range(num_slots)))[: data.draw(st.integers(0, num_slots))]
        rows = mx.array(rng.standard_normal((1, heads, len(slots), dim)).astype(np.float32) * rng.uniform(0.1, 50))
        rows = rows.astype(dtype)
        how = data.draw(st.sampled_from(["list", "numpy", "mx"]))
        index = {"list": list(slots), "numpy": np.array(slots, np.int64), "mx": mx.array(slots, dtype=mx.int32)}[how]
        store.write(index, rows)
        for i, slot in enumerate(slots):
            expected[slot] = rows[:, :, i : i + 1, :]
    order = data.draw(st.lists(st.integers(0, num_slots - 1), min_size=1, max_size=2 * num_slots))
    gathered = store.gather(order)
    assert gathered.num_slots == len(order) and gathered.bits == bits and gathered.group_size == group
    zero = mx.zeros((1, heads, 1, dim), dtype)
    wanted = mx.concatenate([expected.get(slot, zero) for slot in order], axis=2)
    reference = dequantize_rows(*quantize_rows(wanted, bits, group), bits, group, dtype)
    assert mx.array_equal(gathered.dequantize(), reference).item()
    # the three arrays moved together: each gathered row's code, scale and bias are the source slot's
    for name in ("packed", "scales", "biases"):
        source = np.array(getattr(store, name))
        assert np.array_equal(np.array(getattr(gathered, name)), source[:, :, order, :])


def test_slices_write_and_gather_contiguous_runs():
    store = QuantizedRows.zeros(3, 32, 64, 4, 32, mx.float16)
    rows = mx.array(_rows("normal", seed=11, slots=8)).astype(mx.float16)
    store.write(slice(16, 24), rows)
    reference = dequantize_rows(*quantize_rows(rows, 4, 32), 4, 32, mx.float16)
    assert mx.array_equal(store.gather(slice(16, 24)).dequantize(), reference).item()
    assert mx.array_equal(store.gather(range(16, 24)).dequantize(), reference).item()
    untouched = store.gather(slice(0, 16)).dequantize()
    assert mx.array_equal(untouched, mx.zeros_like(untouched)).item()


def test_rows_in_another_float_type_are_stored_in_the_containers():
    store = QuantizedRows.zeros(1, 4, 64, 8, 64, mx.float16)
    rows = mx.random.normal((1, 1, 2, 64), key=mx.random.key(0))  # float32
    store.write([0, 3], rows)
    assert store.scales.dtype == store.biases.dtype == mx.float16
    reference = dequantize_rows(*quantize_rows(rows.astype(mx.float16), 8, 64), 8, 64, mx.float16)
    assert mx.array_equal(store.gather([0, 3]).dequantize(), reference).item()


def test_empty_writes_and_gathers():
    store = QuantizedRows.zeros(2, 8, 64, 8, 64, mx.float32)
    store.write([], mx.zeros((1, 2, 0, 64)))
    assert store.gather([]).dequantize().shape == (1, 2, 0, 64)


def test_packed_storage_is_smaller_for_1024_slots():
    heads, slots, dim = 3, 1024, 64
    float16_bytes = mx.zeros((1, heads, slots, dim), mx.float16).nbytes
    assert float16_bytes == 3 * 1024 * 64 * 2 == 393216
    int8 = QuantizedRows.zeros(heads, slots, dim, 8, 64, mx.float16)
    int4 = QuantizedRows.zeros(heads, slots, dim, 4, 64, mx.float16)
    # codes: 3 * 1024 rows * 64 values * 1 or 0.5 byte; scales + biases: 3 * 1024 rows * 1 group * 2 * 2 bytes
    assert int8.nbytes == 196608 + 12288 == 208896
    assert int4.nbytes == 98304 + 12288 == 110592
    assert int4.nbytes < int8.nbytes < float16_bytes
    # what KVDtype charges for one side of one layer, per token, times the slots
    int8_side = parse_kv_dtype("int8", model_dtype="float16").bytes_per_token(1, heads, dim) // 2
    assert int8_side * slots == int8.nbytes
    written = QuantizedRows.from_rows(mx.random.normal((1, heads, slots, dim)).astype(mx.float16), 4, 64)
    assert written.nbytes == int4.nbytes


def _refused(argument, call, *args, **kwargs):
    with pytest.raises(InvalidArgumentError) as caught:
        call(*args, **kwargs)
    assert argument in str(caught.value), str(caught.value)


def test_bad_codec_arguments_are_refused():
    x = mx.zeros((1, 2, 4, 64))
    _refused("bits", quantize_rows, x, 3, 64)
    _refused("bits", quantize_rows, x, 16, 64)
    _refused("kv_group_size", quantize_rows, x, 8, 128)
    _refused("kv_group_size", quantize_rows, mx.zeros((1, 2, 4, 96)), 8, 64)
    _refused("x", quantize_rows, mx.zeros((2, 4, 64)), 8, 64)
    _refused("x", quantize_rows, mx.zeros((1, 2, 4, 64), mx.int32), 8, 64)
    packed, scales, biases = quantize_rows(mx.ones((1, 2, 4, 64)), 8, 32)
    _refused("packed/scales/biases", dequantize_rows, packed, scales, biases, 8, 64, mx.float32)
    _refused("packed/scales/biases", dequantize_rows, packed, scales[..., :1], biases, 8, 32, mx.float32)


def test_bad_containers_and_slots_are_refused():
    packed, scales, biases = quantize_rows(mx.ones((1, 2, 4, 64)), 8, 32)
    _refused("packed", QuantizedRows, packed.astype(mx.int32), scales, biases, 8, 32)
    _refused("scales", QuantizedRows, packed, scales[..., :1], biases[..., :1], 8, 32)
    _refused("scales/biases", QuantizedRows, packed, scales, biases.astype(mx.float16), 8, 32)
    _refused("kv_group_size", QuantizedRows.zeros, 2, 4, 96, 8, 64, mx.float16)
    _refused("num_slots", QuantizedRows.zeros, 2, 0, 64, 8, 64, mx.float16)
    store = QuantizedRows(packed, scales, biases, 8, 32)
    rows = mx.ones((1, 2, 2, 64))
    _refused("slots", store.write, [0, 4], rows)
    _refused("slots", store.write, [-1, 0], rows)
    _refused("slots", store.write, [1, 1], rows)
    _refused("slots", store.write, [[0, 1]], rows)
    _refused("slots", store.write, [0.0, 1.0], rows)
    _refused("slots", store.gather, slice(4, 0, -1))
    _refused("slots", store.gather, mx.array([[0, 1]]))
    _refused("rows", store.write, [0, 1, 2], rows)
    _refused("rows", store.write, [0, 1], mx.ones((1, 2, 2, 32)))
