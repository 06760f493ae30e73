"""The `Compressor` KV policy: merge semantics, weights sources and caching, parsing, errors, and the runtime."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.compression import CompressorConfig, KVCompressor
from cortexstream.errors import InvalidArgumentError
from cortexstream.policies import parse_policy
from cortexstream.policies.compressor import Compressor, load_cached

H, D, F = 2, 16, 4  # the tiny model's KV heads and head_dim


def _random_compressor(layers: int = 2, factor: int = F, seed: int = 0) -> KVCompressor:
    mx.random.seed(seed)
    comp = KVCompressor(CompressorConfig(layers, D, factor, image=False))
    mx.eval(comp.parameters())
    return comp


def _numpy_mlp(comp: KVCompressor, prefix: str, layer: int, x: np.ndarray) -> np.ndarray:
    """The reference's Sequential(Linear, ReLU, Dropout, Linear, ReLU, Dropout, Linear) in numpy."""
    state = {k: np.array(v) for k, v in comp.state_dict().items()}
    h = x
    for i, idx in enumerate((0, 3, 6)):
        h = h @ state[f"{prefix}.{layer}.{idx}.weight"].T + state[f"{prefix}.{layer}.{idx}.bias"]
        h = np.maximum(h, 0) if i < 2 else h
    return h


def test_merge_runs_each_layers_mlps_on_token_major_windows():
    comp = _random_compressor()
    policy = Compressor(factor=F, weights=comp)
    rng = np.random.default_rng(1)
    keys, values = rng.normal(size=(H, 3 * F, D)).astype(np.float32), rng.normal(size=(H, 3 * F, D)).astype(np.float32)
    out = policy.merge(1, mx.array(keys), mx.array(values), np.ones(3 * F))
    assert out.keys.shape == (H, 3, D) == out.values.shape and out.bias is None and out.sizes is None
    # token-major: window w of head h is [k_{4w}, k_{4w+1}, k_{4w+2}, k_{4w+3}] side by side
    want_k = _numpy_mlp(comp, "compress_tk", 1, keys.reshape(H, 3, F * D))
    want_v = _numpy_mlp(comp, "compress_tv", 1, values.reshape(H, 3, F * D))
    np.testing.assert_allclose(np.array(out.keys), want_k, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(out.values), want_v, rtol=1e-4, atol=1e-5)
    other_layer = policy.merge(0, mx.array(keys), mx.array(values), np.ones(3 * F))
    assert not np.allclose(np.array(other_layer.keys), want_k)  # layers have their own MLPs


@pytest.mark.parametrize("ext", ["safetensors", "pth", "bin"])
def test_weights_from_files_match_the_object_and_load_once(tmp_path, ext):
    from cortexstream.training.compression.cli import export

    comp = _random_compressor(seed=2)
    path = str(tmp_path / f"c.{ext}")
    export(comp, path, "float32")
    a, b = Compressor(factor=F, weights=path, recent=8), Compressor(factor=F, weights=path, recent=8)
    assert a == b and hash(a) == hash(b) and a != Compressor(factor=F, weights=path, recent=9)
    x = mx.array(np.random.default_rng(3).normal(size=(H, 2 * F, D)).astype(np.float32))
    got = a.merge(0, x, x * 2, np.ones(2 * F))
    want = Compressor(factor=F, weights=comp).merge(0, x, x * 2, np.ones(2 * F))
    np.testing.assert_allclose(np.array(got.keys), np.array(want.keys), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(got.values), np.array(want.values), rtol=1e-5, atol=1e-6)
    assert a.resolve(num_kv_heads=H, head_dim=D) is b.resolve(num_kv_heads=H, head_dim=D) is load_cached(path)


def test_float16_files_compute_in_float32(tmp_path):
    comp = _random_compressor(seed=4)
    path = str(tmp_path / "half.safetensors")
    comp.save(path, dtype="float16")
    loaded = load_cached(path)
    assert all(v.dtype == mx.float32 for v in loaded.state_dict().values())
    x = mx.array(np.random.default_rng(5).normal(size=(H, F, D)).astype(np.float16))
    out = Compressor(factor=F, weights=path).merge(0, x, x, np.ones(F))
    assert out.keys.dtype == mx.float16  # the cache's dtype is kept


def test_parse_and_describe_round_trip(tmp_path):
    path = str(tmp_path / "c.safetensors")
    _random_compressor().save(path)
    policy = parse_policy(f"compressor:factor=4,sinks=2,recent=8,weights={path}")
    assert policy == Compressor(factor=4, weights=path, sinks=2, recent=8)
    assert policy.window == 4 and policy.compression_ratio() == 4.0
    assert parse_policy(policy.describe()) == policy
    with pytest.raises(InvalidArgumentError, match="unknown key 'window'"):
        parse_policy(f"compressor:window=4,weights={path}")


