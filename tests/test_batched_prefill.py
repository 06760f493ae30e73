"""Batched prefill, shared-prefix admission and the prefill budget while decoding: outputs equal each prompt alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cortexstream.engine.engine import Engine
from cortexstream.engine.scheduler import SchedulerConfig

from test_engine import alone, collect, random_prompts, run_all
from test_mixed_batch import record_logits


def record_groups(engine: Engine, monkeypatch) -> list[list[int]]:
    """Chunk sizes of every prefill forward pass the runner makes (`engine` is the one whose passes count: every
    runner groups its chunks with `prefill_batch.group_chunks`)."""
    import cortexstream.engine.runner as runner_module

    groups: list[list[int]] = []
    original = runner_module.group_chunks

    def spy(items, batch_prefill=True, max_padding=1.25):
        passes = original(items, batch_prefill, max_padding)
        groups.extend([len(item.token_ids) for item in group] for group in passes)
        return passes

    monkeypatch.setattr(runner_module, "group_chunks", spy)
    return groups


def test_equal_prompts_prefill_in_one_forward_and_match_alone(tiny, monkeypatch):
    model, tokenizer = tiny
    prompts = random_prompts(4, seed=11, low=20, high=21)
    expected = [alone(model, tokenizer, p, 8) for p in prompts]
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4, prefix_caching=False)
    groups = record_groups(engine, monkeypatch)
    ids = [engine.add_request(p, max_tokens=8) for p in prompts]
    results = run_all(engine)
    assert [results[i]["tokens"] for i in ids] == expected
    assert groups == [[20, 20, 20, 20]]


PREFILL_WHILE_DECODING = 16


def test_ragged_prompts_with_history_match_alone(tiny, monkeypatch):
    """Chunks of different lengths (padded), continuing earlier chunks (history gathered from the arena)."""
    model, tokenizer = tiny
    prompts = random_prompts(6, seed=12, low=5, high=70)
    expected = [alone(model, tokenizer, p, 10) for p in prompts]
    # Separate passes only: with mixed_prefill, later chunks ride in the decode pass instead (tested below). A fixed
    # prefill budget while decoding: "auto" sizes chunks by measured step times, so the grouping would vary by run.
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefill_step_size=48, prefix_caching=False,
                    mixed_prefill=False, prefill_tokens_while_decoding=8)
    groups = record_groups(engine, monkeypatch)
    ids = [engine.add_request(p, max_tokens=10) for p in prompts]
    results = run_all(engine)
    assert [results[i]["tokens"] for i in ids] == expected
    assert any(len(g) > 1 and len(set(g)) > 1 for g in groups), groups  # some forward padded ragged chunks


def test_batched_prefill_logits_match_one_at_a_time(tiny, monkeypatch):
    model, tokenizer = tiny
    prompts = random_prompts(3, seed=13, low=9, high=40)
    logits = {}
    for batched in (False, True):
        engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4, prefix_caching=False,
                        batch_prefill=batched)
        ids = [engine.add_request(p, max_tokens=1, request_id=f"r{i}") for i, p in enumerate(prompts)]
        groups = record_groups(engine, monkeypatch)
        drawn = record_logits(engine)
        plan, _ = engine.scheduler.schedule()
        assert [item.request_id for item in plan.prefill] == ids
        engine.runner.execute(plan)
        assert groups == ([[len(p) for p in sorted(prompts, key=len, reverse=True)]] if batched
                          else [[len(p)] for p in prompts])
        logits[batched] = [drawn[rid] for rid in ids]
    for a, b in zip(logits[False], logits[True]):
        assert a.shape == b.shape == (1, model.args.vocab_size)
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=2e-4)


def test_prefill_and_decode_in_the_same_step_match_alone(tiny):
    model, tokenizer = tiny
    first, later = random_prompts(2, seed=14, low=10, high=30), random_prompts(3, seed=15, low=10, high=60)
    expected = [alone(model, tokenizer, p, 12) for p in first + later]
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefix_caching=False, prefill_step_size=16,
                    prefill_tokens_while_decoding=8)
    ids = [engine.add_request(p, max_tokens=12) for p in first]
    results: dict[str, dict] = {}
    while not any(results.get(i, {}).get("tokens") for i in ids):
        collect(engine.step(), results)
    ids += [engine.add_request(p, max_tokens=12) for p in later]
    mixed, budget_ok = 0, True
    original = engine.scheduler.schedule

    def spy():
        plan, ended = original()
        nonlocal mixed, budget_ok
        if plan.prefill and plan.decode:
            mixed += 1
            budget_ok &= sum(len(i.token_ids) for i in plan.prefill) <= 8 * len(later)  # 8 per prompt prefilled
        return plan, ended

    engine.scheduler.schedule = spy
    run_all(engine, results)
    assert [results[i]["tokens"] for i in ids] == expected
    assert mixed > 0 and budget_ok


def test_prompts_with_a_kv_policy_batch_beside_plain_ones(tiny, monkeypatch):
    model, tokenizer = tiny
    prompts = random_prompts(4, seed=16, low=40, high=44)
    policy = "streaming:window=24,sinks=4"
    engine_alone = Engine(model, tokenizer, kv_tokens=4096, block_size=4)
    expected = []
    for i, p in enumerate(prompts):
        rid = engine_alone.add_request(p, max_tokens=10, kv_policy=policy if i % 2 else None)
        expected.append(run_all(engine_alone)[rid]["tokens"])
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefill_step_size=256)
    groups = record_groups(engine, monkeypatch)
    ids = [engine.add_request(p, max_tokens=10, kv_policy=policy if i % 2 else None) for i, p in enumerate(prompts)]
    results = run_all(engine)
    assert [results[i]["tokens"] for i in ids] == expected
    assert any(len(g) > 1 for g in groups)


def test_shared_prefix_is_computed_once_for_requests_arriving_together(tiny):
    model, tokenizer = tiny
    prefix = random_prompts(1, seed=17, low=48, high=49)[0]
    tails = random_prompts(4, seed=18, low=6, high=7)
    prompts = [prefix + t for t in tails]
    expected = [alone(model, tokenizer, p, 6) for p in prompts]
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4)
    ids = [engine.add_request(p, max_tokens=6) for p in prompts]
    results = run_all(engine)
    assert [results[i]["tokens"] for i in ids] == expected
    # The 48-token prefix (12 blocks) once, then each other request only its 6-token tail.
    assert engine.num_prompt_tokens_computed == len(prompts[0]) + 3 * len(tails[0])
    assert engine.block_manager.num_prefix_hits == 3 * 12


def test_prefix_wait_lets_unrelated_requests_pass(tiny):
    model, tokenizer = tiny
    prefix = random_prompts(1, seed=19, low=40, high=41)[0]
    unrelated = random_prompts(1, seed=20, low=12, high=13)[0]
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefill_step_size=8)
    a = engine.add_request(prefix + [5], max_tokens=3)
    b = engine.add_request(prefix + [6], max_tokens=3)
    c = engine.add_request(unrelated, max_tokens=3)
    engine.step()
    running = {s.request_id for s in engine.scheduler.running}
    assert running == {a, c} and [s.request_id for s in engine.scheduler.waiting] == [b]
    results = run_all(engine)
    assert results[b]["tokens"] == alone(model, tokenizer, prefix + [6], 3)


def test_scheduler_config_validates_the_mixed_budget():
    import pytest

    from cortexstream.errors import InvalidArgumentError

    assert SchedulerConfig(prefill_step_size=512, prefill_tokens_while_decoding=128).prefill_budget(True) == 128
    assert SchedulerConfig(prefill_step_size=512, prefill_tokens_while_decoding=128).prefill_budget(False) == 512
    assert SchedulerConfig(prefill_step_size=64, prefill_tokens_while_decoding=128).prefill_budget(True) == 64
    # a share per prompt waiting for its first token, within the step's whole budget
    assert SchedulerConfig(prefill_step_size=512, prefill_tokens_while_decoding=100).prefill_budget(True, 3) == 300
    assert SchedulerConfig(prefill_step_size=512, prefill_tokens_while_decoding=100).prefill_budget(True, 9) == 512
    with pytest.raises(InvalidArgumentError, match="prefill_tokens_while_decoding"):
        SchedulerConfig(prefill_tokens_while_decoding=0)


def test_equal_reservations_give_a_strided_decode_batch(tiny):
    """Every request gets prompt + max_tokens as one contiguous run, so the batch decodes over strided views."""
    model, tokenizer = tiny
    prompts = random_prompts(4, seed=21, low=16, high=17)
    engine = Engine(model, tokenizer, kv_tokens=4 * 32, block_size=4, prefix_caching=False)
    ids = [engine.add_request(p, max_tokens=16) for p in prompts]
    strategies = []
    from cortexstream.engine import batch_cache

    original = batch_cache.DecodeBatch.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        strategies.append(self.strided is not None)

    batch_cache.DecodeBatch.__init__ = spy
    try:
        results = run_all(engine)
    finally:
        batch_cache.DecodeBatch.__init__ = original
    assert strategies and all(strategies)
    assert [results[i]["tokens"] for i in ids] == [alone(model, tokenizer, p, 16) for p in prompts]
    assert engine.arena.allocator.num_used_blocks == 0
    mx.eval()


def test_adaptive_budget_keeps_a_chunk_near_a_decode_steps_time():
    from cortexstream.engine.chunk_budget import AdaptivePrefillBudget

    budget = AdaptivePrefillBudget(max_tokens=512, ratio=1.5, min_tokens=16, smoothing=1.0)
    assert budget.tokens() == 64  # nothing measured: a cautious start
    budget.observe(prefill_tokens=64, prefill_seconds=0.32, decode_seconds=0.1)  # 5 ms a token, 100 ms a step
    assert budget.tokens() == 30  # 1.5 x 100 ms / 5 ms
    budget.observe(prefill_tokens=30, prefill_seconds=0.03, decode_seconds=None)  # cheap tokens: bigger chunks
    assert budget.tokens() == 150
    budget.observe(prefill_tokens=10, prefill_seconds=10.0, decode_seconds=None)  # very dear tokens: the floor
    assert budget.tokens() == 16
    budget.observe(prefill_tokens=1, prefill_seconds=1e-6, decode_seconds=None)  # never above the step budget
    assert budget.tokens() == 512
