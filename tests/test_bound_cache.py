"""One decode loop: a caller's prompt cache or sampler rides on the engine, beside arena requests."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache as mlx_make_prompt_cache

import cortexstream
from cortexstream.engine.engine import Engine
from cortexstream.errors import InvalidArgumentError

from test_engine import alone, collect, random_prompts


def test_stream_generate_with_a_prompt_cache_runs_through_the_engine(tiny, monkeypatch):
    model, tokenizer = tiny
    steps = []
    original = Engine.step
    monkeypatch.setattr(Engine, "step", lambda self: steps.append(1) or original(self))
    prompt = random_prompts(1, seed=30, low=25, high=26)[0]
    cache = mlx_make_prompt_cache(model)
    tokens = [r.token for r in cortexstream.stream_generate(model, tokenizer, prompt, 8, prompt_cache=cache)]
    assert steps and tokens == alone(model, tokenizer, prompt, 8)
    assert cache[0].offset == len(prompt) + len(tokens) - 1  # the last sampled token is not fed yet (mlx-lm)


def test_a_conversation_continues_on_the_same_cache(tiny):
    model, tokenizer = tiny
    first, second = random_prompts(2, seed=31, low=12, high=20)
    cache = cortexstream.make_prompt_cache(model)
    turn1 = [r.token for r in cortexstream.stream_generate(model, tokenizer, first, 5, prompt_cache=cache)]
    turn2 = [r.token for r in cortexstream.stream_generate(model, tokenizer, second, 5, prompt_cache=cache)]
    # The same as one prompt holding the whole history: turn 1's prompt, its answer but the last token (which
    # was never fed), then turn 2's prompt.
    history = first + turn1[:-1] + second
    assert turn2 == alone(model, tokenizer, history, 5)


def test_bound_and_arena_requests_decode_in_the_same_steps(tiny):
    model, tokenizer = tiny
    prompts = random_prompts(3, seed=32, low=10, high=30)
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4)
    cache = mlx_make_prompt_cache(model)
    ids = [engine.add_request(prompts[0], max_tokens=9, prompt_cache=cache)]
    ids += [engine.add_request(p, max_tokens=9) for p in prompts[1:]]
    bound_blocks = []
    results = {}
    while engine.has_unfinished:
        collect(engine.step(), results)
        bound_blocks += [len(s.block_table) for s in engine.scheduler.running if not s.uses_arena]
    assert [results[i]["tokens"] for i in ids] == [alone(model, tokenizer, p, 9) for p in prompts]
    assert bound_blocks and set(bound_blocks) == {0}  # a bound request never takes arena blocks
    assert engine.arena.allocator.num_used_blocks == engine.block_manager.num_cached_blocks


def test_a_custom_sampler_is_used_and_stop_strings_still_apply(tiny):
    model, tokenizer = tiny
    prompt = random_prompts(1, seed=33, low=10, high=11)[0]
    calls = []

    def always(logprobs):
        calls.append(logprobs.shape)
        return mx.array([tokenizer.encode("a")[-1]])

    out = list(cortexstream.stream_generate(model, tokenizer, prompt, 6, sampler=always))
    assert calls and all(shape[-1] == model.args.vocab_size for shape in calls)
    assert [r.token for r in out] == [tokenizer.encode("a")[-1]] * 6
    stopped = cortexstream.generate(model, tokenizer, prompt, 6, sampler=always, stop=["aa"])
    assert stopped == "a" or stopped == ""  # cut at the stop string


def test_a_policy_on_a_prompt_cache_still_evicts(tiny):
    model, tokenizer = tiny
    prompt = random_prompts(1, seed=34, low=50, high=51)[0]
    cache = cortexstream.make_prompt_cache(model)
    list(cortexstream.stream_generate(model, tokenizer, prompt, 10, prompt_cache=cache,
                                      kv_policy="streaming:window=16,sinks=4"))
    assert cache[0].size() <= 16 + 4 + 512  # the policy's bound: budget plus one prefill chunk
    assert cache[0].offset == len(prompt) + 9


def test_bad_prompt_cache_and_sampler_arguments(tiny):
    model, tokenizer = tiny
    with pytest.raises(InvalidArgumentError, match="prompt_cache"):
        cortexstream.generate(model, tokenizer, [5, 6], 2, prompt_cache="x")
    with pytest.raises(InvalidArgumentError, match="sampler"):
        Engine(model, tokenizer, kv_tokens=64).add_request([5, 6], max_tokens=2, sampler=3)
    short = mlx_make_prompt_cache(model)[:1]
    with pytest.raises(InvalidArgumentError):
        cortexstream.generate(model, tokenizer, [5, 6], 2, prompt_cache=short)


def test_a_stop_string_completed_by_the_final_flush_finishes_as_stop(tiny):
    """A detokenizer may hold text back until the end; if the flush at max_tokens completes a stop string, the
    request stopped on it (the text is cut there), so finish_reason is 'stop'."""
    model, tokenizer = tiny

    class HeldBack:  # holds every piece back; the flush finds the stop string
        stopped = False
        stop_string = None

        def add_token(self, token: int) -> str:
            return ""

        def finish(self) -> str:
            self.stopped, self.stop_string = True, "zz"
            return "cut"

    engine = Engine(model, tokenizer, kv_tokens=256, block_size=4)
    rid = engine.add_request([5, 6, 7], max_tokens=3, stop=["zz"])
    engine._outputs._states[rid].text = HeldBack()
    results = {}
    while engine.has_unfinished:
        collect(engine.step(), results)
    assert results[rid]["reason"] == "stop" and results[rid]["text"] == "cut"
