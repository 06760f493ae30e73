"""SnapKV: pooling and selection (numpy), the observation window's rule, a constructed case where the question's
attention points at one planted key (SnapKV keeps it, H2O drops it), and the policy running in the engine and on
a prompt cache: no eviction before the prompt is complete, then exactly its budget, blocks freed at once, only the
window's queries voting, batched equal to unbatched."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.engine import policy_kv_cache
from cortexstream.engine.attention_hook import attention_received
from cortexstream.engine.engine import Engine
from cortexstream.engine.observation import Observation
from cortexstream.errors import InvalidArgumentError
from cortexstream.generation.stream import stream_generate
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import H2O, SnapKV, parse_policy
from cortexstream.policies.snapkv import Pooling, pool_scores
from test_policies_runtime import assert_batched_matches_alone
from tiny_models import random_token_ids


# --- the policy object ------------------------------------------------------------------------------------------
def test_string_forms_and_bad_parameters():
    assert parse_policy("snapkv:budget=0.2,window=16,kernel=5,pooling=avg,sinks=2") == SnapKV(
        budget=0.2, window=16, kernel=5, pooling=Pooling.AVG, sinks=2)
    policy = SnapKV(budget=64)
    assert parse_policy(policy.describe()) == policy and policy.observation_window == 32
    for spec, words in [("snapkv:kernel=4", "odd"), ("snapkv:pooling=median", "pooling"),
                        ("snapkv:budget=5", "budget 5"), ("snapkv:window=0", "window"), ("snapkv:wndow=3", "wndow")]:
        with pytest.raises(InvalidArgumentError, match=words):
            parse_policy(spec)


def test_pooling_matches_a_direct_loop():
    rng = np.random.default_rng(0)
    scores = rng.random((2, 3, 20))
    for pooling in Pooling:
        pooled = pool_scores(scores, 5, pooling)
        for i in range(20):
            window = scores[..., max(0, i - 2): i + 3]
            want = window.max(-1) if pooling is Pooling.MAX else window.sum(-1) / 5  # zero padding counts
            np.testing.assert_allclose(pooled[..., i], want)


def test_select_keeps_sinks_window_and_the_most_voted_keys_per_head():
    policy = SnapKV(budget=10, window=3, kernel=1, sinks=2)
    scores = np.zeros((1, 2, 30))
    scores[0, 0, [5, 9, 12, 20, 21]] = [5, 4, 3, 2, 1]
    scores[0, 1, [6, 7, 8, 13, 14]] = [1, 2, 3, 4, 5]
    keep = policy.select(30, 100, scores)
    assert keep.shape == (1, 2, 10)
    assert keep[0, 0].tolist() == [0, 1, 5, 9, 12, 20, 21, 27, 28, 29]
    assert keep[0, 1].tolist() == [0, 1, 6, 7, 8, 13, 14, 27, 28, 29]
    assert policy.select(10, 100, scores[..., :10]) is None  # within budget: nothing to do
    pooled = SnapKV(budget=5, window=1, kernel=3, sinks=0).select(30, 100, scores)
    assert set(pooled[0, 0, :4].tolist()) <= {4, 5, 6, 8, 9, 10}  # neighbours of the top votes come with them


def test_recent_keeps_more_of_the_newest_keys_than_the_window():
    scores = np.zeros((1, 2, 30))
    scores[0, :, [5, 9, 12, 20, 21]] = np.array([5, 4, 3, 2, 1])[:, None]
    keep = SnapKV(budget=10, window=3, kernel=1, sinks=2, recent=5).select(30, 100, scores)
    assert keep[0, 0].tolist() == [0, 1, 5, 9, 12, 25, 26, 27, 28, 29]  # 5 newest, 3 voted
    half = SnapKV(budget=10, window=3, kernel=1, sinks=2, recent=0.5)
    assert half.recent_tokens(10) == 5 and (half.select(30, 100, scores) == keep).all()
    assert SnapKV(budget=10, window=3).recent_tokens(10) == 3  # default: the window
    policy = parse_policy("snapkv:budget=0.2,recent=0.5,merge=0.3")
    assert policy == SnapKV(budget=0.2, recent=0.5, merge=0.3) and parse_policy(policy.describe()) == policy
    for spec in ("snapkv:recent=0", "snapkv:recent=1.5"):
        with pytest.raises(InvalidArgumentError, match="recent"):
            parse_policy(spec)


def test_pooled_splits_the_voted_slots_between_pooled_and_raw_votes():
    """pooled=3: the 3 slots the pooled votes rank first (a peak and its neighbours), then the rest of the voted
    slots by the raw votes among the others (isolated heavy hitters the pooling would drown)."""
    scores = np.zeros((1, 1, 40))
    scores[0, 0, 10] = 10.0  # the question's fact: a peak
    scores[0, 0, [20, 25, 30]] = [3.0, 2.5, 2.0]  # heavy hitters of the stream
    base = dict(budget=9, window=3, kernel=3, sinks=2, recent=1)
    all_pooled = SnapKV(**base).select(40, 100, scores)[0, 0].tolist()
    split = SnapKV(**base, pooled=3).select(40, 100, scores)[0, 0].tolist()
    assert all_pooled[2:8] == [9, 10, 11, 19, 20, 21]  # max pooling spends slots on the neighbours of 10 and 20
    assert split == [0, 1, 9, 10, 11, 20, 25, 30, 39]  # pooled 9-11, then the raw top three
    assert SnapKV(**base, pooled=0.34).pooled_tokens(9) == 3
    policy = parse_policy("snapkv:budget=0.2,recent=0.5,pooled=0.2,merge=0.5")
    assert policy.pooled == 0.2 and parse_policy(policy.describe()) == policy
    for spec, words in (("snapkv:pooled=0", "pooled"), ("adakv:pooled=0.2", "AdaKV: pooled is not supported"),
                        ("pyramidkv:pooled=4", "PyramidKV: pooled is not supported")):
        with pytest.raises(InvalidArgumentError, match=words):
            parse_policy(spec)


def test_the_prompt_is_held_whole_while_it_is_prefilled():
    policy = SnapKV(budget=40)
    assert policy.max_physical_tokens(1000, 16, prompt_tokens=900) == 916
    assert policy.max_physical_tokens(1000, 16, prompt_tokens=10) == 40 + 16
    assert policy.max_physical_tokens(1000, 16) == 56  # no prompt end (perplexity): evicts after every pass


def test_observation_rule():
    window = Observation(8)
    assert window.first_voting_row(100, 80, 16) is None  # prompt ends at 100; queries 64..79: before the window
    assert window.first_voting_row(100, 96, 16) == 12  # queries 80..95: 92..95 vote
    assert window.first_voting_row(100, 100, 4) == 0 and window.first_voting_row(100, 101, 1) == 0  # then every query
    assert not window.may_evict(100, 96) and window.may_evict(100, 100)
    assert window.first_voting_row(None, 50, 16) == 8 and window.may_evict(None, 1)  # no known prompt end


# --- the constructed case: the question points at one planted key -----------------------------------------------
def test_snapkv_keeps_the_planted_key_the_question_asks_for_where_h2o_drops_it():
    """One head, orthonormal keys. The document's 200 queries each look hard at one of 20 hub keys (10 queries per
    hub), the question's last 8 queries at one planted key. Summed over every query (H2O) the hubs outweigh the
    planted key; counted over the question's window (SnapKV) only the planted key stands out."""
    n, dim, planted, window = 240, 256, 150, 8
    keys = mx.array(np.eye(n, dim, dtype=np.float32)[None, None])  # [1, 1, n, D]: key i is e_i
    hubs = list(range(20, 40))
    targets = [hubs[i % 20] for i in range(n - window)] + [planted] * window
    queries = mx.array((10.0 * np.eye(n, dim, dtype=np.float32)[targets])[None, None])  # query i looks at its target
    budget = 4 + 12 + window  # sinks + 12 voted/heavy + the recent window
    first = Observation(window).first_voting_row(n, n, n)
    snap_scores = np.asarray(attention_received(queries[:, :, first:], keys, 1.0, "causal")[0])[None]
    all_scores = np.asarray(attention_received(queries, keys, 1.0, "causal")[0])[None]
    snap = SnapKV(budget=budget, window=window, kernel=1, sinks=4).select(n, n, snap_scores)
    h2o = H2O(budget=budget, sinks=4, recent=window).select(n, n, all_scores)
    assert planted in snap[0, 0].tolist()
    assert planted not in h2o[0, 0].tolist()


