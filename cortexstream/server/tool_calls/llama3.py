"""Llama 3.x tool calls: the message is a JSON object `{"name": ..., "parameters": {...}}`.

Llama 3.1-3.3 answer a call with the call itself as the whole message, optionally after `<|python_tag|>` (a
special token: it is in the text only when the detokenizer keeps special tokens), and may write several
separated by `;` or newlines. `arguments` is accepted in place of `parameters`, and a JSON string holding the
object in place of the object.

Without a marker, a JSON object is read as a call only where one can be: at the start of the message or right
after another call (past separators). An object there that is not a call (no `name`, or no `parameters` /
`arguments`: the model may simply be answering in JSON) is content, and so is everything after it.
`<|python_tag|>` starts a call anywhere; when what follows it is not a JSON object (Llama's code-interpreter
calls are Python) the tag and what follows are content.
"""

from __future__ import annotations

import re
from cortexstream.server.tool_calls.call_json import call_from_object, decode
from cortexstream.server.tool_calls.parser import (CallScan, CallSearch, Context, ScanStatus, ToolCallParser,
                                                   search_marker)

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")
_SPACE = re.compile(r"\s*")
_SEPARATORS = re.compile(r"[\s;]*")


class Llama3ToolParser(ToolCallParser):
    """Parses Llama 3.x JSON tool calls out of a streamed completion (see the module doc)."""

    def _find_call(self, text: str, context: Context, final: bool) -> CallSearch:
        if context is not Context.TEXT:
            lead = (_SEPARATORS if context is Context.AFTER_CALL else _SPACE).match(text).end()
            rest = text[lead:]
            if rest.startswith("{") or rest.startswith(PYTHON_TAG):
                return CallSearch(0, True)  # separators before a call belong to it: content if it is malformed
            if not rest:
                # Only separators so far: a call may follow. At the end, those after a call are dropped with it.
                return CallSearch(0, bool(final and text and context is Context.AFTER_CALL))
            if PYTHON_TAG.startswith(rest):
                return CallSearch(0, False)
        return search_marker(text, PYTHON_TAG)

    def _scan_call(self, text: str, final: bool) -> CallScan:
        at = _SEPARATORS.match(text).end()
        tagged = text.startswith(PYTHON_TAG, at)
        if tagged:
            at = _SPACE.match(text, at + len(PYTHON_TAG)).end()
        if at == len(text):
            return CallScan(ScanStatus.MORE) if tagged else CallScan(ScanStatus.DONE, len(text))
        if text[at] != "{":
            return CallScan(ScanStatus.MALFORMED, at)  # the tag, then something that is not a JSON call
        end = self._json_end(text, at)
        if end is None:
            return CallScan(ScanStatus.MORE)
        call = call_from_object(decode(text[at:end]), ARGUMENT_KEYS, arguments_required=True)
        if call is None:
            return CallScan(ScanStatus.MALFORMED, end)
        return CallScan(ScanStatus.DONE, end, (call,))
