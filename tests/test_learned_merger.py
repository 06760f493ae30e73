"""The learned merger of evicted tokens: its groups are D2O's, an untrained merger is H2O exactly, a trained one
rewrites only the slots that absorbed a group, batched equals alone, training starts at H2O and lowers the KL,
resumes exactly, and the files and errors say what they are."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from cortexstream.compression import CompressorConfig, KVCompressor
from cortexstream.compression.evicted_merger import anchor_init, group_means, learned_fold, load_merger, new_merger
from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.kv.arena_config import model_kv_shape
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import H2O, parse_policy
from cortexstream.policies.learned_merger import LearnedMerger
from cortexstream.sidecar.network import SidecarConfig, SidecarNet
from cortexstream.training.compression import data as data_module
from cortexstream.training.compression.data import cut_segments
from cortexstream.training.merger.scores import keep_slots, prefix_scores
from cortexstream.training.merger.train import MergerTrainConfig, train_merger

from test_policies_runtime import assert_batched_matches_alone
from tiny_models import random_token_ids

CFG = MergerTrainConfig(budget=12, threshold=0.0, sinks=2, prefix=40, queries=8, steps=6, batch_size=2,
                        checkpoint_every=3, learning_rate=3e-3, warmup=2, max_offset=0)


def _segments(count=6, offset=0):
    return cut_segments(random_token_ids(4000, seed=1), offset, count, CFG.prefix + CFG.queries, "random tokens")


def _perturbed(model, seed=0, scale=0.3):
    """A merger whose last layers are not zero (so it folds something), for runtime tests."""
    merger = _merger(model)
    rng = np.random.default_rng(seed)
    for layer in range(merger.config.num_layers):
        for mlp in (merger.compress_tk[layer], merger.compress_tv[layer]):
            mlp[6].weight = mx.array(rng.standard_normal(mlp[6].weight.shape).astype(np.float32) * scale)
    mx.eval(merger.parameters())
    return merger


def _head_dim(model):
    return model_kv_shape(model)[2]


def _merger(model, network="compressor"):
    layers, heads, head_dim, _ = model_kv_shape(model)
    merger = new_merger(network, layers, head_dim, heads)
    anchor_init(merger)
    return merger


def test_groups_keep_the_anchors_and_count_what_joined(sharp):
    """The groups the merger trains on and the engine's D2O folds with (`merged_values`, checked against a direct
    computation in test_d2o.py): the anchors are the kept slots as stored, and the count is of dropped slots whose
    best cosine reaches the threshold."""
    model, _ = sharp
    cache = make_prompt_cache(model)
    model(mx.array([random_token_ids(40)], dtype=mx.uint32), cache=cache)
    seq = cache[0].sequence
    rng = np.random.default_rng(0)
    heads = seq.arena.config.num_kv_heads
    keep = np.stack([np.stack([np.sort(rng.choice(40, 12, replace=False)) for _ in range(heads)])
                     for _ in range(len(cache))])
    joined = 0
    for layer in range(len(cache)):
        keys, values = seq.arena.read(layer, seq.blocks, 40)
        anchor_k, anchor_v, _, _, _, count = group_means(keys, values, mx.array(keep[layer]), 0.2)
        k = np.array(keys.astype(mx.float32))
        np.testing.assert_array_equal(np.array(anchor_k), np.take_along_axis(k, keep[layer][..., None], axis=1))
        np.testing.assert_array_equal(np.array(anchor_v), np.take_along_axis(
            np.array(values.astype(mx.float32)), keep[layer][..., None], axis=1))
        unit = k / np.linalg.norm(k, axis=-1, keepdims=True)
        want = 0
        for h in range(heads):
            dropped = sorted(set(range(40)) - set(keep[layer, h].tolist()))
            best = (unit[h][dropped] @ unit[h][keep[layer, h]].T).max(axis=1)
            want += int((best >= 0.2).sum())
        assert int(count.item()) == want
        joined += want
    assert joined > 0  # the case tests some grouping, not only empty groups


def test_an_untrained_merger_is_h2o_exactly_and_a_trained_one_keeps_its_budget(sharp):
    model, _ = sharp
    tokens = random_token_ids(90)
    h2o = token_nlls(model, tokens, H2O(budget=24, recent=6), chunk_size=8)
    start = token_nlls(model, tokens, LearnedMerger(budget=24, recent=6, threshold=0.0, weights=_merger(model)),
                       chunk_size=8)
    np.testing.assert_allclose(start, h2o, atol=1e-5)
    sizes = []
    folded = token_nlls(model, tokens, LearnedMerger(budget=24, recent=6, threshold=0.0, weights=_perturbed(model)),
                        chunk_size=8, on_chunk=lambda i, cache: sizes.append(cache[0].sequence.num_tokens))
    assert folded.shape == h2o.shape and not np.allclose(folded, h2o)  # the folds change what later tokens read
    assert max(sizes) == 24 and 21 <= sizes[-1] <= 24  # a last pass of 2 tokens evicts slack (3) below the budget


def test_the_fold_rewrites_only_slots_that_absorbed_a_group(sharp):
    model, _ = sharp
    rng = np.random.default_rng(1)
    keys = mx.array(rng.standard_normal((2, 30, _head_dim(model))).astype(np.float32))
    values = mx.array(rng.standard_normal((2, 30, _head_dim(model))).astype(np.float32))
    keep = mx.array(np.stack([np.sort(rng.choice(30, 8, replace=False)) for _ in range(2)]))
    anchor_k, anchor_v, mean_k, mean_v, weight, _ = group_means(keys, values, keep, 0.3)
    new_k, new_v = learned_fold(_perturbed(model), 0, anchor_k, anchor_v, mean_k, mean_v, weight)
    grouped = np.array(weight) > 0
    assert grouped.any() and not grouped.all()
    for new, old in ((new_k, anchor_k), (new_v, anchor_v)):
        changed = np.abs(np.array(new) - np.array(old)).max(axis=-1) > 0
        np.testing.assert_array_equal(changed, grouped)


def test_batched_equals_unbatched(sharp):
    model, tokenizer = sharp
    merger, sidecar = _perturbed(model), _merger(model, "sidecar")
    prompts = [random_token_ids(50, seed=s) for s in range(3)]
    policies = [LearnedMerger(budget=24, recent=6, threshold=0.0, weights=merger),
                LearnedMerger(budget=0.4, threshold=0.0, weights=sidecar), None]
    assert_batched_matches_alone(model, tokenizer, prompts, policies, max_tokens=12, context=62)


def test_a_sidecar_merger_replaces_grouped_slots_by_the_bead_of_the_pair(sharp):
    model, _ = sharp
    sidecar = _merger(model, "sidecar")
    rng = np.random.default_rng(2)
    heads, dim = model_kv_shape(model)[1], _head_dim(model)
    keys = mx.array(rng.standard_normal((heads, 30, dim)).astype(np.float32))
    values = mx.array(rng.standard_normal((heads, 30, dim)).astype(np.float32))
    keep = mx.array(np.stack([np.sort(rng.choice(30, 8, replace=False)) for _ in range(heads)]))
    anchor_k, anchor_v, mean_k, mean_v, weight, _ = group_means(keys, values, keep, 0.3)
    new_k, new_v = learned_fold(sidecar, 1, anchor_k, anchor_v, mean_k, mean_v, weight)
    group = mx.broadcast_to((heads + mx.arange(heads))[:, None], weight.shape)
    bead_k, bead_v, mass = sidecar(mx.stack([anchor_k, mean_k], axis=-2), mx.stack([anchor_v, mean_v], axis=-2), group)
    grouped = np.array(weight) > 0
    assert grouped.any() and not grouped.all() and not np.array(mass).any()  # no log-mass: nothing to carry
    np.testing.assert_allclose(np.array(new_k)[grouped], np.array(bead_k)[grouped], atol=1e-6)
    np.testing.assert_allclose(np.array(new_v)[~grouped], np.array(anchor_v)[~grouped])
    h2o = token_nlls(model, random_token_ids(90), H2O(budget=24, recent=6), chunk_size=8)
    folded = token_nlls(model, random_token_ids(90), LearnedMerger(budget=24, recent=6, threshold=0.0,
                                                                   weights=sidecar), chunk_size=8)
    assert not np.allclose(folded, h2o)


def test_prefix_scores_choose_what_the_running_h2o_keeps(sharp, monkeypatch):
    """Scores captured in the teacher's prefill give the slots H2O keeps when the same prefix arrives as one chunk."""
    model, _ = sharp
    tokens = random_token_ids(40, seed=3)
    policy = H2O(budget=12, sinks=2)
    kept = {}
    original = direct.apply_policy

    def capture(cache, context):
        original(cache, context)
        if not kept:
            kept["positions"] = np.stack(direct.policy_state_of(cache).positions)

    monkeypatch.setattr(direct, "apply_policy", capture)
    token_nlls(model, tokens + [5], policy, chunk_size=40)
    segments = cut_segments(tokens, 0, 1, 40, "x")
    scores = prefix_scores(model, segments, 40, np.zeros(1, dtype=np.int64), progress=False)
    np.testing.assert_array_equal(keep_slots(scores, policy)[0], np.sort(kept["positions"], axis=-1))


