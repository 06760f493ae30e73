"""How many prompt tokens a step may prefill while other sequences decode, measured rather than guessed.

A decode step's running streams wait for the whole step, so a prefill chunk in it adds its full cost to their
inter-token latency. On a CPU a prompt token costs about as much as a decode step of 1/30 of a batch, and its cost
grows with the KV it attends to, so a fixed token budget is either too small early (a long prompt waits many
steps for its first token) or too large late (running streams stall). `AdaptivePrefillBudget` keeps the chunk's
expected time at `ratio` x a decode step's, from running averages of both, so running streams see their
inter-token latency rise by at most about that factor while a long prompt is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptivePrefillBudget:
    max_tokens: int  # the step's whole prefill budget (prefill_step_size)
    ratio: float = 1.5  # chunk time / decode step time: running streams see about 2.5x their usual latency
    min_tokens: int = 16  # progress for the prompt even when decode steps are very cheap
    smoothing: float = 0.5  # weight of the newest observation: costs change as the context grows
    decode_seconds: float | None = None  # running average of one decode step
    seconds_per_token: float | None = None  # running average of one prefill token

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

    def tokens(self) -> int:
        """The budget for the next step that also decodes."""
        if self.decode_seconds is None or self.seconds_per_token is None:
            return min(self.max_tokens, 4 * self.min_tokens)  # nothing measured yet: a cautious start
        budget = int(self.ratio * self.decode_seconds / self.seconds_per_token)
        return max(self.min_tokens, min(self.max_tokens, budget))
