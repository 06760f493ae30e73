"""What one step's passes collect for the runner's `StepResult` (engine/step_plan.py).

The runner (engine/runner.py) makes one `StepOutcome` per step and hands it to every pass it runs: its own prefill
and decode passes and the speculative verify pass (engine/verify_pass.py). Each pass appends what it sampled and
records failures, policy-evicted lengths, accepted drafts and draft-model timings; `result` turns the collection
into the step's immutable `StepResult`.
"""

from __future__ import annotations

from cortexstream.engine.step_plan import SampledToken, StepResult


class StepOutcome:
    """What a step's passes collect for its `StepResult`."""

    def __init__(self) -> None:
        self.sampled: list[SampledToken] = []
        self.physical: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self.accepted: dict[str, int] = {}
        self.prefill_seconds = 0.0
        self.draft_seconds = 0.0
        self.draft_passes = 0
        self.draft_sequences = 0

    def result(self, prefill_tokens: int, mixed_tokens: int) -> StepResult:
        """The step's result: what the passes collected, with the prompt tokens computed in passes of their own
        (`prefill_tokens`) and packed into the decode forward (`mixed_tokens`)."""
        return StepResult(tuple(self.sampled), self.physical, self.errors, prefill_tokens, self.prefill_seconds,
                          mixed_tokens, accepted=self.accepted, draft_seconds=self.draft_seconds,
                          draft_passes=self.draft_passes, draft_sequences=self.draft_sequences)


__all__ = ["StepOutcome"]
