"""The UI's handle on the engine: every engine access happens on the engine thread, results come back as Messages.

Three kinds of threads meet here and none of them touches a widget:

* the engine thread (a `ThreadedClient` in push mode, see `cortexstream.engine.client`): steps the engine;
  after each step `_on_step` gathers the outputs' text and, at most every `stats_interval` seconds (and at
  once when a reply ends or the engine goes idle), posts it as `ReplyDelta` messages and a `StatsUpdate`;
* one dispatcher thread: runs UI commands (submit, clear) through the client's `call`, which blocks until the
  engine thread is between steps; inside, a command uses only the engine's public methods (`add_request`,
  `abort`, `snapshot`, `drop_cached`). A submit adds the request and notes its sequence's owner id (which tags
  the blocks the block map colours; read from `snapshot(blocks=False)`) in the same turn, before any step can
  produce its first output. Blocking there instead of on the UI thread keeps the UI responsive during a long
  prefill step, and one queue keeps the commands in the order the user gave them;
* the loader thread (`launch`): loads the model after the UI is on screen, so the app starts at once.

The dispatcher and loader are daemon threads: a command stuck behind a stopped engine never blocks exit.
Outputs are consumed in `on_step` rather than through per-request streams, so no output (with its logprobs
array) is kept after the step that produced it.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable

from textual.message import Message

from cortexstream.tui.messages import (ConversationCleared, EngineError, EngineReady, ReplyDelta, RequestFailed,
                                      StatsUpdate)
from cortexstream.tui.snapshot import SnapshotBuilder
from cortexstream.engine.client import ThreadedClient
from cortexstream.engine.engine import Engine, RequestOutput
from cortexstream.engine.finish_reason import FinishReason
from cortexstream.errors import CortexStreamError

Post = Callable[[Message], Any]
_STOP = None


def describe(exc: BaseException) -> str:
    """One line for the UI: our own errors speak for themselves, others get their type name."""
    return str(exc) if isinstance(exc, CortexStreamError) else f"{type(exc).__name__}: {exc}"


class _Reply:
    """Text of one reply gathered over steps: one ReplyDelta per `stats_interval` however fast tokens come,
    so a fast model (or many conversations) cannot flood the UI's message queue."""

    def __init__(self, conv_id: int) -> None:
        self.conv_id = conv_id
        self.text = ""
        self.generated = 0
        self.ttft: float | None = None
        self.ttft_pending = False

    def delta(self, request_id: str, finish_reason: FinishReason | None = None,
              error: str | None = None) -> ReplyDelta:
        ttft = self.ttft if self.ttft_pending else None
        message = ReplyDelta(self.conv_id, request_id, self.text, self.generated, finish_reason, error, ttft)
        self.text, self.ttft_pending = "", False
        return message


