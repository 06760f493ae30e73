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
