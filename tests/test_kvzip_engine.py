"""KVzip in the engine: scoring chunks planned as steps leave the sequence, its blocks and the prefix cache as if
they never ran, the budget per head after compression (then within the eviction slack while decoding), a budget
that keeps everything gives the full cache's tokens exactly, batched equals alone, forked completions and a
preempted request each reconstruct, and the server takes it as a request policy."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.engine.engine import Engine
from cortexstream.engine.reconstruction_prompt import reconstruction_prompt
from cortexstream.engine.step_plan import WorkKind
from cortexstream.policies import KVzip
from test_policies_runtime import engine_run
from tiny_models import random_token_ids


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
    assert all(item.kind is WorkKind.SCORE and item.token_ids[: len(prefix)] == prefix
               for r in scoring for item in r[0])
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
    from server_harness import assert_server_takes_policy

    assert_server_takes_policy(*sharp, random_token_ids(80), "kvzip:budget=32,chunk=40", "kvzip:chunk=0", "chunk")
