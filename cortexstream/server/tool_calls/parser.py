"""What every tool-call parser does with a completion's text: split it, as it streams, into content and calls.

A family (Hermes, Llama 3, Mistral) says only two things: where in the held text a call may begin
(`_find_call`) and, given text that begins with one, whether the call is complete, still open, or malformed
(`_scan_call`). `ToolCallParser` does the rest the same way for all: it emits content as soon as it cannot be
the start of a call marker, a completed call as `ToolCallStart` then its arguments, and a malformed or
unterminated call as the content it is (never an exception, never a lost character).

Whitespace-only content between calls, before the first or after the last is a separator and is dropped when
the completion has a call; content with anything else in it is kept verbatim, and a completion without calls
comes back exactly as it was written.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from cortexstream.server.tool_calls.call_json import JsonSpan, ParsedCall
from cortexstream.server.tool_types import (StreamDelta, TextDelta, ToolCall, ToolCallArguments, ToolCallStart,
                                            new_call_id)


class Context(enum.Enum):
    """What came before the held text: families whose calls are bare JSON only read one in some places."""

    START = "start"  # nothing but whitespace so far
    AFTER_CALL = "after_call"  # a call, then nothing but whitespace
    TEXT = "text"  # content with something other than whitespace since the last call


class ScanStatus(enum.Enum):
    MORE = "more"  # the call is still open: wait for more text
    DONE = "done"  # the call (or calls) ended at `consumed`
    MALFORMED = "malformed"  # text[:consumed] looked like a call but is not one: it is content


@dataclass(frozen=True)
class CallScan:
    status: ScanStatus
    consumed: int = 0
    calls: tuple[ParsedCall, ...] = ()


@dataclass(frozen=True)
class CallSearch:
    """`text_end`: the held text before it is content. `found`: a call begins there (else the rest is held)."""

    text_end: int
    found: bool


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (what must be held back)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def search_marker(text: str, marker: str) -> CallSearch:
    """A call begins at the first `marker`; otherwise all but a possible partial marker at the end is content."""
    at = text.find(marker)
    if at >= 0:
        return CallSearch(at, True)
    return CallSearch(len(text) - partial_marker_length(text, marker), False)


class ToolCallParser(ABC):
    """Incremental: `feed` fragments of the completion's text as they arrive, then `finish` once.

    `id_factory` makes each call's id (the default is `new_call_id`; a family whose chat template checks ids
    may use its own).
    """

    def __init__(self, id_factory: Callable[[], str] = new_call_id) -> None:
        self._id_factory = id_factory
        self._held = ""  # text not yet turned into deltas
        self._in_call = False  # `_held` begins with a call
        self._pending_space = ""  # whitespace-only content held back: a separator if a call follows
        self._content_since_call = False  # content other than whitespace since the last call (or the start)
        self._calls: list[ToolCall] = []
        self._text_parts: list[str] = []
        self._finished = False
        self._span: JsonSpan | None = None  # the open call's JSON value, once it has begun

    @property
    def calls(self) -> list[ToolCall]:
        """The completed calls, in order."""
        return list(self._calls)

    @property
    def text(self) -> str:
        """The content: the text outside calls (malformed calls included, as written)."""
        return "".join(self._text_parts)

    def feed(self, text: str) -> list[StreamDelta]:
        if self._finished:
            raise RuntimeError("feed: this parser has finished; make a new one for the next completion")
        self._held += text
        return self._advance(final=False)

    def finish(self) -> list[StreamDelta]:
        """The end of the completion: what is held is content now, an open call included."""
        if self._finished:
            raise RuntimeError("finish: this parser has already finished")
        out = self._advance(final=True)
        self._finished = True
        if self._pending_space and not self._calls:
            self._emit_text(out, self._pending_space)
        self._pending_space = ""
        return out

    # --- what a family decides --------------------------------------------------------------------------------
    @abstractmethod
    def _find_call(self, text: str, context: Context, final: bool) -> CallSearch:
        """Where in the held `text` (which holds no call yet) a call begins, if it does."""

    @abstractmethod
    def _scan_call(self, text: str, final: bool) -> CallScan:
        """Given held text that begins where `_find_call` said a call does: complete, open or malformed.

        `text` only grows between calls until a DONE or MALFORMED; when `final`, MORE means unterminated.
        """

    def _begin_call(self) -> None:
        """A new call begins at the start of the held text: reset any state kept for `_scan_call` (a family that
        keeps more than the JSON span extends this)."""
        self._span = None

    def _json_end(self, text: str, at: int) -> int | None:
        """Where the call's JSON value, which begins at `at` of the held text, ends (None while it is open)."""
        if self._span is None:
            self._span = JsonSpan(at)
        return self._span.end(text)

    # --- the common machinery ---------------------------------------------------------------------------------
    def _context(self) -> Context:
        if self._content_since_call:
            return Context.TEXT
        return Context.AFTER_CALL if self._calls else Context.START

    def _advance(self, final: bool) -> list[StreamDelta]:
        out: list[StreamDelta] = []
        while True:
            if not self._in_call:
                search = self._find_call(self._held, self._context(), final)
                if not search.found:
                    end = len(self._held) if final else search.text_end
                    self._content(out, self._held[:end])
                    self._held = self._held[end:]
                    return out
                self._content(out, self._held[:search.text_end])
                self._held = self._held[search.text_end:]
                self._in_call = True
                self._begin_call()
            scan = self._scan_call(self._held, final)
            if scan.status is ScanStatus.MORE:
                if not final:
                    return out
                scan = CallScan(ScanStatus.MALFORMED, len(self._held))
            if scan.consumed <= 0:  # a family's bug: without progress the loop would not end
                raise AssertionError(f"{type(self).__name__}: a scan must consume the text it resolves")
            raw, self._held = self._held[:scan.consumed], self._held[scan.consumed:]
            self._in_call = False
            if scan.status is ScanStatus.DONE:
                self._pending_space = ""
                self._content_since_call = False
                for call in scan.calls:
                    self._emit_call(out, call)
            else:
                self._content(out, raw)

    def _content(self, out: list[StreamDelta], text: str) -> None:
        """Content, holding back whitespace until something else shows it is not a separator between calls."""
        if not text:
            return
        if not self._content_since_call:
            if not text.strip():
                self._pending_space += text
                return
            text, self._pending_space = self._pending_space + text, ""
            self._content_since_call = True
        self._emit_text(out, text)

    def _emit_text(self, out: list[StreamDelta], text: str) -> None:
        self._text_parts.append(text)
        out.append(TextDelta(text))

    def _emit_call(self, out: list[StreamDelta], parsed: ParsedCall) -> None:
        call = ToolCall(id=parsed.id or self._id_factory(), name=parsed.name, arguments=parsed.arguments)
        index = len(self._calls)
        self._calls.append(call)
        out.append(ToolCallStart(index=index, id=call.id, name=call.name))
        out.append(ToolCallArguments(index=index, fragment=call.arguments))


def parse_complete(parser_cls: Callable[[], ToolCallParser], text: str) -> tuple[str, list[ToolCall]]:
    """A whole (non-streamed) completion: its content and its calls."""
    parser = parser_cls()
    parser.feed(text)
    parser.finish()
    return parser.text, parser.calls