def test_training_starts_at_h2o_lowers_the_kl_and_the_policy_loads_it(sharp, tmp_path):
    model, _ = sharp
    cfg = MergerTrainConfig(**{**CFG.__dict__, "steps": 30, "checkpoint_every": 15})
    merger, state = train_merger(model, _segments(), str(tmp_path), cfg, val=_segments(2, 3000), progress=False,
                                 pool_cache=str(tmp_path / "pools"))
    assert len([f for f in os.listdir(tmp_path / "pools") if f.startswith("h2o-scores-")]) == 2
    sidecar_cfg = MergerTrainConfig(**{**cfg.__dict__, "network": "sidecar", "steps": 2})
    _, again = train_merger(model, _segments(), str(tmp_path / "sidecar"), sidecar_cfg, progress=False,
                            pool_cache=str(tmp_path / "pools"))  # the stored pool and scores: the same baselines
    assert again["baselines"]["h2o"]["train"] == state["baselines"]["h2o"]["train"]
    assert state["evals"][0]["train"] == pytest.approx(state["baselines"]["h2o"]["train"], rel=1e-6)
    assert set(state["baselines"]) == {"h2o", "d2o"}
    assert state["final"]["train"] < 0.8 * state["evals"][0]["train"]
    path = str(tmp_path / "merger.safetensors")
    loaded = load_merger(path)
    for key, value in merger.state_dict().items():
        np.testing.assert_array_equal(np.array(loaded.state_dict()[key]), np.array(value), err_msg=key)
    policy = parse_policy(f"merger:budget=24,recent=6,threshold=0,weights={path}")
    assert parse_policy(policy.describe()) == policy and policy.folds_keys
    tokens = random_token_ids(90)
    assert not np.allclose(token_nlls(model, tokens, policy, chunk_size=8),
                           token_nlls(model, tokens, H2O(budget=24, recent=6), chunk_size=8))


