"""D2O-style merging on eviction: the values a direct computation gives, the budget kept, batched equal to
unbatched, and the string form."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.engine.evict_merge import merged_values
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import D2O, H2O, parse_policy
from test_policies_runtime import assert_batched_matches_alone
from tiny_models import random_token_ids


def test_string_form_and_bad_threshold():
    assert parse_policy("d2o:budget=0.2,threshold=0.3") == D2O(budget=0.2, threshold=0.3)
    policy = D2O(budget=64, recent=8)
    assert parse_policy(policy.describe()) == policy
    with pytest.raises(InvalidArgumentError, match="threshold"):
        parse_policy("d2o:threshold=2")


def test_merged_values_match_a_direct_computation(sharp):
    model, _ = sharp
    cache = make_prompt_cache(model)
    import mlx.core as mx

    model(mx.array([random_token_ids(40)], dtype=mx.uint32), cache=cache)
    seq = cache[0].sequence
    layers, heads = len(cache), seq.arena.config.num_kv_heads
    rng = np.random.default_rng(0)
    keep = np.stack([np.stack([np.sort(rng.choice(40, 12, replace=False)) for _ in range(heads)])
                     for _ in range(layers)])
    threshold = 0.2
    new, folded = merged_values(seq, keep, threshold)
    total = 0
    for layer in range(layers):
        keys, values = (np.asarray(a.astype(mx.float32)) for a in seq.arena.read(layer, seq.blocks, 40))
        want = np.take_along_axis(values, keep[layer][..., None], axis=1).copy()
        for h in range(heads):
            unit = keys[h] / np.linalg.norm(keys[h], axis=-1, keepdims=True)
            weights = np.ones(12)
            sums = want[h].copy()
            for d in sorted(set(range(40)) - set(keep[layer, h].tolist())):
                sim = unit[keep[layer, h]] @ unit[d]
                j = int(sim.argmax())
                if sim[j] >= threshold:
                    sums[j] += sim[j] * values[h, d]
                    weights[j] += sim[j]
                    total += 1
            want[h] = sums / weights[:, None]
        got = want if new[layer] is None else np.asarray(new[layer])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert folded == total > 0


def test_same_budget_as_h2o_and_different_values(sharp):
    model, _ = sharp
    tokens = random_token_ids(90)
    h2o = token_nlls(model, tokens, H2O(budget=24, recent=6), chunk_size=8)
    d2o = token_nlls(model, tokens, D2O(budget=24, recent=6, threshold=0.0), chunk_size=8)
    assert d2o.shape == h2o.shape and not np.allclose(d2o, h2o)  # the merges change what later tokens read
    never = token_nlls(model, tokens, D2O(budget=24, recent=6, threshold=1.0), chunk_size=8)
    np.testing.assert_allclose(never, h2o, atol=1e-5)  # nothing similar enough: exactly H2O


def test_batched_equals_unbatched(sharp):
    model, tokenizer = sharp
    prompts = [random_token_ids(50, seed=s) for s in range(3)]
    policies = [D2O(budget=24, recent=6), D2O(budget=0.4, threshold=0.0), None]
    assert_batched_matches_alone(model, tokenizer, prompts, policies, max_tokens=12, context=62)
