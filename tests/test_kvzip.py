"""KVzip: the policy object (string form, bad arguments, exactly `budget` per head), the reconstruction scores
against a plain mlx-lm forward, a constructed case where the maximum (KVzip) keeps what the sum (H2O) drops, the
reconstruction prompt, and the policy in the engine: scoring chunks planned as steps leave the sequence, its blocks
and the prefix cache as if they never ran, a budget that keeps everything gives the full cache's tokens exactly,
batched equals alone, and the places it cannot run refuse it by name."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

from cortexstream.engine.attention_hook import attention_received, original_sdpa
from cortexstream.engine.engine import Engine
from cortexstream.engine.policy_prompt_cache import make_policy_cache, policy_state_of
from cortexstream.engine.reconstruction import attend_and_max, attention_max
from cortexstream.engine.reconstruction_pass import reconstruct, score_pass
from cortexstream.engine.reconstruction_prompt import PLAIN_PREFIX, REQUEST, reconstruction_prompt
from cortexstream.engine.step_plan import WorkKind
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.answering import feed_chunks
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import H2O, KVzip, parse_policy
from test_policies_runtime import engine_run
from tiny_models import random_token_ids


# --- the policy object ------------------------------------------------------------------------------------------
def test_string_forms_and_bad_parameters():
    assert parse_policy("kvzip:budget=0.33,sinks=2,chunk=128") == KVzip(budget=0.33, sinks=2, chunk=128)
    assert parse_policy("kvzip") == KVzip()
    assert parse_policy("kvzip:kernel=7") == KVzip(kernel=7)
    policy = KVzip(budget=64, chunk=32)
    assert parse_policy(policy.describe()) == policy
    for spec, words in [("kvzip:chunk=0", "chunk"), ("kvzip:budget=3", "budget 3"), ("kvzip:budget=1.5", "fraction"),
                        ("kvzip:sinks=-1", "sinks"), ("kvzip:windw=3", "windw"), ("kvzip:chunk=2.5", "chunk"),
                        ("kvzip:kernel=4", "kernel 4 must be odd"), ("kvzip:kernel=0", "kernel")]:
        with pytest.raises(InvalidArgumentError, match=words):
            parse_policy(spec)


def test_select_keeps_exactly_the_budget_per_head_sinks_then_the_highest_scores():
    rng = np.random.default_rng(0)
    scores = rng.random((2, 3, 50))
    scores[1, 2, 40:] = np.inf  # slots no reconstruction scored yet come first
    policy = KVzip(budget=12, sinks=2)
    keep = policy.select(50, 1000, scores)
    assert keep.shape == (2, 3, 12)
    for layer in range(2):
        for head in range(3):
            want = sorted([0, 1] + (np.argsort(-scores[layer, head, 2:], kind="stable")[:10] + 2).tolist())
            assert keep[layer, head].tolist() == want
    assert keep[1, 2].tolist() == [0, 1] + list(range(40, 50))
    assert policy.select(12, 1000, scores[..., :12]) is None  # within budget: nothing to do
    assert policy.max_physical_tokens(1000, 16, prompt_tokens=900) == 916  # the prompt is held until repeated


def test_kernel_keeps_the_neighbours_of_a_peak_and_does_not_spread_unscored_slots():
    """With kernel=5 a single high score keeps the two keys either side of it, where kernel=1 keeps only the peak
    and the next highest scattered keys; a fresh (+inf) slot is kept but does not lift its neighbours."""
    scores = np.full((1, 1, 40), 0.1)
    scores[0, 0, [7, 23, 31]] = [0.2, 0.3, 0.25]  # scattered runners-up
    scores[0, 0, 15] = 1.0  # the peak
    scores[0, 0, 39] = np.inf
    plain = KVzip(budget=6, sinks=1).select(40, 1000, scores)[0, 0].tolist()
    pooled = KVzip(budget=6, sinks=1, kernel=5).select(40, 1000, scores)[0, 0].tolist()
    assert plain == [0, 7, 15, 23, 31, 39]
    assert pooled == [0, 13, 14, 15, 16, 39]  # ties among the peak's window broken by position (stable)


# --- scores: the maximum over reconstruction queries ------------------------------------------------------------
def test_scores_equal_max_attention_of_the_reconstruction_queries_in_a_plain_forward(sharp):
    """The policy cache's scores after one reconstruction pass equal a numpy computation from the queries and keys
    a plain mlx-lm KVCache forward of the same tokens attends with."""
    model, tokenizer = sharp
    prompt, repeat = random_token_ids(40, seed=1), reconstruction_prompt(tokenizer).chunk_tokens(random_token_ids(40, seed=1)[:12])
    cache = make_policy_cache(model, KVzip(budget=10, sinks=1))
    state = policy_state_of(cache)
    state.expect_prompt_end(40)
    feed_chunks(model, cache, prompt, 40, 100)
    score_pass(model, cache[0].sequence, state, repeat)
    assert cache[0].sequence.num_tokens == 40 and cache[0].sequence.logical_length == 40  # rolled back

    plain = mlx_lm_cache(model)
    mx.eval(model(mx.array(prompt, dtype=mx.uint32)[None], cache=plain))
    seen = {}
    for layer, c in enumerate(plain):
        def hook(q, k, v, scale, mask, sinks, layer=layer, c=c):
            seen[layer] = (np.array(q.astype(mx.float32)), np.array(k.astype(mx.float32)), scale)
            return original_sdpa(q, k, v, c, scale=scale, mask=mask, sinks=sinks)
        c.attention_hook = hook
    mx.eval(model(mx.array(repeat, dtype=mx.uint32)[None], cache=plain))
    for layer, (q, k, scale) in seen.items():
        q, k = q[0], k[0]  # [Hq, m, D], [H, 40 + m, D]
        heads, m, keys = k.shape[0], q.shape[1], k.shape[1]
        logits = np.einsum("hmd,hkd->hmk", q, np.repeat(k, q.shape[0] // heads, axis=0)) * scale
        logits[:, np.arange(keys)[None, :] > 40 + np.arange(m)[:, None]] = -np.inf  # causal, after the context
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        want = probs.reshape(heads, -1, keys)[:, :, :40].max(axis=1)
        np.testing.assert_allclose(state.scores[layer], want, rtol=2e-3, atol=2e-5)
    assert len(seen) == len(cache)


@pytest.mark.parametrize("mask", [None, "causal", "array"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_one_computation_gives_the_sdpa_output_and_the_maxima(mask, with_sinks):
    """A pass's attention output from the scoring probabilities equals the model's SDPA (GQA, 3 query blocks, a
    causal, boolean or no mask, learned sinks or none), and its maxima equal `attention_max`'s."""
    rng = np.random.default_rng(3)
    queries = mx.array(rng.normal(size=(1, 6, 300, 16)).astype(np.float32))
    keys = mx.array(rng.normal(size=(1, 2, 340, 16)).astype(np.float32))
    values = mx.array(rng.normal(size=(1, 2, 340, 16)).astype(np.float32))
    if mask == "array":
        mask = mx.array(rng.random((300, 340)) > 0.3)
    sinks = mx.array(rng.normal(size=(6,)).astype(np.float32)) if with_sinks else None
    out, best = attend_and_max(queries, keys, values, 0.25, mask, sinks)
    want = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.25, mask=mask, sinks=sinks)
    np.testing.assert_allclose(np.array(out), np.array(want), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.array(best), np.array(attention_max(queries, keys, 0.25, mask, sinks)))
    assert out.dtype == queries.dtype and out.shape == (1, 6, 300, 16)


