"""What an engine step hands back per request (`RequestOutput`) and what the engine keeps per request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

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
    finish_reason: str | None = None
    error: str | None = None
    ttft: float | None = None  # seconds from arrival to the first token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _RequestState:
    def __init__(self, seq: Sequence, tokenizer: Any, eos_ids: set[int], sampler: Any = None) -> None:
        self.seq = seq
        self.text = TextStream(tokenizer, seq.sampling.stop)
        self.custom_sampler = sampler is not None  # a caller's sampler(logprobs) -> token, mlx-lm style
        self.sampler = sampler if sampler is not None else seq.sampling.make_sampler()
        self.processors = seq.sampling.make_logits_processors()
        self.eos_ids = eos_ids

    def set_sampler(self, sampler: Any) -> None:
        self.sampler = sampler
        self.custom_sampler = True

    def draw(self, logits: mx.array, pending: mx.array | None) -> tuple[mx.array, mx.array]:
        """The lazy next token and log-probabilities from this step's logits (`pending`: the token still in
        flight, part of the history the logits processors see)."""
        if self.processors:
            history = mx.array(self.seq.all_ids, dtype=mx.uint32)
            if pending is not None:
                history = mx.concatenate([history, pending.astype(mx.uint32).reshape(1)])
            for processor in self.processors:
                logits = processor(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.seq.sampling.greedy and not self.custom_sampler:
            # The argmax of the logits is that of the log-probabilities, so a greedy token needs no logsumexp (an
            # exp per vocabulary entry, ~1 ms per sequence per step on CPU); its log-probabilities stay lazy and
            # are computed only if the caller reads them (they depend on the logits alone, not on the arena).
            return mx.argmax(logits, axis=-1), logprobs[0]
        return self.sampler(logprobs), logprobs[0]
