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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cortexstream.engine.block_manager import BlockManager
from cortexstream.errors import InvalidArgumentError
from cortexstream.engine.sequence import Sequence, SequenceStatus


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


@dataclass
class ScheduledStep:
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute now)
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # taken off `running` (failed ones too): drop state
    finished: list[Sequence] = field(default_factory=list)  # rejected or aborted since the last step

    @property
    def is_empty(self) -> bool:
        return not (self.prefill or self.decode or self.finished)

    def prefill_groups(self, max_padding: float = 1.25) -> list[list[tuple[Sequence, int]]]:
        """The prefill chunks grouped into batched forward passes: chunks of similar length together (a group's
        padded size stays within `max_padding` x its real tokens); a sequence whose policy evicts alone, since
        its policy acts between its own forward passes."""
        alone = [[item] for item in self.prefill if item[0].prefills_alone]
        groups: list[list[tuple[Sequence, int]]] = []
        for item in sorted((i for i in self.prefill if not i[0].prefills_alone), key=lambda i: -i[1]):
            group = groups[-1] if groups else None
            if group is not None and (len(group) + 1) * group[0][1] <= max_padding * (
                    sum(n for _, n in group) + item[1]):
                group.append(item)
            else:
                groups.append([item])
        return alone + groups


class Scheduler:
    def __init__(self, block_manager: BlockManager, config: SchedulerConfig | None = None) -> None:
        self.blocks = block_manager
        self.config = config or SchedulerConfig()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._finished: list[Sequence] = []
        self.num_preemptions = 0

    # --- requests ---------------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request, or finish it at once as 'rejected' (with the reason) if it can never fit."""
        needed = self.blocks.blocks_for(self.physical_budget(seq)) if seq.uses_arena else 0
        total = self.blocks.allocator.num_total_blocks
        if needed > total:
            seq.finish(
                "rejected",
                f"needs {needed} KV blocks ({self.physical_budget(seq)} tokens) but the arena has {total}; "
                "lower max_tokens, shorten the prompt, or use a KV policy with a budget",
            )
            self._finished.append(seq)
            return
        self.waiting.append(seq)

    def physical_budget(self, seq: Sequence) -> int:
        """Most KV slots the sequence can ever hold: its policy's bound, else prompt + max_tokens."""
        limit = seq.kv_policy.max_physical_tokens(seq.max_total_tokens, self.config.prefill_step_size)
        return min(seq.max_total_tokens, limit) if limit else seq.max_total_tokens

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                if seq in self.running:
                    self.running.remove(seq)
                    self.blocks.release(seq)
                else:
                    self.waiting.remove(seq)
                seq.finish("aborted")
                self._finished.append(seq)
                return seq
        return None

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

    def finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Called by the engine when a running sequence hit eos, a stop string or max_tokens, or failed."""
        seq.finish(reason, error)
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.release(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    # --- the step ---------------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        step = ScheduledStep(finished=self._finished)
        self._finished = []
        self._admit()
        self._run_hooks(step)
        budget = self.config.prefill_budget(decoding=any(s.num_pending == 1 for s in self.running),
                                            num_prefilling=sum(s.num_pending > 1 for s in self.running))
        for seq in self.running:
            # More than one pending token is prompt (or recompute after preemption); one is a decode step.
            if seq.num_pending > 1:
                if budget <= 0:
                    continue
                chunk = min(seq.num_pending, budget, self._room_before_hook(seq))
                if not self.blocks.reserve(seq, chunk):
                    continue  # its blocks were allocated at admission; only copy-on-write can be short
                step.prefill.append((seq, chunk))
                budget -= chunk
        prefilling = {id(s) for s, _ in step.prefill}
        for seq in list(self.running):
            if id(seq) in prefilling or seq.num_pending != 1 or seq not in self.running:
                continue
            while not self.blocks.reserve(seq, 1):
                victim = self._newest_other_than(seq, prefilling)
                if victim is None and not seq.kv_from_tokens:
                    victim = self._newest_other_than(seq, prefilling, recomputable=False)
                if victim is None:
                    break  # wait: a recomputable sequence never forces out one that cannot be recomputed
                if victim.kv_from_tokens:
                    self._preempt(victim)
                else:
                    self._fail(victim, step, "preempted for lack of KV blocks, and its KV was written from outside "
                               "the model (C2C fusion), so it cannot be recomputed from its tokens; give the "
                               "engine more KV memory or fewer concurrent requests")
                step.preempted.append(victim)
                step.decode = [s for s in step.decode if s is not victim]
            else:
                step.decode.append(seq)
        return step

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

    # --- hooks and failures -----------------------------------------------------------------------------------
    @staticmethod
    def _room_before_hook(seq: Sequence) -> int:
        """Tokens this sequence may prefill before its pending hook must run (unbounded without one)."""
        if seq.hook is None:
            return seq.num_pending
        return max(1, seq.hook.at_token - seq.num_computed)

    def _run_hooks(self, step: ScheduledStep) -> None:
        for seq in list(self.running):
            hook = seq.hook
            if hook is None or seq.num_computed != hook.at_token or seq.output_ids:
                continue
            seq.hook = None  # once: a failing hook must not run again
            try:
                hook.run(seq)
            except Exception as exc:  # noqa: BLE001 - any failure fails this request only, with its reason
                self._fail(seq, step, f"{hook.name} hook failed: {type(exc).__name__}: {exc}")
                step.preempted.append(seq)

    def _fail(self, seq: Sequence, step: ScheduledStep, reason: str) -> None:
        """Finish a running sequence with finish_reason "error" (reported in this step's `finished`)."""
        self.finish(seq, "error", reason)
        step.finished.append(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
