"""Text that cannot be encoded as UTF-8 (undecodable bytes from a terminal or argv) is repaired at the door.

Python hands undecodable command-line and terminal bytes over as lone surrogates (`surrogateescape`: byte 0xFF
becomes U+DCFF). Tokenizers refuse such strings with a TypeError. We decode those bytes again with replacement,
as a terminal would show them: every undecodable byte becomes U+FFFD, and the text keeps everything else.
"""

from __future__ import annotations

from typing import Any

from cortexstream.errors import InvalidArgumentError

REPLACEMENT = "\ufffd"


def has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def repair_text(text: str) -> str:
    """`text` with undecodable bytes (lone surrogates) replaced by U+FFFD; valid text is returned unchanged."""
    if not has_surrogates(text):
        return text
    raw = text.encode("utf-8", "surrogateescape") if _only_escaped_bytes(text) else None
    if raw is not None:
        return raw.decode("utf-8", "replace")
    # Surrogates outside the escape range (e.g. "\ud800" typed in Python) are not bytes at all: replace them.
    return "".join(REPLACEMENT if 0xD800 <= ord(ch) <= 0xDFFF else ch for ch in text)


def _only_escaped_bytes(text: str) -> bool:
    return all(0xDC80 <= ord(ch) <= 0xDCFF for ch in text if 0xD800 <= ord(ch) <= 0xDFFF)


def repair_messages(messages: list[Any], name: str = "prompt") -> list[Any]:
    """Chat messages with each string content repaired (other fields are left to the chat template)."""
    out = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            message = {**message, "content": repair_text(content)}
        elif content is not None and not isinstance(content, list):
            raise InvalidArgumentError(f"{name}: chat message {i} content must be a string, got "
                                       f"{type(content).__name__}")
        out.append(message)
    return out
