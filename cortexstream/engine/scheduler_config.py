"""`SchedulerConfig`: how many sequences run at once and how many prompt tokens one step may compute. Pure Python.

The prefill budget is the scheduler's rule for chunked prefill: a step with nothing decoding may compute
`prefill_step_size` prompt tokens; a step that also decodes computes at most `prefill_tokens_while_decoding` per
request being prefilled, so admitting a long prompt delays the running streams' next token by a bounded amount.
"""

from __future__ import annotations

from dataclasses import dataclass

from cortexstream.errors import InvalidArgumentError


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    prefill_step_size: int = 512  # prompt tokens computed per step, over all prefilling sequences
    # The budget while other sequences are decoding, per request being prefilled (None: prefill_step_size). A
    # smaller one bounds how much one prompt being admitted delays the next token of running streams; it grows
    # with the number of prompts waiting for their first token, which matter as much as the running streams.
    prefill_tokens_while_decoding: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise InvalidArgumentError(f"max_num_seqs: {self.max_num_seqs!r} must be an integer >= 1")
        if not isinstance(self.prefill_step_size, int) or self.prefill_step_size < 1:
            raise InvalidArgumentError(f"prefill_step_size: {self.prefill_step_size!r} must be an integer >= 1")
        mixed = self.prefill_tokens_while_decoding
        if mixed is not None and (not isinstance(mixed, int) or isinstance(mixed, bool) or mixed < 1):
            raise InvalidArgumentError(f"prefill_tokens_while_decoding: {mixed!r} must be None or an integer >= 1")

    def prefill_budget(self, decoding: bool, num_prefilling: int = 1) -> int:
        """Prompt tokens one step may compute, given whether some sequence decodes in the same step and how many
        requests are waiting for their prompt to be computed."""
        if decoding and self.prefill_tokens_while_decoding is not None:
            return min(self.prefill_step_size, self.prefill_tokens_while_decoding * max(1, num_prefilling))
        return self.prefill_step_size


__all__ = ["SchedulerConfig"]
