"""Expected Attention: the query statistics against direct computations (RoPE undone, the average future rotation,
the expected-attention score), and the policy in the engine and on a prompt cache."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.engine.engine import Engine
from cortexstream.engine.query_statistics import QueryStatistics
from cortexstream.errors import InvalidArgumentError
from cortexstream.generation.stream import stream_generate
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import ExpectedAttention, parse_policy
from test_policies_runtime import assert_batched_matches_alone
from tiny_models import random_token_ids

DIM = 8


def rope() -> nn.RoPE:
    return nn.RoPE(DIM, traditional=False, base=100.0)


def test_statistics_are_those_of_the_queries_before_rope():
    rng = np.random.default_rng(0)
    pre = rng.normal(size=(3, 20, DIM)).astype(np.float32)  # [Hq, n, D] at positions 10..29
    stats = QueryStatistics(1, rope(), skip=12)
    post = rope()(mx.array(pre)[None], offset=10)[0]
    stats.add(0, post[:, :7], 17)  # two passes: positions 10..16, then 17..29
    stats.add(0, post[:, 7:], 30)
    kept = pre[:, 2:]  # positions >= skip
    assert stats.count[0] == 18
    np.testing.assert_allclose(np.asarray(stats.sums[0]) / 18, kept.mean(axis=1), atol=1e-5)
    np.testing.assert_allclose(np.asarray(stats.outer[0]), np.einsum("hnd,hne->hde", kept, kept), atol=1e-4)


def test_average_rotation_and_scores_match_a_direct_computation():
    rng = np.random.default_rng(1)
    stats = QueryStatistics(1, rope(), skip=0)
    queries = rng.normal(size=(4, 50, DIM)).astype(np.float32)  # two KV heads, two query heads each
    stats.add(0, rope()(mx.array(queries)[None], offset=0)[0], 50)
    rotation = np.asarray(stats.average_rotation(50, 16, DIM))
    v = rng.normal(size=DIM).astype(np.float32)
    moved = np.asarray(rope()(mx.broadcast_to(mx.array(v), (1, 1, 16, DIM)), offset=50))[0, 0].mean(axis=0)
    np.testing.assert_allclose(rotation @ v, moved, atol=1e-5)
    keys = rng.normal(size=(2, 30, DIM)).astype(np.float32)
    values = rng.normal(size=(2, 30, DIM)).astype(np.float32)
    got = stats.scores(0, mx.array(keys), mx.array(values), 50, 16)
    mu = queries.mean(axis=1)
    cov = np.einsum("hnd,hne->hde", queries - mu[:, None], queries - mu[:, None]) / 50
    mu, cov = mu @ rotation.T, rotation @ cov @ rotation.T
    want = np.zeros((2, 30))
    for h in range(4):
        k = keys[h // 2]
        logits = k @ mu[h] / math.sqrt(DIM) + np.einsum("nd,de,ne->n", k, cov[h], k) / (2 * DIM)
        want[h // 2] += np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum() / 2
    np.testing.assert_allclose(got, want * np.linalg.norm(values, axis=-1), rtol=2e-3, atol=1e-6)


def test_string_form_and_the_model_it_needs(sharp):
    assert parse_policy("expected:budget=0.25,recent=8,future=64") == ExpectedAttention(budget=0.25, recent=8,
                                                                                      future=64)
    policy = ExpectedAttention(budget=64)
    assert parse_policy(policy.describe()) == policy
    with pytest.raises(InvalidArgumentError, match="future"):
        parse_policy("expected:future=0")
    with pytest.raises(InvalidArgumentError, match="model"):
        direct.attach_policy(make_prompt_cache(sharp[0]), policy)  # no model: no RoPE to undo


def test_engine_keeps_the_budget_frees_blocks_and_ignores_generated_queries(sharp):
    model, tokenizer = sharp
    policy = ExpectedAttention(budget=40, recent=8)
    engine = Engine(model, tokenizer, kv_tokens=2048, prefill_step_size=16)
    rid = engine.add_request(random_token_ids(100), max_tokens=12, kv_policy=policy)
    budget, counts = policy.budget_tokens(112), []
    while engine.has_unfinished:
        engine.step()
        for _ in engine.scheduler.running:
            kv = engine.runner.kv_view(rid)
            assert kv.num_tokens <= budget
            counts.append((kv.logical_length, engine.runner.policy_view(rid).queries.count[0]))
    assert engine.arena.allocator.num_used_blocks == 0
    after_prompt = {count for logical, count in counts if logical >= 100}
    assert after_prompt == {100 - 4}  # the prompt's queries past the 4 skipped, none generated


def test_batched_equals_unbatched(sharp):
    model, tokenizer = sharp
    prompts = [random_token_ids(60, seed=s) for s in range(3)]
    policies = [ExpectedAttention(budget=30, recent=4), ExpectedAttention(budget=0.4), None]
    assert_batched_matches_alone(model, tokenizer, prompts, policies, max_tokens=12, context=72)


def test_on_a_prompt_cache_across_turns(sharp):
    model, tokenizer = sharp
    cache = make_prompt_cache(model)
    policy = ExpectedAttention(budget=30, recent=4)
    list(stream_generate(model, tokenizer, random_token_ids(70), 4, prompt_cache=cache, kv_policy=policy,
                         prefill_step_size=16))
    state = direct.policy_state_of(cache)
    first = state.queries.count[0]
    assert first == 70 - 4 and cache[0].size() <= policy.budget_tokens(74)
    list(stream_generate(model, tokenizer, random_token_ids(10, seed=3), 4, prompt_cache=cache, kv_policy=policy))
    assert state.queries.count[0] == first + 10  # the new turn's prompt, not the answers


def test_on_quantized_blocks(tiny):
    """Keys and values are read dequantized for the scores; the packed rows are compressed to the budget."""
    from tiny_models import tiny_model

    model = tiny_model(seed=5, head_dim=32)
    policy = ExpectedAttention(budget=24, recent=4)
    engine = Engine(model, tiny[1], kv_tokens=1024, prefill_step_size=16, kv_dtype="k=int8,v=int4",
                    kv_group_size=32)
    rid = engine.add_request(random_token_ids(60), max_tokens=8, kv_policy=policy)
    physical = []
    while engine.has_unfinished:
        engine.step()
        kv = engine.runner.kv_view(rid)
        physical += [kv.num_tokens] if kv is not None else []
    assert max(physical) <= 24 + 16 and 24 in physical and 21 <= physical[-1] <= 24  # decoding: slack 3 below
    assert engine.arena.allocator.num_used_blocks == 0
