"""The `Compressor` policy running: perplexity path (private, contiguous and paged arenas), engine, generate.

The exact checks use facts that do not depend on the policy's own code: layer-0 keys/values depend only on each
token and its logical position, so the cache after a run must equal [sinks | MLP(windows) | raw tail] of a plain
full-cache run; and scoring after one prefill chunk must equal the training objective's forward over the same
compressed prefix (so training optimises exactly what the runtime does).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import cortexstream
from cortexstream.compression import CompressorConfig, KVCompressor
from cortexstream.training.compression.objective import compress_prefix, layout, logits_of, student_forward
from cortexstream.training.compression.train import merge_fn
from cortexstream.evaluation.perplexity import token_nlls
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies.compressor import Compressor
from test_policies_runtime import engine_run
from tiny_models import random_token_ids


@pytest.fixture(scope="module")
def comp():
    mx.random.seed(5)
    c = KVCompressor(CompressorConfig(num_layers=2, head_dim=16, factor=4, image=False))
    mx.eval(c.parameters())
    return c


def _full_kv(model, ids):
    caches = [KVCache() for _ in model.model.layers]
    model.model(mx.array([ids]), cache=caches)
    return [(c.keys[:, :, : len(ids)], c.values[:, :, : len(ids)]) for c in caches]


def test_scoring_after_a_prefill_equals_the_training_objective(sharp, comp):
    model, _ = sharp
    sinks, recent, prefix, queries = 2, 8, 40, 9
    policy = Compressor(factor=4, weights=comp, sinks=sinks, recent=recent)
    ids = random_token_ids(prefix + queries, seed=3)
    nll = token_nlls(model, ids, policy, chunk_size=prefix)  # one prefill of `prefix` tokens, merge, then the rest
    hidden = student_forward(model, _full_kv(model, ids[:prefix]), mx.array([ids[prefix:-1]]), merge_fn(comp),
                             sinks=sinks, recent=recent, factor=4)
    logits = logits_of(model, hidden)[0].astype(mx.float32)
    targets = mx.array(ids[prefix + 1:])[:, None]
    want = np.array(mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, targets, axis=-1)[:, 0])
    np.testing.assert_allclose(nll[prefix:], want, atol=1e-4)
    full = token_nlls(model, ids, None)
    np.testing.assert_allclose(nll[:prefix], full[:prefix], atol=1e-4)  # nothing merged before the first pass ended
    assert np.abs(nll[prefix:] - full[prefix:]).max() > 1e-3  # the merged prefix really changed the predictions


@pytest.mark.parametrize("arena_kind", ["private", "contiguous", "paged"])
def test_layer0_cache_is_sinks_merged_windows_and_raw_tail(sharp, comp, arena_kind):
    model, _ = sharp
    sinks, recent, n = 3, 8, 100
    policy = Compressor(factor=4, weights=comp, sinks=sinks, recent=recent)
    ids = random_token_ids(n, seed=4)
    budget = policy.budget_tokens(n)
    arena, cache = None, None
    if arena_kind != "private":
        arena = KVArena(ArenaConfig.for_model(model, num_tokens=256, block_size=4))
        cache = make_prompt_cache(model, arena=arena, contiguous=arena_kind == "contiguous")
    seen = []

    def on_chunk(stop, c):
        seen.append((c[0].size(), c[0].offset, arena.allocator.num_used_blocks if arena else 0))

    nll = token_nlls(model, ids, policy, chunk_size=1, prompt_cache=cache, on_chunk=on_chunk)
    assert np.isfinite(nll).all()
    assert max(size for size, _, _ in seen) <= budget < n - 1
    assert [offset for _, offset, _ in seen] == list(range(1, n))  # positions continue from the logical length
    if arena is not None:  # merged-away slots give their blocks back as the text grows
        assert seen[-1][2] <= -(-(budget + 1) // 4) < -(-(n - 1) // 4)
    (k0, v0) = _full_kv(model, ids[:-1])[0]
    start, end = layout(n - 1, sinks, recent, 4)
    want_k, want_v, _ = compress_prefix(k0, v0, 0, merge_fn(comp), sinks=sinks, recent=recent, factor=4)
    got_k, got_v = cache[0].state if cache is not None else (None, None)
    if cache is None:  # the private cache is internal to token_nlls: rebuild it the same way to inspect it
        cache = make_prompt_cache(model, max_tokens=policy.max_physical_tokens(n, 1))
        token_nlls(model, ids, policy, chunk_size=1, prompt_cache=cache)
        got_k, got_v = cache[0].state
    assert got_k.shape[2] == sinks + (end - start) // 4 + (n - 1 - end)
    np.testing.assert_allclose(np.array(got_k), np.array(want_k), atol=1e-5)
    np.testing.assert_allclose(np.array(got_v), np.array(want_v), atol=1e-5)


def test_engine_and_generate_with_a_weights_file(sharp, comp, tmp_path):
    model, tokenizer = sharp
    path = str(tmp_path / "c.safetensors")
    comp.save(path)
    spec = f"compressor:factor=4,sinks=2,recent=6,weights={path}"
    prompts = [random_token_ids(70, seed=s) for s in range(2)]
    tokens, logprobs, physical, engine = engine_run(model, tokenizer, prompts, [spec, None], max_tokens=16,
                                                    prefill_step_size=16)
    budget = Compressor(factor=4, weights=path, sinks=2, recent=6).budget_tokens(70 + 16)
    assert max(p for p, _ in physical[0]) <= budget and min(p for p, _ in physical[0]) < 40
    alone, alone_logprobs, _, engine = engine_run(model, tokenizer, prompts[:1], [spec], max_tokens=16,
                                             prefill_step_size=16)
    assert tokens[0] == alone[0]  # batched decode with a merging row equals the request alone
    np.testing.assert_allclose(logprobs[0], alone_logprobs[0], atol=1e-4)
    # a merging request's blocks are all freed when it finishes (a plain one's may stay in the prefix cache)
    assert engine.arena.allocator.num_used_blocks == 0
    text = cortexstream.generate(model, tokenizer, prompts[0], max_tokens=8, kv_policy=spec)
    assert isinstance(text, str)
