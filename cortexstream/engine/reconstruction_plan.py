"""The scheduler's side of a reconstruction (KVzip, `policies.kvzip`): which scoring chunks a sequence runs next.

A sequence whose policy reconstructs carries a `ReconstructionPlan` (`Sequence.reconstruction`). Once its prompt is
computed, the plan is due: each step the scheduler plans one `WorkKind.SCORE` item for
it (`plan_scoring`) and no decode, until every token of the context (the sequence's computed tokens) has been
repeated once; the last item says `compress`, and the next step decodes on the compressed cache. A score item's
tokens are the reconstruction prefix and the next chunk of the context, sized to the policy's `chunk` and to the
prefill step size; they sit after the context (logical start = tokens computed, physical start = the
sequence's slots), so the blocks reserved for them hold nothing of the sequence once the runner rolled them back
and reported the physical length (the block manager frees those past it). The sequence's counters never move for
a score item: its tokens are not the sequence's. A preempted sequence is recomputed and reconstructed again
(`restart`). Pure Python.
"""

from __future__ import annotations

from typing import Any

from cortexstream.engine.step_plan import WorkItem, WorkKind
from cortexstream.errors import InvalidArgumentError


class ReconstructionPlan:
    """See the module docstring. One per sequence whose policy reconstructs."""

    def __init__(self, prefix: tuple[int, ...], chunk: int) -> None:
        if not prefix:
            raise InvalidArgumentError("reconstruction: the prompt prefix is empty")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise InvalidArgumentError(f"reconstruction: chunk {chunk!r} must be an integer >= 1")
        self.prefix = tuple(prefix)
        self.chunk = chunk
        self.scored = 0  # context tokens repeated so far
        self.done = False
        self.num_items = 0

    def due(self, seq: Any) -> bool:
        """Whether `seq` should run a scoring chunk now: its prompt computed (its next token, read or still in
        flight, is not part of the context)."""
        return not self.done and seq.num_pending == 1 and seq.num_computed >= len(seq.prompt_ids)

    def fresh(self) -> "ReconstructionPlan":
        """A new plan with the same prefix and chunk (a forked sequence reconstructs its own context)."""
        return ReconstructionPlan(self.prefix, self.chunk)

    def restart(self) -> None:
        """The sequence lost its KV (preempted): it is recomputed, then reconstructed from the start."""
        self.scored = 0
        self.done = False

    def piece(self, seq: Any, step_size: int) -> int:
        """Context tokens in the next item: the policy's chunk, what is left, and a pass of at most `step_size`
        tokens with the prefix (at least one)."""
        return max(1, min(self.chunk, seq.num_computed - self.scored, step_size - len(self.prefix)))

    def largest_item(self, context: int, step_size: int) -> int:
        """Most tokens one scoring pass over a context of `context` tokens holds after it (prefix + piece): the
        slots the sequence needs beyond its context while it is reconstructed."""
        return len(self.prefix) + max(1, min(self.chunk, context, step_size - len(self.prefix)))

    def next_tokens(self, seq: Any, step_size: int) -> tuple[tuple[int, ...], bool]:
        """The next item's tokens (see `piece`) and whether it is the last; the plan advances as if it ran (the
        runner does it next)."""
        context = seq.num_computed
        piece = self.piece(seq, step_size)
        tokens = self.prefix + seq.token_slice(self.scored, self.scored + piece)
        self.scored += piece
        self.done = self.scored >= context
        self.num_items += 1
        return tokens, self.done


def plan_scoring(running: list[Any], blocks: Any, budget: int, step_size: int) -> tuple[list[WorkItem], int]:
    """The score items of this step for the running sequences whose reconstruction is due, one per sequence while
    `budget` prompt tokens are left, each a pass of at most `step_size` tokens (the prefill step size: the budget
    while others decode can be smaller than the prefix, and a chunk of a few tokens would repeat the prefix for
    every few context tokens), with blocks reserved for them; returns the items and the budget left (<= 0: no
    prompt chunk this step)."""
    items = []
    for seq in running:
        plan = seq.reconstruction
        if plan is None or budget <= 0 or not plan.due(seq):
            continue
        if not blocks.reserve(seq, len(plan.prefix) + plan.piece(seq, step_size)):
            continue  # no room this step: it neither scores nor decodes, and tries again next step
        tokens, last = plan.next_tokens(seq, step_size)
        items.append(WorkItem(seq.request_id, WorkKind.SCORE, tokens, seq.num_computed, seq.num_physical,
                              tuple(seq.block_table), sample=False, alone=True, mixable=False, compress=last))
        budget -= len(tokens)
    return items, budget


def scoring(seq: Any, items: list[WorkItem] | tuple[WorkItem, ...] = ()) -> bool:
    """Whether `seq` is between its prompt and its first decode step, reconstructing (it must not decode): its
    reconstruction is due, or one of `items` (this step's score items) is its."""
    plan = seq.reconstruction
    return plan is not None and (plan.due(seq) or any(item.request_id == seq.request_id for item in items))


__all__ = ["ReconstructionPlan", "plan_scoring", "scoring"]
