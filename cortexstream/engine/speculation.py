"""A sequence's speculative decoding state: what it drafts next and how many tokens. Pure Python.

Prompt lookup (`ngram`): the drafter is an index of the sequence's own tokens (prompt and output so far); each step
it proposes the continuation of the latest earlier occurrence of the last n tokens (engine/ngram_proposer.py), as
many tokens as the match's extent (how far back the copy goes, engine/match_extent.py) makes pay.
Draft model (`draft:model=...`): the runner's draft model proposes (engine/draft_runner.py); this state tracks how
many of the sequence's tokens the draft model's KV holds (`draft_len`, a function of the plans alone: a fresh,
re-admitted or forked sequence starts at 0), so each plan tells the runner what to feed it first.

The draft length adapts to the sequence's acceptance rate and to what a drafted row costs in the current batch
(engine/adaptive_draft.py, engine/verify_cost.py), down to no draft at all when drafting does not pay; the
scheduler asks for a draft only when the sequence's last token has been read.
"""

from __future__ import annotations

from typing import Sequence

from cortexstream.engine.adaptive_draft import AdaptiveDraftLength
from cortexstream.engine.match_extent import EXTENT_CAP, EXTENT_PRIORS, extent_class
from cortexstream.engine.ngram_proposer import NgramIndex
from cortexstream.engine.speculative_config import SpeculativeConfig, SpeculativeMethod
from cortexstream.engine.step_plan import ModelDraft
from cortexstream.engine.verify_cost import PRIOR_COST_PER_DRAFT


class SpeculationState:
    """See the module docstring. One per sequence (`Sequence.speculation`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.by_model = config.method is SpeculativeMethod.DRAFT
        self.index = None if self.by_model else NgramIndex(config.n)
        self.length = AdaptiveDraftLength(config.k, adaptive=config.adaptive, cost_per_draft=PRIOR_COST_PER_DRAFT,
                                          contexts=None if self.by_model else EXTENT_PRIORS)
        self.indexed = 0  # tokens of the sequence in the index
        self.draft_len = 0  # tokens whose KV the draft model holds (draft models)
        self._planned: tuple[int, int] | None = None  # (tokens known, k) of the model draft in flight
        self.proposed = 0
        self.accepted = 0
        self.verify_steps = 0

    def wants_draft(self, clock: int | None = None) -> bool:
        """Whether step `clock` (the engine's step number) may draft (then the sequence's last token must be read
        first: no pipelining)."""
        return self.length.will_draft(clock)

    def idle(self, clock: int | None = None) -> None:
        """A pipelined step that could not draft (its last token is in flight): it counts toward the next probe."""
        if not self.length.will_draft(clock):
            self.length.next_k(clock)

    def set_cost_per_draft(self, cost: float, fixed: float = 0.0) -> None:
        """What one drafted token costs now, and drafting at all (engine/verify_cost.py, measured per engine); k is
        chosen again."""
        self.length.set_cost_per_draft(cost, fixed)

    def fresh(self) -> "SpeculationState":
        """A new state with the same settings (a forked sequence drafts on its own)."""
        return SpeculationState(self.config)

    def restart(self) -> None:
        """The sequence lost its blocks (preempted): the draft model's KV is gone with them."""
        self.draft_len = 0
        self._planned = None

    def plan(self, tokens: Sequence[int], room: int,
             clock: int | None = None) -> tuple[tuple[int, ...], ModelDraft | None]:
        """What to draft after `tokens` (the sequence's prompt and output so far) in step `clock`, at most `room`
        tokens: (proposed tokens, None) for prompt lookup, ((), ModelDraft) for a draft model, ((), None) for none."""
        k = min(self.length.next_k(clock), room)
        if k <= 0:
            return (), None
        if self.by_model:
            self._planned = (len(tokens), k)
            return (), ModelDraft(k, self.draft_len, tuple(tokens[self.draft_len:]))
        if len(tokens) > self.indexed:
            self.index.extend(list(tokens[self.indexed:]))
            self.indexed = len(tokens)
        found = self.index.match(self.config.n)
        context = None if found is None else extent_class(self.index.extent(*found, EXTENT_CAP))
        k = min(self.length.draft_length(context), room)  # by how far the match reaches back (a copy, or chance)
        draft = tuple(self.index.propose(k, self.config.n)) if k > 0 else ()
        if not draft:
            self.length.record(0, 0)  # nothing matched, or not well enough to pay: says nothing about acceptance
        return draft, None

    def feed(self, tokens: Sequence[int], end: int) -> ModelDraft | None:
        """A prompt chunk ending at `end` (of `tokens`, the sequence's prompt and output so far): for a draft model,
        the tokens it has not seen through `end`, computed by it in the chunk's step (`ModelDraft` with k=0), so its
        KV is ready when decoding starts; None for prompt lookup or when it has seen them."""
        if not self.by_model or end <= self.draft_len:
            return None
        feed = ModelDraft(0, self.draft_len, tuple(tokens[self.draft_len:end]))
        self.draft_len = end
        return feed

    def record(self, proposed: int, accepted: int) -> None:
        """A verified draft: `accepted` of its `proposed` tokens were kept."""
        self.length.record(proposed, accepted)
        self.proposed += proposed
        self.accepted += accepted
        self.verify_steps += 1
        if self._planned is not None:  # the draft model was fed the known tokens and every kept draft but the last
            known, k = self._planned
            self.draft_len = known + min(accepted, k - 1)
            self._planned = None


__all__ = ["SpeculationState"]
