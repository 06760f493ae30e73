"""How the runner turns one request's logits into its next token: logits processors, the sampler, log-probs.

One per request the runner holds (made from the plan's `NewRequest`). It keeps the request's token history as an
array when a logits processor (repetition penalty) needs it: the sampled tokens join it lazily, so a pipelined
decode step can sample before anyone has read the previous token.

A request with a grammar (`SamplingParams.grammar`) has its logits masked to the tokens the grammar allows. The
mask depends on every earlier token, so its draw reads the previous sampled token first (in a pipelined step that
waits for the previous step only, not for the one being built). Its matcher is made on the first draw, replaying
the output tokens a re-created request already has, and a grammar failure ends that request alone.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx

from cortexstream.engine.sampling import SamplingParams, keep_random_state
from cortexstream.grammar.constraint import TokenConstraint, apply_mask
from cortexstream.grammar.spec import GrammarSpec

ConstraintFactory = Callable[[GrammarSpec], TokenConstraint]


class SamplingFailed(Exception):
    """A request's sampler or logits processor raised or returned something that is not a token."""


class RequestSampler:
    def __init__(self, sampling: SamplingParams, token_ids: tuple[int, ...],
                 sampler: Callable[[mx.array], mx.array] | None = None,
                 constraints: ConstraintFactory | None = None, num_prompt_tokens: int | None = None) -> None:
        self.sampling = sampling
        self.custom = sampler is not None  # a caller's sampler(logprobs) -> token, mlx-lm style
        self.sampler = sampler if sampler is not None else sampling.make_sampler()
        self.processors = sampling.make_logits_processors()
        self.history = mx.array(token_ids, dtype=mx.uint32) if self.processors else None
        self.constraint: TokenConstraint | None = None
        self._constraints = constraints
        prompt = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self._replay: Sequence[int] = token_ids[prompt:] if sampling.grammar is not None else ()
        self._unread: mx.array | None = None  # the last token sampled, not yet consumed by the grammar

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
        if self.sampling.grammar is not None:
            self._unread = token
        return token, logprobs

    def _constrain(self, logits: mx.array) -> mx.array:
        if self.constraint is None:
            if self._constraints is None:
                raise RuntimeError("this runner has no grammar compiler (Engine makes one from its tokenizer)")
            self.constraint = self._constraints(self.sampling.grammar)
            self.constraint.replay(self._replay)
            self._replay = ()
        elif self._unread is not None:
            self.constraint.consume(int(self._unread.item()))
        self._unread = None
        return apply_mask(logits, self.constraint.allowed(logits.shape[-1]))

    def _draw(self, logits: mx.array) -> tuple[Any, mx.array]:
        if self.sampling.grammar is not None:
            logits = self._constrain(logits)
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