class EngineLink:
    """The TUI's link to its engine: UI commands run on the engine thread in order, outputs come back as Messages
    (see the module docstring)."""

    def __init__(self, engine: Engine, post: Post, *, stats_interval: float = 0.1) -> None:
        self.engine = engine
        self._post = post
        self._builder = SnapshotBuilder()  # engine thread only
        self._interval = stats_interval
        self._last_stats = self._last_flush = 0.0
        self._replies: dict[str, _Reply] = {}  # engine thread only: text not posted yet, per request
        self._reported_error: BaseException | None = None
        self.client = ThreadedClient(engine, on_step=self._on_step, start=False)
        self._commands: queue.Queue = queue.Queue()
        self._dispatcher = threading.Thread(target=self._run_commands, name="cortexstream-tui-commands", daemon=True)

    # --- lifecycle (UI thread) --------------------------------------------------------------------------------
    def start(self) -> "EngineLink":
        self.client.start()
        self._dispatcher.start()
        self.refresh()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the engine thread (waits for the step in flight). Running replies just end."""
        self._commands.put(_STOP)
        self.client.close(timeout)

    # --- commands (UI thread; none of them blocks) ------------------------------------------------------------
    def submit(self, conv_id: int, request_id: str, prompt: Any, **kwargs: Any) -> None:
        """Queue a request; its text arrives as ReplyDelta, a refusal as RequestFailed."""

        def add(engine: Engine) -> None:
            rid = engine.add_request(prompt, request_id=request_id, **kwargs)
            seq = engine.snapshot(blocks=False).sequence(rid)  # waiting: no step ran since
            # Also maps a rejection's output to the conversation.
            self._builder.track(rid, conv_id, None if seq is None else seq.owner)

        self._commands.put((add, conv_id, request_id))

    def abort(self, request_id: str) -> None:
        """Stop a reply; its final ReplyDelta has finish_reason 'aborted'."""
        self.client.abort(request_id)

    def clear(self, conv_id: int, request_id: str | None = None) -> None:
        """Abort the conversation's reply and free every block it holds, prefix-cached ones included."""

        def drop(engine: Engine) -> None:
            before = engine.snapshot(blocks=False).num_free_blocks
            if request_id is not None:
                engine.abort(request_id)
            for rid in [r for r, reply in self._replies.items() if reply.conv_id == conv_id]:
                del self._replies[rid]
            engine.drop_cached(self._builder.forget(conv_id))
            self._post(ConversationCleared(conv_id, engine.snapshot(blocks=False).num_free_blocks - before))
            self._post_stats(engine)

        self._commands.put((drop, conv_id, None))

    def refresh(self) -> None:
        """Post a fresh snapshot even while the engine is idle."""
        self._commands.put((self._post_stats, None, None))

    def take_failure(self) -> str | None:
        """A failed engine step not reported yet (ThreadedEngine then aborts everything without outputs)."""
        error = self.client.error
        if error is None or error is self._reported_error:
            return None
        self._reported_error = error
        return f"engine step failed: {describe(error)}"

    # --- engine thread ----------------------------------------------------------------------------------------
    def _run_commands(self) -> None:
        while True:
            command = self._commands.get()
            if command is _STOP:
                return
            fn, conv_id, request_id = command
            try:
                self.client.call(fn)
            except Exception as exc:  # noqa: BLE001 - shown in the UI, never raised into it
                if request_id is not None:
                    self._post(RequestFailed(conv_id, request_id, describe(exc)))
                else:
                    self._post(EngineError(describe(exc)))

    def _on_step(self, engine: Engine, outputs: list[RequestOutput]) -> None:
        try:
            self._builder.observe(engine.snapshot(blocks=False))
            ended = False
            for out in outputs:
                conv = self._builder.conv_of_request.get(out.request_id)
                if conv is None:
                    continue
                reply = self._replies.setdefault(out.request_id, _Reply(conv))
                reply.text += out.text
                reply.generated = out.generation_tokens
                if reply.ttft is None and out.token is not None:
                    reply.ttft, reply.ttft_pending = out.ttft, True
                if out.finished:
                    ended = True
                    self._builder.finished(conv, out.prompt_tokens, out.generation_tokens)
                    del self._builder.conv_of_request[out.request_id]
                    del self._replies[out.request_id]
                    self._post(reply.delta(out.request_id, out.finish_reason, out.error))
            now = time.perf_counter()
            if now - self._last_flush >= self._interval:
                self._last_flush = now
                for request_id, reply in self._replies.items():
                    if reply.text or reply.ttft_pending:
                        self._post(reply.delta(request_id))
            if ended or not engine.has_unfinished or now - self._last_stats >= self._interval:
                self._post_stats(engine)
        except Exception as exc:  # noqa: BLE001 - an exception here would kill the engine thread
            self._post(EngineError(f"TUI engine link: {describe(exc)}"))

    def _post_stats(self, engine: Engine) -> None:
        self._last_stats = time.perf_counter()
        self._post(StatsUpdate(self._builder.build(engine.snapshot())))


# --- start-up -----------------------------------------------------------------------------------------------------
def model_label(model: Any) -> str:
    from cortexstream.models.loader import model_info

    info = model_info(model)
    if info is None:
        return type(model).__module__.rsplit(".", 1)[-1]
    return f"{os.path.basename(info.source)} ({info.architecture}, {info.num_layers} layers, {info.weights})"


def backend_label() -> str:
    from cortexstream.backend import backend_info

    info = backend_info()
    return f"{'Metal GPU' if info.metal else 'CPU'} - {info.blas.split(' (')[0]}"


def launch(config: Any, post: Post, model: Any = None, tokenizer: Any = None, engine: Engine | None = None) -> None:
    """Load the model (unless given), build the engine and its link on a daemon thread; post EngineReady."""

    def work() -> None:
        try:
            nonlocal model, tokenizer, engine
            if engine is None:
                if model is None:
                    from cortexstream.models.loader import load

                    model, tokenizer = load(config.model, dtype=config.dtype,
                                            dequantize=False if config.keep_quantized else None)
                engine = Engine(model, tokenizer, kv_tokens=config.kv_tokens, block_size=config.block_size,
                                max_num_seqs=config.max_num_seqs, kv_dtype=config.kv_dtype,
                                kv_group_size=config.kv_group_size, kv_disk=config.kv_disk,
                                kv_disk_size=config.kv_disk_size, speculative=config.speculative)
            link = EngineLink(engine, post).start()
            if not post(EngineReady(link, model_label(engine.model), backend_label())):
                link.stop()  # the app closed while we were loading
        except Exception as exc:  # noqa: BLE001 - shown in the UI, which stays up
            post(EngineError(describe(exc), fatal=True))

    threading.Thread(target=work, name="cortexstream-tui-loader", daemon=True).start()
