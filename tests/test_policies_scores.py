"""H2O's scores against a direct computation, RoPE positions after eviction, the SDPA hook, multi-turn chat."""

from __future__ import annotations

from collections import defaultdict

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import llama

from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.generation.stream import stream_generate
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.engine import attention_hook as attention_scores
from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.policies import H2O, StreamingLLM
from tiny_models import random_token_ids




tokens = random_token_ids


@pytest.mark.parametrize("chunk", [1, 4])
def test_heavy_hitters_match_a_direct_computation_of_accumulated_attention(sharp, chunk, monkeypatch):
    """Queries are recomputed from each attention layer's recorded input (q_proj + RoPE at the logical offset),
    attention probabilities by hand in numpy against the cached K; the accumulated reference, keyed by logical
    position, must equal the policy's scores after every compaction, and the kept heavy hitters must be the
    reference's top scores."""
    model, _ = sharp
    policy = H2O(budget=20, sinks=2, recent=5)
    attn_layers = [layer.self_attn for layer in model.model.layers]
    inputs: dict[int, tuple[mx.array, int]] = {}
    original_call = llama.Attention.__call__

    def recording_call(self, x, mask=None, cache=None):
        inputs[next(i for i, a in enumerate(attn_layers) if a is self)] = (x, cache.offset)
        return original_call(self, x, mask=mask, cache=cache)

    monkeypatch.setattr(llama.Attention, "__call__", recording_call)
    reference = [defaultdict(lambda: defaultdict(float)) for _ in attn_layers]  # layer -> head -> position -> score
    checked = {"evictions": 0}
    original_apply = direct.apply_policy

    def checked_apply(cache, context):
        mx.eval([c.state for c in cache])
        state = direct.policy_state_of(cache)
        for layer, attn in enumerate(attn_layers):
            x, offset = inputs[layer]
            n_new = x.shape[1]
            q = attn.q_proj(x).reshape(1, n_new, attn.n_heads, -1).transpose(0, 2, 1, 3)
            q = np.array(attn.rope(q, offset=offset)[0])  # [Hq, n, D] at the logical positions
            k_new = attn.k_proj(x).reshape(1, n_new, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            k_new = np.array(attn.rope(k_new, offset=offset)[0])
            keys = np.array(cache[layer].state[0][0])  # [H, physical, D], the cache as attended
            np.testing.assert_allclose(keys[:, -n_new:], k_new, atol=1e-5)  # new keys: RoPE at the logical offset
            old = state.positions[layer]
            positions = np.concatenate([old, np.broadcast_to(np.arange(offset, offset + n_new), (old.shape[0], n_new))],
                                       axis=1)
            group = attn.n_heads // attn.n_kv_heads
            for head in range(attn.n_kv_heads):
                for g in range(group):
                    logits = q[head * group + g] @ keys[head].T * attn.scale  # [n, physical]
                    query_pos = np.arange(offset, offset + n_new)[:, None]
                    logits = np.where(positions[head][None, :] <= query_pos, logits, -np.inf)
                    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
                    probs /= probs.sum(axis=1, keepdims=True)
                    for pos, p in zip(positions[head], probs.sum(axis=0)):
                        reference[layer][head][int(pos)] += float(p)
        pre = [positions.copy() for positions in state.positions]
        original_apply(cache, context)
        budget = policy.budget_tokens(context)
        for layer in range(len(attn_layers)):
            for head, (kept_pos, scores) in enumerate(zip(state.positions[layer], state.scores[layer])):
                ref = reference[layer][head]
                np.testing.assert_allclose(scores, [ref[int(p)] for p in kept_pos], rtol=1e-4, atol=1e-5)
                before = set(pre[layer][head].tolist()) | set(range(cache[0].offset - chunk, cache[0].offset))
                if len(before) <= budget:
                    continue
                offset = cache[0].offset
                recent = set(range(offset - policy.recent_tokens(budget), offset))
                candidates = sorted(p for p in before if p >= policy.protected and p not in recent)
                chosen = set(kept_pos.tolist()) - recent - set(range(policy.protected))
                top = sorted(candidates, key=lambda p: (-ref[p], p))[: len(chosen)]
                assert chosen == set(top), (layer, head)
                checked["evictions"] += 1

    monkeypatch.setattr(direct, "apply_policy", checked_apply)
    token_nlls(model, tokens(60), policy, chunk_size=chunk)
    assert checked["evictions"] > 20


def test_positions_continue_from_the_logical_length_after_eviction(sharp):
    model, _ = sharp
    cache = make_prompt_cache(model)
    direct.attach_policy(cache, StreamingLLM(sinks=2, budget=10))
    for step, token in enumerate(tokens(30)):
        model(mx.array([[token]]), cache=cache)
        direct.apply_policy(cache, 30)
        assert cache[0].offset == step + 1 and cache[0].size() == min(step + 1, 10)
    state = direct.policy_state_of(cache)
    assert state.positions[0][0].tolist() == [0, 1] + list(range(22, 30))
    # The next forward's mask covers the 10 physical keys plus the new one; its query sits at logical 30.
    assert cache[0].make_mask(1) is None and cache[0].make_mask(3) == "causal"


def test_unhooked_paths_are_bit_identical(sharp):
    model, _ = sharp
    ids = tokens(40)
    attention_scores.unroute_sdpa()
    assert not attention_scores.routed_modules()
    before = token_nlls(model, ids, None, chunk_size=7)
    token_nlls(model, ids, H2O(budget=1.0), chunk_size=7)  # installs the hook
    assert attention_scores.routed_modules() and llama.scaled_dot_product_attention is attention_scores.dispatch_sdpa
    assert np.array_equal(token_nlls(model, ids, None, chunk_size=7), before)
    assert np.array_equal(token_nlls(model, ids, H2O(budget=1.0), chunk_size=7), before)


def test_attention_received_handles_gqa_masks_and_query_blocks():
    rng = np.random.default_rng(3)
    q = mx.array(rng.normal(size=(2, 6, 5, 8)).astype(np.float32))
    k = mx.array(rng.normal(size=(2, 3, 9, 8)).astype(np.float32))
    got = attention_scores.attention_received(q, k, 0.4, "causal", query_block=2)
    qn, kn = np.array(q), np.array(k)
    ref = np.zeros((2, 3, 9))
    for b in range(2):
        for h in range(6):
            scores = qn[b, h] @ kn[b, h // 2].T * 0.4
            scores = np.where(np.arange(5)[:, None] + 4 >= np.arange(9)[None], scores, -np.inf)
            p = np.exp(scores - scores.max(1, keepdims=True))
            ref[b, h // 2] += (p / p.sum(1, keepdims=True)).sum(0)
    np.testing.assert_allclose(np.array(got), ref, rtol=1e-5, atol=1e-5)
    # every query's probabilities sum to one: the total equals heads-per-group * queries
    np.testing.assert_allclose(np.array(got).sum(-1), 2 * 5, rtol=1e-5)


def test_multi_turn_chat_continues_on_the_evicted_cache_without_recompute(sharp, monkeypatch):
    model, tokenizer = sharp
    policy = H2O(budget=24, sinks=2, recent=6)
    cache = make_prompt_cache(model)
    computed: list[int] = []
    original_call = type(model).__call__

    def counting_call(self, inputs, *args, **kwargs):
        computed.append(inputs.shape[1])
        return original_call(self, inputs, *args, **kwargs)

    monkeypatch.setattr(type(model), "__call__", counting_call)
    turn1 = tokens(40, seed=1)
    out1 = [r.token for r in stream_generate(model, tokenizer, turn1, 8, prompt_cache=cache, kv_policy=policy)]
    state = direct.policy_state_of(cache)
    first_offset, first_evictions = cache[0].offset, state.num_evictions
    assert first_evictions > 0 and cache[0].size() <= 24 and first_offset >= 40 + 7
    scores_before = state.scores[0].sum()
    computed.clear()
    turn2 = tokens(12, seed=2)
    out2 = [r.token for r in stream_generate(model, tokenizer, turn2, 6, prompt_cache=cache, kv_policy=policy)]
    assert sum(computed) <= len(turn2) + 6  # only the new turn (and its answer) is computed
    assert direct.policy_state_of(cache) is state and state.num_evictions > first_evictions
    assert cache[0].offset >= first_offset + 12 + 5 and cache[0].size() <= 24
    assert state.positions[0].max() == cache[0].offset - 1  # positions continue across turns
    assert state.scores[0].sum() > scores_before - 1e-9 or state.num_evicted > 0
    assert len(out1) == 8 and len(out2) == 6


def test_fork_copies_kv_counters_and_scores(sharp):
    model, _ = sharp
    cache = make_prompt_cache(model)
    direct.attach_policy(cache, H2O(budget=16, recent=4))
    token_nlls(model, tokens(30), None, chunk_size=5, prompt_cache=cache)
    fork = direct.fork_cache(cache)
    a, b = direct.policy_state_of(cache), direct.policy_state_of(fork)
    assert a is not b and np.array_equal(a.scores[1], b.scores[1]) and fork[0].offset == cache[0].offset
    assert np.array_equal(np.array(fork[1].state[0]), np.array(cache[1].state[0]))
    nxt = tokens(6, seed=9)
    assert np.array_equal(token_nlls(model, nxt, None, chunk_size=1, prompt_cache=fork),
                          token_nlls(model, nxt, None, chunk_size=1, prompt_cache=cache))
