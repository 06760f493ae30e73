"""Mistral tool calls: `[TOOL_CALLS]` then a JSON array of calls, or the newer `[TOOL_CALLS]name[ARGS]{...}`.

Mistral 7B v0.3, Mixtral 8x22B and Nemo write `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (a
single object without the array is accepted too); later models (Mistral Small 3.2, Devstral, Magistral) write
each call as `[TOOL_CALLS]name[ARGS]{...}`, optionally `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`.
`[TOOL_CALLS]`, `[ARGS]` and `[CALL_ID]` are control tokens of Mistral's tokenizers: they are in the text only
when the detokenizer keeps special tokens.

A call whose array holds anything but well-formed calls, or whose name form breaks off, is content. Mistral's
chat templates refuse tool-call ids that are not 9 alphanumeric characters, so this parser makes ids of that
form (`mistral_call_id`) unless the model wrote one with `[CALL_ID]`.
"""

from __future__ import annotations

import re
import secrets
import string
from typing import Any, Callable

from cortexstream.server.tool_calls.call_json import (OPENERS, ParsedCall, call_from_object, decode,
                                                      normalize_arguments)
from cortexstream.server.tool_calls.parser import (CallScan, CallSearch, Context, ScanStatus, ToolCallParser,
                                                   search_marker)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
ARGUMENT_KEYS = ("arguments", "parameters")
_SPACE = re.compile(r"\s*")
_NAME = re.compile(r'[^\s\[\]{}"]+')
_ID = re.compile(r"[^\s\[\]]+")
_ID_ALPHABET = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A call id Mistral's chat templates accept: 9 alphanumeric characters."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _calls_from_json(value: Any) -> tuple[ParsedCall, ...] | None:
    items = value if isinstance(value, list) else [value]
    calls = tuple(call_from_object(item, ARGUMENT_KEYS, arguments_required=False) for item in items)
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]  # no None left


class MistralToolParser(ToolCallParser):
    """Parses `[TOOL_CALLS]` calls, in either of Mistral's forms, out of a streamed completion."""

    def __init__(self, id_factory: Callable[[], str] = mistral_call_id) -> None:
        super().__init__(id_factory)

    def _find_call(self, text: str, context: Context, final: bool) -> CallSearch:
        return search_marker(text, TOOL_CALLS)

    def _scan_call(self, text: str, final: bool) -> CallScan:
        at = _SPACE.match(text, len(TOOL_CALLS)).end()
        if at == len(text):
            return CallScan(ScanStatus.MORE)
        if text[at] in OPENERS:
            end = self._json_end(text, at)
            if end is None:
                return CallScan(ScanStatus.MORE)
            calls = _calls_from_json(decode(text[at:end]))
            if calls is None:
                return CallScan(ScanStatus.MALFORMED, end)
            return CallScan(ScanStatus.DONE, end, calls)
        return self._scan_named(text, at)

    def _scan_named(self, text: str, at: int) -> CallScan:
        """`name[ARGS]{...}` or `name[CALL_ID]id[ARGS]{...}`, from `at`."""
        name = _NAME.match(text, at)
        if name is None:
            return CallScan(ScanStatus.MALFORMED, at)  # the marker alone is content; what follows is read anew
        at = name.end()
        call_id = None
        if text.startswith(CALL_ID, at):
            given = _ID.match(text, at + len(CALL_ID))
            if given is None:
                return self._more_or_malformed(text, at + len(CALL_ID), ())
            call_id, at = given.group(), given.end()
        if not text.startswith(ARGS, at):
            return self._more_or_malformed(text, at, (ARGS,) if call_id else (ARGS, CALL_ID))
        at = _SPACE.match(text, at + len(ARGS)).end()
        if at == len(text):
            return CallScan(ScanStatus.MORE)
        if text[at] != "{":
            return CallScan(ScanStatus.MALFORMED, at)
        end = self._json_end(text, at)
        if end is None:
            return CallScan(ScanStatus.MORE)
        arguments = normalize_arguments(decode(text[at:end]))
        if arguments is None:
            return CallScan(ScanStatus.MALFORMED, end)
        return CallScan(ScanStatus.DONE, end, (ParsedCall(name.group(), arguments, call_id),))

    @staticmethod
    def _more_or_malformed(text: str, at: int, markers: tuple[str, ...]) -> CallScan:
        """At `at` one of `markers` must come: wait while the text so far may still be its beginning."""
        rest = text[at:]
        if any(marker.startswith(rest) for marker in markers) or (not markers and not rest):
            return CallScan(ScanStatus.MORE)
        return CallScan(ScanStatus.MALFORMED, at)
