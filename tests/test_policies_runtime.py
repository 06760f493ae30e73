"""KV policies running on a tiny model: bounds, protected tokens, exactness without eviction, the engine."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.engine.engine import Engine
from cortexstream.evaluation import perplexity as ppl_module
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.policies import H2O, FullCache, StreamingLLM
from cortexstream.engine import policy_prompt_cache as direct
from tiny_models import random_token_ids

POLICIES = [StreamingLLM(sinks=3, budget=24), H2O(budget=24, sinks=3, recent=6), H2O(budget=0.25, keep_prefix=7)]




token_stream = random_token_ids


def engine_run(model, tokenizer, prompts, policies, max_tokens=12, **kwargs):
    """Greedy tokens and per-step logprobs of each request, plus the physical tokens seen after every step."""
    # A fixed budget while decoding: "auto" sizes the chunks of a prompt prefilled beside a decoding one from
    # measured step times, and runs compared exactly here must cut the same chunks.
    engine = Engine(model, tokenizer, **{"kv_tokens": 2048, "prefill_step_size": 16,
                                         "prefill_tokens_while_decoding": 8, **kwargs})
    ids = [engine.add_request(p, max_tokens=max_tokens, kv_policy=k) for p, k in zip(prompts, policies)]
    tokens = {i: [] for i in ids}
    logprobs = {i: [] for i in ids}
    physical = {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens[out.request_id].append(out.token)
                logprobs[out.request_id].append(np.array(out.logprobs))
        for seq in engine.scheduler.running:
            kv = engine.runner.kv_view(seq.request_id)  # None until its first step
            physical[seq.request_id].append((seq.num_physical, kv.num_tokens if kv is not None else 0))
    return ([tokens[i] for i in ids], [np.stack(logprobs[i]) for i in ids], [physical[i] for i in ids], engine)


def assert_batched_matches_alone(model, tokenizer, prompts, policies, *, max_tokens, context, atol=2e-4):
    """Each request's greedy tokens and logprobs in one engine run with all of them equal its run alone (each
    prompt one prefill chunk in both: eviction points depend on chunking; decode is batched), and each policy stays
    within its budget for `context` tokens. Returns the batched run's physical sizes per request and step."""
    tokens, logprobs, physical, _ = engine_run(model, tokenizer, prompts, policies, max_tokens=max_tokens,
                                               prefill_step_size=256)
    for i, (prompt, policy) in enumerate(zip(prompts, policies)):
        alone_tokens, alone_logprobs, _, _ = engine_run(model, tokenizer, [prompt], [policy], max_tokens=max_tokens,
                                                        prefill_step_size=256)
        assert tokens[i] == alone_tokens[0], policy
        np.testing.assert_allclose(logprobs[i], alone_logprobs[0], atol=atol)
        if policy is not None:
            assert max(p for p, _ in physical[i]) <= policy.budget_tokens(context), policy
    return physical


# --- budgets, protected tokens ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.describe())
@pytest.mark.parametrize("chunk", [1, 5])
def test_budget_is_never_exceeded_and_sinks_and_recent_are_always_kept(sharp, policy, chunk, monkeypatch):
    model, _ = sharp
    tokens = token_stream(90)
    budget = policy.budget_tokens(len(tokens))
    seen = {"evictions": 0}
    original = direct.apply_policy

    def checked(cache, context):
        before = cache[0].size()
        assert before <= budget + chunk  # during the forward: budget + one chunk at most
        original(cache, context)
        state, seq = direct.policy_state_of(cache), cache[0].sequence
        assert seq.num_tokens <= budget and all(n == seq.num_tokens for n in seq.lengths)
        seen["evictions"] += seq.num_tokens < before
        protected = policy.sinks if isinstance(policy, StreamingLLM) else policy.protected
        # StreamingLLM's recent tokens are its window: slack fewer right after a decode step went over the budget
        window = policy.eviction_target(budget + 1, budget, policy.sinks + 1) - policy.sinks
        recent = window if isinstance(policy, StreamingLLM) else policy.recent_tokens(budget)
        offset = cache[0].offset
        for positions in state.positions:
            for row in positions:
                assert set(range(min(protected, offset))) <= set(row.tolist())
                assert set(range(max(0, offset - recent), offset)) <= set(row.tolist())
                assert row.max() == offset - 1

    monkeypatch.setattr(direct, "apply_policy", checked)
    token_nlls(model, tokens, policy, chunk_size=chunk)
    assert seen["evictions"] > 5


def test_full_and_no_policy_never_build_a_policy_state(sharp):
    model, _ = sharp
    cache = direct.make_policy_cache(model, FullCache())
    assert direct.policy_state_of(cache) is None
    assert direct.attach_policy(cache, None) is None


