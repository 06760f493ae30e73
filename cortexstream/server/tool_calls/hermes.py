"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or several.

The format of NousResearch's Hermes models and of Qwen 2.5 / Qwen 3 (whose chat templates render calls so, and
whose tokenizers hold `<tool_call>` as an added, non-special token: it decodes as this text). Content may come
before, between and after calls. `arguments` may also be a JSON string holding the object, or `parameters`;
a call without them has none (`{}`).

The call's JSON is delimited by its brackets, not by the first `</tool_call>` in the text, so an argument may
contain that string. A body that is not one JSON object followed by `</tool_call>` is content, up to and
including the first `</tool_call>` after its `<tool_call>`; with no `</tool_call>` at all it is unterminated,
and content up to the end.

Untagged calls. Small Qwen models often drop the markers and write the call as bare JSON, alone or in a Markdown
fence (```json ... ```), as llama.cpp's Hermes parser also accepts. Given `known_tools` (the names the request
offered), such a call is read where a call can stand: at the start of the message or right after another call.
It must be an object (or an array of objects) whose every `name` is a known tool and which has `arguments` (or
`parameters`); anything else there (a JSON answer, a code block) is content, exactly as written. Without
`known_tools`, only tagged calls are read.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

from cortexstream.server.tool_calls.call_json import ParsedCall, call_from_object, decode
from cortexstream.server.tool_calls.parser import (CallScan, CallSearch, Context, ScanStatus, ToolCallParser,
                                                   search_marker)
from cortexstream.server.tool_types import new_call_id

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FENCE = "```"
ARGUMENT_KEYS = ("arguments", "parameters")
_SPACE = re.compile(r"\s*")
_FENCE_INFO = re.compile(r"[A-Za-z]*[ \t]*\r?\n")  # the fence's language tag (json, or none), then its newline


def _skip_space(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()


class HermesToolParser(ToolCallParser):
    """Parses `<tool_call>` ... `</tool_call>` blocks, and untagged calls to `known_tools`, out of a streamed
    completion (see the module doc)."""

    def __init__(self, id_factory: Callable[[], str] = new_call_id, known_tools: Iterable[str] = ()) -> None:
        super().__init__(id_factory)
        self._known = frozenset(known_tools)

    def _find_call(self, text: str, context: Context, final: bool) -> CallSearch:
        if self._known and context is not Context.TEXT:
            lead = _skip_space(text, 0)
            rest = text[lead:]
            if rest.startswith("{") or rest.startswith("[") or rest.startswith(FENCE):
                return CallSearch(lead, True)
            if not final and (not rest or FENCE.startswith(rest)):
                return CallSearch(lead, False)  # a call may still begin here: hold what could start one
        return search_marker(text, OPEN)

    def _scan_call(self, text: str, final: bool) -> CallScan:
        if not text.startswith(OPEN):
            return self._scan_bare(text, final)
        body = _skip_space(text, len(OPEN))
        if body == len(text):
            return self._up_to_close(text, final)
        if text[body] != "{":
            return self._up_to_close(text, final)
        end = self._json_end(text, body)
        if end is None:
            # Still open, or never closing (a missing bracket): only the end of the completion tells which.
            return self._up_to_close(text, final) if final else CallScan(ScanStatus.MORE)
        after = _skip_space(text, end)
        rest = text[after:]
        if not rest.startswith(CLOSE):
            if CLOSE.startswith(rest) and not final:
                return CallScan(ScanStatus.MORE)
            return self._up_to_close(text, final)
        consumed = after + len(CLOSE)
        call = call_from_object(decode(text[body:end]), ARGUMENT_KEYS, arguments_required=False)
        if call is None:
            return CallScan(ScanStatus.MALFORMED, consumed)
        return CallScan(ScanStatus.DONE, consumed, (call,))

    def _scan_bare(self, text: str, final: bool) -> CallScan:
        """An untagged call: a JSON object or array, maybe in a fence; MALFORMED (content) unless it is calls."""
        fenced = text.startswith(FENCE)
        body = 0
        if fenced:
            info = _FENCE_INFO.match(text, len(FENCE))
            if info is None:
                newline = text.find("\n", len(FENCE))
                if newline < 0 and not final:
                    return CallScan(ScanStatus.MORE)
                return CallScan(ScanStatus.MALFORMED, len(text) if newline < 0 else newline + 1)
            body = _skip_space(text, info.end())
            if body == len(text):
                return CallScan(ScanStatus.MORE)  # at the end of the completion this becomes content
            if text[body] not in "{[":
                return CallScan(ScanStatus.MALFORMED, body)  # a code block, not a call
        end = self._json_end(text, body)
        if end is None:
            return CallScan(ScanStatus.MORE)
        calls = self._known_calls(decode(text[body:end]))
        if not calls:
            return CallScan(ScanStatus.MALFORMED, end)
        if not fenced:
            return CallScan(ScanStatus.DONE, end, calls)
        after = _skip_space(text, end)
        rest = text[after:]
        if rest.startswith(FENCE):
            return CallScan(ScanStatus.DONE, after + len(FENCE), calls)
        if not final and FENCE.startswith(rest):
            return CallScan(ScanStatus.MORE)
        if final and not rest:
            return CallScan(ScanStatus.DONE, len(text), calls)  # the completion ended before the closing fence
        return CallScan(ScanStatus.MALFORMED, end)

    def _known_calls(self, value: object) -> tuple[ParsedCall, ...]:
        """The calls in a decoded object or array of objects, or () unless every one calls a known tool."""
        items = value if isinstance(value, list) else [value]
        calls = [call_from_object(item, ARGUMENT_KEYS, arguments_required=True) for item in items]
        if not calls or any(call is None or call.name not in self._known for call in calls):
            return ()
        return tuple(calls)  # type: ignore[arg-type]

    @staticmethod
    def _up_to_close(text: str, final: bool) -> CallScan:
        """Not a well-formed call: content through the first `</tool_call>`, or all of it when there is none."""
        close = text.find(CLOSE, len(OPEN))
        if close >= 0:
            return CallScan(ScanStatus.MALFORMED, close + len(CLOSE))
        return CallScan(ScanStatus.MALFORMED, len(text)) if final else CallScan(ScanStatus.MORE)
