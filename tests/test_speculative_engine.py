"""Speculative decoding (prompt lookup) inside the engine: greedy output identical to plain decoding, alone and
batched, with the prefix cache, n > 1 and preemption; rejected drafts leave no blocks behind."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.engine.engine import Engine
from cortexstream.errors import InvalidArgumentError
from tests.test_engine import run_all

BS = 4


def _looping_prompt(seed: int, period: int = 7, repeats: int = 6) -> list[int]:
    """A prompt that repeats a random phrase: prompt lookup finds its continuation (a tiny random model's greedy
    output also tends to loop, so drafts get accepted)."""
    phrase = [int(x) for x in np.random.default_rng(seed).integers(3, 250, size=period)]
    return phrase * repeats


def _run(model, tokenizer, prompts, max_tokens=24, speculative=None, **options):
    options.setdefault("kv_tokens", 2048)
    options.setdefault("block_size", BS)
    engine = Engine(model, tokenizer, speculative=speculative, **options)
    ids = [engine.add_request(p, max_tokens=max_tokens) for p in prompts]
    results = run_all(engine)
    return [results[i]["tokens"] for i in ids], engine


def test_greedy_prompt_lookup_equals_plain_decoding(tiny):
    model, tokenizer = tiny
    prompts = [_looping_prompt(1), _looping_prompt(2, period=5), list(range(5, 40))]
    plain = [_run(model, tokenizer, [p])[0][0] for p in prompts]
    for p, expected in zip(prompts, plain):
        got, engine = _run(model, tokenizer, [p], speculative="ngram:k=4,n=3")
        assert got == [expected]
    got, engine = _run(model, tokenizer, prompts, speculative="ngram:k=4,n=3")
    assert got == plain  # batched speculative == each alone, plain
    stats = [engine.scheduler.num_preemptions]
    assert stats == [0]
    assert engine.arena.allocator.num_used_blocks == engine.block_manager.num_cached_blocks  # nothing leaked


def test_drafts_are_proposed_and_accepted(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=BS)
    rid = engine.add_request(_looping_prompt(3), max_tokens=40, speculative="ngram:k=4,n=2,adaptive=0")
    seq = engine.lookup(rid)
    state = seq.speculation
    run_all(engine)
    assert state.verify_steps > 0 and state.proposed > 0
    assert state.accepted > 0, "a looping greedy continuation should accept some drafts"
    # Fewer decode passes than tokens: accepted drafts are tokens that needed no step of their own.
    assert state.verify_steps < 40


def test_speculation_with_prefix_cache_hit_forks_and_preemption(tiny):
    from cortexstream.engine.sampling import SamplingParams

    model, tokenizer = tiny
    prompt = _looping_prompt(4)
    expected = _run(model, tokenizer, [prompt], max_tokens=30)[0][0]
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=BS, speculative="ngram")
    first = engine.add_request(prompt, max_tokens=30)
    assert run_all(engine)[first]["tokens"] == expected
    again = engine.add_request(prompt, max_tokens=30)  # a prefix-cache hit
    assert run_all(engine)[again]["tokens"] == expected
    assert engine.block_manager.num_prefix_hits > 0
    ids = ["fork-a", "fork-b"]
    engine.fork(list(prompt), SamplingParams(max_tokens=30), ids)
    results = run_all(engine)
    assert [results[i]["tokens"] for i in ids] == [expected, expected]
    # A small arena: sequences are preempted and recomputed, drafts included, with the same output.
    prompts = [_looping_prompt(10 + i) for i in range(4)]
    plain = [_run(model, tokenizer, [p], max_tokens=40)[0][0] for p in prompts]
    got, small = _run(model, tokenizer, prompts, max_tokens=40, speculative="ngram", kv_tokens=40 * BS)
    assert got == plain
    assert small.scheduler.num_preemptions > 0


def test_requests_that_cannot_be_verified_decode_plainly(tiny):
    model, tokenizer = tiny
    prompt = _looping_prompt(5)
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=BS, speculative="ngram")
    penalised = engine.add_request(prompt, max_tokens=8, repetition_penalty=1.3)
    evicting = engine.add_request(prompt, max_tokens=8, kv_policy="h2o:budget=32")
    assert engine.lookup(penalised).speculation is None and engine.lookup(evicting).speculation is None
    run_all(engine)
    off = engine.add_request(prompt, max_tokens=8, speculative="off")
    assert engine.lookup(off).speculation is None
    with pytest.raises(InvalidArgumentError, match="speculative"):
        engine.add_request(prompt, max_tokens=8, speculative="ngram:k=0")


def test_random_drafts_are_rolled_back_and_output_stays_plain(tiny, monkeypatch):
    """A drafter proposing random tokens: nearly every draft is rejected, the rejected tokens' KV is rolled back
    (the next step overwrites it, blocks taken for it are freed), and the output is plain greedy's."""
    from cortexstream.engine.ngram_proposer import NgramIndex

    model, tokenizer = tiny
    rng = np.random.default_rng(0)
    monkeypatch.setattr(NgramIndex, "propose",
                        lambda self, k, n: [int(x) for x in rng.integers(3, 250, size=k)])
    prompts = [list(range(5, 40)), _looping_prompt(6), list(range(100, 117))]
    plain = [_run(model, tokenizer, [p], max_tokens=30)[0][0] for p in prompts]
    assert len({tuple(p) for p in plain}) == 3
    got, engine = _run(model, tokenizer, prompts, max_tokens=30, speculative="ngram:k=6,adaptive=0")
    assert got == plain
    assert engine.arena.allocator.num_used_blocks == engine.block_manager.num_cached_blocks


