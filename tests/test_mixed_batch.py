"""Prefill chunks packed into the decode forward (engine/mixed_batch.py): outputs equal each prompt alone, with
ragged chunks, several chunks in one pass, prefix-cache hits, every decode strategy, and policies kept apart."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.engine import batch_attention as ba
from cortexstream.engine.chunk_budget import AdaptivePrefillBudget
from cortexstream.engine.engine import Engine

from test_engine import alone, collect, random_prompts, run_all


def record_mixed(engine: Engine) -> list[tuple[int, list[int]]]:
    """(decode rows, chunk sizes) of every mixed forward the runner makes."""
    calls: list[tuple[int, list[int]]] = []
    original = engine.runner._mixed

    def spy(items, tokens, chunks):
        calls.append((len(items), [len(c.token_ids) for c in chunks]))
        return original(items, tokens, chunks)

    engine.runner._mixed = spy
    return calls


def record_logits(engine: Engine) -> dict[str, np.ndarray]:
    """The logits each request's sampler is given, by request id (the last ones)."""
    drawn: dict[str, np.ndarray] = {}
    original = engine.runner._draw

    def spy(item, logits, out):
        drawn[item.request_id] = np.array(logits)
        return original(item, logits, out)

    engine.runner._draw = spy
    return drawn


def run_with_arrivals(engine: Engine, first: list[list[int]], later: list[list[int]], n: int) -> dict[str, dict]:
    """`first` start alone; `later` arrive once every first request has its first token."""
    ids = [engine.add_request(p, max_tokens=n) for p in first]
    results: dict[str, dict] = {}
    while not all(results.get(i, {}).get("tokens") for i in ids):
        collect(engine.step(), results)
    ids += [engine.add_request(p, max_tokens=n) for p in later]
    run_all(engine, results)
    return {"ids": ids, "results": results}


@pytest.mark.parametrize("pipeline", [True, False])
def test_chunks_ride_in_the_decode_pass_and_outputs_match_alone(tiny, pipeline):
    model, tokenizer = tiny
    first, later = random_prompts(3, seed=31, low=8, high=30), random_prompts(3, seed=32, low=20, high=70)
    expected = [alone(model, tokenizer, p, 12) for p in first + later]
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefix_caching=False, prefill_step_size=32,
                    prefill_tokens_while_decoding=6, pipeline=pipeline)
    calls = record_mixed(engine)
    run = run_with_arrivals(engine, first, later, 12)
    assert [run["results"][i]["tokens"] for i in run["ids"]] == expected
    assert calls and any(len(chunks) > 1 for _, chunks in calls)  # several prompts' chunks in one pass
    assert any(len(set(chunks)) > 1 or chunks[0] != 6 for _, chunks in calls)  # ragged: a prompt's last chunk
    assert engine.num_prompt_tokens_computed == sum(len(p) for p in first + later)
    assert engine.arena.allocator.num_used_blocks == 0


def test_mixed_and_separate_passes_give_the_same_logits(tiny):
    """The packed pass computes what separate decode and prefill passes compute (to float rounding)."""
    model, tokenizer = tiny
    first, later = random_prompts(2, seed=33, low=10, high=20), random_prompts(2, seed=34, low=15, high=40)
    logits = {}
    for mixed in (False, True):
        engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4, prefix_caching=False, pipeline=False,
                        prefill_tokens_while_decoding=1000, mixed_prefill=mixed)
        for i, p in enumerate(first):
            engine.add_request(p, max_tokens=5, request_id=f"first-{i}")
        engine.step()  # both first prompts prefilled, first tokens out
        for i, p in enumerate(later):
            engine.add_request(p, max_tokens=5, request_id=f"later-{i}")
        drawn = record_logits(engine)
        plan, _ = engine.scheduler.schedule()
        assert len(plan.decode) == 2 and [len(i.token_ids) for i in plan.prefill] == [len(p) for p in later]
        engine.runner.execute(plan)
        logits[mixed] = [drawn[rid] for rid in ("first-0", "first-1", "later-0", "later-1")]
    for a, b in zip(logits[False], logits[True]):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("strategy", [ba.BLOCKS, ba.PER_SEQUENCE, ba.GATHER, ba.STRIDED])
def test_every_decode_strategy_mixes(tiny, monkeypatch, strategy):
    model, tokenizer = tiny
    first, later = random_prompts(2, seed=35, low=12, high=13), random_prompts(2, seed=36, low=30, high=50)
    expected = [alone(model, tokenizer, p, 10) for p in first + later]
    monkeypatch.setenv(ba.ENV_VAR, strategy)
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefix_caching=False,
                    prefill_tokens_while_decoding=8)
    calls = record_mixed(engine)
    run = run_with_arrivals(engine, first, later, 10)
    assert [run["results"][i]["tokens"] for i in run["ids"]] == expected and calls


