"""The merging-policy runtime (policies.merging + PolicyState.merge) with MeanPool as the vehicle."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.policies import parse_policy
from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.engine.attention_hook import original_sdpa
from cortexstream.policies.mean_pool import MeanPool
from cortexstream.policies.merging import Merged, MergingPolicy
from cortexstream.engine.attention_hook import biased_mask
from test_policies_runtime import assert_batched_matches_alone, engine_run
from tiny_models import random_token_ids


def test_policy_strings_and_validation():
    policy = parse_policy("meanpool:window=8,sinks=2,recent=16,log_mass=0")
    assert policy == MeanPool(window=8, sinks=2, recent=16, log_mass=False)
    assert parse_policy(policy.describe()) == policy
    with pytest.raises(InvalidArgumentError, match="window"):
        MeanPool(window=1)
    with pytest.raises(InvalidArgumentError, match="log_mass"):
        parse_policy("meanpool:log_mass=maybe")


@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("log_mass", [True, False])
def test_bookkeeping_through_scoring(sharp, chunk, log_mass, monkeypatch):
    """Budget, raw sinks and recent tail, mass conservation, positions and biases after every forward pass."""
    model, _ = sharp
    policy = MeanPool(window=4, sinks=3, recent=8, log_mass=log_mass)
    tokens = random_token_ids(120)
    budget = policy.budget_tokens(len(tokens))
    original = direct.apply_policy
    seen = {"merged": 0}

    def checked(cache, context):
        assert cache[0].size() <= budget + chunk
        original(cache, context)
        state, seq = direct.policy_state_of(cache), cache[0].sequence
        n, offset = seq.num_tokens, cache[0].offset
        assert n <= budget and all(length == n for length in seq.lengths)
        assert state.mass.shape == (n,) and state.mass.sum() == offset  # every token accounted for once
        merged = np.flatnonzero(state.mass != 1)
        seen["merged"] = max(seen["merged"], merged.size)
        if merged.size:
            assert merged.min() == policy.sinks and (state.mass[merged] == policy.window).all()
            assert n - merged.max() - 1 < policy.recent + policy.window  # raw tail bounded
        for layer in range(len(state.positions)):
            positions, bias = state.positions[layer], state.bias[layer]
            assert (positions[:, -min(n, policy.recent):] == np.arange(offset - min(n, policy.recent), offset)).all()
            assert (positions[:, : policy.sinks] == np.arange(min(n, policy.sinks))).all()
            # a merged slot sits at its newest member's position
            cumulative = np.cumsum(state.mass) - 1
            assert (positions == cumulative[None, :]).all()
            expected = np.where(state.mass != 1, np.log(state.mass), 0.0) if log_mass else np.zeros(n)
            np.testing.assert_allclose(bias, np.broadcast_to(expected, bias.shape), rtol=1e-6)

    monkeypatch.setattr(direct, "apply_policy", checked)
    nll = token_nlls(model, tokens, policy, chunk_size=chunk)
    assert seen["merged"] >= 20 and np.isfinite(nll).all()


def test_pooled_slot_with_log_mass_equals_its_window_of_identical_tokens():
    """The bias path is what makes a pooled slot weigh like its window: exact for identical tokens."""
    rng = np.random.default_rng(0)
    window, heads, q_heads, dim = 4, 2, 4, 8
    distinct_k = rng.standard_normal((1, heads, 5, dim)).astype(np.float32)
    distinct_v = rng.standard_normal((1, heads, 5, dim)).astype(np.float32)
    dense_k = np.repeat(distinct_k, [1, window, 1, window, 1], axis=2)  # two windows of repeated tokens
    dense_v = np.repeat(distinct_v, [1, window, 1, window, 1], axis=2)
    q = mx.array(rng.standard_normal((1, q_heads, 1, dim)).astype(np.float32))
    dense = original_sdpa(q, mx.array(dense_k), mx.array(dense_v), None, scale=0.3, mask=None)
    bias = np.log(np.array([1, window, 1, window, 1], np.float32))
    bias_array = mx.array(np.broadcast_to(bias, (1, q_heads, 1, 5)).copy())
    merged = original_sdpa(q, mx.array(distinct_k), mx.array(distinct_v), None, scale=0.3,
                           mask=biased_mask(None, bias_array, 1, 5, mx.float32))
    unbiased = original_sdpa(q, mx.array(distinct_k), mx.array(distinct_v), None, scale=0.3, mask=None)
    np.testing.assert_allclose(np.array(merged), np.array(dense), atol=1e-5)
    assert not np.allclose(np.array(unbiased), np.array(dense), atol=1e-3)
    causal = biased_mask("causal", bias_array, 1, 5, mx.float32)  # a string mask becomes additive first
    np.testing.assert_allclose(np.array(causal), np.array(bias_array))


def test_engine_frees_blocks_and_batched_decode_matches_alone(sharp):
    """Merging in the engine: bounded physical KV, no leaks, and the batched bias path equals the single one."""
    model, tokenizer = sharp
    prompts = [random_token_ids(70, seed=s) for s in range(3)]
    policies = [MeanPool(window=4, sinks=2, recent=6), None, MeanPool(window=8, sinks=4, recent=4, log_mass=False)]
    physical = assert_batched_matches_alone(model, tokenizer, prompts, policies, max_tokens=20, context=90, atol=1e-4)
    for i, policy in enumerate(policies):
        if policy is not None:
            assert min(p for p, _ in physical[i]) < 70  # it really merged
    # only merging requests: every block comes back; and the bias changes the model's view once windows pool
    _, with_mass, _, engine = engine_run(model, tokenizer, prompts[:1], [MeanPool(window=4, sinks=2, recent=6)],
                                         max_tokens=20, prefill_step_size=16)
    assert engine.arena.allocator.num_used_blocks == 0
    _, without, _, _ = engine_run(model, tokenizer, prompts[:1], [MeanPool(window=4, sinks=2, recent=6, log_mass=False)],
                                  max_tokens=20, prefill_step_size=16)
    assert not np.allclose(with_mass[0], without[0], atol=1e-3)


class _BadSizes(MergingPolicy):
    name = "bad"

    def merge(self, layer, keys, values, mass):
        heads, n, dim = keys.shape
        return Merged(keys[:, : n // 2], values[:, : n // 2], sizes=(1,) * (n // 2))


def test_a_policy_returning_inconsistent_sizes_is_refused(sharp):
    model, _ = sharp
    with pytest.raises(InvalidArgumentError, match="sizes"):
        token_nlls(model, random_token_ids(60), _BadSizes(window=4, sinks=2, recent=4), chunk_size=8)
