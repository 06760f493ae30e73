"""`EngineClient`: the one way interfaces (server, TUI, benchmarks) talk to an engine.

Four calls cover a request's life, and a fifth shows the engine:

* `submit(prompt, **options) -> request_id`: queue a prompt (a string, token ids or chat messages). `options` are
  `Engine.add_request`'s: `sampling=` or sampling keywords (`max_tokens`, `temperature`, `top_p`, `stop`, ...),
  `kv_policy=`, `tenant=`, `request_id=`. Bad arguments raise `InvalidArgumentError` here, in the caller.
* `stream(request_id) -> Iterator[RequestOutput]`: that request's outputs in order, the last one `finished`
  (`finish_reason` 'stop', 'length', 'aborted' or 'rejected' with `error`). Each request's stream is read once;
  outputs produced before it is read are kept for it.
* `abort(request_id)`: stop a request from any point; its stream ends with `finish_reason='aborted'`. Aborting
  an unknown or finished request does nothing.
* `stats() -> dict`: `Engine.stats()` taken between two steps (arena blocks and bytes, running / waiting,
  preemptions, prefix-cache blocks and hits, generated tokens).
* `snapshot(blocks=True) -> EngineView`: `Engine.snapshot()` taken between two steps: a read-only view (plain data,
  see engine/snapshot.py) of the live sequences and their block tables, block counts, counters and, with
  `blocks`, every block's reference count and owner and the prefix cache's blocks.

`call(fn)` runs `fn(engine)` between two steps and returns its result: an escape hatch (several engine calls in
one engine-thread turn, as the TUI's commands do). Interfaces read the engine through the calls above and, inside
`call`, only through the engine's public methods (`add_request`, `abort`, `stats`, `snapshot`, `drop_cached`),
never its scheduler, block manager or runner (`tests/test_layers.py` checks). `close()` releases the client
(stops a thread, aborts what is left).

Two implementations:

* `InProcessClient(engine)`: no thread; the engine steps in the caller's thread while it reads a stream, or
  `run()` steps until everything finished and returns all outputs. For scripts, tests and benchmarks that time
  the engine itself.
* `ThreadedClient(engine)`: the engine on its own thread (`ThreadedEngine`); every call is safe from any thread
  and `stream` blocks only its reader. For servers and UIs. With `on_step=` the outputs of every step go to that
  callback on the engine thread instead (push mode, as the TUI wants), and `stream` is not available.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator, Protocol, TypeVar, runtime_checkable

from cortexstream.engine.engine import Engine, RequestOutput
from cortexstream.engine.snapshot import EngineView
from cortexstream.engine.threaded import RequestStream, ThreadedEngine
from cortexstream.errors import InvalidArgumentError

T = TypeVar("T")


@runtime_checkable
class EngineClient(Protocol):
    """Submit, stream, abort, stats, snapshot (and `call` / `close`); see the module docstring for the contract."""

    def submit(self, prompt: Any, **options: Any) -> str: ...

    def stream(self, request_id: str) -> Iterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def snapshot(self, blocks: bool = True) -> EngineView: ...

    def call(self, fn: Callable[[Engine], T]) -> T: ...

    def close(self) -> None: ...


def _unknown(request_id: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"request_id: no stream for '{request_id}' (never submitted here, or already read)")


class InProcessClient:
    """The engine stepped in the caller's thread: reading a stream steps until that request finishes."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # request id -> outputs produced but not read yet (other requests' outputs arrive while one is read)
        self._pending: dict[str, deque[RequestOutput]] = {}

    def submit(self, prompt: Any, **options: Any) -> str:
        request_id = self.engine.add_request(prompt, **options)
        self._pending[request_id] = deque()
        return request_id

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        if request_id not in self._pending:
            raise _unknown(request_id)
        return self._read(request_id)

    def _read(self, request_id: str) -> Iterator[RequestOutput]:
        pending = self._pending[request_id]
        try:
            while True:
                while pending:
                    output = pending.popleft()
                    yield output
                    if output.finished:
                        return
                if not self.engine.has_unfinished:
                    return  # nothing can produce more (the engine was stepped to completion elsewhere)
                self._step()
        finally:
            self._pending.pop(request_id, None)
            self.engine.abort(request_id)  # a reader that stops early frees the request's blocks

    def _step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        for output in outputs:
            pending = self._pending.get(output.request_id)
            if pending is not None:
                pending.append(output)
        return outputs

    def run(self) -> list[RequestOutput]:
        """Step until every request finished; returns all outputs in order. They are handed out here only: the
        requests' streams end (keeping every output for an unread stream would hold each step's logits)."""
        outputs: list[RequestOutput] = []
        self._pending.clear()
        while self.engine.has_unfinished:
            outputs.extend(self.engine.step())
        return outputs

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def snapshot(self, blocks: bool = True) -> EngineView:
        return self.engine.snapshot(blocks)

    def call(self, fn: Callable[[Engine], T]) -> T:
        return fn(self.engine)

    def close(self) -> None:
        for request_id in list(self._pending):
            self.engine.abort(request_id)
        self._pending.clear()


class ThreadedClient:
    """The engine on its own thread (wraps `ThreadedEngine`, whose API stays as it is). Starts at once unless
    `start=False` (then call `start()`)."""

    def __init__(self, engine: Engine | ThreadedEngine,
                 on_step: Callable[[Engine, list[RequestOutput]], None] | None = None, *, start: bool = True) -> None:
        if isinstance(engine, ThreadedEngine):
            if on_step is not None:
                raise InvalidArgumentError("on_step: pass it to the ThreadedEngine, which is already built")
            self.threaded = engine
        else:
            self.threaded = ThreadedEngine(engine, on_step=on_step)
        self._push = self.threaded.on_step is not None
        self._streams: dict[str, RequestStream] = {}
        if start:
            self.start()

    def start(self) -> "ThreadedClient":
        """Start the engine thread (once; a client built with start=True already runs)."""
        if not self.threaded.running:
            self.threaded.start()
        return self

    @property
    def error(self) -> BaseException | None:
        """The last failed engine step's exception (every request then ended with an error)."""
        return self.threaded.error

    def submit(self, prompt: Any, **options: Any) -> str:
        if self._push:
            # Outputs go to on_step; a RequestStream would only pile them up unread.
            return self.threaded.call(lambda engine: engine.add_request(prompt, **options))
        stream = self.threaded.submit(prompt, **options)
        self._streams[stream.request_id] = stream
        return stream.request_id

    def stream(self, request_id: str) -> Iterator[RequestOutput]:
        if self._push:
            raise InvalidArgumentError("stream: this client hands outputs to on_step")
        stream = self._streams.pop(request_id, None)
        if stream is None:
            raise _unknown(request_id)
        return iter(stream)

    def abort(self, request_id: str) -> None:
        self.threaded.abort(request_id)

    def stats(self) -> dict[str, Any]:
        return self.threaded.call(lambda engine: engine.stats())

    def snapshot(self, blocks: bool = True) -> EngineView:
        return self.threaded.call(lambda engine: engine.snapshot(blocks))

    def call(self, fn: Callable[[Engine], T]) -> T:
        return self.threaded.call(fn)

    def close(self, timeout: float = 10.0) -> None:
        self.threaded.stop(timeout)
        self._streams.clear()