def test_maximum_keeps_the_key_one_query_needs_where_the_sum_keeps_the_hubs():
    """One head, orthonormal keys. 200 reconstruction queries each spread over 20 hub keys, one query looks hard at
    a planted key. Summed (H2O) the hubs win; by the maximum (KVzip) the planted key stands out."""
    n, dim, planted = 240, 256, 150
    keys = mx.array(np.eye(n, dim, dtype=np.float32)[None, None])
    eye = np.eye(n, dim, dtype=np.float32)
    hubs = list(range(20, 40))
    spread = 3.0 * eye[hubs].sum(axis=0)
    queries = np.stack([spread] * 200 + [10.0 * eye[planted]])[None, None]
    queries = mx.array(queries)
    budget = 16
    by_max = np.asarray(attention_max(queries, keys, 1.0)[0])[None]
    by_sum = np.asarray(attention_received(queries, keys, 1.0)[0])[None]
    kvzip = KVzip(budget=budget, sinks=4).select(n, n, by_max)
    h2o = H2O(budget=budget, sinks=4, recent=0).select(n, n, by_sum)
    assert planted in kvzip[0, 0].tolist()
    assert planted not in h2o[0, 0].tolist()
    assert set(h2o[0, 0, 4:].tolist()) <= set(hubs)


