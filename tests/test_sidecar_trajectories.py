"""Trajectory collection on a tiny mlx-lm model: chunking and bounded buffering, reload equals what attention saw,
and the stored rest-of-context pseudo-key reproduces the model's real attention output at every stored query."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.training.sidecar.loss import outputs
from cortexstream.training.sidecar.trajectories import (CollectConfig, TrajectoryStore, collect_trajectories, pack_tokens)
from tiny_models import tiny_model

T, W = 48, 8


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def _sequences(count: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [rng.integers(3, 250, T).tolist() for _ in range(count)]


def _capture(model: Any, tokens: list[int]) -> list[dict[str, np.ndarray]]:
    """What SDPA saw and returned, per layer, through the same hook the collector uses."""
    from mlx_lm.models.cache import KVCache

    from cortexstream.backend.sdpa import original_sdpa, route_sdpa

    route_sdpa(model)
    seen: list[dict[str, np.ndarray]] = []

    class Recorder(KVCache):
        def attention_hook(self, queries, keys, values, scale, mask, sinks=None):
            out = original_sdpa(queries, keys, values, self, scale=scale, mask=mask, sinks=sinks)
            seen.append({"q": np.array(queries[0]), "k": np.array(keys[0]), "v": np.array(values[0]),
                         "out": np.array(out[0])})
            return out

    mx.eval(model(mx.array([tokens]), cache=[Recorder() for _ in model.layers]))
    return seen


def test_collection_chunks_bounded_and_reload(model, tmp_path):
    config = CollectConfig(window=W, num_sinks=4, queries_per_window=4, rows_per_chunk=10, dtype="float32", seed=1)
    index = collect_trajectories(model, _sequences(3), str(tmp_path), config, progress=False)
    windows = len(range(4, T - W, W))
    per_layer = windows * 2  # tiny model: 2 KV heads
    assert index["rows"] == 3 * 2 * per_layer
    assert all(c["rows"] <= 10 for c in index["chunks"]) and len(index["chunks"]) == -(-index["rows"] // 10)
    assert index["peak_buffered_rows"] < 10 + per_layer
    assert (index["num_layers"], index["num_kv_heads"], index["num_query_heads"], index["head_dim"]) == (2, 2, 4, 16)
    store = TrajectoryStore(str(tmp_path))
    rows = store.load_all()
    assert store.num_rows == index["rows"] and rows["window_keys"].shape == (index["rows"], W, 16)
    assert rows["queries"].shape == (index["rows"], 4, 16) and rows["rest_bias"].shape == (index["rows"], 4)
    # queries are strictly after their window and belong to the row's KV head group
    assert (np.array(rows["query_pos"]) >= np.array(rows["start"])[:, None] + W).all()
    assert (np.array(rows["query_head"]) // 2 == np.array(rows["head"])[:, None]).all()
    # deterministic: same seed, same rows
    again = collect_trajectories(model, _sequences(3), str(tmp_path / "again"), config, progress=False)
    other = TrajectoryStore(str(tmp_path / "again")).load_all()
    assert again["rows"] == index["rows"]
    for name in rows:
        assert mx.array_equal(rows[name], other[name]), name


def test_rows_equal_what_attention_saw(model, tmp_path):
    seqs = _sequences(2)
    collect_trajectories(model, seqs, str(tmp_path), CollectConfig(window=W, queries_per_window=6,
                                                                   rows_per_chunk=7, dtype="float32"), progress=False)
    store = TrajectoryStore(str(tmp_path))
    rows = {k: np.array(v) for k, v in store.load_all().items()}
    seen = [_capture(model, s) for s in seqs]
    for r in range(len(rows["group"])):
        ref = seen[rows["sequence"][r]][rows["layer"][r]]
        h, s = rows["head"][r], rows["start"][r]
        np.testing.assert_array_equal(rows["window_keys"][r], ref["k"][h, s:s + W])
        np.testing.assert_array_equal(rows["window_values"][r], ref["v"][h, s:s + W])
        np.testing.assert_array_equal(rows["queries"][r], ref["q"][rows["query_head"][r], rows["query_pos"][r]])
    # dense attention over {rest pseudo-key, window} at the stored query == the model's SDPA output there
    batch = {k: mx.array(v) for k, v in rows.items()}
    dense, _ = outputs(batch, batch["rest_keys"][:, 0], batch["rest_values"][:, 0], mx.zeros(len(rows["group"])),
                       store.scale)
    expected = np.stack([seen[rows["sequence"][r]][rows["layer"][r]]["out"][rows["query_head"][r], rows["query_pos"][r]]
                         for r in range(len(rows["group"]))])
    np.testing.assert_allclose(np.array(dense), expected, atol=2e-5)
    assert ((rows["window_share"] > 0) & (rows["window_share"] < 1)).all()


def test_float16_storage_and_max_rows(model, tmp_path):
    config = CollectConfig(window=W, queries_per_window=2, rows_per_chunk=16, max_rows=25, layers=(1,))
    index = collect_trajectories(model, _sequences(5), str(tmp_path), config, progress=False)
    assert index["rows"] == 25 and index["sequences"] <= 5
    raw = mx.load(str(tmp_path / index["chunks"][0]["file"]))
    assert raw["window_keys"].dtype == mx.float16 and raw["rest_bias"].dtype == mx.float32
    rows = TrajectoryStore(str(tmp_path)).load_all()
    assert rows["window_keys"].dtype == mx.float32 and set(np.array(rows["layer"]).tolist()) == {1}


def test_pack_tokens_cuts_exact_sequences():
    class Tok:
        eos_token_id = 0

        def encode(self, text):
            return [ord(c) for c in text]

    seqs = list(pack_tokens(Tok(), ["abcdef", "ghij", "k"], 4))
    assert seqs == [[97, 98, 99, 100], [101, 102, 0, 103], [104, 105, 106, 0]]


@pytest.mark.real_model
def test_collect_on_smollm2(smollm, tmp_path):
    model, tokenizer = smollm
    text = ("The history of the printing press begins in the fifteenth century, when movable type changed how "
            "books were made, sold and read across Europe. ") * 12
    seqs = list(pack_tokens(tokenizer, [text], 256))[:1]
    index = collect_trajectories(model, seqs, str(tmp_path), CollectConfig(window=16, rows_per_chunk=512),
                                 progress=False)
    assert (index["num_layers"], index["num_kv_heads"], index["head_dim"]) == (30, 3, 64)
    assert index["rows"] == 30 * 3 * len(range(4, 256 - 16, 16))
    rows = TrajectoryStore(str(tmp_path)).load_chunk(0)
    assert all(np.isfinite(np.array(v)).all() for v in rows.values())


@pytest.mark.parametrize("kind", ["sinks", "sliding"])
def test_layer_rows_with_sinks_and_array_masks(kind):
    """Learned sink logits and a boolean sliding-window mask: the rest pseudo-key still reproduces SDPA exactly."""
    from cortexstream.training.sidecar.trajectories import layer_rows

    rng = np.random.default_rng(4)
    t, d, scale = 40, 8, 8 ** -0.5
    q, k, v = (mx.array(rng.normal(size=(1, h, t, d)).astype(np.float32)) for h in (4, 2, 2))
    sinks, mask = None, "causal"
    if kind == "sinks":
        sinks = mx.array(rng.normal(size=4).astype(np.float32))
    else:
        i = mx.arange(t)
        mask = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < 20)
    config = CollectConfig(window=W, queries_per_window=5)
    rows = layer_rows(q, k, v, scale, mask, sinks, 0, config, np.random.default_rng(0))
    expected = mx.fast.scaled_dot_product_attention(q, mx.repeat(k, 2, axis=1), mx.repeat(v, 2, axis=1), scale=scale,
                                                    mask=mask, sinks=sinks)[0]
    batch = {name: mx.array(a) for name, a in rows.items()}
    dense, _ = outputs(batch, batch["rest_keys"][:, 0], batch["rest_values"][:, 0], mx.zeros(len(rows["group"])),
                       scale)
    ref = np.array(expected)[rows["query_head"], rows["query_pos"]]
    np.testing.assert_allclose(np.array(dense), ref, atol=2e-5)
    if kind == "sliding":  # only queries that see the whole window (its first token within the last 20)
        assert (rows["query_pos"] - rows["start"][:, None] < 20).all() and len(rows["group"]) == 2 * 4
