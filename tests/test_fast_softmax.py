"""kernels/fast_softmax.py: equal to mx.softmax(precise=True) to float rounding, masks and any shape included."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.kernels.fast_softmax import softmax


@pytest.mark.parametrize("shape", [(1, 1), (2, 1), (3, 1, 1), (3, 7), (1, 2), (2, 3, 3, 1, 192), (8, 3, 3, 2048),
                                   (1, 9, 4, 1500)])
def test_equals_mx_softmax_to_rounding(shape):
    rng = np.random.default_rng(sum(shape))
    x = mx.array((rng.standard_normal(shape) * rng.choice([0.1, 3.0, 40.0])).astype(np.float32))
    ours, reference = softmax(x), mx.softmax(x, axis=-1, precise=True)
    assert ours.shape == reference.shape and ours.dtype == mx.float32
    np.testing.assert_allclose(np.array(ours), np.array(reference), rtol=2e-6, atol=1e-7)


def test_masked_entries_get_zero_and_rows_still_sum_to_one():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3, 300)).astype(np.float32) * 5
    mask = rng.random((4, 3, 300)) < 0.6
    mask[..., 0] = False  # every row keeps at least one key, as the decode masks do
    for fill in (-np.inf, np.finfo(np.float32).min):
        masked = mx.array(np.where(mask, fill, x).astype(np.float32))
        ours = np.array(softmax(masked))
        assert not np.isnan(ours).any()
        assert (ours[mask] == 0).all()
        np.testing.assert_allclose(ours.sum(-1), 1.0, rtol=1e-5)
        np.testing.assert_allclose(ours, np.array(mx.softmax(masked, axis=-1, precise=True)), rtol=2e-6, atol=1e-7)


def test_one_compiled_function_serves_changing_lengths():
    """A decode step's key count grows by one each step: the shapeless compile must follow, not reuse a shape."""
    for rows, length in ((2, 5), (2, 6), (3, 7), (1, 300), (2, 1), (4, 17)):
        x = mx.array(np.linspace(-3, 3, rows * length, dtype=np.float32).reshape(rows, length))
        ours = softmax(x)
        assert ours.shape == (rows, length)
        np.testing.assert_allclose(np.array(ours), np.array(mx.softmax(x, axis=-1, precise=True)), rtol=2e-6)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_other_dtypes_are_mx_softmax_itself(dtype):
    x = mx.array(np.random.default_rng(0).standard_normal((2, 3, 50)).astype(np.float32)).astype(dtype)
    ours = softmax(x)
    assert ours.dtype == dtype
    assert mx.array_equal(ours, mx.softmax(x, axis=-1, precise=True)).item()
