"""Continuous-batching scheduler: admission, chunked prefill, one decode batch, preemption. Pure Python.

Each step the scheduler (1) admits waiting requests in arrival order while their blocks fit, (2) hands out
prefill chunks within a token budget, and (3) puts every running sequence that is ready to decode into one batch.
When a decode step cannot get a block, the newest running sequence is preempted (its blocks are released and it
is recomputed later from its tokens, which are never lost).

Sequences whose KV is not a function of their tokens (`Sequence.kv_from_tokens` False: C2C fusion) are never
preempted, since recompute would silently drop what was written into their KV: another sequence is preempted
instead. When a fused sequence needs a block and only fused ones could give it up, the newest of those is failed
with finish_reason "error" and the reason; a recomputable sequence that finds only fused ones waits instead.
A sequence with a hook (`Sequence.hook`, a `SequenceHook`) gets its prefill chunks cut at the hook's `at_token`;
the hook runs at the start of the next `schedule()` (between forward passes), then the remaining tokens follow.

The chosen work becomes the step's `StepPlan` in engine/plan_builder.py, then the scheduler advances the counters;
the KV capacity arithmetic (budgets, rejection, room to pipeline) is in engine/kv_capacity.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from cortexstream.engine import kv_capacity
from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine.finish_reason import FinishReason
from cortexstream.engine.plan_builder import PlanBuilder
from cortexstream.engine.reconstruction_plan import plan_scoring, scoring
from cortexstream.engine.scheduler_config import SchedulerConfig
from cortexstream.engine.sequence import Sequence, SequenceHook, SequenceStatus
from cortexstream.engine.step_plan import ModelDraft, StepPlan, StepResult
from cortexstream.engine.verify_cost import VerifyCostModel, drafted_passes, pipelined_pass, timed_pass
from cortexstream.errors import InvalidArgumentError


class Scheduler:
    """Owns every sequence's state; `schedule()` decides the next step and returns it as a `StepPlan`."""

    def __init__(self, block_manager: BlockManager, config: SchedulerConfig | None = None) -> None:
        self.blocks = block_manager
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._finished: list[Sequence] = []
        self.num_preemptions = 0
        # Speculative decoding: verify passes run, tokens drafted, drafted tokens accepted (all sequences).
        self.num_verified = self.num_drafted = self.num_accepted = 0
        self.verify_cost = VerifyCostModel()  # what a drafted row costs this engine, measured (engine/verify_cost.py)
        self.clock = 0  # steps planned: aligns the draft probes of a batch (engine/adaptive_draft.py)
        self._plans = PlanBuilder()  # writes each step's plan; knows which requests the runner holds state for

    # --- requests ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request, or finish it at once as 'rejected' (with the reason) if it can never fit."""
        reason = kv_capacity.rejection(seq, self.blocks, self.config)
        if reason is not None:
            self._set_finished(seq, FinishReason.REJECTED, reason)
            self._finished.append(seq)
            return
        self.waiting.append(seq)

    def physical_budget(self, seq: Sequence) -> int:
        """Most KV slots the sequence can ever hold (engine/kv_capacity.py)."""
        return kv_capacity.physical_budget(seq, self.config)

    def live_sequences(self) -> list[Sequence]:
        """Waiting then running sequences."""
        return list(self.waiting) + list(self.running)

    def lookup(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                return seq
        return None

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.lookup(request_id)
        if seq is None:
            return None
        if seq in self.running:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)
        self._set_finished(seq, FinishReason.ABORTED)
        self._finished.append(seq)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Called by the engine when a running sequence hit eos, a stop string or max_tokens, or failed."""
        self._set_finished(seq, reason, error)
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    # --- what the engine records between steps ---------------------------------------------------------------
    def record_token(self, seq: Sequence, token_id: int, now: float) -> None:
        """A sampled token was read: it joins the output (no longer in flight)."""
        seq.num_inflight = 0
        seq.output_ids.append(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now

    def set_in_flight(self, seq: Sequence, count: int) -> None:
        """`count` (0 or 1) sampled tokens of `seq` are being computed and not read yet."""
        seq.num_inflight = count

    def set_physical(self, seq: Sequence, num_physical: int) -> None:
        """The runner's policy left `num_physical` KV slots (evicted or compressed); surplus blocks go back."""
        if seq.uses_arena:
            self.blocks.set_physical(seq, num_physical)
        else:
            seq.num_physical = num_physical

    def attach_hook(self, seq: Sequence, hook: SequenceHook) -> None:
        """Give the sequence its hook; it must not have one already nor have passed `hook.at_token`."""
        if seq.hook is not None:
            raise InvalidArgumentError(f"request '{seq.request_id}' already has a {seq.hook.name} hook")
        if seq.num_computed > hook.at_token or seq.output_ids:
            raise InvalidArgumentError(f"request '{seq.request_id}' is already past token {hook.at_token}")
        seq.hook = hook

    def set_sampler(self, seq: Sequence, sampler: object) -> None:
        if self._plans.announced(seq.request_id):
            raise InvalidArgumentError(f"request '{seq.request_id}' has started: its sampler is set before its "
                                       "first step")
        seq.sampler = sampler
        seq.speculation = None  # drafts are verified against the engine's own sampler only

    def make_writable(self, seq: Sequence, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """Prepare KV slots [start, end) of a running sequence for a write from outside the model (C2C fusion):
        shared blocks get private copies (the returned pairs, to copy first), and since such KV cannot be rebuilt
        from the tokens, the sequence is never preempted by recompute nor registered in the prefix cache."""
        seq.kv_from_tokens = False
        return tuple(self.blocks.make_writable(seq, start, end))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` running from the parent's computed KV (shared blocks, same counters)."""
        self.blocks.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    # --- the step ---------------------------------------------------------------------------------------------
    def may_pipeline(self) -> bool:
        """True when the next step can only decode: nothing to admit or prefill, and blocks enough for every
        running sequence to grow (and copy on write) without preempting anyone."""
        if not self._only_decodes():
            return False
        if not self._measuring_plain() and any(s.speculation is not None and s.speculation.wants_draft(self.clock)
                                               for s in self.running):
            return False  # speculation needs its last token read to draft from it
        return kv_capacity.room_to_grow(self.running, self.blocks)

    def _only_decodes(self) -> bool:
        """Nothing to admit, prefill or score: the next step decodes the running sequences only."""
        return not self.waiting and not any(s.num_pending > 1 or scoring(s) for s in self.running)

    def _measuring_plain(self) -> bool:
        """Whether this step pauses drafting to time plain pipelined steps: the batch only decodes, every
        speculating sequence adapts its k, and the period of a plain step at this batch size is not measured yet
        (`VerifyCostModel.wants_plain_steps`)."""
        speculating = [s.speculation for s in self.running if s.speculation is not None]
        if not speculating or not all(x.config.adaptive for x in speculating) or not self._only_decodes():
            return False
        return self.verify_cost.wants_plain_steps(len(self.running))

    def schedule(self) -> tuple[StepPlan, list[Sequence]]:
        """The next step's plan, and the sequences that ended since the last one (rejected, aborted, failed)."""
        ended, self._finished = self._finished, []
        self._admit()
        self._run_hooks(ended)
        restores = tuple((block, payload) for done in self.blocks.finish_restores()
                         for block, payload in zip(done.blocks, done.payloads))
        budget = self.config.prefill_budget(decoding=any(s.num_pending == 1 for s in self.running),
                                            num_prefilling=sum(s.num_pending > 1 for s in self.running))
        score, budget = plan_scoring(self.running, self.blocks, budget, self.config.prefill_step_size)  # KVzip
        prefill: list[tuple[Sequence, int]] = []
        for seq in self.running:
            # More than one pending token is prompt (or recompute after preemption); one is a decode step.
            if seq.num_pending > 1:
                if budget <= 0 or self.blocks.restoring(seq):
                    continue
                chunk = min(seq.num_pending, budget, self._room_before_hook(seq))
                if not self.blocks.reserve(seq, chunk):
                    continue  # its blocks were allocated at admission; only copy-on-write can be short
                prefill.append((seq, chunk))
                budget -= chunk
        prefilling = {id(s) for s, _ in prefill} | {id(s) for s in self.running if scoring(s, score)}
        paused = self._measuring_plain()  # no drafts this step: its plain pipelined period is timed
        if paused:
            self.verify_cost.plain_step_paused(len(self.running))
        decode: list[Sequence] = []
        drafts: dict[int, tuple[int, ...]] = {}
        for seq in list(self.running):
            if id(seq) in prefilling or seq.num_pending != 1 or seq not in self.running:
                continue
            if seq.num_inflight and len(seq.output_ids) + 1 >= seq.sampling.max_tokens:
                continue  # its unread token is its last by length: no step after it
            draft, by_model = ((), None) if paused else self._draft(seq, self.clock)
            extra = len(draft) + (by_model.k if by_model else 0)
            if extra and self.blocks.reserve(seq, 1 + extra):
                drafts[id(seq)] = (draft, by_model)
            while not self.blocks.reserve(seq, 1):
                victim = self._newest_other_than(seq, prefilling)
                if victim is None and not seq.kv_from_tokens:
                    victim = self._newest_other_than(seq, prefilling, recomputable=False)
                if victim is None:
                    break  # wait: a recomputable sequence never forces out one that cannot be recomputed
                if victim.kv_from_tokens:
                    self._preempt(victim)
                else:
                    self._fail(victim, ended, "preempted for lack of KV blocks, and its KV was written from "
                               "outside the model (C2C fusion), so it cannot be recomputed from its tokens; give "
                               "the engine more KV memory or fewer concurrent requests")
                decode = [s for s in decode if s is not victim]
            else:
                decode.append(seq)
        self.clock += 1
        plan = self._plans.build(self.blocks, prefill, decode, restores, drafts)
        for seq, n in prefill + [(seq, 1) for seq in decode]:  # as if done: the runner does it next
            seq.num_computed += n
            seq.num_physical += n
        return replace(plan, score=tuple(score)), ended

    @staticmethod
    def _draft(seq: Sequence, clock: int) -> tuple[tuple[int, ...], ModelDraft | None]:
        """Tokens to verify after the sequence's next one (speculative decoding) in step `clock`, within its
        limits: proposed here (prompt lookup) or by the runner's draft model."""
        if seq.speculation is not None and seq.num_inflight:
            seq.speculation.idle(clock)  # pipelined while drafting does not pay: still counts toward the next probe
        if seq.speculation is None or seq.num_inflight or not seq.uses_arena or seq.kv_policy.evicts:
            return (), None
        room = min(seq.sampling.max_tokens - len(seq.output_ids) - 1, seq.max_total_tokens - seq.num_tokens)
        return seq.speculation.plan(seq.all_ids, room, clock) if room > 0 else ((), None)

    def accept_drafts(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """The runner kept `accepted` of the `proposed` drafted tokens: their KV is the sequence's now (the rest
        is past its length, overwritten later), and blocks taken only for rejected ones go back at once."""
        seq.num_computed += accepted
        seq.num_physical += accepted
        self.num_verified += 1
        self.num_drafted += proposed
        self.num_accepted += accepted
        seq.speculation.record(proposed, accepted)
        self.blocks.trim_surplus(seq)

    def observe_step(self, plan: StepPlan, result: StepResult, decode_seconds: float | None,
                     had_in_flight: bool = False) -> None:
        """Feed a step's timing to the verify-cost estimate (engine/verify_cost.py; `had_in_flight`: the step
        started with a pass in flight); every running sequence's draft length is chosen again for the batch's costs."""
        cost, fixed = self.verify_cost.after_step(
            timed_pass(plan, result, decode_seconds), len(self.running), drafted_passes(result),
            pipelined_pass(plan, result, decode_seconds, had_in_flight))
        for seq in (s for s in self.running if s.speculation is not None):
            seq.speculation.set_cost_per_draft(cost, fixed)

    def _admit(self) -> None:
        deferred: list[Sequence] = []  # waiting for a shared prefix another sequence is computing now
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._evicts(seq) and self.blocks.waits_for_shared_prefix(seq):
                deferred.append(self.waiting.popleft())
                continue
            if self._evicts(seq):
                if not self._admit_bounded(seq):
                    break
                self.waiting.popleft()
            else:
                if not self.blocks.can_admit(seq):
                    break
                self.waiting.popleft()
                self.blocks.admit(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        self.waiting.extendleft(reversed(deferred))  # first in line again, in their order

    @staticmethod
    def _evicts(seq: Sequence) -> bool:
        return seq.kv_policy.evicts

    def _admit_bounded(self, seq: Sequence) -> bool:
        """Admit a sequence whose policy evicts with blocks for its first prefill chunk only.

        Its physical KV never exceeds the policy's budget plus one chunk, so taking blocks for the whole prompt
        (as `BlockManager.admit` does) could make a long prompt wait forever for an arena it never needs. The
        prefix cache is not used either way: hits could exceed the budget before the first eviction, and shared
        blocks would have to be copied on write by every later eviction (the engine does not register them).
        """
        seq.block_table.clear()
        seq.block_hashes = []
        seq.num_computed = seq.num_physical = seq.num_cached_prefix = 0
        return self.blocks.reserve(seq, min(seq.num_tokens, self.config.prefill_step_size))

    def _newest_other_than(self, seq: Sequence, protected: set[int], recomputable: bool = True) -> Sequence | None:
        """The newest other running sequence whose KV is (or, recomputable=False, is not) rebuildable from tokens."""
        candidates = [s for s in self.running  # a bound sequence holds no blocks: failing it would free none
                      if s is not seq and id(s) not in protected and s.kv_from_tokens == recomputable
                      and s.uses_arena]
        return max(candidates, key=lambda s: s.arrival_time) if candidates else None

    # --- hooks, failures, release -----------------------------------------------------------------------------
    @staticmethod
    def _room_before_hook(seq: Sequence) -> int:
        """Tokens this sequence may prefill before its pending hook must run (unbounded without one)."""
        if seq.hook is None:
            return seq.num_pending
        return max(1, seq.hook.at_token - seq.num_computed)

    def _run_hooks(self, ended: list[Sequence]) -> None:
        for seq in list(self.running):
            hook = seq.hook
            if hook is None or seq.num_computed != hook.at_token or seq.output_ids:
                continue
            seq.hook = None  # once: a failing hook must not run again
            try:
                hook.run(seq)
            except Exception as exc:  # noqa: BLE001 - any failure fails this request only, with its reason
                self._fail(seq, ended, f"{hook.name} hook failed: {type(exc).__name__}: {exc}")

    def _fail(self, seq: Sequence, ended: list[Sequence], reason: str) -> None:
        """Finish a running sequence with finish_reason "error" (reported among this step's ended ones)."""
        self.finish(seq, FinishReason.ERROR, reason)
        ended.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        for state in (seq.speculation, seq.reconstruction):
            if state is not None:
                state.restart()
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back the sequence's blocks; the runner forgets it with the next plan."""
        self.blocks.release(seq)
        seq.num_inflight = 0
        self._plans.forget(seq.request_id)

    @staticmethod
    def _set_finished(seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
