"""The Sidecar KV policy on a tiny model: merge outputs, weights lookup and errors, runtime bookkeeping (positions,
budgets, freed blocks), and that the beads' log-mass bias is present and really applied."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.policies import parse_policy
from cortexstream.policies.sidecar import Sidecar
from cortexstream.sidecar import SidecarConfig, SidecarNet, save_sidecar
from cortexstream.sidecar.shipped import find_shipped, load_cached
from test_policies_runtime import engine_run
from tiny_models import random_token_ids

# tiny_model: 2 layers, 2 KV heads, head_dim 16
TINY_NET = {"head_dim": 16, "num_layers": 2, "num_kv_heads": 2, "d_model": 16, "encoder_layers": 1, "num_heads": 2}


def _weights(directory, window: int, seed: int = 0, perturb: float = 0.3, **overrides) -> str:
    """A small sidecar with non-zero correction heads (so beads differ from plain pooling), saved to a file."""
    mx.random.seed(seed)
    net = SidecarNet(SidecarConfig(**{**TINY_NET, "window": window, **overrides}))
    for head in (net.k_out, net.v_out, net.mass_out):
        head.weight = mx.random.normal(head.weight.shape) * perturb
    path = str(directory / f"sc_w{window}_{seed}.safetensors")
    save_sidecar(net, path, {"note": "test"})
    return path


@pytest.fixture(scope="module")
def w4(tmp_path_factory) -> str:
    return _weights(tmp_path_factory.mktemp("sc"), window=4)


def test_merge_returns_the_networks_beads_and_mass(w4):
    policy = Sidecar(window=4, sinks=2, recent=8, weights=w4)
    rng = np.random.default_rng(0)
    keys = mx.array(rng.standard_normal((2, 12, 16)).astype(np.float32))
    values = mx.array(rng.standard_normal((2, 12, 16)).astype(np.float32))
    merged = policy.merge(1, keys, values, np.ones(12))
    assert merged.keys.shape == (2, 3, 16) and merged.values.shape == (2, 3, 16) and merged.sizes is None
    k_b, v_b, beta = load_cached(w4).beads_with_mass(keys.reshape(2, 3, 4, 16), values.reshape(2, 3, 4, 16), 1)
    np.testing.assert_array_equal(np.array(merged.keys), np.array(k_b))
    np.testing.assert_array_equal(np.array(merged.bias), np.array(beta))
    assert np.array(merged.bias).shape == (2, 3) and np.abs(np.array(merged.bias)).min() > 0.1
    # a different layer is a different (layer, head) embedding: different beads
    assert not np.allclose(np.array(policy.merge(0, keys, values, np.ones(12)).keys), np.array(k_b))
    with pytest.raises(InvalidArgumentError, match="raw tokens"):
        policy.merge(0, keys, values, np.array([1.0] * 8 + [4.0] * 4))
    with pytest.raises(InvalidArgumentError, match="layers"):
        policy.merge(5, keys, values, np.ones(12))


def test_strings_weights_lookup_and_errors(w4, tmp_path):
    policy = parse_policy(f"sidecar:window=4,sinks=2,recent=8,weights={w4}")
    assert policy == Sidecar(window=4, sinks=2, recent=8, weights=w4) and hash(policy) == hash(Sidecar(
        window=4, sinks=2, recent=8, weights=w4))
    assert parse_policy(policy.describe()) == policy and policy.uses_logit_bias
    assert policy.budget_tokens(1000) == 2 + 8 + 3 + 4 * 0 + -(-(1000 - 10) // 4)
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        parse_policy("sidecar:weights=/no/such/file.safetensors")
    with pytest.raises(InvalidArgumentError, match="trained for window 4"):
        Sidecar(window=8, weights=w4).merge(0, mx.zeros((2, 8, 16)), mx.zeros((2, 8, 16)), np.ones(8))
    with pytest.raises(InvalidArgumentError, match="KV heads"):
        Sidecar(window=4, weights=w4).merge(0, mx.zeros((3, 4, 16)), mx.zeros((3, 4, 16)), np.ones(4))
    # shipped lookup by stored config, not by file name
    folder = tmp_path / "shipped"
    folder.mkdir()
    (folder / "notes.safetensors").write_bytes(b"not a sidecar")
    with pytest.raises(InvalidArgumentError, match="no shipped weights match"):
        find_shipped(4, 16, 16, 2, directory=str(folder))
    mine = _weights(folder, window=4, seed=1)
    _weights(folder, window=8, seed=2)
    assert find_shipped(4, 16, 16, 2, directory=str(folder)) == mine
    assert find_shipped(4, 16, 16, 2, num_layers=2, directory=str(folder)) == mine
    with pytest.raises(InvalidArgumentError, match="no shipped"):
        find_shipped(4, 16, 16, 3, directory=str(folder))
    _weights(folder, window=4, seed=3)
    with pytest.raises(InvalidArgumentError, match="several"):
        find_shipped(4, 16, 16, 2, directory=str(folder))


@pytest.mark.parametrize("chunk", [1, 7])
def test_bookkeeping_through_scoring(sharp, w4, chunk, monkeypatch):
    """Budget, raw sinks and tail, mass and positions, and each bead's bias equals the network's beta."""
    model, _ = sharp
    policy = Sidecar(window=4, sinks=3, recent=8, weights=w4)
    net = load_cached(w4)
    tokens = random_token_ids(100)
    budget = policy.budget_tokens(len(tokens))
    original = direct.apply_policy
    seen = {"beads": 0, "compared": 0}

    def checked(cache, context):
        assert cache[0].size() <= budget + chunk
        raw = [cache[0].sequence.arena.read(layer, cache[0].sequence.blocks, cache[0].sequence.lengths[layer])
               for layer in range(2)]
        state_before = direct.policy_state_of(cache)
        state_before.sync(cache[0].sequence)
        first = policy.first_raw_slot(state_before.mass)
        original(cache, context)
        state, seq = direct.policy_state_of(cache), cache[0].sequence
        n, offset = seq.num_tokens, cache[0].offset
        assert n <= budget and state.mass.sum() == offset
        beads = np.flatnonzero(state.mass != 1)
        if beads.size:
            assert beads.min() == policy.sinks and (state.mass[beads] == 4).all()
            assert n - beads.max() - 1 < policy.recent + policy.window
        new = beads[beads >= first] if beads.size > seen["beads"] else np.array([], int)
        for layer in range(2):
            assert (state.positions[layer] == (np.cumsum(state.mass) - 1)[None]).all()
            assert (state.bias[layer][:, state.mass == 1] == 0).all()
            if new.size:  # the beads written now are the network's beads of the windows that were raw
                k, v = raw[layer]
                windows = slice(first, first + 4 * new.size)
                k_b, v_b, beta = net.beads_with_mass(k[:, windows].reshape(2, new.size, 4, 16),
                                                     v[:, windows].reshape(2, new.size, 4, 16), layer)
                np.testing.assert_allclose(state.bias[layer][:, new], np.array(beta), rtol=1e-5, atol=1e-6)
                got_k, _ = seq.arena.read(layer, seq.blocks, seq.lengths[layer])
                np.testing.assert_allclose(np.array(got_k)[:, new], np.array(k_b), rtol=1e-5, atol=1e-5)
                seen["compared"] += 1
        seen["beads"] = max(seen["beads"], beads.size)

    monkeypatch.setattr(direct, "apply_policy", checked)
    nll = token_nlls(model, tokens, policy, chunk_size=chunk)
    assert seen["beads"] >= 18 and seen["compared"] >= 10 and np.isfinite(nll).all()


def test_bias_is_applied(sharp, w4):
    """Same beads with their bias zeroed give different likelihoods: the runtime adds the bias to the logits."""
    model, _ = sharp
    tokens = random_token_ids(80, seed=3)

    class NoBias(Sidecar):
        def merge_from_arena(self, *args):  # what the runtime calls
            merged = super().merge_from_arena(*args)
            merged.bias = None
            return merged

    with_bias = token_nlls(model, tokens, Sidecar(window=4, sinks=2, recent=8, weights=w4), chunk_size=8)
    without = token_nlls(model, tokens, NoBias(window=4, sinks=2, recent=8, weights=w4), chunk_size=8)
    full = token_nlls(model, tokens, None, chunk_size=8)
    assert np.allclose(with_bias[:16], without[:16])  # first merge: after the 2nd chunk (16 tokens)
    assert np.abs(with_bias - without).max() > 1e-3
    assert np.abs(with_bias - full).max() > 1e-4  # and the merges do change the context


def test_engine_frees_blocks_and_batched_equals_alone(sharp, w4):
    model, tokenizer = sharp
    prompts = [random_token_ids(70, seed=s) for s in range(2)]
    policies = [Sidecar(window=4, sinks=2, recent=6, weights=w4), None]
    tokens, logprobs, physical, engine = engine_run(model, tokenizer, prompts, policies, max_tokens=20,
                                                    prefill_step_size=32)
    alone_tokens, alone_logprobs, _, _ = engine_run(model, tokenizer, prompts[:1], policies[:1], max_tokens=20,
                                                    prefill_step_size=32)
    assert tokens[0] == alone_tokens[0]
    np.testing.assert_allclose(logprobs[0], alone_logprobs[0], atol=1e-4)
    assert max(p for p, _ in physical[0]) <= policies[0].budget_tokens(90) and min(p for p, _ in physical[0]) < 70
    _, _, _, engine = engine_run(model, tokenizer, prompts[:1], policies[:1], max_tokens=20, prefill_step_size=16)
    assert engine.arena.allocator.num_used_blocks == 0


def test_bias_path_equals_replicated_beads(sharp):
    """What the runtime does with a bias, checked exactly: a slot of mass m with bias log m attends like m copies
    of itself, so the next token through the policy cache equals a plain mlx-lm cache holding every merged slot
    repeated `mass` times (MeanPool as the vehicle, its bias is exactly log mass; same code path as Sidecar's)."""
    from mlx_lm.models.cache import KVCache

    from cortexstream.kv.prompt_cache import make_prompt_cache
    from cortexstream.engine.policy_prompt_cache import attach_policy
    from cortexstream.policies.mean_pool import MeanPool

    model, _ = sharp
    tokens = random_token_ids(90, seed=4)
    cache = make_prompt_cache(model, max_tokens=200)
    attach_policy(cache, MeanPool(window=4, sinks=2, recent=8))
    for start in range(0, 88, 8):
        mx.eval(model(mx.array([tokens[start:start + 8]]), cache=cache))
        direct.apply_policy(cache, 200)
    state, seq = direct.policy_state_of(cache), cache[0].sequence
    reps = state.mass.astype(int)
    assert seq.num_tokens < 40 and reps.sum() == cache[0].offset == 88
    plain = []
    for layer in range(len(model.layers)):
        k, v = seq.arena.read(layer, seq.blocks, seq.lengths[layer])
        replicated = KVCache()
        replicated.update_and_fetch(mx.array(np.repeat(np.array(k), reps, axis=1))[None],
                                    mx.array(np.repeat(np.array(v), reps, axis=1))[None])
        plain.append(replicated)
    nxt = mx.array([[tokens[88]]])
    through_policy, expanded = model(nxt, cache=cache)[0, -1], model(nxt, cache=plain)[0, -1]
    np.testing.assert_allclose(np.array(through_policy), np.array(expanded), atol=1e-4)
