"""EngineClient: both implementations satisfy the protocol and give each request exactly its own outputs."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cortexstream.engine.client import EngineClient, InProcessClient, ThreadedClient
from cortexstream.engine.engine import Engine
from cortexstream.errors import InvalidArgumentError


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(x) for x in rng.integers(3, 250, size=n)] for n in (5, 17, 30)[:count]]


def alone(model, tokenizer, prompt, n) -> list[int]:
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4)
    client = InProcessClient(engine)
    return [o.token for o in client.stream(client.submit(prompt, max_tokens=n)) if o.token is not None]


@pytest.mark.parametrize("kind", ["in_process", "threaded"])
def test_streams_carry_each_requests_own_tokens(tiny, kind):
    model, tokenizer = tiny
    expected = [alone(model, tokenizer, p, 8) for p in prompts(3)]
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4)
    client = InProcessClient(engine) if kind == "in_process" else ThreadedClient(engine)
    try:
        assert isinstance(client, EngineClient)
        ids = [client.submit(p, max_tokens=8) for p in prompts(3)]
        # Read the last request first: the others' outputs must be kept for their own streams.
        got = {rid: [o for o in client.stream(rid)] for rid in reversed(ids)}
        assert [[o.token for o in got[rid] if o.token is not None] for rid in ids] == expected
        assert all(got[rid][-1].finish_reason == "length" for rid in ids)
        assert client.stats()["running"] == 0
        with pytest.raises(InvalidArgumentError):
            client.stream(ids[0])  # a stream is read once
        with pytest.raises(InvalidArgumentError):
            client.submit("", max_tokens=3)
    finally:
        client.close()


@pytest.mark.parametrize("kind", ["in_process", "threaded"])
def test_abort_ends_the_stream_and_frees_blocks(tiny, kind):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4, prefix_caching=False)
    client = InProcessClient(engine) if kind == "in_process" else ThreadedClient(engine)
    try:
        rid = client.submit(prompts(1)[0], max_tokens=500)
        client.abort(rid)
        outputs = list(client.stream(rid))
        assert outputs[-1].finish_reason in ("aborted", "length")
        assert client.call(lambda e: e.arena.allocator.num_used_blocks) == 0
    finally:
        client.close()


def test_in_process_reader_that_stops_early_frees_the_request(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4, prefix_caching=False)
    client = InProcessClient(engine)
    rid = client.submit(prompts(1)[0], max_tokens=100)
    stream = client.stream(rid)
    next(stream)
    stream.close()
    engine.step()  # the abort's final output
    assert not engine.has_unfinished
    assert engine.arena.allocator.num_used_blocks == 0


def test_threaded_push_mode_hands_outputs_to_on_step(tiny):
    model, tokenizer = tiny
    seen: list = []
    done = threading.Event()

    def on_step(engine, outputs):
        seen.extend(outputs)
        if any(o.finished for o in outputs):
            done.set()

    client = ThreadedClient(Engine(model, tokenizer, kv_tokens=1024, block_size=4), on_step=on_step)
    try:
        rid = client.submit(prompts(1)[0], max_tokens=4)
        assert done.wait(30)
        assert [o.request_id for o in seen] == [rid] * 4
        with pytest.raises(InvalidArgumentError):
            client.stream(rid)
    finally:
        client.close()


def test_in_process_run_steps_to_completion_and_hands_out_every_output(tiny):
    model, tokenizer = tiny
    expected = [alone(model, tokenizer, p, 6) for p in prompts(3)]
    client = InProcessClient(Engine(model, tokenizer, kv_tokens=1024, block_size=4))
    ids = [client.submit(p, max_tokens=6) for p in prompts(3)]
    outputs = client.run()
    got = [[o.token for o in outputs if o.request_id == rid and o.token is not None] for rid in ids]
    assert got == expected
    assert client.stats()["running"] == 0 and not client.engine.has_unfinished
    with pytest.raises(InvalidArgumentError):
        client.stream(ids[0])  # run() handed the outputs out itself
