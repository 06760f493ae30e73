"""A request whose sampler or logits processor fails ends alone, with finish_reason "error" and the reason; the
other requests of the same steps go on with the tokens they would have had without it, and its blocks return."""

from __future__ import annotations

import mlx.core as mx
import pytest

import cortexstream
from cortexstream.engine.engine import Engine
from cortexstream.errors import GenerationError

PROMPTS = ([1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])


def _failing_after(calls: int, exc: Exception):
    """A sampler that draws greedily `calls` times, then raises."""
    seen = [0]

    def sampler(logprobs: mx.array) -> mx.array:
        seen[0] += 1
        if seen[0] > calls:
            raise exc
        return mx.argmax(logprobs, axis=-1)

    return sampler


def _run(engine: Engine) -> tuple[dict[str, list[int]], dict[str, tuple[str, str | None]]]:
    tokens: dict[str, list[int]] = {}
    finished: dict[str, tuple[str, str | None]] = {}
    for _ in range(80):
        if not engine.has_unfinished:
            break
        for out in engine.step():  # never raises for one request's failure
            if out.token is not None:
                tokens.setdefault(out.request_id, []).append(out.token)
            if out.finished:
                finished[out.request_id] = (out.finish_reason, out.error)
    assert not engine.has_unfinished
    return tokens, finished


def _alone(tiny, prompt: list[int], max_tokens: int) -> list[int]:
    model, tok = tiny
    engine = Engine(model, tok, kv_tokens=512)
    rid = engine.add_request(prompt, max_tokens=max_tokens)
    return _run(engine)[0][rid]


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("fail_after", [0, 3])  # in the prefill's first draw; in a decode step
def test_a_failing_sampler_ends_only_its_own_request(tiny, pipeline, fail_after):
    model, tok = tiny
    engine = Engine(model, tok, kv_tokens=512, block_size=4, pipeline=pipeline)
    total = engine.arena.allocator.num_free_blocks
    good = [engine.add_request(p, max_tokens=10) for p in PROMPTS[:2]]
    bad = engine.add_request(PROMPTS[2], max_tokens=10,
                             sampler=_failing_after(fail_after, RuntimeError("boom in the sampler")))
    tokens, finished = _run(engine)
    assert finished[bad] == ("error", "sampling failed: RuntimeError: boom in the sampler")
    assert len(tokens.get(bad, [])) <= fail_after  # no token after the failure
    for rid, prompt in zip(good, PROMPTS):
        assert finished[rid][0] == "length"
        assert tokens[rid] == _alone(tiny, prompt, 10)
    engine.drop_cached(range(10**6))  # prefix-cached blocks aside, everything came back
    assert engine.arena.allocator.num_free_blocks == total


def test_a_sampler_returning_no_token_id_is_an_error_for_that_request(tiny):
    model, tok = tiny
    engine = Engine(model, tok, kv_tokens=512)
    bad = engine.add_request(PROMPTS[0], max_tokens=5, sampler=lambda logprobs: logprobs)  # the whole row
    good = engine.add_request(PROMPTS[1], max_tokens=5, temperature=0.7, seed=1)
    tokens, finished = _run(engine)
    reason, error = finished[bad]
    assert reason == "error" and "expected one integer token id" in error and "float32" in error
    assert finished[good][0] == "length" and len(tokens[good]) == 5


def test_a_failing_logits_processor_is_isolated_too(tiny):
    model, tok = tiny
    engine = Engine(model, tok, kv_tokens=512)
    bad = engine.add_request(PROMPTS[0], max_tokens=5, repetition_penalty=1.3)
    good = engine.add_request(PROMPTS[1], max_tokens=5)

    def broken(history, logits):
        raise IndexError("processor out of range")

    original = engine.runner._open

    def open_with_a_broken_processor(spec):
        original(spec)
        if spec.request_id == bad:
            engine.runner._requests[bad].sampler.processors = [broken]

    engine.runner._open = open_with_a_broken_processor
    _tokens, finished = _run(engine)
    assert finished[bad] == ("error", "sampling failed: IndexError: processor out of range")
    assert finished[good][0] == "length"


def test_stream_generate_raises_the_reason(tiny):
    model, tok = tiny
    with pytest.raises(GenerationError, match="generation failed: sampling failed: ValueError: no such token"):
        cortexstream.generate(model, tok, PROMPTS[0], max_tokens=4,
                              sampler=_failing_after(1, ValueError("no such token")))
