"""Hermes / Qwen tool calls: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or several.

The format of NousResearch's Hermes models and of Qwen 2.5 / Qwen 3 (whose chat templates render calls so, and
whose tokenizers hold `<tool_call>` as an added, non-special token: it decodes as this text). Content may come
before, between and after calls. `arguments` may also be a JSON string holding the object, or `parameters`;
a call without them has none (`{}`).

The call's JSON is delimited by its brackets, not by the first `</tool_call>` in the text, so an argument may
contain that string. A body that is not one JSON object followed by `</tool_call>` is content, up to and
including the first `</tool_call>` after its `<tool_call>`; with no `</tool_call>` at all it is unterminated,
and content up to the end.
"""

from __future__ import annotations

from cortexstream.server.tool_calls.call_json import call_from_object, decode
from cortexstream.server.tool_calls.parser import (CallScan, CallSearch, Context, ScanStatus, ToolCallParser,
                                                   search_marker)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


class HermesToolParser(ToolCallParser):
    """Parses `<tool_call>` ... `</tool_call>` blocks out of a streamed completion (see the module doc)."""

    def _find_call(self, text: str, context: Context, final: bool) -> CallSearch:
        return search_marker(text, OPEN)

    def _scan_call(self, text: str, final: bool) -> CallScan:
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

    @staticmethod
    def _up_to_close(text: str, final: bool) -> CallScan:
        """Not a well-formed call: content through the first `</tool_call>`, or all of it when there is none."""
        close = text.find(CLOSE, len(OPEN))
        if close >= 0:
            return CallScan(ScanStatus.MALFORMED, close + len(CLOSE))
        return CallScan(ScanStatus.MALFORMED, len(text)) if final else CallScan(ScanStatus.MORE)
