"""Engine support for C2C: fused sequences are never recomputed (another victim, or a clear failure), never enter
the prefix cache, and the before-last-prompt-token hook gives the paper's semantics through the scheduler."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from cortexstream.c2c import C2CProjectorFuser
from cortexstream.c2c.request_fusion import fuse_on_prefill, fuse_requests, run_until_prefilled
from cortexstream.c2c.pipeline import fused_prompt_cache
from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine.engine import Engine
from cortexstream.engine.sequence import Sequence
from cortexstream.errors import InvalidArgumentError
from cortexstream.engine.sampling import SamplingParams
from cortexstream.kv.allocator import BlockAllocator
from tiny_models import tiny_model

PROMPT = [5, 17, 42, 99, 7, 123, 64, 250, 31, 88, 12, 200, 77]
OTHER = [213, 160, 129, 69, 79, 13, 21, 7, 46, 203, 163, 228, 127]  # runs to max_tokens (no early eos)


@pytest.fixture(scope="module")
def models(tiny):
    _, tokenizer = tiny
    receiver = tiny_model(11)
    sharer = tiny_model(12, num_hidden_layers=3, num_key_value_heads=1, head_dim=32, num_attention_heads=2)
    return receiver, sharer, tokenizer


def open_fuser(sharer, receiver):
    mx.random.seed(3)
    fuser = C2CProjectorFuser.from_models(sharer, receiver, hidden_dim=32, intermediate_dim=48)
    for p in fuser.projectors:
        p.key_gate_logit, p.value_gate_logit = mx.array(1.0), mx.array(1.0)
    return fuser


def sharer_engine(sharer, tokenizer, prompt=PROMPT):
    engine = Engine(sharer, tokenizer, kv_tokens=512, block_size=4)
    rid = engine.add_request(prompt, max_tokens=64)
    run_until_prefilled(engine, rid)
    return engine, rid


def drain(engine):
    results: dict[str, dict] = {}
    while engine.has_unfinished:
        for out in engine.step():
            row = results.setdefault(out.request_id, {"tokens": [], "lps": [], "reason": None, "error": None})
            if out.token is not None:
                row["tokens"].append(out.token)
                row["lps"].append(out.logprobs)
            if out.finished:
                row["reason"], row["error"] = out.finish_reason, out.error
    return results


def seq_of(engine, rid):
    return next(s for s in list(engine.scheduler.waiting) + engine.scheduler.running if s.request_id == rid)


def test_hook_fuses_before_the_last_prompt_token_like_the_paper(models):
    receiver, sharer, tokenizer = models
    fuser = open_fuser(sharer, receiver)
    src = sharer_engine(sharer, tokenizer)
    engine = Engine(receiver, tokenizer, kv_tokens=512, block_size=4, prefill_step_size=5)  # chunks 5, 5, 2 (+1)
    rid = engine.add_request(PROMPT, max_tokens=6)
    fuse_on_prefill(fuser, src, (engine, rid))
    seq = seq_of(engine, rid)
    hook, seen = seq.hook, []
    seq.hook = dataclasses.replace(hook, run=lambda s: (seen.append(s.num_computed), hook.run(s)))
    got = drain(engine)[rid]
    assert seen == [len(PROMPT) - 1] and not seq.kv_from_tokens
    # Reference: the paper's recipe on prompt caches, then greedy decoding with mlx-lm caches.
    cache, last = fused_prompt_cache(receiver, PROMPT, sharer, PROMPT, fuser)
    token, tokens, lps = last, [], []
    for _ in range(len(got["tokens"])):
        logits = receiver(token.reshape(1, 1), cache=cache)[0, -1]
        lps.append(logits - mx.logsumexp(logits))
        token = mx.argmax(logits).reshape(1)
        tokens.append(int(token.item()))
    assert got["tokens"] == tokens
    assert mx.allclose(got["lps"][0], lps[0], atol=1e-4)  # the first token already reads the fused cache
    plain = Engine(receiver, tokenizer, kv_tokens=512, block_size=4)
    p = plain.add_request(PROMPT, max_tokens=1)
    assert not mx.allclose(drain(plain)[p]["lps"][0], lps[0], atol=1e-3)


def test_failing_hook_fails_only_its_request_with_the_reason(models):
    receiver, sharer, tokenizer = models
    src_engine, src_id = sharer_engine(sharer, tokenizer, PROMPT[:4])  # too short for the 12 fused positions
    engine = Engine(receiver, tokenizer, kv_tokens=512, block_size=4)
    rid = engine.add_request(PROMPT, max_tokens=4)
    other = engine.add_request(OTHER, max_tokens=4)
    fuse_on_prefill(open_fuser(sharer, receiver), (src_engine, src_id), (engine, rid))
    results = drain(engine)
    assert results[rid]["reason"] == "error"
    assert "hook failed" in results[rid]["error"] and "token-aligned" in results[rid]["error"]
    assert results[rid]["tokens"] == [] and len(results[other]["tokens"]) == 4
    assert engine.arena.allocator.num_free_blocks + engine.block_manager.num_cached_blocks == \
        engine.arena.allocator.num_total_blocks


def test_hook_checks_tenants_and_state_up_front(models):
    receiver, sharer, tokenizer = models
    src_engine = Engine(sharer, tokenizer, kv_tokens=512, block_size=4)
    src_id = src_engine.add_request(PROMPT, max_tokens=2, tenant="a")
    engine = Engine(receiver, tokenizer, kv_tokens=512, block_size=4)
    rid = engine.add_request(PROMPT, max_tokens=2, tenant="b")
    with pytest.raises(PermissionError):
        fuse_on_prefill(open_fuser(sharer, receiver), (src_engine, src_id), (engine, rid))
    with pytest.raises(InvalidArgumentError, match="neither waiting nor running"):
        fuse_on_prefill(open_fuser(sharer, receiver), (src_engine, "nope"), (engine, rid))


def _pressure_engine(receiver, tokenizer):
    # 16 blocks of 4 tokens: two requests of 13 + 24 tokens (10 blocks each) cannot both finish at once. A fixed
    # budget while decoding ("auto" follows measured step times): a preempted request is recomputed beside a
    # decoding one in the same chunks every run.
    return Engine(receiver, tokenizer, kv_tokens=64, block_size=4, prefix_caching=False,
                  prefill_tokens_while_decoding=8)


def test_fused_sequence_is_never_recomputed_another_is_preempted(models):
    receiver, sharer, tokenizer = models
    fuser = open_fuser(sharer, receiver)
    src = sharer_engine(sharer, tokenizer)
    roomy = Engine(receiver, tokenizer, kv_tokens=512, block_size=4)
    ref = roomy.add_request(PROMPT, max_tokens=24)
    fuse_on_prefill(fuser, src, (roomy, ref))
    expected = drain(roomy)[ref]["tokens"]

    engine = _pressure_engine(receiver, tokenizer)
    plain = engine.add_request(OTHER, max_tokens=24)  # older: without the flag, the newest (fused) would go
    fused = engine.add_request(PROMPT, max_tokens=24)
    fuse_on_prefill(fuser, src, (engine, fused))
    fused_seq, plain_seq = seq_of(engine, fused), seq_of(engine, plain)
    results = drain(engine)
    assert engine.scheduler.num_preemptions > 0
    assert fused_seq.num_preemptions == 0 and plain_seq.num_preemptions > 0
    assert results[fused]["tokens"] == expected  # the fusion survived the memory pressure
    alone = Engine(receiver, tokenizer, kv_tokens=512, block_size=4)
    a = alone.add_request(OTHER, max_tokens=24)
    assert results[plain]["tokens"] == drain(alone)[a]["tokens"]  # recomputed exactly


def test_when_only_fused_sequences_remain_one_fails_with_a_clear_reason(models):
    receiver, sharer, tokenizer = models
    fuser = open_fuser(sharer, receiver)
    src = sharer_engine(sharer, tokenizer)
    src2 = sharer_engine(sharer, tokenizer, OTHER)
    engine = _pressure_engine(receiver, tokenizer)
    first = engine.add_request(PROMPT, max_tokens=24)
    second = engine.add_request(OTHER, max_tokens=24)
    fuse_on_prefill(fuser, src, (engine, first))
    fuse_on_prefill(fuser, src2, (engine, second))
    results = drain(engine)
    failed = [r for r in (first, second) if results[r]["reason"] == "error"]
    assert len(failed) == 1 and "C2C fusion" in results[failed[0]]["error"]
    survivor = first if failed[0] == second else second
    assert results[survivor]["reason"] in ("stop", "length") and engine.scheduler.num_preemptions == 0
    assert engine.arena.allocator.num_free_blocks == engine.arena.allocator.num_total_blocks


def test_block_manager_never_registers_a_fused_sequence():
    allocator = BlockAllocator(32)
    bm = BlockManager(allocator, block_size=4)
    seq = Sequence(list(range(3, 15)), SamplingParams(max_tokens=2))
    bm.admit(seq)
    seq.num_computed = seq.num_physical = 12
    seq.kv_from_tokens = False
    bm.register_full_blocks(seq)
    assert bm.num_cached_blocks == 0 and seq.block_hashes == []
    seq.kv_from_tokens = True
    bm.register_full_blocks(seq)
    assert bm.num_cached_blocks == 3  # the same sequence, recomputable, would have been cached


def test_fuse_requests_marks_the_sequence(models):
    receiver, sharer, tokenizer = models
    src = sharer_engine(sharer, tokenizer)
    engine = Engine(receiver, tokenizer, kv_tokens=512, block_size=4)
    rid = engine.add_request(PROMPT, max_tokens=4)
    run_until_prefilled(engine, rid)
    assert seq_of(engine, rid).kv_from_tokens
    fuse_requests(open_fuser(sharer, receiver), src, (engine, rid))
    assert not seq_of(engine, rid).kv_from_tokens
