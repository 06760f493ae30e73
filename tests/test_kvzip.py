"""KVzip: the policy object (string form, bad arguments, exactly `budget` per head), the reconstruction scores
against a plain mlx-lm forward, a constructed case where the maximum (KVzip) keeps what the sum (H2O) drops, the
reconstruction prompt, the direct path on a prompt cache, and the places it cannot run refusing it by name (the
policy running in the engine: tests/test_kvzip_engine.py)."""

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
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.answering import feed_chunks
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import H2O, KVzip, parse_policy
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


def test_a_prefill_step_too_small_for_the_prefix_is_refused_by_name(sharp):
    model, tokenizer = sharp
    engine = Engine(model, tokenizer, kv_tokens=1024, prefill_step_size=16)
    assert len(reconstruction_prompt(tokenizer).prefix) >= 16
    with pytest.raises(InvalidArgumentError, match="prefill_step_size 16"):
        engine.add_request(random_token_ids(40), max_tokens=2, kv_policy="kvzip:budget=8")
