"""Ada-KV: a layer's budget shared by its KV heads, stored without padding (cells holding another head's key).

The policy's choice (numpy): each layer keeps exactly budget x heads cells, sinks and window per head, the
safeguard floor, a head with sharper votes getting more. The layout (`engine.pooled_heads`): where kept cells go,
and attention over owned cells equal to each head attending its own keys. On the tiny model: after the prompt is
compressed some head keeps more keys than the sequence has slots while the arena holds exactly the budget, and the
next pass (one token, or a chunk under the causal mask) gives the logits of the full cache with each head masked
to its own kept positions; batched equals alone; floor 1 (an equal split) is SnapKV token for token; quantized
blocks; several ranks refuse it.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from cortexstream.engine import policy_prompt_cache as direct
from cortexstream.engine import pooled_state
from cortexstream.engine.attention_hook import attention_received, original_sdpa
from cortexstream.engine.engine import Engine
from cortexstream.engine.pooled_heads import attend_owned, column_owners, gather_cells, is_pooled, place
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import AdaKV, SnapKV, parse_policy
from test_policies_runtime import assert_batched_matches_alone, engine_run
from tiny_models import random_token_ids


# --- the policy object ------------------------------------------------------------------------------------------
def test_string_form_and_bad_floor():
    policy = parse_policy("adakv:budget=0.2,window=16,kernel=5,sinks=2,floor=0.5")
    assert policy == AdaKV(budget=0.2, window=16, kernel=5, sinks=2, floor=0.5)
    assert parse_policy(policy.describe()) == policy
    for spec in ("adakv:floor=1.5", "adakv:floor=-0.1"):
        with pytest.raises(InvalidArgumentError, match="floor"):
            parse_policy(spec)


def test_select_cells_shares_the_layer_budget_by_votes():
    policy = AdaKV(budget=10, window=2, kernel=1, sinks=1, floor=0.25)
    heads, n = 2, 30
    positions = np.broadcast_to(np.arange(n), (1, heads, n)).copy()
    owners = column_owners(heads, n)[None]
    scores = np.zeros((1, heads, n))
    scores[0, 0, 3:20] = np.linspace(9, 5, 17)  # head 0: many strong votes
    scores[0, 1, [5, 6]] = [1.0, 0.5]  # head 1: two weak ones
    keep = policy.select_cells(n, 100, scores, positions, owners)
    assert keep.shape == (1, heads, n) and keep.dtype == np.bool_
    assert keep.sum() == heads * 10  # the layer's budget, exactly
    assert keep[0, 0].sum() > 10 > keep[0, 1].sum()  # the head with more to keep keeps more than the slots
    for head in range(heads):
        assert keep[0, head, 0] and keep[0, head, n - 2:].all()  # its sink and its window
    assert keep[0, 1].sum() >= 1 + 2 + int(0.25 * 7)  # the floor: sink + window + a quarter of an equal share
    assert policy.select_cells(10, 100, scores[..., :10], positions[..., :10], owners[..., :10]) is None


def test_select_cells_follows_owners_and_positions_not_columns():
    """The same keys stored in a pooled layout are chosen as in their own columns."""
    policy = AdaKV(budget=6, window=1, kernel=3, sinks=1, floor=0.0)
    rng = np.random.default_rng(1)
    heads, n = 2, 12
    scores = rng.random((1, heads, n))
    positions = np.broadcast_to(np.arange(n), (1, heads, n)).copy()
    plain = policy.select_cells(n, 100, scores, positions, column_owners(heads, n)[None])
    perm = rng.permutation(heads * n).reshape(heads, n)  # any rearrangement of the cells
    moved = [gather_cells(a[0], perm)[None] for a in (scores, positions, column_owners(heads, n)[None])]
    chosen = policy.select_cells(n, 100, *moved[:1], moved[1], moved[2])
    assert np.array_equal(np.sort(perm.reshape(-1)[chosen[0].reshape(-1)]), np.nonzero(plain[0].reshape(-1))[0])


# --- the layout ---------------------------------------------------------------------------------------------------
def test_place_keeps_own_cells_and_lends_the_surplus():
    keep = np.zeros((3, 6), dtype=bool)
    keep[0, [0, 1, 2, 3, 4]] = True  # 5 kept: 1 over the 3 slots
    keep[1, [0, 5]] = True  # 2 kept
    keep[2, [1, 2]] = True  # 2 kept
    sources = place(keep)
    assert sources.shape == (3, 3)
    assert sources[0].tolist() == [0, 1, 2]
    assert sources[1].tolist() == [6, 11, 3] and sources[2].tolist() == [13, 14, 4]  # head 0's cells 3 and 4 lent
    owners = gather_cells(column_owners(3, 6), sources)
    assert owners.tolist() == [[0, 0, 0], [1, 1, 0], [2, 2, 0]] and is_pooled(owners)
    with pytest.raises(InvalidArgumentError, match="multiple"):
        place(np.array([[True, True, False], [True, False, False]]))


def _ragged_case(seed: int, queries: int):
    """Two KV heads keeping 7 and 3 keys (10 cells in 5 slots), four query heads, random vectors."""
    rng = np.random.default_rng(seed)
    heads, group, dim, slots = 2, 2, 8, 5
    own = [rng.standard_normal((7, dim)), rng.standard_normal((3, dim))]
    vals = [rng.standard_normal((7, dim)), rng.standard_normal((3, dim))]
    q = mx.array(rng.standard_normal((1, heads * group, queries, dim)).astype(np.float32))
    keep = np.zeros((heads, 2 * slots), dtype=bool)
    keep[0, :7] = keep[1, :3] = True
    sources = place(keep)  # a column layout holding head 0's 7 keys in both columns
    cells_k = np.zeros((heads * 2 * slots, dim), np.float32)
    cells_v = np.zeros_like(cells_k)
    for head in range(heads):
        cells_k[head * 2 * slots: head * 2 * slots + len(own[head])] = own[head]
        cells_v[head * 2 * slots: head * 2 * slots + len(vals[head])] = vals[head]
    keys = mx.array(cells_k[sources.reshape(-1)].reshape(1, heads, slots, dim))
    values = mx.array(cells_v[sources.reshape(-1)].reshape(1, heads, slots, dim))
    owners = gather_cells(column_owners(heads, 2 * slots), sources)
    return q, keys, values, owners, own, vals, group


def test_attention_over_owned_cells_equals_each_head_over_its_own_keys():
    q, keys, values, owners, own, vals, group = _ragged_case(0, queries=1)
    out, received = attend_owned(q, keys, values, 0.5, None, None, owners, record_from=0)
    for head in range(2):
        k = mx.array(own[head].astype(np.float32))[None, None]
        v = mx.array(vals[head].astype(np.float32))[None, None]
        qh = q[:, head * group:(head + 1) * group]
        want = original_sdpa(qh, k, v, None, scale=0.5, mask=None)
        np.testing.assert_allclose(np.asarray(out[:, head * group:(head + 1) * group]), np.asarray(want), atol=1e-5)
        got = np.asarray(received).reshape(-1)[np.asarray(owners).reshape(-1) == head]
        np.testing.assert_allclose(np.sort(got), np.sort(np.asarray(attention_received(qh, k, 0.5)[0, 0])),
                                   atol=1e-5)


def test_the_largest_attention_per_owned_cell_is_each_heads_own():
    from cortexstream.engine.pooled_heads import Reduce
    from cortexstream.engine.reconstruction import attention_max

    q, keys, values, owners, own, _, group = _ragged_case(2, queries=4)
    _, best = attend_owned(q, keys, values, 0.5, None, None, owners, record_from=0, reduce=Reduce.MAX)
    for head in range(2):
        k = mx.array(own[head].astype(np.float32))[None, None]
        want = np.asarray(attention_max(q[:, head * group:(head + 1) * group], k, 0.5)[0, 0])
        got = np.asarray(best).reshape(-1)[np.asarray(owners).reshape(-1) == head]
        np.testing.assert_allclose(np.sort(got), np.sort(want), atol=1e-6)


def test_owned_cells_with_their_own_columns_are_plain_attention_with_a_causal_mask_and_a_bias():
    rng = np.random.default_rng(3)
    q = mx.array(rng.standard_normal((1, 4, 3, 8)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 9, 8)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 9, 8)).astype(np.float32))
    bias = rng.standard_normal((2, 9)).astype(np.float32)
    out, _ = attend_owned(q, k, v, 0.3, "causal", None, column_owners(2, 9), bias)
    causal = np.where(np.arange(9)[None, :] <= np.arange(6, 9)[:, None], 0.0, -np.inf)
    mask = mx.array((causal[None, None] + np.repeat(bias, 2, axis=0)[None, :, None, :]).astype(np.float32))
    np.testing.assert_allclose(np.asarray(out), np.asarray(original_sdpa(q, k, v, None, scale=0.3, mask=mask)),
                               atol=1e-5)


# --- on the tiny model ------------------------------------------------------------------------------------------
class _MaskedCache(KVCache):
    """mlx-lm's cache whose attention masks, per query head, the positions its KV head did not keep."""

    def __init__(self, allowed: np.ndarray | None = None) -> None:
        super().__init__()
        self.allowed = allowed  # [kv_heads, positions] bool
        if allowed is not None:
            self.attention_hook = self._hook

    def _hook(self, queries, keys, values, scale, mask, sinks):
        heads, num_queries, num_keys = keys.shape[1], queries.shape[2], keys.shape[2]
        group = queries.shape[1] // heads
        allowed = np.ones((heads, num_keys), bool)
        allowed[:, : self.allowed.shape[1]] = self.allowed
        causal = np.arange(num_keys)[None, :] <= np.arange(num_keys - num_queries, num_keys)[:, None]
        full = np.repeat(allowed, group, axis=0)[:, None, :] & causal[None]
        return original_sdpa(queries, keys, values, None, scale=scale,
                             mask=mx.array(np.where(full, 0.0, -np.inf).astype(np.float32))[None], sinks=sinks)


