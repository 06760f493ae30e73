"""One completion of a /v1/messages or /v1/responses request as its token events arrive: the text, the tool calls
its parser found, the `StreamDelta`s to send, the counts for usage, and which stop sequence (if any) ended it."""

from __future__ import annotations

from typing import Any

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.server.jobs import RequestHandle, TokenEvent
from cortexstream.server.responses import failure
from cortexstream.server.tool_types import StreamDelta, TextDelta, ToolCall


class TurnState:
    def __init__(self, handle: RequestHandle, prompt_tokens: int, parser: Any) -> None:
        self.handle = handle
        self.prompt_tokens = prompt_tokens
        self.parser = parser  # a ToolCallParser, or None when the text is not read for calls
        self.raw_text = ""
        self.output_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.stop_sequence: str | None = None  # the stop string that ended it (the engine cuts it from the text)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> list[StreamDelta]:
        """Record one event; returns what it adds to the stream. Raises the APIError of a failed finish."""
        error = failure(event)
        if error is not None:
            raise error
        if event.cached_tokens is not None:
            self.cached_tokens = event.cached_tokens
        if event.token is not None:
            self.output_tokens += 1
        self.stop_sequence = event.stop_string or self.stop_sequence
        self.raw_text += event.text
        deltas: list[StreamDelta] = []
        if self.parser is None:
            if event.text:
                deltas.append(TextDelta(event.text))
        else:
            if event.text:
                deltas += self.parser.feed(event.text)
            if event.finish_reason is not None:
                deltas += self.parser.finish()
        self.finish_reason = event.finish_reason or self.finish_reason
        return deltas

    @property
    def text(self) -> str:
        return self.parser.text if self.parser is not None else self.raw_text

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self.parser.calls) if self.parser is not None else []
