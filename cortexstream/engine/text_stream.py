"""Turn generated token ids into text segments, holding back text that may become a stop string."""

from __future__ import annotations

from typing import Any


class TextStream:
    """Streaming detokenisation with stop strings.

    Text is released only once it can no longer be the start of a stop string, so a caller never prints a
    stop string (or half of one) and then has to take it back.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._detokenizer = tokenizer.detokenizer
        self._detokenizer.reset()
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._emitted = 0
        self.stop_string: str | None = None  # the stop string the text ended on

    def add_token(self, token: int) -> str:
        """Feed one token; return the newly releasable text ('' if none). Sets `stop_string` on a stop string."""
        self._detokenizer.add_token(token)
        text = self._detokenizer.text
        cut = self._find_stop(text)
        if cut is not None:
            return self._release(text, cut)
        return self._release(text, max(self._emitted, len(text) - self._hold))

    def finish(self) -> str:
        """Flush everything still held back (end of generation without a stop string)."""
        if self.stopped:
            return ""
        self._detokenizer.finalize()
        text = self._detokenizer.text
        cut = self._find_stop(text)
        if cut is not None:
            return self._release(text, cut)
        return self._release(text, len(text))

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    @property
    def text(self) -> str:
        """All text released so far."""
        return self._released

    _released = ""

    def _find_stop(self, text: str) -> int | None:
        """Where the earliest stop string begins (recorded in `stop_string`), or None."""
        # Only the not-yet-released tail (plus overlap) can contain a new stop string.
        start = max(0, self._emitted - self._hold)
        cuts = [(i, s) for s in self._stop if (i := text.find(s, start)) >= 0]
        if not cuts:
            return None
        cut, self.stop_string = min(cuts, key=lambda pair: pair[0])
        return cut

    def _release(self, text: str, upto: int) -> str:
        upto = max(upto, self._emitted)
        segment = text[self._emitted : upto]
        self._emitted = upto
        self._released = text[:upto]
        return segment
