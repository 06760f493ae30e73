"""n > 1 completions forked from one prefill (cortexstream.engine.fork) and per-request seeds (engine.seeded)."""

from __future__ import annotations

import pytest

from cortexstream.engine.engine import Engine
from cortexstream.engine.fork import add_forking_request
from cortexstream.engine.sampling import SamplingParams
from tiny_models import random_token_ids


def _run(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens.setdefault(out.request_id, []).append(out.token)
    return tokens


@pytest.mark.parametrize("prompt_len", [37, 33, 48])  # last token in a shared partial block / new block / full
def test_forked_greedy_children_match_a_single_request_and_prefill_once(tiny, prompt_len):
    model, tokenizer = tiny
    prompt = random_token_ids(prompt_len, seed=prompt_len)
    sampling = SamplingParams(max_tokens=12)
    single = Engine(model, tokenizer, kv_tokens=1024, prefix_caching=False)
    single.add_request(prompt, sampling, request_id="solo")
    expected = _run(single)["solo"]

    engine = Engine(model, tokenizer, kv_tokens=1024, prefix_caching=False)
    add_forking_request(engine, prompt, sampling, ["a", "b", "c"])
    got = _run(engine)
    assert got == {"a": expected, "b": expected, "c": expected}
    # One prefill of the prompt (all but the last token) plus the last token once per completion.
    assert engine.num_prompt_tokens_computed == prompt_len - 1
    assert engine.arena.allocator.num_used_blocks == 0
    engine.arena.allocator.check_invariants()


def test_children_share_the_prompt_blocks_by_reference(tiny):
    model, tokenizer = tiny
    prompt = random_token_ids(70, seed=3)
    engine = Engine(model, tokenizer, kv_tokens=1024, prefix_caching=False, block_size=16)
    add_forking_request(engine, prompt, SamplingParams(max_tokens=40), ["p", "c1", "c2", "c3"])
    engine.step()  # prefill 69 tokens
    engine.step()  # fork, then the last prompt token of all four in one decode batch
    allocator = engine.arena.allocator
    tables = {s.request_id: list(s.block_table) for s in engine.scheduler.running}
    assert set(tables) == {"p", "c1", "c2", "c3"}
    # The four full prompt blocks are one set of blocks, each referenced by all four sequences.
    first_blocks = {tuple(t[:4]) for t in tables.values()}
    assert len(first_blocks) == 1
    assert all(allocator.ref_count(b) == 4 for b in tables["p"][:4])
    # The partly filled fifth block was copied on write: each sequence has its own.
    assert len({t[4] for t in tables.values()}) == 4
    for rid in tables:
        engine.abort(rid)
    engine.step()
    assert allocator.num_used_blocks == 0


def test_aborted_parent_before_fork_creates_no_children(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=1024, prefix_caching=False, prefill_step_size=16)
    add_forking_request(engine, random_token_ids(60, seed=1), SamplingParams(max_tokens=5), ["p", "c"])
    engine.step()
    engine.abort("p")
    got = _run(engine)
    assert got == {}
    assert engine.arena.allocator.num_used_blocks == 0


def test_skipped_child_is_not_created(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=1024)
    add_forking_request(engine, random_token_ids(20, seed=2), SamplingParams(max_tokens=4), ["p", "c1", "c2"],
                        skip_child=lambda rid: rid == "c1")
    assert set(_run(engine)) == {"p", "c2"}


def test_seeded_sampling_repeats_and_children_differ(tiny):
    model, tokenizer = tiny
    prompt = random_token_ids(20, seed=4)
    sampling = SamplingParams(max_tokens=16, temperature=1.5, seed=123)

    def run() -> dict[str, list[int]]:
        engine = Engine(model, tokenizer, kv_tokens=1024)
        add_forking_request(engine, prompt, sampling, ["a", "b"])
        # Unrelated traffic must not change a seeded request's draws.
        engine.add_request(random_token_ids(30, seed=9), SamplingParams(max_tokens=8, temperature=1.0))
        return _run(engine)

    first, second = run(), run()
    assert first["a"] == second["a"] and first["b"] == second["b"]
    assert first["a"] != first["b"]