def test_the_reconstruction_prompt():
    class Plain:
        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    assert reconstruction_prompt(Plain()).prefix == tuple(ord(c) for c in PLAIN_PREFIX)

    class Chat(Plain):
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
            text = "<s>[system]" + "".join(f"[{m['role']}]{m['content']}[end]" for m in messages)
            return text + ("[assistant]" if add_generation_prompt else "")

    assert reconstruction_prompt(Chat()).prefix == tuple(ord(c) for c in f"[user]{REQUEST}[end][assistant]")


# --- in the engine ------------------------------------------------------------------------------------------------
def run(engine, rid):
    """Step to the end; per step: (plan's score items of rid, seq counters, table length, blocks used, cached)."""
    plans, rows, tokens = [], [], []
    engine.plan_listener = plans.append
    while engine.has_unfinished:
        tokens += [out.token for out in engine.step() if out.token is not None and out.request_id == rid]
        seq = engine.scheduler.lookup(rid)
        items = [item for item in plans[-1].score if item.request_id == rid]
        if seq is not None:
            rows.append((items, seq.num_computed, seq.num_physical, tuple(seq.all_ids), len(seq.block_table),
                         engine.arena.allocator.num_used_blocks, engine.block_manager.num_cached_blocks))
    return rows, tokens, plans


