"""Short passes over a pooled layout attended per column (`engine.pooled_decode`).

Against `pooled_heads.attend_cells` (the per-owner reference) on random layouts: cells lent within the layer, cells
lent to other layers (not attended), keys held in other layers' cells (attended by their owner), logit biases, the
causal mask over a pass of several queries, padding past `valid`; same output, same scores for the layer's cells
and its foreign cells. The extras are read through the block table, again after it changed; int8 cells too.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.engine.pooled_decode import ExtrasReader, attend_columns, layer_cells
from cortexstream.engine.pooled_heads import Foreign, Reduce, attend_cells
from cortexstream.engine.pooled_layers import ForeignCells
from cortexstream.kv.kv_dtype import parse_kv_dtype
from cortexstream.kv.sequence_kv import private_sequence


def _layout(rng: np.random.Generator, heads: int, stored: int, layer: int = 0):
    """Owners and owner layers `[H, stored]` with cells lent within the layer and to layer `layer + 1`."""
    owners = np.broadcast_to(np.arange(heads, dtype=np.int16)[:, None], (heads, stored)).copy()
    owner_layers = np.full((heads, stored), layer, np.int16)
    swap = rng.random((heads, stored)) < 0.3
    owners[swap] = rng.integers(0, heads, int(swap.sum()))
    lent = rng.random((heads, stored)) < 0.15
    owner_layers[lent] = layer + 1
    return owners, owner_layers


@pytest.mark.parametrize("num_queries,valid_pad,with_bias", [(1, 0, False), (1, 3, True), (3, 0, True),
                                                             (4, 2, False)])
def test_per_column_attention_equals_the_per_owner_reference(num_queries, valid_pad, with_bias):
    rng = np.random.default_rng(num_queries * 10 + valid_pad)
    heads, group, stored, dim, far = 3, 2, 11, 8, 5
    num_keys = stored + num_queries + valid_pad  # padding slots after the real ones (a batch row)
    valid = stored + num_queries
    q = mx.array(rng.standard_normal((1, heads * group, num_queries, dim)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, heads, num_keys, dim)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, heads, num_keys, dim)).astype(np.float32))
    owners, owner_layers = _layout(rng, heads, stored)
    bias = rng.standard_normal((heads, stored)).astype(np.float32) if with_bias else None
    foreign = ForeignCells(np.array([1, 1, 2, 2, 2]), rng.integers(0, heads, far), rng.integers(0, 20, far),
                           np.array([0, 2, 2, 1, 0]))
    far_bias = rng.standard_normal(far).astype(np.float32) if with_bias else None
    far_keys = mx.array(rng.standard_normal((far, dim)).astype(np.float32))
    far_values = mx.array(rng.standard_normal((far, dim)).astype(np.float32))

    # the reference: owners over every slot (new tokens own their column), this layer's cells only, the foreign
    full_owners = np.concatenate([owners, np.broadcast_to(np.arange(heads)[:, None], (heads, num_keys - stored))],
                                 axis=1).astype(np.int16)
    mine = np.concatenate([owner_layers == 0, np.ones((heads, num_keys - stored), bool)], axis=1)
    full_bias = None if bias is None else np.concatenate([bias, np.zeros((heads, num_keys - stored), np.float32)],
                                                         axis=1)
    want = attend_cells(q, k, v, 0.3, "causal", None, full_owners, full_bias, valid, 0, Reduce.SUM, mine,
                        Foreign(far_keys, far_values, foreign.heads, far_bias))

    cells = layer_cells(0, owners, owner_layers, bias, foreign, far_bias)
    lent = np.nonzero((owner_layers == 0) & (owners != np.arange(heads)[:, None]))
    assert cells.num_local == len(lent[0]) > 0 and cells.num_extras == cells.num_local + far
    local_keys = k[0][mx.array(lent[0].astype(np.int32)), mx.array(lent[1].astype(np.int32))]
    local_values = v[0][mx.array(lent[0].astype(np.int32)), mx.array(lent[1].astype(np.int32))]
    got = attend_columns(cells, q, k, v, 0.3, "causal", valid, mx.concatenate([local_keys, far_keys]),
                         mx.concatenate([local_values, far_values]), 0)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert np.asarray(got[1])[:, :stored][owner_layers == 1].max() == 0  # cells lent to another layer get nothing here
    unrecorded = attend_columns(cells, q, k, v, 0.3, "causal", valid, mx.concatenate([local_keys, far_keys]),
                                mx.concatenate([local_values, far_values]), None)
    np.testing.assert_allclose(np.asarray(unrecorded[0]), np.asarray(want[0]), atol=1e-5)
    assert unrecorded[1] is None and unrecorded[2] is None


def test_a_layer_with_only_its_own_cells_is_grouped_attention():
    rng = np.random.default_rng(2)
    heads, group, stored, dim = 2, 3, 7, 4
    q = mx.array(rng.standard_normal((1, heads * group, 1, dim)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, heads, stored + 1, dim)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, heads, stored + 1, dim)).astype(np.float32))
    owners = np.broadcast_to(np.arange(heads, dtype=np.int16)[:, None], (heads, stored)).copy()
    cells = layer_cells(0, owners, np.zeros((heads, stored), np.int16), None, None, None)
    assert cells.index is None and cells.num_extras == 0
    out, received, far = attend_columns(cells, q, k, v, 0.5, None, None, None, None, 0)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5)
    assert far is None and np.allclose(np.asarray(received).sum(axis=1), group)  # each query head's mass is 1


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_extras_are_read_through_the_block_table_again_after_it_changed(kv_dtype):
    heads, dim = 2, 64
    seq = private_sequence(3, heads, dim, dim, 16, "float32", block_size=4,
                           kv_dtype=None if kv_dtype is None else parse_kv_dtype(kv_dtype, model_dtype="float32"))
    rng = np.random.default_rng(3)
    keys = [rng.standard_normal((heads, 8, dim)).astype(np.float32) for _ in range(3)]
    for layer in range(3):
        seq.arena.write(layer, seq.blocks, 0, mx.array(keys[layer]), mx.array(keys[layer] * 2))
    seq.lengths = [8] * 3
    owners = np.broadcast_to(np.arange(heads, dtype=np.int16)[:, None], (heads, 8)).copy()
    owner_layers = np.zeros((heads, 8), np.int16)
    owners[1, 3] = 0  # column 1, slot 3 holds head 0's key of this layer
    foreign = ForeignCells(np.array([2]), np.array([1]), np.array([6]), np.array([1]))
    reader = ExtrasReader(layer_cells(0, owners, owner_layers, None, foreign, None))
    tol = 0 if kv_dtype is None else 0.05
    got_k, got_v = reader.read(seq)
    np.testing.assert_allclose(np.asarray(got_k), np.stack([keys[0][1, 3], keys[2][1, 6]]), atol=tol)
    np.testing.assert_allclose(np.asarray(got_v), 2 * np.stack([keys[0][1, 3], keys[2][1, 6]]), atol=2 * tol)
    # the sequence's first two blocks swap places (as a move or copy-on-write would give): same cells, new slots
    for layer in range(3):
        row_k, row_v = seq.arena.read(layer, seq.blocks, 8)
        seq.blocks[0], seq.blocks[1] = seq.blocks[1], seq.blocks[0]
        seq.arena.write(layer, seq.blocks, 0, row_k, row_v)
        seq.blocks[0], seq.blocks[1] = seq.blocks[1], seq.blocks[0]
    seq.blocks[0], seq.blocks[1] = seq.blocks[1], seq.blocks[0]
    moved_k, _ = reader.read(seq)
    np.testing.assert_allclose(np.asarray(moved_k), np.asarray(got_k), atol=tol)
