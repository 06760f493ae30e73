"""The JSON inside a tool call: where a streamed JSON value ends, and what a decoded call object means.

Every family writes a call's arguments (and often the whole call) as JSON. `JsonSpan` finds where an object or
array that opens at a known position of a growing text closes, without decoding it, so a parser knows when a
call is complete; it reads each character once across feeds and ignores brackets inside strings (an argument
may well contain `}` or `</tool_call>`). `call_from_object` checks a decoded call and normalizes its arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_IN_STRING_STOP = re.compile(r'[\\"]')
_STRUCTURE_STOP = re.compile(r'["{}\[\]]')
OPENERS = "{["


@dataclass(frozen=True)
class ParsedCall:
    """A call a parser recognized: `arguments` is already the normalized JSON text of an object."""

    name: str
    arguments: str
    id: str | None = None  # when the model wrote one (Mistral's `[CALL_ID]`), else the parser makes one


class JsonSpan:
    """Where the JSON object or array opening at `start` of a text ends; the text may grow between calls."""

    def __init__(self, start: int) -> None:
        self.start = start
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._end: int | None = None

    def end(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while the value is still open (read up to len(text))."""
        if self._end is not None:
            return self._end
        if self._pos == self.start and (len(text) <= self.start or text[self.start] not in OPENERS):
            raise ValueError(f"start: the text at {self.start} does not open a JSON object or array")
        i, n = self._pos, len(text)
        while i < n:
            if self._escape:  # the character after a backslash inside a string
                self._escape = False
                i += 1
                continue
            found = (_IN_STRING_STOP if self._in_string else _STRUCTURE_STOP).search(text, i)
            if found is None:
                i = n
                break
            ch, i = found.group(), found.end()
            if self._in_string:
                if ch == "\\":
                    self._escape = True
                else:
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in OPENERS:
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._end = i
                    return i
        self._pos = i
        return None


def normalize_arguments(value: Any) -> str | None:
    """The arguments as JSON text of an object (`json.dumps`, non-ASCII kept), or None when they are not one.

    A JSON string holding an object is accepted too: some models write `"arguments": "{\\"city\\": ...}"`.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def call_from_object(obj: Any, argument_keys: tuple[str, ...], arguments_required: bool) -> ParsedCall | None:
    """A call from a decoded `{"name": ..., <argument key>: {...}}`, or None when it is not a well-formed one.

    The first of `argument_keys` present holds the arguments; when none is, the call has no arguments (`{}`)
    unless `arguments_required` (a family whose calls are bare JSON, where an object without them is content).
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    key = next((k for k in argument_keys if k in obj), None)
    if key is None:
        return None if arguments_required else ParsedCall(name, "{}")
    arguments = normalize_arguments(obj[key])
    if arguments is None:
        return None
    return ParsedCall(name, arguments)


def decode(text: str) -> Any:
    """`json.loads`, with None for text that is not JSON (a malformed call is content, not an error)."""
    try:
        return json.loads(text)
    except ValueError:
        return None