def test_scoring_chunks_leave_the_sequence_and_its_blocks_as_if_they_never_ran(sharp):
    model, tokenizer = sharp
    engine = Engine(model, tokenizer, kv_tokens=4096, prefill_step_size=96)
    engine.add_request(random_token_ids(64, seed=5), max_tokens=1)  # a full-cache neighbour: its blocks cached
    policy = KVzip(budget=40, sinks=4, chunk=24)
    rid = engine.add_request(random_token_ids(100), max_tokens=6, kv_policy=policy)
    rows, tokens, plans = run(engine, rid)
    scoring = [r for r in rows if r[0]]
    prefix = reconstruction_prompt(tokenizer).prefix
    assert len(scoring) == -(-100 // 24)  # one item per step, chunk tokens of the context each
    assert all(item.kind is WorkKind.SCORE and item.token_ids[: len(prefix)] == prefix for r in scoring for item in r[0])
    assert [r[0][0].compress for r in scoring] == [False] * (len(scoring) - 1) + [True]
    before = rows[rows.index(scoring[0]) - 1]
    for items, computed, physical, ids, table, used, cached in scoring[:-1]:
        assert (computed, physical, ids) == before[1:4]  # the sequence's tokens and counters did not move
        assert table == -(-physical // 16) and used == before[5] and cached == before[6]  # surplus blocks freed
    last = scoring[-1]
    assert last[2] == policy.budget_tokens(106) and last[4] == -(-last[2] // 16)  # compressed, blocks freed
    assert all(not p.decode or all(i.request_id != rid for i in p.decode) for p in plans if p.score)
    assert len(tokens) == 6 and engine.arena.allocator.num_used_blocks == engine.block_manager.num_cached_blocks


def test_per_head_budget_after_compression_and_no_prefix_cache_for_the_scoring_tokens(sharp):
    model, tokenizer = sharp
    engine = Engine(model, tokenizer, kv_tokens=4096, prefill_step_size=128)
    prompt = random_token_ids(90, seed=2)
    engine.add_request(prompt, max_tokens=2)
    while engine.has_unfinished:
        engine.step()
    cached = engine.block_manager.num_cached_blocks
    assert cached > 0
    policy = KVzip(budget=30, chunk=64)
    rid = engine.add_request(prompt, max_tokens=3, kv_policy=policy)
    seen = []
    while engine.has_unfinished:
        engine.step()
        seq, state = engine.scheduler.lookup(rid), engine.runner.policy_view(rid)
        if seq is not None:
            assert seq.num_cached_prefix == 0  # an evicting policy takes no prefix-cache hits
        if state is not None and state.reconstruction.scored_end:
            seen.append([p.shape for p in state.positions])
    budget = policy.budget_tokens(93)
    low = policy.eviction_target(budget + 1, budget, 0)  # decoding evicts `slack` below the budget at a time
    assert seen and seen[0][0] == (tokenizer_heads(engine), budget)
    assert all(shape[0] == tokenizer_heads(engine) and low <= shape[1] <= budget for s in seen for shape in s)
    assert engine.block_manager.num_cached_blocks == cached  # nothing registered, nothing lost


def tokenizer_heads(engine):
    return engine.arena.config.num_kv_heads


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_budget_that_keeps_everything_gives_the_full_caches_tokens(sharp, temperature):
    """The scoring passes run (their KV written and rolled back, their logits discarded, the sampler untouched), but
    nothing is evicted: tokens and logprobs equal the run without a policy."""
    model, tokenizer = sharp
    prompt = random_token_ids(70, seed=3)
    outs = []
    for policy in (None, KVzip(budget=200, chunk=32)):
        engine = Engine(model, tokenizer, kv_tokens=2048, prefill_step_size=128, mixed_prefill=False)
        rid = engine.add_request(prompt, max_tokens=10, kv_policy=policy, temperature=temperature, seed=7)
        tokens, logprobs, passes = [], [], 0
        while engine.has_unfinished:
            for out in engine.step():
                if out.token is not None:
                    tokens.append(out.token)
                    logprobs.append(np.array(out.logprobs))
            state = engine.runner.policy_view(rid)
            passes = max(passes, state.reconstruction.num_passes if state is not None else 0)
        outs.append((tokens, np.stack(logprobs), passes))
    assert outs[1][2] == 3 and outs[0][2] == 0
    assert outs[0][0] == outs[1][0]
    np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-5)


def test_batched_equals_alone(sharp):
    """Greedy tokens and logprobs of each request in one run with the others equal its run alone (the scoring
    chunks of two KVzip requests share steps with each other and with a decoding full-cache request); once
    compressed, each stays at its budget."""
    model, tokenizer = sharp
    prompts = [random_token_ids(60, seed=s) for s in range(3)]
    policies = [KVzip(budget=30, chunk=32), KVzip(budget=0.4, sinks=2, chunk=64), None]
    tokens, logprobs, physical, _ = engine_run(model, tokenizer, prompts, policies, max_tokens=12,
                                               prefill_step_size=256)
    for i, (prompt, policy) in enumerate(zip(prompts, policies)):
        alone_tokens, alone_logprobs, _, _ = engine_run(model, tokenizer, [prompt], [policy], max_tokens=12,
                                                        prefill_step_size=256)
        assert tokens[i] == alone_tokens[0] and len(tokens[i]) == 12, policy
        np.testing.assert_allclose(logprobs[i], alone_logprobs[0], atol=2e-4)
        if policy is not None:
            held = [p for p, _ in physical[i]]
            budget = policy.budget_tokens(72)
            low = policy.eviction_target(budget + 1, budget, 0)
            assert held[0] == 60 and budget in held and low <= held[-1] <= budget, held  # whole, then compressed


# --- the direct path and the places that refuse it ----------------------------------------------------------------
def test_direct_path_holds_the_prompt_until_it_is_repeated(sharp):
    model, tokenizer = sharp
    policy = KVzip(budget=30, chunk=16)
    cache = make_policy_cache(model, policy)
    state = policy_state_of(cache)
    ids = random_token_ids(80)
    state.expect_prompt_end(80)
    feed_chunks(model, cache, ids, 16, 100)
    assert cache[0].size() == 80  # nothing evicted before the reconstruction
    assert reconstruct(model, cache, ids, reconstruction_prompt(tokenizer), 100) == 50
    assert cache[0].size() == 30 and cache[0].offset == 80 and state.reconstruction.num_passes == 5
    with pytest.raises(InvalidArgumentError, match="chunk"):
        reconstruct(model, cache, ids, reconstruction_prompt(tokenizer), 100, chunk=0)


def test_refused_where_no_reconstruction_can_run(sharp):
    from cortexstream.evaluation.perplexity import perplexity, token_nlls

    model, tokenizer = sharp
    with pytest.raises(InvalidArgumentError, match="kvzip.*perplexity"):
        token_nlls(model, random_token_ids(20), "kvzip:budget=8")
    with pytest.raises(InvalidArgumentError, match="kvzip.*perplexity"):
        perplexity(model, tokenizer, "some text to score, long enough", "kvzip:budget=8")
    engine = Engine(model, tokenizer, kv_tokens=1024)
    with pytest.raises(InvalidArgumentError, match="kvzip.*prompt_cache"):
        engine.add_request(random_token_ids(10), max_tokens=2, kv_policy="kvzip:budget=8",
                           prompt_cache=make_prompt_cache(model))


def test_an_arena_without_room_for_the_reconstruction_pass_rejects_the_request_by_name(sharp):
    """The scoring pass sits after the prompt, beyond the request's own tokens: an arena that holds prompt +
    max_tokens but not prompt + a pass rejects the request at once with the reason (it used to wait for room that
    never came, stepping forever), and an arena with room runs it."""
    model, tokenizer = sharp
    prompt = random_token_ids(100, seed=4)
    engine = Engine(model, tokenizer, kv_tokens=144, block_size=16, prefill_step_size=64)
    rid = engine.add_request(prompt, max_tokens=2, kv_policy=KVzip(budget=30, chunk=32))
    outs = []
    for _ in range(20):
        outs += engine.step()
        if not engine.has_unfinished:
            break
    assert not engine.has_unfinished
    (last,) = [o for o in outs if o.request_id == rid and o.finish_reason is not None]
    assert last.finish_reason.value == "rejected" and "repeats the prompt" in last.error
    engine.close()
    plan_tokens = len(reconstruction_prompt(tokenizer).prefix) + 32
    roomy = Engine(model, tokenizer, kv_tokens=16 * (-(-(100 + plan_tokens) // 16)), block_size=16,
                   prefill_step_size=64)
    roomy.add_request(prompt, max_tokens=2, kv_policy=KVzip(budget=30, chunk=32))
    tokens = []
    for _ in range(40):
        tokens += [o.token for o in roomy.step() if o.token is not None]
        if not roomy.has_unfinished:
            break
    assert len(tokens) == 2 and not roomy.has_unfinished
    roomy.close()


def test_a_private_engine_is_sized_for_the_reconstruction_pass(sharp):
    from cortexstream.engine.sizing import job_kv_tokens
    from cortexstream.generation.stream import generate
    from cortexstream.policies import FullCache

    assert job_kv_tokens([(100, 2, KVzip(budget=30, chunk=32))], 16, 64) >= 100 + 64  # the prompt and a pass
    assert job_kv_tokens([(100, 2, FullCache())], 16, 64) == 16 * (7 + 1)  # its text in blocks, + one
    model, tokenizer = sharp
    text = generate(model, tokenizer, random_token_ids(100, seed=5), max_tokens=2, kv_policy="kvzip:budget=30",
                    prefill_step_size=64)
    assert isinstance(text, str)


def test_forked_completions_and_a_preempted_request_each_reconstruct(sharp):
    """n > 1 completions fork before the prompt's last token: every child repeats its context and is compressed.
    A request preempted mid-reconstruction is recomputed and reconstructs from the start."""
    from cortexstream.engine.sampling import SamplingParams

    model, tokenizer = sharp
    policy = KVzip(budget=24, chunk=32)
    engine = Engine(model, tokenizer, kv_tokens=2048, prefill_step_size=128)
    engine.fork(random_token_ids(50), SamplingParams(max_tokens=4), ["a", "b", "c"], kv_policy=policy)
    finals = {}
    while engine.has_unfinished:
        engine.step()
        for rid in "abc":
            state = engine.runner.policy_view(rid)
            if state is not None:
                finals[rid] = (state.reconstruction.num_passes, state.num_tokens)
    budget = policy.budget_tokens(54)
    low = policy.eviction_target(budget + 1, budget, 0)
    assert set(finals) == set("abc") and all(passes == 2 and low <= n <= budget for passes, n in finals.values())

    engine = Engine(model, tokenizer, kv_tokens=2048, prefill_step_size=128)
    rid = engine.add_request(random_token_ids(50), max_tokens=4, kv_policy=policy)
    while not engine.scheduler.running or engine.scheduler.running[0].reconstruction.num_items == 0:
        engine.step()
    seq = engine.scheduler.running[0]
    engine.scheduler._preempt(seq)  # noqa: SLF001 - what the scheduler does when a decode needs the blocks
    assert seq.reconstruction.scored == 0 and not seq.reconstruction.done
    physical = []
    while engine.has_unfinished:
        engine.step()
        state = engine.runner.policy_view(rid)
        if state is not None and state.reconstruction.scored_end:
            physical.append(state.num_tokens)
    assert len(seq.output_ids) == 4 and seq.reconstruction.done and seq.num_preemptions == 1
    # recomputed, reconstructed, compressed (then slack below the budget while decoding)
    assert physical and physical[0] == budget and all(low <= n <= budget for n in physical)


def test_the_server_takes_kvzip_as_a_request_policy(sharp):
    from server_harness import LiveServer

    model, tokenizer = sharp
    with LiveServer(model, tokenizer, kv_tokens=2048) as live:
        # greedy: a sampled reply may end early on an end-of-text token
        out = live.client().completions.create(model="tiny", prompt=random_token_ids(80), max_tokens=4,
                                               temperature=0.0, extra_body={"kv_policy": "kvzip:budget=32,chunk=40"})
        assert out.usage.completion_tokens == 4
        bad = live.client().with_options(max_retries=0)
        with pytest.raises(Exception, match="chunk"):
            bad.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"kv_policy": "kvzip:chunk=0"})


def test_a_prefill_step_too_small_for_the_prefix_is_refused_by_name(sharp):
    model, tokenizer = sharp
    engine = Engine(model, tokenizer, kv_tokens=1024, prefill_step_size=16)
    assert len(reconstruction_prompt(tokenizer).prefix) >= 16
    with pytest.raises(InvalidArgumentError, match="prefill_step_size 16"):
        engine.add_request(random_token_ids(40), max_tokens=2, kv_policy="kvzip:budget=8")
