"""Engine: batching invariance, chunked prefill, preemption, prefix caching, tenants, rejection, aborts, threads."""

from __future__ import annotations

import random

import numpy as np
import pytest

import cortexstream
from cortexstream.engine.engine import Engine
from cortexstream.engine.threaded import ThreadedEngine
from cortexstream.errors import InvalidArgumentError


def collect(outputs, results: dict[str, dict]) -> None:
    for out in outputs:
        entry = results.setdefault(out.request_id, {"tokens": [], "text": ""})
        if out.token is not None:
            entry["tokens"].append(out.token)
        entry["text"] += out.text
        if out.finished:
            entry["reason"], entry["error"] = out.finish_reason, out.error


def run_all(engine: Engine, results: dict[str, dict] | None = None) -> dict[str, dict]:
    results = {} if results is None else results
    while engine.has_unfinished:
        collect(engine.step(), results)
    return results


def alone(model, tokenizer, prompt, n):
    engine = Engine(model, tokenizer, kv_tokens=4096, block_size=4)
    rid = engine.add_request(prompt, max_tokens=n)
    return run_all(engine)[rid]["tokens"]


def random_prompts(count, seed, low=1, high=60):
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(3, 250, size=int(n))] for n in rng.integers(low, high, size=count)]


def test_batched_greedy_outputs_equal_each_request_alone(tiny):
    model, tokenizer = tiny
    prompts = random_prompts(8, seed=1)
    expected = [alone(model, tokenizer, p, 16) for p in prompts]
    # A fixed budget while decoding ("auto" sizes chunks from measured step times): the same chunks every run.
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4, prefill_step_size=7,
                    prefill_tokens_while_decoding=4)
    ids = [engine.add_request(p, max_tokens=16) for p in prompts]
    results = run_all(engine)
    assert [results[i]["tokens"] for i in ids] == expected
    assert engine.arena.allocator.num_used_blocks == engine.block_manager.num_cached_blocks


def test_one_decode_forward_per_step_for_all_running(tiny, monkeypatch):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=4)
    calls = []
    original = engine.runner._decode
    monkeypatch.setattr(engine.runner, "_decode",
                        lambda items, chunks, out: calls.append(len(items)) or original(items, chunks, out))
    for p in random_prompts(5, seed=2, low=3, high=20):
        engine.add_request(p, max_tokens=6)
    engine.step()  # all five prefill (they fit the token budget)
    engine.step()
    assert calls == [5]


def test_generate_and_stream_generate_run_through_the_engine(tiny, monkeypatch):
    model, tokenizer = tiny
    steps = []
    original = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: steps.append(1) or original(self))
    cortexstream.generate(model, tokenizer, "the cat", max_tokens=5)
    assert steps


def test_batch_generate_matches_individual_generation(tiny):
    model, tokenizer = tiny
    prompts = ["the cat sat", "hello there", "a", "on the mat the end"]
    singles = [cortexstream.generate(model, tokenizer, p, max_tokens=10) for p in prompts]
    response = cortexstream.batch_generate(model, tokenizer, prompts, max_tokens=10, return_token_ids=True)
    assert response.texts == singles
    assert response.stats.generation_tokens == sum(len(t) for t in response.token_ids)
    assert response.stats.prompt_tps > 0 and len(response.stats.ttft) == len(prompts)


def test_preemption_under_memory_pressure_keeps_outputs_exact(tiny):
    model, tokenizer = tiny
    prompts = random_prompts(6, seed=3, low=20, high=40)
    expected = [alone(model, tokenizer, p, 24) for p in prompts]
    # 40 blocks of 4 tokens: not enough for six sequences of up to 63 tokens at once
    # Later prompts prefill while earlier ones decode: a fixed budget ("auto" follows measured step times) keeps
    # the chunks, and so when preemption strikes, the same every run.
    engine = Engine(model, tokenizer, kv_tokens=160, block_size=4, prefix_caching=False,
                    prefill_tokens_while_decoding=8)
    ids = [engine.add_request(p, max_tokens=24) for p in prompts]
    results = run_all(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [results[i]["tokens"] for i in ids] == expected
    assert engine.arena.allocator.num_free_blocks == engine.arena.allocator.num_total_blocks


def test_request_that_can_never_fit_is_rejected_with_a_reason(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=64, block_size=4)
    small = engine.add_request([5, 6, 7], max_tokens=4)
    big = engine.add_request(list(range(3, 60)), max_tokens=100)
    results = run_all(engine)
    assert results[big]["reason"] == "rejected" and "KV blocks" in results[big]["error"]
    assert results[small]["reason"] in ("stop", "length")


def test_prefix_cache_reuses_blocks_within_a_tenant_only(tiny):
    model, tokenizer = tiny
    system = random_prompts(1, seed=4, low=30, high=31)[0]
    # bob's prompt prefills while alice's decodes: a fixed budget ("auto" follows measured step times) keeps its
    # chunks, and so the tokens compared below, the same every run.
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4, prefill_tokens_while_decoding=8)
    engine.add_request(system + [9, 10], max_tokens=3, tenant="alice")
    run_all(engine)
    hits_before = engine.block_manager.num_prefix_hits
    second = engine.add_request(system + [11, 12], max_tokens=3, tenant="alice")
    results: dict[str, dict] = {}
    collect(engine.step(), results)
    assert engine.block_manager.num_prefix_hits - hits_before == len(system) // 4
    seq_alice = next(s for s in engine.scheduler.running if s.request_id == second)
    other = engine.add_request(system + [11, 12], max_tokens=3, tenant="bob")
    collect(engine.step(), results)
    seq_bob = next(s for s in engine.scheduler.running if s.request_id == other)
    assert not set(seq_alice.block_table) & set(seq_bob.block_table)
    run_all(engine, results)
    # cached prefix must not change the answer
    assert results[second]["tokens"] == alone(model, tokenizer, system + [11, 12], 3)
    assert results[other]["tokens"] == results[second]["tokens"]