@pytest.mark.parametrize("new_tokens", [1, 5])
def test_compressed_cache_attends_as_the_full_cache_masked_per_head(sharp, new_tokens):
    model, _ = sharp
    prompt, more = random_token_ids(70), random_token_ids(new_tokens, seed=9)
    policy = AdaKV(budget=24, window=4, sinks=2, kernel=3, floor=0.0)
    cache = make_prompt_cache(model)
    state = direct.attach_policy(cache, policy, model)
    state.expect_prompt_end(len(prompt))
    model(mx.array([prompt]), cache=cache)
    direct.apply_policy(cache, 200)
    assert cache[0].size() == policy.budget_tokens(200) == 24  # the arena holds the budget, no more
    assert state.any_pooled()
    kept = [[np.sort(state.positions[layer][state.owners[layer] == head]) for head in range(2)]
            for layer in range(len(cache))]
    assert max(len(k) for layer in kept for k in layer) > 24  # some head keeps more keys than there are slots
    got = model(mx.array([more]), cache=cache)

    reference = [KVCache() for _ in cache]
    model(mx.array([prompt]), cache=reference)
    masked = []
    for layer, ref in enumerate(reference):
        allowed = np.zeros((2, len(prompt)), bool)
        for head in range(2):
            allowed[head, kept[layer][head]] = True
        cell = _MaskedCache(allowed)
        cell.state = ref.state
        masked.append(cell)
    want = model(mx.array([more]), cache=masked)
    full = model(mx.array([more]), cache=reference)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-4)
    assert not np.allclose(np.asarray(want), np.asarray(full), atol=1e-3)  # the masks matter: the test can fail


