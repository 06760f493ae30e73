"""The scheduler's chosen work written down as the step's `StepPlan`, and which requests the runner knows. Pure Python.

The scheduler (engine/scheduler.py) decides what runs: admission, the prefill chunks within the token budget, the
decode batch, preemption and drafts. `PlanBuilder.build` turns that choice into the plain data of
engine/step_plan.py: one `WorkItem` per request with its tokens, positions, block table and drafts (and, on a prompt
chunk, what the runner's draft model computes of it), the copy-on-write pairs the block manager queued, the blocks
read back from the disk tier, and the blocks in use. It does not move the sequences' counters: the scheduler then
advances them as if the work were done (the runner does it next), since only the scheduler and the block manager
write sequence state. A prompt chunk's draft feed does advance what the sequence's speculation state records the
draft model as holding (`SpeculationState.feed`), since the runner computes it in the same step. The builder also tracks
which requests the runner holds state for: a request is announced (`NewRequest`) in the first plan that gives it
work, and dropped in the first plan after the scheduler released it (`forget`).

A module of its own so the scheduler keeps to choosing the work.
"""

from __future__ import annotations

from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine.sequence import Sequence
from cortexstream.engine.step_plan import ModelDraft, NewRequest, StepPlan, WorkItem, WorkKind


class PlanBuilder:
    """Builds each step's `StepPlan` for the scheduler that owns it; remembers what the runner was told."""

    def __init__(self) -> None:
        self._announced: set[str] = set()  # requests the runner holds state for
        self._dropped: list[str] = []  # ... that it must forget with the next plan

    def announced(self, request_id: str) -> bool:
        """True while the runner holds state for the request (a plan announced it and it was not released since)."""
        return request_id in self._announced

    def forget(self, request_id: str) -> None:
        """The scheduler released the request: if the runner holds state for it, the next plan drops it."""
        if request_id in self._announced:
            self._announced.discard(request_id)
            self._dropped.append(request_id)

    def build(self, blocks: BlockManager, prefill: list[tuple[Sequence, int]], decode: list[Sequence],
              restores: tuple[tuple[int, bytes], ...] = (),
              drafts: dict[int, tuple[tuple[int, ...], ModelDraft | None]] | None = None) -> StepPlan:
        """The plan of the chosen work: `n` tokens of each `(seq, n)` in `prefill`, one of each `decode` sequence
        with its drafts (`drafts`, by `id(seq)`), from the counters as they stand (the scheduler advances them once
        the plan is built)."""
        dropped, self._dropped = tuple(self._dropped), []
        new = [self._announce(seq) for seq, _ in prefill if seq.request_id not in self._announced]
        new += [self._announce(seq) for seq in decode if seq.request_id not in self._announced]
        copies = blocks.take_copies()
        prefill_items = []
        for seq, n in prefill:
            start = seq.num_computed
            prefill_items.append(WorkItem(
                seq.request_id, WorkKind.PREFILL, seq.token_slice(start, start + n), start, seq.num_physical,
                tuple(seq.block_table), sample=start + n == seq.num_tokens, alone=seq.prefills_alone,
                mixable=seq.uses_arena and not seq.prefills_alone and seq.hook is None,
                model_draft=self._draft_feed(seq, start + n)))
        decode_items = []
        for seq in decode:
            start = seq.num_computed
            tokens = () if seq.num_inflight else (seq.token_at(start),)
            draft, by_model = (drafts or {}).get(id(seq), ((), None))
            decode_items.append(WorkItem(seq.request_id, WorkKind.DECODE, tokens, start, seq.num_physical,
                                         tuple(seq.block_table), sample=True, alone=not seq.uses_arena,
                                         mixable=False, draft=draft, model_draft=by_model))
        return StepPlan(tuple(new), dropped, copies, tuple(prefill_items), tuple(decode_items),
                        blocks.allocator.high_water, restores)

    def _announce(self, seq: Sequence) -> NewRequest:
        self._announced.add(seq.request_id)
        return NewRequest(seq.request_id, seq.owner, seq.sampling, seq.kv_policy, tuple(seq.all_ids),
                          seq.max_total_tokens, seq.sampler, seq.bound_cache, len(seq.prompt_ids))

    @staticmethod
    def _draft_feed(seq: Sequence, end: int) -> ModelDraft | None:
        """What the runner's draft model computes of a prompt chunk ending at `end`, in the same step (None: no
        draft model, or a sequence that will never draft)."""
        if seq.speculation is None or not seq.uses_arena or seq.kv_policy.evicts:
            return None
        return seq.speculation.feed(seq.all_ids, end)


__all__ = ["PlanBuilder"]
