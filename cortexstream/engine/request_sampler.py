"""How the runner turns one request's logits into its next token: logits processors, the sampler, log-probs.

One per request the runner holds (made from the plan's `NewRequest`). It keeps the request's token history as an
array when a logits processor (repetition penalty) needs it: the sampled tokens join it lazily, so a pipelined
decode step can sample before anyone has read the previous token.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx

from cortexstream.engine.sampling import SamplingParams, keep_random_state


class SamplingFailed(Exception):
    """A request's sampler or logits processor raised or returned something that is not a token."""


class RequestSampler:
    def __init__(self, sampling: SamplingParams, token_ids: tuple[int, ...],
                 sampler: Callable[[mx.array], mx.array] | None = None) -> None:
        self.sampling = sampling
        self.custom = sampler is not None  # a caller's sampler(logprobs) -> token, mlx-lm style
        self.sampler = sampler if sampler is not None else sampling.make_sampler()
        self.processors = sampling.make_logits_processors()
        self.history = mx.array(token_ids, dtype=mx.uint32) if self.processors else None

    def draw(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        """The lazy next token `[1]` and log-probabilities `[V]` from logits `[1, V]`. Raises SamplingFailed."""
        try:
            with keep_random_state():  # a sampler that raises must not leave MLX's random state broken for others
                token, logprobs = self._draw(logits)
            if token.size != 1 or not mx.issubdtype(token.dtype, mx.integer):
                raise TypeError(f"the sampler returned a {token.dtype} array of shape {tuple(token.shape)}, "
                                "expected one integer token id")
        except Exception as exc:  # noqa: BLE001 - reported for this request only, with its reason
            raise SamplingFailed(f"sampling failed: {type(exc).__name__}: {exc}") from exc
        if self.history is not None:
            self.history = mx.concatenate([self.history, token.astype(mx.uint32).reshape(1)])
        return token, logprobs

    def _draw(self, logits: mx.array) -> tuple[Any, mx.array]:
        if self.processors:
            for processor in self.processors:
                logits = processor(self.history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if self.sampling.greedy and not self.custom:
            # The argmax of the logits is that of the log-probabilities, so a greedy token needs no logsumexp (an
            # exp per vocabulary entry per sequence per step); its log-probabilities stay lazy and are computed
            # only if the caller reads them (they depend on the logits alone, not on the arena).
            return mx.argmax(logits, axis=-1), logprobs[0]
        return self.sampler(logprobs), logprobs[0]
