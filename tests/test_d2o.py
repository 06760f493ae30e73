"""D2O-style merging on eviction: the values a direct computation gives, the budget kept, batched equal to
unbatched, and the string form; the same merging on SnapKV's and KVzip's choices (`merge=`)."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.engine.evict_merge import merged_values
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import D2O, H2O, KVzip, SnapKV, parse_policy

from test_policies_runtime import assert_batched_matches_alone, engine_run
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
        stored = np.take_along_axis(values, keep[layer][..., None], axis=1)
        got = stored.copy()
        if new[layer] is not None:  # the rows from the first one a merge changed; those before it as stored
            assert np.allclose(want[:, : new[layer].start], stored[:, : new[layer].start])
            assert not np.allclose(want[:, new[layer].start], stored[:, new[layer].start])
            got[:, new[layer].start:] = np.asarray(new[layer].values)
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


def test_merge_on_snapkv_and_kvzip_string_forms_and_refusals():
    policy = parse_policy("snapkv:budget=0.2,merge=0.4")
    assert policy == SnapKV(budget=0.2, merge=0.4) and policy.merges_evicted and policy.merge_threshold == 0.4
    assert parse_policy(policy.describe()) == policy
    assert not SnapKV(budget=0.2).merges_evicted and SnapKV(budget=0.2).merge_threshold is None
    zipped = parse_policy("kvzip:budget=0.33,merge=0")
    assert zipped.merges_evicted and zipped.merge_threshold == 0.0 and parse_policy(zipped.describe()) == zipped
    for spec, words in (("snapkv:merge=1.5", "SnapKV: merge 1.5 must be a cosine"),
                        ("kvzip:merge=-2", "KVzip: merge -2.0 must be a cosine"),
                        ("kvzip:shared=1,merge=0.5", "KVzip: merge needs a per-head choice"),
                        ("adakv:merge=0.5", "AdaKV: merge is not supported")):
        with pytest.raises(InvalidArgumentError, match=words):
            parse_policy(spec)


def test_snapkv_merge_keeps_its_choice_and_budget_and_changes_only_values(sharp):
    """Perplexity under SnapKV with merge=1.0 (nothing is that similar) equals plain SnapKV; merge=0 folds and
    changes later tokens' losses; the slots kept stay SnapKV's (the budget after every pass)."""
    model, _ = sharp
    tokens = random_token_ids(90)
    sizes = []
    plain = token_nlls(model, tokens, SnapKV(budget=24, window=6), chunk_size=8)
    never = token_nlls(model, tokens, SnapKV(budget=24, window=6, merge=1.0), chunk_size=8)
    folded = token_nlls(model, tokens, SnapKV(budget=24, window=6, merge=0.0), chunk_size=8,
                        on_chunk=lambda i, cache: sizes.append(cache[0].sequence.num_tokens))
    np.testing.assert_allclose(never, plain, atol=1e-5)
    assert folded.shape == plain.shape and not np.allclose(folded, plain)
    assert max(sizes) == 24 and 21 <= sizes[-1] <= 24  # a last pass of 2 tokens evicts slack (3) below the budget


def test_merging_snapkv_and_kvzip_batched_equal_alone(sharp):
    model, tokenizer = sharp
    prompts = [random_token_ids(50, seed=s) for s in range(3)]
    assert_batched_matches_alone(model, tokenizer, prompts, [SnapKV(budget=24, window=6, merge=0.0),
                                                             SnapKV(budget=0.4, merge=0.3), None],
                                 max_tokens=12, context=62)
    policies = [KVzip(budget=30, chunk=32, merge=0.0), None]
    tokens, logprobs, _, _ = engine_run(model, tokenizer, prompts[:2], policies, max_tokens=10,
                                        prefill_step_size=256)
    alone, alone_logprobs, _, _ = engine_run(model, tokenizer, prompts[:1], policies[:1], max_tokens=10,
                                             prefill_step_size=256)
    _, plain_logprobs, _, _ = engine_run(model, tokenizer, prompts[:1], [KVzip(budget=30, chunk=32)],
                                         max_tokens=10, prefill_step_size=256)
    assert tokens[0] == alone[0]
    np.testing.assert_allclose(logprobs[0], alone_logprobs[0], atol=2e-4)
    assert not np.allclose(logprobs[0], plain_logprobs[0], atol=1e-4)  # the folded values reach the logits
