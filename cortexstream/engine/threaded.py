"""`ThreadedEngine`: the engine on its own thread, serving per-request streaming iterators.

Callers (the TUI, a server, `stream_generate`) never touch the engine's state: they enqueue commands and read
`RequestOutput`s from a per-request queue. All engine mutation happens on the engine thread.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterator

from cortexstream.engine.engine import Engine, RequestOutput
from cortexstream.errors import CortexStreamError, EngineNotRunningError

_DONE = object()


class RequestStream:
    """Iterator over one request's outputs; `abort()` stops it early."""

    def __init__(self, engine: "ThreadedEngine", request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: queue.Queue = queue.Queue()

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    def abort(self) -> None:
        self._engine.abort(self.request_id)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: hand the reader an output, or an error that ends its iteration."""
        self._queue.put(item)


class ThreadedEngine:
    """`on_step(engine, outputs)` runs on the engine thread after every step (e.g. to post UI stats).
    `on_failure(exc)` runs there after a step raised `exc`: every request was then aborted and every open stream
    got the error; callers that read outputs through `on_step` instead of streams learn of the failure here."""

    def __init__(self, engine: Engine, on_step: Callable[[Engine, list[RequestOutput]], None] | None = None,
                 on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self.on_failure = on_failure
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cortexstream-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> "ThreadedEngine":
        if self._stop.is_set():
            raise EngineNotRunningError("ThreadedEngine: stopped engines cannot be restarted; build a new one")
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; every open stream and every caller still waiting gets EngineNotRunningError."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_pending_commands()
        if not self._thread.is_alive():
            self.engine.close()  # what its backend holds goes back; the engine could step again later

    def _check_running(self, what: str) -> None:
        if not self.running:
            state = "was stopped" if self._stop.is_set() else "was never started (call start() or use `with`)"
            raise EngineNotRunningError(f"ThreadedEngine.{what}: the engine thread {state}")

    def _wait_reply(self, reply: queue.Queue, what: str) -> Any:
        # Poll so that a thread that stops (or dies) after the command was queued cannot leave us waiting forever.
        while True:
            try:
                result = reply.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive():
                    self._fail_pending_commands()
                    try:
                        result = reply.get_nowait()
                    except queue.Empty:
                        raise EngineNotRunningError(f"ThreadedEngine.{what}: the engine thread stopped") from None
                else:
                    continue
            if isinstance(result, BaseException):
                raise result
            return result

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _kind, _payload, reply = self._commands.get_nowait()
            except queue.Empty:
                return
            if reply is not None:
                reply.put(EngineNotRunningError("ThreadedEngine: the engine thread stopped before this call ran"))

    def __enter__(self) -> "ThreadedEngine":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def submit(self, prompt: Any, **kwargs: Any) -> RequestStream:
        """Queue a request from any thread; returns its stream. Bad arguments raise here, in the caller."""
        self._check_running("submit")
        reply: queue.Queue = queue.Queue()
        self._commands.put(("add", (prompt, kwargs), reply))
        self._wake.set()
        return self._wait_reply(reply, "submit")

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread and return its result (e.g. a consistent stats snapshot)."""
        self._check_running("call")
        reply: queue.Queue = queue.Queue()
        self._commands.put(("call", fn, reply))
        self._wake.set()
        return self._wait_reply(reply, "call")

    def _handle_commands(self) -> None:
        while True:
            try:
                kind, payload, reply = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "add":
                    prompt, kwargs = payload
                    request_id = self.engine.add_request(prompt, **kwargs)
                    stream = RequestStream(self, request_id)
                    self._streams[request_id] = stream
                    reply.put(stream)
                elif kind == "abort":
                    self.engine.abort(payload)
                elif kind == "call":
                    reply.put(payload(self.engine))
            except Exception as exc:  # noqa: BLE001 - handed back to the caller's thread
                if reply is not None:
                    reply.put(exc)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._handle_commands()
            if not self.engine.has_unfinished:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - a failed step must not hang every waiting stream
                self.error = exc
                failure = CortexStreamError(f"engine step failed: {type(exc).__name__}: {exc}")
                for stream in self._streams.values():
                    stream.put(failure)
                self._streams.clear()
                self._reset_after_failure()
                if self.on_failure is not None:
                    self.on_failure(exc)
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    stream.put(output)
                    if output.finished:
                        del self._streams[output.request_id]
            if self.on_step is not None:
                self.on_step(self.engine, outputs)
        stopped = EngineNotRunningError("ThreadedEngine: the engine was stopped before this request finished")
        for stream in self._streams.values():
            stream.put(stopped)
        self._streams.clear()
        self._fail_pending_commands()

    def _reset_after_failure(self) -> None:
        self.engine.abort_all()
        self.engine.step()  # flush the aborted outputs; nothing is running now
