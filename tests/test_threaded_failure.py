"""A failed engine step: ThreadedEngine aborts every request through the engine's public `abort_all`, ends every
open stream with the error, tells `on_failure`, and keeps serving; the server (which reads outputs through
`on_step`, not streams) answers the open requests with an engine error through that callback."""

from __future__ import annotations

import threading

import httpx
import pytest

from cortexstream.engine.engine import Engine
from cortexstream.engine.finish_reason import FinishReason
from cortexstream.engine.threaded import ThreadedEngine
from cortexstream.errors import CortexStreamError
from server_harness import LiveServer

PROMPT = [int(x) for x in range(5, 40)]


def fail_once_when_live(engine: Engine, request_id: str) -> list[list[str]]:
    """Make `engine.step` raise once, on the first step that finds `request_id` waiting or running; returns a
    list that then holds the ids that were live at that step."""
    original = engine.step
    live_at_failure: list[list[str]] = []

    def step():
        if not live_at_failure and engine.lookup(request_id) is not None:
            live_at_failure.append([rid for rid in ("a", "b") if engine.lookup(rid) is not None])
            raise RuntimeError("boom")
        return original()

    engine.step = step
    return live_at_failure


def test_a_failed_step_ends_the_live_streams_calls_on_failure_and_the_engine_keeps_serving(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4, prefix_caching=False)
    live_at_failure = fail_once_when_live(engine, "b")
    failures: list[BaseException] = []
    failed = threading.Event()

    def on_failure(exc: BaseException) -> None:
        failures.append(exc)
        failed.set()

    with ThreadedEngine(engine, on_failure=on_failure) as threaded:
        streams = {rid: threaded.submit(PROMPT, request_id=rid, max_tokens=200) for rid in ("a", "b")}
        assert failed.wait(30)
        assert len(failures) == 1 and isinstance(failures[0], RuntimeError) and threaded.error is failures[0]
        assert "b" in live_at_failure[0]
        for rid, stream in streams.items():
            if rid in live_at_failure[0]:
                with pytest.raises(CortexStreamError, match="engine step failed: RuntimeError: boom"):
                    list(stream)
            else:  # it ended (at an end-of-sequence token) before the failing step
                assert list(stream)[-1].finished
        # Everything was aborted and flushed: nothing is live and no block is held.
        assert threaded.call(lambda e: (e.has_unfinished, e.lookup("a"), e.lookup("b"), e.stats()["running"])) \
            == (False, None, None, 0)
        assert threaded.call(lambda e: e.snapshot(blocks=False).num_used_blocks) == 0
        after = list(threaded.submit(PROMPT, max_tokens=3))
        assert after[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP) and threaded.running


def test_the_server_answers_a_request_caught_in_a_failed_step_with_an_engine_error(tiny):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_tokens=512) as server:
        original = server.engine.step
        calls = [0]

        def step():  # the engine steps only while a request is live: the first step is this request's
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("boom")
            return original()

        server.engine.step = step
        response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": "hello", "max_tokens": 5})
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["code"] == "engine_error" and "engine step failed: RuntimeError: boom" in error["message"]
        # The engine thread survived, and the next request is served.
        ok = server.client().completions.create(model="tiny", prompt="hello", max_tokens=3)
        assert ok.choices[0].finish_reason in ("length", "stop")
        assert server.state.bridge.engine_running