@pytest.mark.parametrize("network", ["compressor", "sidecar"])
def test_resume_continues_exactly(sharp, tmp_path, network):
    model, _ = sharp
    cfg = MergerTrainConfig(**{**CFG.__dict__, "network": network})
    straight, _ = train_merger(model, _segments(), str(tmp_path / "a"), cfg, progress=False)
    train_merger(model, _segments(), str(tmp_path / "b"), cfg, progress=False, stop_at=3)
    resumed, state = train_merger(model, _segments(), str(tmp_path / "b"), cfg, progress=False)
    assert state["step"] == 6 and [h[0] for h in state["history"]] == list(range(6))
    want, got = dict(tree_flatten(straight.parameters())), dict(tree_flatten(resumed.parameters()))
    for key, value in want.items():
        np.testing.assert_array_equal(np.array(got[key]), np.array(value), err_msg=key)
    policy = LearnedMerger(weights=str(tmp_path / "b" / "merger.safetensors"))
    assert policy.network == network and parse_policy(policy.describe()) == policy


def test_cli_trains_and_exports(tiny_gguf, tmp_path, monkeypatch, capsys):
    from cortexstream.cli.main import main

    monkeypatch.setattr(data_module, "wiki_segments", lambda tok, **kw: (_segments(), _segments(2, 3000)))
    out, export = str(tmp_path / "run"), str(tmp_path / "m.safetensors")
    base = ["train", "merger", "--model", tiny_gguf, "--out", out, "--network", "sidecar", "--prefix", "40",
            "--queries", "8",
            "--budget", "0.3", "--sinks", "2", "--steps", "2", "--batch-size", "2", "--max-offset", "0",
            "--no-progress"]
    assert main(base + ["--export", export]) == 0
    assert json.load(open(os.path.join(out, "state.json")))["step"] == 2
    assert load_merger(export).config.window == 2
    assert main(base) != 0 and "holds a run already; pass --resume" in capsys.readouterr().err
    assert main(base + ["--resume", "--export", str(tmp_path / "m.pth")]) != 0
    assert "must be a .safetensors file" in capsys.readouterr().err


