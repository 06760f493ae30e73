"""`StepOutputs`: the "apply" third of an engine step, a `StepResult` turned into one `RequestOutput` per token.

It keeps what the engine holds per request between steps: the request's text state (`RequestText`: detokenizer,
stop strings), the sampled tokens still in flight (launched by a pipelined decode step, not read yet; see
engine/engine.py), and the requests a failed sampler ended during the step. Applying a result goes through the
scheduler, which owns every sequence's state: tokens read, drafts accepted, physical lengths, finishing; full
blocks enter the prefix cache through the block manager.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import mlx.core as mx

from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine.finish_reason import FinishReason
from cortexstream.engine.request_state import RequestOutput, RequestText
from cortexstream.engine.scheduler import Scheduler
from cortexstream.engine.sequence import Sequence
from cortexstream.engine.step_plan import StepPlan, StepResult

# request id -> (sequence, lazy sampled token [1], lazy logprobs [V]) of a decode step in flight
InFlight = dict[str, tuple[Sequence, mx.array, mx.array]]


class StepOutputs:
    """Per-request text and in-flight tokens of one engine, and the outputs its steps' results become."""

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, tokenizer: Any,
                 eos_ids: set[int]) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.num_generated_tokens = 0
        self.num_prompt_tokens_computed = 0
        self._states: dict[str, RequestText] = {}
        self._inflight: InFlight = {}
        self._failures: list[RequestOutput] = []  # requests ended by a failed sampler during this step

    # --- requests ---------------------------------------------------------------------------------------------
    def track(self, seq: Sequence) -> None:
        """Start keeping the text state of a request just queued (or forked)."""
        self._states[seq.request_id] = RequestText(seq, self.tokenizer, self.eos_ids)

    def in_use(self, request_id: str) -> bool:
        """Whether a request with this id is live (its final output not handed back yet)."""
        return request_id in self._states

    def forget_in_flight(self, request_id: str) -> None:
        """Drop the request's unread token, if any (an aborted request)."""
        self._inflight.pop(request_id, None)

    @property
    def has_in_flight(self) -> bool:
        return bool(self._inflight)

    def check_dropped(self, request_ids: Iterable[str]) -> None:
        """Forget the unread tokens of requests the plan drops; a live one there would lose a token."""
        for request_id in request_ids:
            entry = self._inflight.pop(request_id, None)
            if entry is not None and not entry[0].is_finished:  # may_pipeline rules this out; never lose a token
                raise RuntimeError(f"internal: request '{request_id}' preempted with a token in flight")

    def take_failures(self) -> list[RequestOutput]:
        """The final outputs of requests a failed sampler ended since the last call."""
        failures, self._failures = self._failures, []
        return failures

    # --- applying a result ------------------------------------------------------------------------------------
    def apply(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Record what the runner did: failures, physical lengths, prompt blocks, tokens read and in flight."""
        proposed = {item.request_id: item.num_tokens - 1 for item in plan.decode if item.draft or item.model_draft}
        for request_id, reason in result.errors.items():
            state = self._states.get(request_id)
            if state is not None and not state.seq.is_finished:
                self._fail(state.seq, reason)
        for request_id, num_physical in result.physical.items():
            state = self._states.get(request_id)
            if state is not None and not state.seq.is_finished:
                self.scheduler.set_physical(state.seq, num_physical)
        for item in plan.prefill:
            self.num_prompt_tokens_computed += len(item.token_ids)
            state = self._states.get(item.request_id)
            if state is not None and state.seq.hook is None and not state.seq.kv_policy.evicts:
                # Full prompt blocks enter the prefix cache as soon as they are computed, so a request
                # waiting on the same prefix starts from them (see BlockManager.waits_for_shared_prefix).
                self.block_manager.register_full_blocks(state.seq)
        outputs = []
        for sampled in result.sampled:
            state = self._states.get(sampled.request_id)
            if sampled.ready and state is not None and not state.seq.is_finished:
                if sampled.request_id in result.accepted:  # a verified draft: its kept tokens, then one more
                    self.scheduler.accept_drafts(state.seq, proposed[sampled.request_id],
                                                 result.accepted[sampled.request_id])
                outputs.extend(self._emit_tokens(state.seq, sampled))
        previous, self._inflight = self._inflight, {}
        outputs.extend(self._resolve(previous))
        for sampled in result.sampled:
            state = self._states.get(sampled.request_id)
            if sampled.ready or state is None or state.seq.is_finished:
                continue  # the token it was launched on ended the request: discard this one
            self.scheduler.set_in_flight(state.seq, 1)
            self._inflight[sampled.request_id] = (state.seq, sampled.token, sampled.logprobs)
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Read and apply every token in flight."""
        entries, self._inflight = self._inflight, {}
        return self._resolve(entries)

    def final_output(self, seq: Sequence) -> RequestOutput:
        """The last output of a request the scheduler ended (rejected, aborted, failed); it is forgotten here."""
        self._states.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, None, "", None, len(seq.prompt_ids), len(seq.output_ids),
                             seq.finish_reason, seq.error)

    def _resolve(self, entries: InFlight) -> list[RequestOutput]:
        if not entries:
            return []
        mx.eval([token for _, token, _ in entries.values()])
        outputs = []
        for seq, token, logprobs in entries.values():
            if seq.is_finished or seq.request_id not in self._states:
                continue
            outputs.append(self._emit(seq, int(token.item()), logprobs))
        return outputs

    def _emit_tokens(self, seq: Sequence, sampled: Any) -> list[RequestOutput]:
        """Emit a read sample's tokens in order (several for a verified draft) until one ends the request."""
        outputs = []
        tokens = sampled.token.reshape(-1).tolist()
        for i, token_id in enumerate(tokens):
            logprobs = sampled.logprobs[i] if sampled.logprobs.ndim == 2 else sampled.logprobs
            outputs.append(self._emit(seq, token_id, logprobs))
            if seq.is_finished:
                break
        return outputs

    def _fail(self, seq: Sequence, reason: str) -> None:
        """End a running request with finish_reason "error"; its output goes out with this step's."""
        self._inflight.pop(seq.request_id, None)
        self.scheduler.finish(seq, FinishReason.ERROR, reason)
        self._failures.append(self.final_output(seq))

    def _emit(self, seq: Sequence, token_id: int, logprobs: mx.array) -> RequestOutput:
        """Append one read token to its request: text, stop conditions, prefix-cache blocks, finishing."""
        state = self._states[seq.request_id]
        self.scheduler.record_token(seq, token_id, time.perf_counter())
        self.num_generated_tokens += 1
        text, reason = state.accept(token_id)
        if not seq.kv_policy.evicts:
            # An evicting sequence's blocks stay private: a shared block would have to be copied on write
            # by the next eviction, which may find no free block.
            self.block_manager.register_full_blocks(seq)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._states[seq.request_id]
        return RequestOutput(
            seq.request_id, token_id, text, logprobs, len(seq.prompt_ids), len(seq.output_ids), reason,
            ttft=seq.first_token_time - seq.arrival_time, stop_string=state.text.stop_string,
        )


__all__ = ["StepOutputs"]