def test_rollback_frees_the_blocks_taken_for_rejected_drafts(tiny, monkeypatch):
    from cortexstream.engine.ngram_proposer import NgramIndex

    model, tokenizer = tiny
    monkeypatch.setattr(NgramIndex, "propose", lambda self, k, n: [3] * k)  # almost surely rejected
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=BS, speculative="ngram:k=12,adaptive=0")
    engine.block_manager.reserve_ahead = False  # blocks are taken exactly as needed: what is left is visible
    rid = engine.add_request(list(range(5, 12)), max_tokens=20)
    seq = engine.lookup(rid)
    while engine.has_unfinished:
        engine.step()
        if seq.is_finished:
            break
        # After every step the table holds only what the sequence's tokens need (plus its next one).
        assert len(seq.block_table) <= -(-(seq.num_tokens + 1) // BS)
    assert seq.speculation.proposed > 0 and seq.speculation.accepted < seq.speculation.proposed


def test_public_calls_take_speculative(tiny):
    import cortexstream

    model, tokenizer = tiny
    prompt = _looping_prompt(7)
    plain = cortexstream.generate(model, tokenizer, prompt, max_tokens=20)
    assert cortexstream.generate(model, tokenizer, prompt, max_tokens=20, speculative="ngram:k=3") == plain
    prompts = [prompt, list(range(5, 30))]
    expected = cortexstream.batch_generate(model, tokenizer, prompts, max_tokens=20).texts
    assert cortexstream.batch_generate(model, tokenizer, prompts, max_tokens=20, speculative="ngram").texts == expected
    with pytest.raises(InvalidArgumentError, match="speculative"):
        cortexstream.generate(model, tokenizer, prompt, max_tokens=4, speculative="lookup")
    sampled = cortexstream.generate(model, tokenizer, prompt, max_tokens=20, temperature=0.8, speculative="ngram")
    assert isinstance(sampled, str)


def test_cli_generate_and_tui_take_speculative(tiny_gguf):
    from tests.test_cli import assert_one_line_error, run_cli

    result = run_cli("generate", "--model", tiny_gguf, "--prompt", "a b a b a b", "--max-tokens", "8",
                     "--speculative", "ngram:k=3,n=2")
    assert result.returncode == 0, result.stderr
    assert_one_line_error(run_cli("generate", "--model", "/nonexistent.gguf", "--prompt", "x", "--speculative",
                                  "ngram:q=1"), "speculative", "q")
    import argparse

    from cortexstream.tui.config import TuiConfig

    assert TuiConfig.from_args(argparse.Namespace(speculative="ngram:k=2")).speculative == "ngram:k=2"


def test_engine_stats_count_drafts(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=BS, speculative="ngram:k=4,n=2,adaptive=0")
    engine.add_request(_looping_prompt(8), max_tokens=30)
    run_all(engine)
    stats = engine.stats()
    assert stats["spec_verify_steps"] > 0
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_drafted_tokens"] <= 4 * stats["spec_verify_steps"]
    # Each verify pass emits its accepted drafts plus one token; the first token came from the prompt's pass.
    assert stats["generated_tokens"] == 30
    assert stats["spec_verify_steps"] + stats["spec_accepted_tokens"] <= 29


def test_smollm_prompt_lookup_on_int8_kv_and_beside_structured_output(smollm):
    """On a real model: greedy prompt lookup equals plain decoding on float and int8 KV blocks, accepts drafts
    on an input-grounded prompt, and a JSON-schema request in the same batch (which decodes plainly) stays valid."""
    import json

    from cortexstream.engine.sampling import sampling_from_kwargs

    model, tokenizer = smollm
    text = ("Copy this list exactly: apples, pears, plums, cherries, apricots, peaches, grapes, lemons. "
            "Copy: apples, pears, plums, cherries, apricots, peaches, grapes, lemons. Copy:")
    prompt = tokenizer.encode(text)
    schema = {"type": "object", "properties": {"fruit": {"type": "string"}}, "required": ["fruit"]}
    for kv_dtype in (None, "int8"):
        plain, _ = _run(model, tokenizer, [prompt], max_tokens=24, kv_dtype=kv_dtype, block_size=16)
        engine = Engine(model, tokenizer, kv_tokens=2048, block_size=16, kv_dtype=kv_dtype, speculative="ngram")
        rid = engine.add_request(prompt, max_tokens=24)
        structured = engine.add_request("Name a fruit as JSON.", sampling_from_kwargs(
            max_tokens=40, response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}}))
        assert engine.lookup(structured).speculation is None
        results = run_all(engine)
        assert results[rid]["tokens"] == plain[0]
        assert json.loads(results[structured]["text"])["fruit"]
        assert engine.stats()["spec_accepted_tokens"] > 0