def test_fully_cached_prompt_recomputes_only_its_last_token(tiny):
    model, tokenizer = tiny
    prompt = random_prompts(1, seed=5, low=16, high=17)[0]  # exactly 4 blocks of 4
    engine = Engine(model, tokenizer, kv_tokens=512, block_size=4)
    a = engine.add_request(prompt, max_tokens=5)
    first = run_all(engine)[a]["tokens"]
    b = engine.add_request(prompt, max_tokens=5)
    assert run_all(engine)[b]["tokens"] == first


def test_abort_frees_blocks_and_reports(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=512, block_size=4, prefix_caching=False)
    rid = engine.add_request(list(range(3, 40)), max_tokens=50)
    engine.step()
    assert engine.arena.allocator.num_used_blocks > 0
    assert engine.abort(rid)
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [(rid, "aborted")]
    assert engine.arena.allocator.num_used_blocks == 0
    assert not engine.abort("nope")


def test_soak_random_lengths_aborts_and_shared_prefixes(tiny):
    """200 requests in a small arena: each finishes or is rejected with a reason, nothing leaks, outputs exact."""
    model, tokenizer = tiny
    rng = random.Random(0)
    prefixes = random_prompts(3, seed=6, low=8, high=20)
    # A fixed budget while decoding ("auto" follows measured step times): the step count, and so which request
    # each rng-drawn abort hits and which outputs are checked, is the same every run.
    engine = Engine(model, tokenizer, kv_tokens=400, block_size=4, max_num_seqs=12, prefill_step_size=32,
                    prefill_tokens_while_decoding=8)
    prompts, ids, aborted = {}, [], set()
    for i in range(200):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 250) for _ in range(rng.randrange(0, 12))]
        n = rng.randrange(1, 12) if i % 50 else 200  # a few can never fit in 100 blocks
        rid = engine.add_request(prompt, max_tokens=n, tenant=rng.choice(["a", "b"]))
        prompts[rid] = (prompt, n)
        ids.append(rid)
    results: dict[str, dict] = {}
    while engine.has_unfinished:
        if rng.random() < 0.05:
            victim = rng.choice(ids)
            if engine.abort(victim):
                aborted.add(victim)
        for out in engine.step():
            entry = results.setdefault(out.request_id, {"tokens": []})
            if out.token is not None:
                entry["tokens"].append(out.token)
            if out.finished:
                entry["reason"], entry["error"] = out.finish_reason, out.error
    assert set(results) == set(ids)
    for rid in ids:
        reason = results[rid]["reason"]
        assert reason in ("stop", "length", "aborted", "rejected"), reason
        if reason == "rejected":
            assert results[rid]["error"]
    alloc = engine.arena.allocator
    assert alloc.num_used_blocks == engine.block_manager.num_cached_blocks  # only the prefix cache holds blocks
    engine.block_manager._reclaim(alloc.num_total_blocks)
    assert alloc.num_free_blocks == alloc.num_total_blocks
    alloc.check_invariants()
    checked = [rid for rid in ids if results[rid]["reason"] in ("stop", "length")][:25]
    for rid in checked:
        prompt, n = prompts[rid]
        assert results[rid]["tokens"] == alone(model, tokenizer, prompt, n)


def test_add_request_validates_arguments(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=128)
    with pytest.raises(InvalidArgumentError, match="temperature"):
        engine.add_request("hi", temperature=-1)
    with pytest.raises(InvalidArgumentError, match="prompt"):
        engine.add_request("")
    assert not engine.has_unfinished


def test_threaded_engine_streams_concurrent_requests(tiny):
    model, tokenizer = tiny
    prompts = random_prompts(4, seed=8)
    expected = [alone(model, tokenizer, p, 10) for p in prompts]
    with ThreadedEngine(Engine(model, tokenizer, kv_tokens=1024, block_size=4)) as threaded:
        streams = [threaded.submit(p, max_tokens=10) for p in prompts]
        got = [[o.token for o in s if o.token is not None] for s in streams]
        assert got == expected
        with pytest.raises(InvalidArgumentError):
            threaded.submit("", max_tokens=3)
        stream = threaded.submit(prompts[0], max_tokens=500)
        stream.abort()
        assert list(stream)[-1].finish_reason in ("aborted", "length", "stop")
        stats = threaded.call(lambda engine: engine.stats())
        assert stats["running"] == 0