# --- in the engine and on a prompt cache -------------------------------------------------------------------------
def test_engine_holds_the_prompt_then_compresses_it_to_the_budget_and_frees_blocks(sharp):
    model, tokenizer = sharp
    policy = SnapKV(budget=40, window=8)
    engine = Engine(model, tokenizer, kv_tokens=2048, prefill_step_size=16)
    rid = engine.add_request(random_token_ids(100), max_tokens=20, kv_policy=policy)
    budget, held = policy.budget_tokens(120), []
    while engine.has_unfinished:
        engine.step()
        for seq in engine.scheduler.running:
            kv = engine.runner.kv_view(rid)
            held.append((kv.logical_length, kv.num_tokens, engine.arena.allocator.num_used_blocks))
            assert len(seq.block_table) == -(-kv.num_tokens // 16)
    prefill = [(logical, physical) for logical, physical, _ in held if logical < 100]
    assert prefill and all(logical == physical for logical, physical in prefill)  # nothing evicted mid-prompt
    after = [physical for logical, physical, _ in held if logical >= 100]
    low = policy.eviction_target(budget + 1, budget, 0)  # decoding evicts `slack` below the budget at a time
    assert after and after[0] == budget and all(low <= physical <= budget for physical in after)
    assert any(physical < budget for physical in after)
    assert max(blocks for logical, _, blocks in held if logical >= 100) <= -(-budget // 16) + 1
    assert engine.arena.allocator.num_used_blocks == 0


def test_only_the_windows_queries_vote_on_a_prompt_cache(sharp, monkeypatch):
    model, tokenizer = sharp
    rows = []
    original = policy_kv_cache.attention_received

    def counting(queries, *args, **kwargs):
        rows.append(queries.shape[2])
        return original(queries, *args, **kwargs)

    monkeypatch.setattr(policy_kv_cache, "attention_received", counting)
    cache = make_prompt_cache(model)
    policy = SnapKV(budget=30, window=8)
    out = list(stream_generate(model, tokenizer, random_token_ids(70), 5, prompt_cache=cache, kv_policy=policy,
                               prefill_step_size=16))
    layers = len(cache)
    # 8 window rows per layer over the prompt's passes, then one row per layer per decode pass (4 of them)
    assert sum(rows) == layers * (8 + 4) and len(out) == 5
    assert cache[0].size() == policy.budget_tokens(75)
    state = direct.policy_state_of(cache)
    assert state.prompt_end == 70 and state.num_evictions >= 1


def test_batched_equals_unbatched(sharp):
    model, tokenizer = sharp
    prompts = [random_token_ids(60, seed=s) for s in range(3)]
    policies = [SnapKV(budget=30, window=8), SnapKV(budget=0.4, window=4, pooling="avg"), None]
    assert_batched_matches_alone(model, tokenizer, prompts, policies, max_tokens=12, context=72)


@pytest.mark.parametrize("kv_dtype", ["int8", "k=int8,v=int4"])
def test_on_quantized_blocks(tiny, kv_dtype):
    """The packed rows, their scales and the policy's scores stay aligned through the compression."""
    from tiny_models import tiny_model

    model, tokenizer = tiny_model(seed=5, head_dim=32), tiny[1]
    policy = SnapKV(budget=24, window=4)
    engine = Engine(model, tokenizer, kv_tokens=1024, prefill_step_size=16, kv_dtype=kv_dtype, kv_group_size=32)
    rid = engine.add_request(random_token_ids(60), max_tokens=8, kv_policy=policy)
    tokens, physical = [], []
    while engine.has_unfinished:
        for out in engine.step():
            tokens += [out.token] if out.token is not None else []
        kv = engine.runner.kv_view(rid)
        if kv is not None and kv.logical_length >= 60:
            physical.append(kv.num_tokens)
    assert len(tokens) == 8 and physical and max(physical) == 24
    assert engine.arena.allocator.num_used_blocks == 0


def test_the_server_takes_snapkv_as_a_request_policy(sharp):
    from server_harness import assert_server_takes_policy

    assert_server_takes_policy(*sharp, random_token_ids(80), "snapkv:budget=32,window=8", "snapkv:kernel=2", "kernel")