def test_a_chunk_after_a_prefix_cache_hit_reads_the_shared_blocks(tiny):
    model, tokenizer = tiny
    prefix = random_prompts(1, seed=37, low=32, high=33)[0]
    first = random_prompts(2, seed=38, low=10, high=20)
    later = [prefix + t for t in random_prompts(2, seed=39, low=9, high=14)]
    expected = [alone(model, tokenizer, p, 8) for p in first + later]
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefill_tokens_while_decoding=4)
    engine.add_request(prefix + [7], max_tokens=1)  # puts the prefix in the cache
    run_all(engine)
    calls = record_mixed(engine)
    run = run_with_arrivals(engine, first, later, 8)
    assert [run["results"][i]["tokens"] for i in run["ids"]] == expected and calls
    assert engine.block_manager.num_prefix_hits >= 2 * 8


def test_evicting_policies_keep_their_own_passes(tiny):
    model, tokenizer = tiny
    first, later = random_prompts(2, seed=40, low=30, high=40), random_prompts(2, seed=41, low=30, high=40)
    policy = "streaming:window=24,sinks=4"
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefill_tokens_while_decoding=8)
    calls = record_mixed(engine)
    ids = [engine.add_request(p, max_tokens=10, kv_policy=policy) for p in first]
    while not engine.scheduler.running or any(s.num_pending > 1 for s in engine.scheduler.running):
        engine.step()
    ids += [engine.add_request(p, max_tokens=10) for p in later]
    results = run_all(engine)
    assert all(results[i]["tokens"] for i in ids[2:])
    assert not calls  # a decode row with an evicting policy: its policy acts between its own passes


def test_adaptive_budget_uses_the_mixed_cost_of_a_token():
    budget = AdaptivePrefillBudget(max_tokens=512, ratio=1.0, min_tokens=16, smoothing=1.0)
    budget.observe(prefill_tokens=20, prefill_seconds=0.12, decode_seconds=0.1)  # 6 ms a token in its own pass
    assert budget.tokens() == budget.tokens(mixed=True) == 16  # no mixed pass measured yet: the floor
    budget.observe_mixed(prefill_tokens=25, step_seconds=0.15)  # 50 ms beyond a decode step: 2 ms a token
    assert budget.tokens(mixed=True) == 50 and budget.tokens() == 16
    assert budget.decode_seconds == 0.1  # a mixed pass is not a decode step


@pytest.mark.parametrize("q_heads,kv_heads", [(9, 3), (4, 4), (8, 2)])
def test_chunk_attention_equals_the_fused_causal_call(q_heads, kv_heads):
    """The folded grouped-query path (small chunks on the CPU) gives the fused SDPA's output to float rounding (BLAS
    may sum in another order for a different row count), also over a strided view of a larger buffer, as the arena
    hands it out; above FOLD_MAX_TOKENS it is the fused call."""
    import mlx.core as mx

    from cortexstream.engine.mixed_batch import FOLD_MAX_TOKENS, chunk_attention

    rng = np.random.default_rng(q_heads * 10 + kv_heads)
    buffer = mx.array(rng.standard_normal((1, kv_heads, 700, 64)).astype(np.float32))
    for n in range(1, FOLD_MAX_TOKENS + 2):
        for length in (n, 37, 300):
            keys, values = buffer[:, :, 100 : 100 + length], buffer[:, :, 400 : 400 + length]
            queries = mx.array(rng.standard_normal((1, q_heads, n, 64)).astype(np.float32))
            fused = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask="causal")
            folded = chunk_attention(queries, keys, values, 0.125)
            assert folded.shape == fused.shape
            if n > FOLD_MAX_TOKENS:
                assert mx.array_equal(folded, fused).item()
            np.testing.assert_allclose(np.array(folded), np.array(fused), atol=2e-6, rtol=1e-5, err_msg=f"{n} {length}")


def test_floor_size_chunks_match_alone(tiny):
    """Chunks of at most FOLD_MAX_TOKENS (the folded attention) riding in decode passes: outputs equal alone."""
    model, tokenizer = tiny
    first, later = random_prompts(3, seed=35, low=8, high=20), random_prompts(1, seed=36, low=30, high=60)
    expected = [alone(model, tokenizer, p, 10) for p in first + later]
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefix_caching=False, prefill_step_size=32,
                    prefill_tokens_while_decoding=3)
    calls = record_mixed(engine)
    run = run_with_arrivals(engine, first, later, 10)
    assert [run["results"][i]["tokens"] for i in run["ids"]] == expected
    assert calls and all(max(chunks) <= 3 for _, chunks in calls)
    assert engine.arena.allocator.num_used_blocks == 0
