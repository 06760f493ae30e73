"""OpenAI response shapes: whole bodies, Server-Sent-Event chunks, log-probabilities and usage."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.server.jobs import TokenEvent
from cortexstream.server.errors import APIError
from cortexstream.server.tool_types import StreamDelta, TextDelta, ToolCallArguments, ToolCallStart

TokenText = Callable[[int], str]


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


def failure(event: TokenEvent) -> APIError | None:
    """The error an unsuccessful finish maps to (None for 'stop' / 'length')."""
    if event.finish_reason in (None, FinishReason.STOP, FinishReason.LENGTH):
        return None
    if event.finish_reason == FinishReason.REJECTED:
        return APIError(400, f"request rejected: {event.error}", code="context_length_exceeded")
    if event.finish_reason == FinishReason.ABORTED:
        return APIError(503, "request aborted by the server (shutting down)", code="aborted")
    return APIError(500, f"generation failed: {event.error or event.finish_reason}", code="engine_error")


@dataclass
class Choice:
    """What one completion has produced so far."""

    text: str = ""
    tokens: int = 0
    finish_reason: FinishReason | None = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    parser: Any = None  # a ToolCallParser when the text is read for tool calls
    pending: list[StreamDelta] = field(default_factory=list)  # parsed deltas not yet sent as chunks

    def reported_finish(self) -> str | None:
        """OpenAI's finish_reason: 'tool_calls' when a finished completion made calls."""
        if self.finish_reason is None:
            return None
        if self.parser is not None and self.parser.calls and self.finish_reason == FinishReason.STOP:
            return "tool_calls"
        return self.finish_reason.value


def tool_call_dicts(calls: list[Any]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def _delta_dict(delta: StreamDelta) -> dict[str, Any]:
    if isinstance(delta, TextDelta):
        return {"content": delta.text}
    if isinstance(delta, ToolCallStart):
        return {"tool_calls": [{"index": delta.index, "id": delta.id, "type": "function",
                                "function": {"name": delta.name, "arguments": ""}}]}
    assert isinstance(delta, ToolCallArguments)
    return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.fragment}}]}


# OpenAI's stand-in for a log-probability of -inf (JSON has no infinities).
MIN_LOGPROB = -9999.0


def chat_logprob_entry(event: TokenEvent, token_text: TokenText) -> dict[str, Any]:
    def item(token: int, logprob: float) -> dict[str, Any]:
        text = token_text(token)
        value = logprob if math.isfinite(logprob) else MIN_LOGPROB
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    entry = item(event.token, event.logprob)
    entry["top_logprobs"] = [item(t, lp) for t, lp in event.top_logprobs]
    return entry


def completion_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """Legacy completions format from chat-style entries (token, logprob, top_logprobs)."""
    offsets, position = [], offset
    for entry in entries:
        offsets.append(position)
        position += len(entry["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class ResponseBuilder:
    """Builds one request's chunks and final body for either endpoint (`chat` or legacy `completion`)."""

    def __init__(self, kind: str, response_id: str, model: str, n: int, prompt_tokens: int,
                 token_text: TokenText, logprobs: bool, tool_parser: Callable[[], Any] | None = None) -> None:
        self.kind = kind
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.prompt_tokens = prompt_tokens
        self.token_text = token_text
        self.want_logprobs = logprobs
        self.choices = [Choice(parser=tool_parser() if tool_parser else None) for _ in range(n)]
        self.cached_tokens = 0
        self._role_sent = [False] * n

    # --- accumulating ----------------------------------------------------------------------------------------
    def add(self, event: TokenEvent) -> dict[str, Any] | None:
        """Record one event; returns its logprob entry (if any). Raises the APIError of a failed finish."""
        error = failure(event)
        if error is not None:
            raise error
        choice = self.choices[event.index]
        if event.cached_tokens is not None and event.index == 0:
            self.cached_tokens = event.cached_tokens
        entry = None
        if event.token is not None:
            choice.tokens += 1
            if self.want_logprobs and event.logprob is not None:
                entry = chat_logprob_entry(event, self.token_text)
                choice.logprobs.append(entry)
        choice.text += event.text
        choice.finish_reason = event.finish_reason or choice.finish_reason
        if choice.parser is not None:
            choice.pending += choice.parser.feed(event.text) if event.text else []
            if event.finish_reason is not None:
                choice.pending += choice.parser.finish()
        return entry

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, sum(c.tokens for c in self.choices), self.cached_tokens)

    # --- whole body ------------------------------------------------------------------------------------------
    def body(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.choices):
            if self.kind == "chat":
                logprobs = {"content": choice.logprobs} if self.want_logprobs else None
                message: dict[str, Any] = {"role": "assistant", "content": choice.text}
                if choice.parser is not None:
                    calls = choice.parser.calls
                    message["content"] = choice.parser.text or (None if calls else "")
                    if calls:
                        message["tool_calls"] = tool_call_dicts(calls)
                choices.append({"index": index, "message": message, "logprobs": logprobs,
                                "finish_reason": choice.reported_finish()})
            else:
                logprobs = completion_logprobs(choice.logprobs) if self.want_logprobs else None
                choices.append({"index": index, "text": choice.text, "logprobs": logprobs,
                                "finish_reason": choice.finish_reason})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage()}

    # --- streaming -------------------------------------------------------------------------------------------
    def chunk(self, event: TokenEvent, entry: dict[str, Any] | None, include_usage: bool) -> bytes:
        """The SSE chunk for one event ('' when it carries nothing: held-back text, no logprobs, no finish)."""
        if self.kind == "chat" and self.choices[event.index].parser is not None:
            return self._tool_chunks(event, entry, include_usage)
        index = event.index
        if not event.text and entry is None and event.finish_reason is None and self._role_sent[index]:
            return b""
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if not self._role_sent[index]:
                delta["role"] = "assistant"
                self._role_sent[index] = True
            if event.text or event.finish_reason is None:
                delta["content"] = event.text
            logprobs = {"content": [entry]} if entry is not None else None
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": event.finish_reason}
            obj = "chat.completion.chunk"
        else:
            self._role_sent[index] = True
            position = len(self.choices[index].text) - len(event.text)
            logprobs = completion_logprobs([entry], position) if entry is not None else None
            choice = {"index": index, "text": event.text, "logprobs": logprobs,
                      "finish_reason": event.finish_reason}
            obj = "text_completion"
        payload = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                   "choices": [choice]}
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    def _tool_chunks(self, event: TokenEvent, entry: dict[str, Any] | None, include_usage: bool) -> bytes:
        """Chunks of a completion read for tool calls: its parsed deltas, in order, then its finish."""
        index, choice = event.index, self.choices[event.index]
        deltas = [_delta_dict(d) for d in choice.pending]
        choice.pending = []
        if not self._role_sent[index]:
            deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}] + deltas[1:]
            self._role_sent[index] = True
        finish = choice.reported_finish() if event.finish_reason is not None else None
        if finish is not None or (entry is not None and not deltas):
            deltas.append({})
        out = []
        for position, delta in enumerate(deltas):
            last = position == len(deltas) - 1
            logprobs = {"content": [entry]} if entry is not None and last else None
            payload = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                       "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                    "finish_reason": finish if last else None}]}
            if include_usage:
                payload["usage"] = None
            out.append(sse(payload))
        return b"".join(out)

    def usage_chunk(self) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return sse({"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [],
                    "usage": self.usage()})
