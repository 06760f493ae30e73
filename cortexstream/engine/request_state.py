"""What an engine step hands back per request (`RequestOutput`) and what the engine keeps per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.engine.sequence import Sequence
from cortexstream.engine.text_stream import TextStream


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token: int | None
    text: str
    logprobs: mx.array | None
    prompt_tokens: int
    generation_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None
    ttft: float | None = None  # seconds from arrival to the first token
    stop_string: str | None = None  # the stop string a 'stop' finish ended on (None: eos, or not finished)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestText:
    """What the engine keeps per request: its sequence (read only), its detokenizer and stop strings."""

    def __init__(self, seq: Sequence, tokenizer: Any, eos_ids: set[int]) -> None:
        self.seq = seq
        self.text = TextStream(tokenizer, seq.sampling.stop)
        self.eos_ids = eos_ids

    def accept(self, token_id: int) -> tuple[str, FinishReason | None]:
        """The text a token just appended to the sequence's output adds, and why the request ends with it (eos, a
        stop string, max_tokens) or None."""
        if token_id in self.eos_ids:
            return self.text.finish(), FinishReason.STOP
        text = self.text.add_token(token_id)
        if self.text.stopped:
            return text, FinishReason.STOP
        if len(self.seq.output_ids) >= self.seq.sampling.max_tokens:
            text = text + self.text.finish()
            # The flush can complete a stop string that the held-back text hid until now.
            return text, FinishReason.STOP if self.text.stopped else FinishReason.LENGTH
        return text, None
