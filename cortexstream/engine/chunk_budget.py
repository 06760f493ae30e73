"""How many prompt tokens a step may prefill while other sequences decode, from observed costs, not guessed.

A decode step's running streams wait for the whole step, so a prefill chunk in it adds its full cost to their
inter-token latency. On a CPU a prompt token costs about as much as a decode step of 1/30 of a batch, and its cost
grows with the KV it attends to, so a fixed token budget is either too small early (a long prompt waits many
steps for its first token) or too large late (running streams stall). `AdaptivePrefillBudget` keeps the chunk's
expected time at `ratio` x a decode step's, from running averages of both, so running streams see their
inter-token latency rise by about 1 + that factor while a long prompt is admitted. When the chunks ride in the
decode pass (engine/mixed_batch.py) a token's cost is what it adds to that pass (`observe_mixed`), without the
fixed cost of a pass of its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptivePrefillBudget:
    max_tokens: int  # the step's whole prefill budget (prefill_step_size)
    # chunk time / decode step time: running streams see about 2x their usual latency while a prompt is admitted
    # (the admission-window latency this gives: bench/results/throughput_itl.md; docs/performance.md).
    ratio: float = 1.0
    # Progress for the prompt even when its tokens are dear; small, because at long contexts even a few chunk
    # tokens attending to thousands of keys can cost more than a decode step on a CPU.
    min_tokens: int = 4
    smoothing: float = 0.5  # weight of the newest observation: costs change as the context grows
    decode_seconds: float | None = None  # running average of one decode step
    seconds_per_token: float | None = None  # running average of one prefill token in a pass of its own
    # Running average of what one prompt token adds to a decode pass it rides in (engine/mixed_batch.py): no
    # fixed cost of a pass of its own, so several times cheaper than `seconds_per_token` for small chunks.
    mixed_seconds_per_token: float | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.min_tokens < 1 or self.ratio <= 0 or not 0 < self.smoothing <= 1:
            raise ValueError(f"AdaptivePrefillBudget: bad settings {self}")

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe(self, prefill_tokens: int, prefill_seconds: float, decode_seconds: float | None) -> None:
        """Record one step: its prefill tokens and time, and its decode time (None: it decoded nothing)."""
        if prefill_tokens > 0 and prefill_seconds > 0:
            self.seconds_per_token = self._average(self.seconds_per_token, prefill_seconds / prefill_tokens)
        if decode_seconds is not None and decode_seconds > 0:
            self.decode_seconds = self._average(self.decode_seconds, decode_seconds)

    def observe_mixed(self, prefill_tokens: int, step_seconds: float) -> None:
        """Record a decode pass that also computed `prefill_tokens` prompt tokens: their cost is the pass's time
        beyond an average decode step (not recorded as a decode step itself)."""
        if prefill_tokens > 0 and self.decode_seconds is not None:
            extra = max(step_seconds - self.decode_seconds, 0.05 * self.decode_seconds)
            self.mixed_seconds_per_token = self._average(self.mixed_seconds_per_token, extra / prefill_tokens)

    def after_step(self, prefill_tokens: int, prefill_seconds: float, mixed_tokens: int,
                   decode_seconds: float | None, decoded: bool, mixed: bool) -> int:
        """Record a step as the engine measured it (`decoded`: it planned decode work; `mixed_tokens` prompt tokens
        rode in its decode pass) and return the budget for the next step (`mixed`: chunks may ride again)."""
        self.observe(prefill_tokens, prefill_seconds, decode_seconds if decoded and not mixed_tokens else None)
        if mixed_tokens and decode_seconds is not None:
            self.observe_mixed(mixed_tokens, decode_seconds)
        return self.tokens(mixed=mixed)

    def tokens(self, mixed: bool = False) -> int:
        """The budget for the next step that also decodes; `mixed`: its chunks ride in the decode pass."""
        per_token = self.mixed_seconds_per_token if mixed and self.mixed_seconds_per_token else self.seconds_per_token
        if self.decode_seconds is None or per_token is None:
            return min(self.max_tokens, 4 * self.min_tokens)  # nothing measured yet: a cautious start
        budget = int(self.ratio * self.decode_seconds / per_token)
        return max(self.min_tokens, min(self.max_tokens, budget))