def test_a_sequence_whose_drafts_do_not_pay_is_pipelined_and_still_probes(tiny, monkeypatch):
    """Drafts that are always rejected drive k to 0: the sequence then decodes pipelined like a plain one, and
    now and then drafts one token again (its last token read first)."""
    from cortexstream.engine.ngram_proposer import NgramIndex
    from cortexstream.engine.verify_cost import VerifyCostModel

    model, tokenizer = tiny
    # every step finds a match reaching back 4 tokens (a class whose prior drafts) and proposes what is rejected
    monkeypatch.setattr(NgramIndex, "match", lambda self, n: (0, 1))
    monkeypatch.setattr(NgramIndex, "extent", lambda self, start, size, cap: 4)
    monkeypatch.setattr(NgramIndex, "propose", lambda self, k, n: [3] * k)
    # the cost of a draft pinned: measured, it follows the machine's load, and a cost that drifts back down (as the
    # fit forgets its spread) rightly makes a read pay again, one verify more than this test counts
    measured = VerifyCostModel.after_step
    monkeypatch.setattr(VerifyCostModel, "after_step", lambda self, *args: (measured(self, *args), (0.2, 0.0))[1])
    engine = Engine(model, tokenizer, kv_tokens=2048, block_size=BS, speculative="ngram:k=4")
    rid = engine.add_request(list(range(5, 12)), max_tokens=80)
    state = engine.lookup(rid).speculation
    pipelined, verified_at_zero = 0, None
    while engine.has_unfinished:
        engine.step()
        pipelined += engine.has_in_flight
        if verified_at_zero is None and state.length.k == 0:
            verified_at_zero = state.verify_steps
    assert state.length.k == 0 and verified_at_zero is not None
    assert pipelined > 30  # most steps after k reached 0 overlapped the next step's launch
    # then probes on the engine clock's multiples of 16, 32, 64 (after half an interval idle, backing off while
    # they fail): 1 to 3 in the steps left, depending on the step at which k reached 0
    assert 1 <= state.verify_steps - verified_at_zero <= 3, (state.verify_steps, verified_at_zero)