def test_batched_equals_alone_and_stays_within_the_budget(sharp, monkeypatch):
    model, tokenizer = sharp
    calls = {"decode": 0, "alone": 0}
    original = pooled_state.attend_columns

    def counting(*args, **kwargs):
        calls["decode" if args[6] is not None else "alone"] += 1  # `valid`: a row of the decode batch
        return original(*args, **kwargs)

    monkeypatch.setattr(pooled_state, "attend_columns", counting)
    prompts = [random_token_ids(60, seed=s) for s in range(3)]
    policies = [AdaKV(budget=30, window=8, floor=0.0), AdaKV(budget=0.4, window=4), SnapKV(budget=30, window=8)]
    assert_batched_matches_alone(model, tokenizer, prompts, policies, max_tokens=12, context=72)
    assert calls["decode"] > 0  # pooled rows went through the decode batch's hook


def test_an_equal_split_is_snapkv_token_for_token(sharp):
    """At the prompt's compression an equal split keeps SnapKV's keys. While decoding, a pooled policy compresses
    to `eviction_target` (slack fewer, so not every token rebuilds its layout), so the runs part ways once the cache
    first goes over the budget again: the first two tokens are compared, and with no slack (a budget under 8) all."""
    model, tokenizer = sharp
    prompts = [random_token_ids(60, seed=s) for s in range(2)]
    for budget, tokens in ((24, 2), (7, 10)):
        ada = engine_run(model, tokenizer, prompts, [AdaKV(budget=budget, window=4, floor=1.0)] * 2,
                         max_tokens=tokens, prefill_step_size=256)
        snap = engine_run(model, tokenizer, prompts, [SnapKV(budget=budget, window=4)] * 2, max_tokens=tokens,
                          prefill_step_size=256)
        assert ada[0] == snap[0]
    assert AdaKV().eviction_target(25, 24, 5) == 21 and AdaKV().eviction_target(70, 24, 5) == 24