def test_bad_weights_and_values_are_refused(sharp, tmp_path):
    model, _ = sharp
    window = KVCompressor(CompressorConfig(2, 8, 2, image=False))
    path = str(tmp_path / "window.safetensors")
    window.save(path)
    with pytest.raises(InvalidArgumentError, match="is not a merger of evicted tokens"):
        parse_policy(f"merger:weights={path}")
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        LearnedMerger(weights=str(tmp_path / "missing.safetensors"))
    with pytest.raises(InvalidArgumentError, match="factor 2"):
        LearnedMerger(weights=KVCompressor(CompressorConfig(2, 8, 4, image=False)))
    with pytest.raises(InvalidArgumentError, match="LearnedMerger: threshold 2.0 must be a cosine"):
        parse_policy("merger:threshold=2")
    with pytest.raises(InvalidArgumentError, match="network 'mlp' is not one of compressor, sidecar"):
        parse_policy("merger:network=mlp")
    with pytest.raises(InvalidArgumentError, match="threshold -0.2 must be a cosine in \\[0, 1\\] for a learned"):
        parse_policy("merger:threshold=-0.2")
    for bad in ({"threshold": -0.5}, {"network": "mlp"}):
        with pytest.raises(InvalidArgumentError, match="MergerTrainConfig: (threshold|network)"):
            MergerTrainConfig(**bad)
    with pytest.raises(InvalidArgumentError, match="network=sidecar but the weights hold a compressor merger"):
        LearnedMerger(network="sidecar", weights=_merger(model))
    with pytest.raises(InvalidArgumentError, match="without log-mass"):
        LearnedMerger(weights=SidecarNet(SidecarConfig(head_dim=8, window=2, num_layers=2, num_kv_heads=2)))
    # no shipped merger fits the tiny model
    with pytest.raises(InvalidArgumentError, match="cortexstream train merger --network compressor"):
        token_nlls(model, random_token_ids(60), LearnedMerger(budget=24, recent=6, threshold=0.0), chunk_size=8)
    with pytest.raises(InvalidArgumentError, match="budget"):
        MergerTrainConfig(budget=0)


def test_the_shipped_mergers_fit_smollm2s_shape_and_window_compressors_are_not_mistaken_for_them():
    from cortexstream.compression.shipped import shipped_factors, shipped_weights

    merger = LearnedMerger().resolve(num_kv_heads=3, head_dim=64, num_layers=30)
    assert isinstance(merger, KVCompressor) and merger.config.factor == 2
    sidecar = LearnedMerger(network="sidecar").resolve(num_kv_heads=3, head_dim=64, num_layers=30)
    assert isinstance(sidecar, SidecarNet) and sidecar.config.window == 2 and not sidecar.config.log_mass
    assert 2 in shipped_factors()  # the factor-2 window compressor is still the window compressor's
    assert {e.network for e in shipped_weights() if e.merges == "evicted"} == {"compressor", "sidecar"}
    with pytest.raises(InvalidArgumentError, match="no shipped sidecar merger of evicted tokens fits"):
        LearnedMerger(network="sidecar").resolve(num_kv_heads=2, head_dim=64)
    path = next(e.path for e in shipped_weights() if e.network == "sidecar")
    with pytest.raises(InvalidArgumentError, match="trained for 3 KV heads, the model has 2"):
        LearnedMerger(weights=path).resolve(num_kv_heads=2, head_dim=64)


@pytest.mark.real_model
def test_the_shipped_merger_on_smollm2_folds_and_stays_near_h2o(smollm):
    """On text it was not trained on (Python docs) the shipped merger changes what H2O gives, and its perplexity
    stays within a few percent of H2O's at the same budget (a broken fold would move it far off)."""
    from pydoc_data.topics import topics

    model, tokenizer = smollm
    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))[:640]
    h2o = float(np.exp(token_nlls(model, ids, H2O(budget=0.2), chunk_size=32).mean()))
    for spec in ("merger:budget=0.2", "merger:budget=0.2,network=sidecar"):
        merged = float(np.exp(token_nlls(model, ids, parse_policy(spec), chunk_size=32).mean()))
        assert merged != h2o and abs(merged / h2o - 1) < 0.05, (spec, merged, h2o)


def test_the_manifest_spells_what_a_file_merges_and_its_network_as_enums():
    from cortexstream.compression.evicted_merger import MergerNetwork
    from cortexstream.compression.shipped import Merges, ShippedWeights, shipped_weights

    mergers = [e for e in shipped_weights() if e.merges is Merges.EVICTED]
    assert {e.network for e in mergers} == {MergerNetwork.COMPRESSOR, MergerNetwork.SIDECAR}
    assert all(e.merges is Merges.WINDOWS and e.network is MergerNetwork.COMPRESSOR
               for e in shipped_weights() if e not in mergers)
    with pytest.raises(ValueError, match=r"x\.safetensors: merges='bogus' is not one of 'windows', 'evicted'"):
        ShippedWeights("x.safetensors", "m", 1, 1, 4, 2, merges="bogus")
    with pytest.raises(ValueError, match="network='gru'"):
        ShippedWeights("x.safetensors", "m", 1, 1, 4, 2, network="gru")