def test_bad_arguments_name_what_is_wrong(tmp_path):
    with pytest.raises(InvalidArgumentError, match="weights: file .*missing.pth' does not exist"):
        Compressor(weights=str(tmp_path / "missing.pth"))
    with pytest.raises(InvalidArgumentError, match="factor"):
        Compressor(factor=1, weights=_random_compressor())
    with pytest.raises(InvalidArgumentError, match="merges 4 tokens, factor is 2"):
        Compressor(factor=2, weights=_random_compressor())
    with pytest.raises(InvalidArgumentError, match="weights: expected a path"):
        Compressor(weights=3)  # type: ignore[arg-type]
    path = str(tmp_path / "f2.safetensors")
    _random_compressor(factor=2).save(path)
    with pytest.raises(InvalidArgumentError, match="merges 2 tokens, factor is 4"):
        Compressor(factor=4, weights=path).merge(0, mx.zeros((H, 4, D)), mx.zeros((H, 4, D)), np.ones(4))
    with pytest.raises(InvalidArgumentError, match="head_dim 16, the model's is 8"):
        Compressor(weights=_random_compressor()).merge(0, mx.zeros((H, 4, 8)), mx.zeros((H, 4, 8)), np.ones(4))
    with pytest.raises(InvalidArgumentError, match="have 2 layers, the model has more"):
        Compressor(weights=_random_compressor()).merge(5, mx.zeros((H, 4, D)), mx.zeros((H, 4, D)), np.ones(4))


def test_shipped_weights_missing_for_a_shape_or_factor_is_a_clear_error():
    from cortexstream.compression.shipped import shipped_factors

    missing = max(shipped_factors() | {1}) + 5
    with pytest.raises(InvalidArgumentError, match=f"no shipped weights for factor {missing}"):
        Compressor(factor=missing)
    if not shipped_factors():
        pytest.skip("no shipped weights in this checkout")
    factor = min(shipped_factors())
    policy = Compressor(factor=factor)  # construction is fine: the shape is only known at the first merge
    with pytest.raises(InvalidArgumentError, match="no shipped weights fit this model .*2 KV heads, head_dim 16"):
        policy.merge(0, mx.zeros((H, factor, D)), mx.zeros((H, factor, D)), np.ones(factor))


def test_shipped_manifest_matches_the_files():
    from cortexstream.compression.shipped import shipped_weights

    entries = shipped_weights()
    if not entries:
        pytest.skip("no shipped weights in this checkout")
    for entry in entries:
        assert os.path.isfile(entry.path), entry.path
        comp = load_cached(entry.path, entry.merges)
        if entry.network == "sidecar":  # a sidecar merger: windows of `factor` tokens, one group row per KV head
            assert (comp.config.num_layers, comp.config.head_dim, comp.config.window, comp.config.num_kv_heads) == \
                (entry.num_layers, entry.head_dim, entry.factor, entry.num_kv_heads)
            continue
        assert (comp.config.num_layers, comp.config.head_dim, comp.config.factor) == \
            (entry.num_layers, entry.head_dim, entry.factor)


@pytest.mark.real_model
def test_shipped_weights_on_smollm2_beat_an_untrained_compressor(smollm):
    """`Compressor(factor=4)` with no training step: the shipped weights load for SmolLM2's shape and keep the
    perplexity close to the full cache on text it was not trained on (Python docs), unlike random weights."""
    from pydoc_data.topics import topics

    from cortexstream.compression.shipped import shipped_factors
    from cortexstream.evaluation.perplexity import token_nlls

    if 4 not in shipped_factors():
        pytest.skip("no shipped factor-4 weights in this checkout")
    model, tokenizer = smollm
    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))[:640]
    shipped = Compressor(factor=4, sinks=4, recent=32)
    comp = shipped.resolve(num_kv_heads=3, head_dim=64, num_layers=30)
    mx.random.seed(0)
    untrained = KVCompressor(comp.config)
    ppl = {name: float(np.exp(token_nlls(model, ids, policy, chunk_size=32).mean())) for name, policy in
           (("full", None), ("shipped", shipped), ("untrained", Compressor(factor=4, weights=untrained, sinks=4,
                                                                            recent=32)))}
    assert ppl["shipped"] < 1.5 * ppl["full"], ppl
    assert ppl["shipped"] < 0.5 * ppl["untrained"], ppl