# --- exactness when nothing is evicted ----------------------------------------------------------------------------
def test_budget_at_least_the_context_gives_exactly_full_results(sharp, monkeypatch):
    model, tokenizer = sharp
    # Block tables differ between runs with and without policies (evicting sequences keep their blocks out of the
    # prefix cache), and the CPU batch attention picked for a layout (strided view or block-wise) rounds
    # differently: pin one so that only the policy can make a difference.
    monkeypatch.setenv("CORTEXSTREAM_BATCH_ATTENTION", "blocks")
    tokens = token_stream(70)
    full = token_nlls(model, tokens, None, chunk_size=1)
    for policy in (StreamingLLM(budget=1.0), StreamingLLM(window=200), H2O(budget=1.0), H2O(budget=70)):
        assert np.array_equal(token_nlls(model, tokens, policy, chunk_size=1), full), policy
    small = token_nlls(model, tokens, H2O(budget=16, recent=4), chunk_size=1)
    assert not np.allclose(small, full)  # the comparison can fail: eviction does change the model's view

    prompts = [token_stream(40, seed=1), token_stream(23, seed=2)]
    # Evicting sequences prefill one per forward pass; full-cache ones may share a padded forward or ride in a
    # decode pass (mixed prefill), which round differently: compare with both off, so that only the policy can
    # make a difference.
    ref_tokens, ref_logprobs, _, _ = engine_run(model, tokenizer, prompts, [None, None], max_tokens=10,
                                                batch_prefill=False, mixed_prefill=False)
    for policy in (FullCache(), StreamingLLM(budget=1.0), H2O(budget=1.0), "h2o:budget=60"):
        got_tokens, got_logprobs, _, _ = engine_run(model, tokenizer, prompts, [policy, policy], max_tokens=10,
                                                    batch_prefill=False, mixed_prefill=False)
        assert got_tokens == ref_tokens, policy
        for got, ref in zip(got_logprobs, ref_logprobs):
            assert np.array_equal(got, ref), policy
    evicted_tokens, evicted_logprobs, _, _ = engine_run(model, tokenizer, prompts, [H2O(budget=12)] * 2, max_tokens=10)
    assert not all(np.array_equal(a, b) for a, b in zip(evicted_logprobs, ref_logprobs))


# --- the engine -----------------------------------------------------------------------------------------------------
def test_engine_bounds_physical_kv_and_frees_blocks_at_once(sharp):
    model, tokenizer = sharp
    policy = H2O(budget=40, recent=10)
    engine = Engine(model, tokenizer, kv_tokens=2048, prefill_step_size=16)
    rid = engine.add_request(token_stream(100), max_tokens=30, kv_policy=policy)
    used, budget = [], policy.budget_tokens(130)
    while engine.has_unfinished:
        engine.step()
        for seq in engine.scheduler.running:
            assert seq.request_id == rid
            kv = engine.runner.kv_view(seq.request_id)
            assert seq.num_physical == kv.num_tokens <= budget
            assert len(seq.block_table) == -(-kv.num_tokens // 16)  # no block beyond what is held
            used.append(engine.arena.allocator.num_used_blocks)
    assert max(used) <= -(-budget // 16) + 1
    assert engine.arena.allocator.num_used_blocks == 0
    assert engine.arena.stats()["evicted_tokens"] > 0


def test_a_prompt_larger_than_the_arena_runs_with_a_bounded_policy(sharp):
    model, tokenizer = sharp
    prompt = token_stream(300)
    tokens, _, physical, _ = engine_run(model, tokenizer, [prompt], [StreamingLLM(budget=48)], max_tokens=5,
                                        kv_tokens=128)
    assert len(tokens[0]) == 5 and max(p for p, _ in physical[0]) <= 48
    engine = Engine(model, tokenizer, kv_tokens=128, prefill_step_size=16)
    rid = engine.add_request(prompt, max_tokens=5)
    assert engine.step()[0].finish_reason == "rejected" and rid


def test_batched_decode_with_mixed_policies_matches_each_request_alone(sharp):
    model, tokenizer = sharp
    prompts = [token_stream(50, seed=s) for s in range(4)]
    policies = [None, StreamingLLM(budget=30), H2O(budget=30, recent=8), H2O(budget=0.3, keep_prefix=6)]
    assert_batched_matches_alone(model, tokenizer, prompts, policies, max_tokens=16, context=66)


def test_batch_generate_takes_one_policy_per_prompt(sharp):
    from cortexstream.generation.batch import batch_generate

    model, tokenizer = sharp
    prompts = [token_stream(30, seed=5), token_stream(30, seed=6)]
    out = batch_generate(model, tokenizer, prompts, max_tokens=4, kv_policy=["h2o:budget=16", None],
                         return_token_ids=True, prefill_step_size=8)
    assert [len(t) for t in out.token_ids] == [4, 4]
    from cortexstream.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="2 prompts"):
        batch_generate(model, tokenizer, prompts, max_tokens=4, kv_policy=[None])


def test_engine_default_policy_and_bad_policy_string(sharp):
    from cortexstream.errors import InvalidArgumentError

    model, tokenizer = sharp
    engine = Engine(model, tokenizer, kv_tokens=512, kv_policy="streaming:budget=20")
    assert engine.kv_policy == StreamingLLM(budget=20)
    with pytest.raises(InvalidArgumentError, match="recnt"):
        engine.add_request([5, 6, 7], max_tokens=2, kv_policy="h2o:recnt=3")


def test_perplexity_module_uses_the_policy_path(sharp):
    # token_nlls imports apply_policy at call time, so the monkeypatched checks above really ran on it.
    assert ppl_module.token_nlls is token_nlls