def int8_run(model, tokenizer, policy, flag, prompt_tokens: int = 60):
    """One prompt on int8 blocks (groups of 32: the model's head dim must be 32): its tokens, and the physical
    slots and `flag(state)` at every step once the prompt is in. Every block is freed at the end."""
    engine = Engine(model, tokenizer, kv_tokens=1024, prefill_step_size=16, kv_dtype="int8", kv_group_size=32)
    rid = engine.add_request(random_token_ids(prompt_tokens), max_tokens=8, kv_policy=policy)
    tokens, physical, flags = [], [], []
    while engine.has_unfinished:
        for out in engine.step():
            tokens += [out.token] if out.token is not None else []
        kv, state = engine.runner.kv_view(rid), engine.runner.policy_view(rid)
        if kv is not None and kv.logical_length >= prompt_tokens:
            physical.append(kv.num_tokens)
            flags.append(flag(state))
    assert engine.arena.allocator.num_used_blocks == 0
    return tokens, physical, flags


def test_on_int8_blocks_the_arena_holds_the_budget(sharp):
    from tiny_models import tiny_model

    model = tiny_model(seed=11, head_dim=32)  # int8 groups of 32 need a head dim of 32
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 4.0
    tokens, physical, pooled = int8_run(model, sharp[1], AdaKV(budget=24, window=4, floor=0.0),
                                        lambda state: state.any_pooled())
    assert len(tokens) == 8 and physical and max(physical) == 24 and any(pooled)


def test_several_ranks_refuse_it():
    from cortexstream.distributed import policy_problem

    assert "pools_heads" in policy_problem(AdaKV())


def assert_perplexity_and_server_take(model, tokenizer, spec: str, bad_spec: str, bad_match: str) -> None:
    """`perplexity` scores with `spec` evicting (not the full cache's value); the server takes it as a request's
    `kv_policy` with n=2 (identical greedy choices) and refuses `bad_spec` with an error matching `bad_match`."""
    from cortexstream.evaluation.perplexity import perplexity
    from server_harness import LiveServer

    text = " ".join(["the river flows past the old mill and the garden"] * 12)
    full = perplexity(model, tokenizer, text, chunk_size=16)
    evicted = perplexity(model, tokenizer, text, spec, chunk_size=16)
    assert np.isfinite(evicted) and evicted != full  # evicted while scoring, not the full cache
    with LiveServer(model, tokenizer, kv_tokens=2048) as live:
        out = live.client().completions.create(model="tiny", prompt=random_token_ids(80), max_tokens=4, n=2,
                                               temperature=0, extra_body={"kv_policy": spec})
        assert [c.text for c in out.choices][0] == out.choices[1].text and out.usage.completion_tokens == 8
        bad = live.client().with_options(max_retries=0)
        with pytest.raises(Exception, match=bad_match):
            bad.completions.create(model="tiny", prompt=random_token_ids(80), max_tokens=2,
                                   extra_body={"kv_policy": bad_spec})


