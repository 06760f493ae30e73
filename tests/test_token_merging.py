"""TokenMerging ('tome'): greedy most-similar-pair merging against a direct per-window loop, strings and limits,
and the policy through the runtime (budget, nominal bookkeeping, log-size bias)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.policies import parse_policy
from cortexstream.policies.token_merging import TokenMerging, greedy_merge
from tiny_models import random_token_ids


def _reference(keys: np.ndarray, values: np.ndarray, slots: int) -> tuple[list, list, list]:
    """One window of one head, written as plainly as possible: lists of groups of original token indices."""
    groups = [[i] for i in range(len(keys))]

    def mean(array, group):
        return np.mean([array[i] for i in group], axis=0)  # size-weighted mean == mean over original tokens

    while len(groups) > slots:
        best, pair = -np.inf, None
        for a in range(len(groups)):
            for b in range(a + 1, len(groups)):
                ka, kb = mean(keys, groups[a]), mean(keys, groups[b])
                sim = ka @ kb / (np.linalg.norm(ka) * np.linalg.norm(kb))
                if sim > best:
                    best, pair = sim, (a, b)
        a, b = pair
        groups[a] = groups[a] + groups[b]
        del groups[b]
    order = sorted(range(len(groups)), key=lambda g: min(groups[g]))
    return ([mean(keys, groups[g]) for g in order], [mean(values, groups[g]) for g in order],
            [len(groups[g]) for g in order])


@pytest.mark.parametrize("window,slots", [(8, 2), (8, 3), (6, 1), (16, 4)])
def test_merge_matches_a_direct_loop(window, slots):
    rng = np.random.default_rng(window * 10 + slots)
    heads, windows, dim = 3, 2, 8
    base = rng.standard_normal((heads, windows * window, dim))
    keys = base + 0.3 * rng.standard_normal(base.shape)
    keys[:, 1::2] = keys[:, 0::2] * 1.5 + 0.1 * rng.standard_normal(keys[:, 0::2].shape)  # near-duplicate pairs
    values = rng.standard_normal((heads, windows * window, 5))
    policy = TokenMerging(window=window, slots=slots, sinks=0, recent=0)
    merged = policy.merge(0, mx.array(keys.astype(np.float32)), mx.array(values.astype(np.float32)),
                          np.ones(windows * window))
    assert merged.keys.shape == (heads, windows * slots, dim) and merged.values.shape == (heads, windows * slots, 5)
    assert sum(merged.sizes) == windows * window and len(merged.sizes) == windows * slots
    bias = np.array(merged.bias)
    for h in range(heads):
        for w in range(windows):
            span = slice(w * window, (w + 1) * window)
            ref_k, ref_v, ref_sizes = _reference(keys.astype(np.float32)[h, span].astype(np.float64),
                                                 values.astype(np.float32)[h, span].astype(np.float64), slots)
            out = slice(w * slots, (w + 1) * slots)
            np.testing.assert_allclose(np.array(merged.keys)[h, out], np.stack(ref_k), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.array(merged.values)[h, out], np.stack(ref_v), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(bias[h, out], np.log(ref_sizes), rtol=1e-6)


def test_heads_merge_different_pairs_and_mass_weights():
    """Head 0 has tokens 0,1 identical, head 1 has tokens 2,3 identical: each merges its own pair. Pre-merged
    inputs (mass 3) weigh three times as much in the mean."""
    k = np.eye(4, dtype=np.float32)[None].repeat(2, axis=0) + 0.01
    k[0, 1] = k[0, 0]
    k[1, 3] = k[1, 2]
    v = np.arange(8, dtype=np.float32).reshape(1, 4, 2).repeat(2, axis=0)
    three_k, three_v, three_s = greedy_merge(k, v, np.ones((2, 4)), 3)
    assert three_s[0].tolist() == [2, 1, 1] and three_s[1].tolist() == [1, 1, 2]
    np.testing.assert_allclose(three_v[0, 0], v[0, :2].mean(axis=0))
    np.testing.assert_allclose(three_v[1, 2], v[1, 2:].mean(axis=0))
    weighted = greedy_merge(k[:1, :2], v[:1, :2], np.array([[3.0, 1.0]]), 1)
    np.testing.assert_allclose(weighted[1][0, 0], (3 * v[0, 0] + v[0, 1]) / 4)
    assert weighted[2][0, 0] == 4


def test_strings_and_limits():
    policy = parse_policy("tome:window=16,slots=2,sinks=4,recent=32,log_mass=0")
    assert policy == TokenMerging(window=16, slots=2, sinks=4, recent=32, log_mass=False)
    assert parse_policy(policy.describe()) == policy and not policy.uses_logit_bias
    assert policy.compression_ratio() == 8.0 and TokenMerging().uses_logit_bias
    assert TokenMerging(window=7, slots=3).nominal_sizes(2) == (3, 2, 2, 3, 2, 2)
    with pytest.raises(InvalidArgumentError, match="slots"):
        TokenMerging(window=8, slots=5)
    with pytest.raises(InvalidArgumentError, match="slots"):
        parse_policy("tome:slots=0")


@pytest.mark.parametrize("log_mass", [True, False])
def test_through_scoring(sharp, log_mass, monkeypatch):
    model, _ = sharp
    policy = TokenMerging(window=8, slots=2, sinks=2, recent=8, log_mass=log_mass)
    tokens = random_token_ids(100)
    budget = policy.budget_tokens(len(tokens))
    original = direct.apply_policy
    seen = {"merged": 0}

    def checked(cache, context):
        original(cache, context)
        state, seq = direct.policy_state_of(cache), cache[0].sequence
        n = seq.num_tokens
        assert n <= budget and state.mass.sum() == cache[0].offset
        merged = np.flatnonzero(state.mass != 1)
        seen["merged"] = max(seen["merged"], merged.size)
        if merged.size:
            assert (state.mass[merged] == 4).all() and merged.min() == policy.sinks
        for bias in state.bias:
            assert (bias[:, state.mass == 1] == 0).all()
            if log_mass and merged.size:
                # true group sizes per head: each window's two slots sum to 8 tokens
                sizes = np.exp(bias[:, merged]).reshape(bias.shape[0], -1, 2).sum(axis=-1)
                np.testing.assert_allclose(sizes, 8.0, rtol=1e-5)
            elif merged.size:
                assert (bias == 0).all()

    monkeypatch.setattr(direct, "apply_policy", checked)
    nll = token_nlls(model, tokens, policy, chunk_size=5)
    assert seen["merged"] >= 16 and np.isfinite(nll).all()
