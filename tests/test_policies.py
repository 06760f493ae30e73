"""KV policies as objects: string parsing, budgets, and what StreamingLLM / H2O select (pure numpy, no model)."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies import H2O, FullCache, StreamingLLM, parse_policy


# --- parsing --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, expected", [
    ("full", FullCache()),
    ("none", FullCache()),
    ("streaming:window=1020", StreamingLLM(window=1020)),
    ("StreamingLLM:budget=0.2,sinks=2", StreamingLLM(budget=0.2, sinks=2)),
    ("h2o:budget=0.2", H2O(budget=0.2)),
    ("h2o:budget=0.2,sinks=4,recent=64", H2O(budget=0.2, sinks=4, recent=64)),
    ("h2o: budget=512, keep-prefix=40", H2O(budget=512, keep_prefix=40)),
])
def test_parse_policy_strings(spec, expected):
    assert parse_policy(spec) == expected


def test_parse_passes_objects_through_and_none_is_the_full_cache():
    policy = H2O(budget=100)
    assert parse_policy(policy) is policy
    assert parse_policy(None) == FullCache()  # no policy named: the explicit full cache, never None


def test_every_capability_is_declared_on_the_base_class():
    # The runtime reads these attributes directly (no getattr with a default), so each must exist on every policy.
    for policy in (FullCache(), H2O(budget=100), StreamingLLM(window=8), parse_policy("meanpool:window=4"),
                   parse_policy("tome:window=4")):
        for capability in ("evicts", "needs_attention_scores", "merges", "uses_logit_bias", "rerotate"):
            assert isinstance(getattr(policy, capability), bool), (policy, capability)
        assert isinstance(policy.parse_keys, dict)
    full = FullCache()
    assert not (full.evicts or full.merges or full.needs_attention_scores or full.uses_logit_bias or full.rerotate)
    assert full.max_physical_tokens(100, 16) is None and full.merge_range(10, 100, None) is None


@pytest.mark.parametrize("spec, words", [
    ("lru:budget=3", ["unknown policy", "lru", "h2o"]),
    ("h2o:budgt=0.2", ["unknown key", "budgt", "budget"]),
    ("h2o:budget=abc", ["budget", "'abc'"]),
    ("h2o:sinks=0.5", ["sinks", "'0.5'", "integer"]),
    ("h2o:budget", ["budget", "key=value"]),
    ("h2o:budget=0.2,budget=0.3", ["budget", "twice"]),
    ("h2o:budget=1.5", ["budget", "1.5", "(0, 1]"]),
    ("h2o:budget=0", ["budget", ">= 1"]),
    ("h2o:budget=10,sinks=4,recent=8", ["budget 10", "13"]),
    ("streaming:sinks=4", ["window=", "budget="]),
    ("streaming:window=10,budget=20", ["exactly one"]),
    ("full:budget=3", ["unknown key", "budget"]),
])
def test_parse_errors_name_the_bad_key_or_value(spec, words):
    with pytest.raises(InvalidArgumentError) as info:
        parse_policy(spec)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_parse_rejects_other_types():
    with pytest.raises(InvalidArgumentError, match="string or a KVPolicy"):
        parse_policy(3)


def test_describe_round_trips():
    for policy in (StreamingLLM(window=64, sinks=2), H2O(budget=0.25, recent=8, keep_prefix=6), FullCache()):
        assert parse_policy(policy.describe()) == policy


# --- budgets --------------------------------------------------------------------------------------------------
def test_fraction_budgets_resolve_against_the_context_rounding_up():
    assert H2O(budget=0.2).budget_tokens(1000) == 200
    assert H2O(budget=0.2).budget_tokens(1001) == 201
    assert StreamingLLM(budget=0.1).budget_tokens(2048) == 205
    assert StreamingLLM(window=0.5, sinks=4).budget_tokens(100) == 54
    assert H2O(budget=300).budget_tokens(10**6) == 300


def test_small_contexts_are_raised_to_the_policy_minimum():
    assert H2O(budget=0.1, sinks=4, recent=8).budget_tokens(20) == 13  # sinks + recent + 1 heavy hitter
    assert H2O(budget=0.1, keep_prefix=30).budget_tokens(20) == 31
    assert StreamingLLM(budget=0.01, sinks=4).budget_tokens(10) == 5


def test_max_physical_tokens_is_budget_plus_one_chunk():
    assert H2O(budget=100).max_physical_tokens(5000, 512) == 612
    assert StreamingLLM(window=60).max_physical_tokens(5000, 32) == 96
    assert FullCache().max_physical_tokens(5000, 32) is None


# --- selection ------------------------------------------------------------------------------------------------
def test_streaming_keeps_sinks_and_the_window():
    policy = StreamingLLM(sinks=3, budget=10)
    assert policy.select(10, 100, None) is None
    keep = policy.select(25, 100, None)
    assert keep.tolist() == [0, 1, 2] + list(range(18, 25))


def test_h2o_keeps_protected_prefix_recent_window_and_top_scores_per_head():
    rng = np.random.default_rng(0)
    layers, heads, n = 3, 2, 40
    scores = rng.random((layers, heads, n))
    policy = H2O(budget=20, sinks=2, recent=5, keep_prefix=4)
    keep = policy.select(n, 100, scores)
    assert keep.shape == (layers, heads, 20)
    for layer in range(layers):
        for head in range(heads):
            row = keep[layer, head]
            assert row.tolist() == sorted(row.tolist()) and len(set(row.tolist())) == 20
            assert set(range(4)) <= set(row.tolist())  # keep_prefix > sinks: the whole prefix is protected
            assert set(range(35, 40)) <= set(row.tolist())
            middle = scores[layer, head, 4:35]
            expected = set((np.argsort(-middle, kind="stable")[:11] + 4).tolist())
            assert set(row.tolist()) - set(range(4)) - set(range(35, 40)) == expected
    assert not (keep[0, 0] == keep[0, 1]).all()  # heads choose independently


def test_h2o_default_recent_is_half_of_the_unprotected_budget_and_ties_keep_the_older_token():
    policy = H2O(budget=14, sinks=4)
    assert policy.recent_tokens(14) == 5
    keep = policy.select(30, 100, np.zeros((1, 1, 30)))
    assert keep[0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 25, 26, 27, 28, 29]
    assert policy.select(14, 100, np.zeros((1, 1, 14))) is None


def test_h2o_needs_scores_to_evict():
    with pytest.raises(InvalidArgumentError, match="scores"):
        H2O(budget=10).select(20, 100, None)


@pytest.mark.parametrize("spec", ["h2o:budget=64", "streaming:budget=64", "snapkv:budget=64,window=8",
                                  "kvzip:budget=64", "d2o:budget=64", "expected:budget=64"])
def test_a_decode_step_over_the_budget_evicts_slack_below_it_and_a_prompt_evicts_to_it(spec):
    """slack = min(16, budget // 8) = 8: a pass that went 1-7 over keeps 56 (the next 8 tokens evict nothing), one
    that went 8 or more over keeps the budget itself."""
    policy = parse_policy(spec)
    rng = np.random.default_rng(0)
    for n, expected in ((65, 56), (71, 56), (72, 64), (200, 64)):
        scores = rng.random((2, 3, n))
        keep = np.asarray(policy.select(n, 1000, scores))
        assert keep.shape[-1] == expected, (spec, n)
        assert (np.diff(keep, axis=-1) > 0).all() and (keep[..., 0] == 0).all()  # ascending, the first sink kept
        if not spec.startswith("kvzip"):  # every policy here but KVzip keeps the newest tokens by position
            assert (keep[..., -1] == n - 1).all()
    assert policy.select(64, 1000, rng.random((2, 3, 64))) is None