def test_perplexity_and_the_server_take_it(sharp):
    assert_perplexity_and_server_take(*sharp, "adakv:budget=32,window=8,floor=0", "adakv:floor=2", "floor")


def test_kvzip_with_shared_head_budgets(sharp):
    """KVzip's reconstruction scores with the layer's budget shared by its heads: the string form, the arena
    holding the budget while some head keeps more, batched equal to alone, refused on several ranks."""
    from cortexstream.distributed import policy_problem
    from cortexstream.policies import KVzip

    policy = parse_policy("kvzip:budget=24,sinks=2,chunk=16,shared=1,floor=0")
    assert policy == KVzip(budget=24, sinks=2, chunk=16, shared=True, floor=0.0) and policy.pools_heads
    assert parse_policy(policy.describe()) == policy and "shared" not in KVzip().describe()
    assert "pools_heads" in policy_problem(policy) and policy_problem(KVzip()) is None
    model, tokenizer = sharp
    engine = Engine(model, tokenizer, kv_tokens=2048, prefill_step_size=128)  # room for the repeat's prefix
    rid = engine.add_request(random_token_ids(70), max_tokens=6, kv_policy=policy)
    seen = []
    while engine.has_unfinished:
        engine.step()
        kv, state = engine.runner.kv_view(rid), engine.runner.policy_view(rid)
        if state is not None and state.num_evictions:
            seen.append((kv.num_tokens, max(int((o == h).sum()) for o in state.owners for h in range(2))))
    assert seen and seen[0][0] == 24 and all(21 <= slots <= 24 for slots, _ in seen)  # decoding: eviction_target
    assert max(most for _, most in seen) > 24
    prompts = [random_token_ids(50, seed=s) for s in range(2)]
    # (the prompt is held whole while it is reconstructed, so the budget check of assert_batched_matches_alone
    # does not apply)
    batched = engine_run(model, tokenizer, prompts, [policy, policy], max_tokens=8, prefill_step_size=256)
    for i, prompt in enumerate(prompts):
        alone = engine_run(model, tokenizer, [prompt], [policy], max_tokens=8, prefill_step_size=256)
        assert batched[0][i] == alone[0][0]
        np.testing.assert_allclose(batched[1][i], alone[1][0], atol=2e-4)


def test_kvzip_shared_reconstructs_a_later_turn_over_pooled_cells(sharp):
    """Direct path (as `bench retrieval`'s later turn): a document compressed into pooled cells, then a question
    fed and reconstructed over them; its maxima land on the owned cells and the cache is compressed again."""
    from cortexstream.engine.reconstruction_pass import reconstruct
    from cortexstream.engine.reconstruction_prompt import reconstruction_prompt

    model, tokenizer = sharp
    policy = parse_policy("kvzip:budget=24,sinks=2,chunk=32,shared=1,floor=0")
    document, question = random_token_ids(70), random_token_ids(12, seed=4)
    cache = make_prompt_cache(model, max_tokens=200)
    state = direct.attach_policy(cache, policy, model)
    repeat = reconstruction_prompt(tokenizer)
    for end, ids, done in ((70, document, document), (82, question, question)):
        state.expect_prompt_end(end)
        model(mx.array([ids]), cache=cache)
        direct.apply_policy(cache, 200)  # held until the reconstruction ran
        reconstruct(model, cache, done, repeat, 200)
        assert cache[0].size() == 24 and state.any_pooled()
    assert state.reconstruction.num_passes >= 2 and not np.isinf(np.concatenate(state.scores)).any()
