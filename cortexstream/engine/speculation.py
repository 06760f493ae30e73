"""A sequence's speculative decoding state: its drafter and how many tokens to draft next. Pure Python.

Prompt lookup (`ngram`): the drafter is an index of the sequence's own tokens (prompt and output so far); each step
it proposes the continuation of the latest earlier occurrence of the last n tokens (engine/ngram_proposer.py). The
draft length adapts to the sequence's acceptance rate (engine/adaptive_draft.py), down to no draft at all when
drafting does not pay; the scheduler asks for a draft only when the sequence's last token has been read.
"""

from __future__ import annotations

from typing import Sequence

from cortexstream.engine.adaptive_draft import AdaptiveDraftLength
from cortexstream.engine.ngram_proposer import NgramIndex
from cortexstream.engine.speculative_config import SpeculativeConfig, SpeculativeMethod
from cortexstream.errors import InvalidArgumentError


class SpeculationState:
    """See the module docstring. One per sequence (`Sequence.speculation`)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method is not SpeculativeMethod.NGRAM:
            raise InvalidArgumentError(f"speculative: {config.text!r}: draft models are not supported yet; use "
                                       "prompt lookup ('ngram:k=4,n=3')")
        self.config = config
        self.index = NgramIndex(config.n)
        self.length = AdaptiveDraftLength(config.k, adaptive=config.adaptive)
        self.indexed = 0  # tokens of the sequence in the index
        self.proposed = 0
        self.accepted = 0
        self.verify_steps = 0

    def fresh(self) -> "SpeculationState":
        """A new state with the same settings (a forked sequence drafts on its own)."""
        return SpeculationState(self.config)

    def propose(self, tokens: Sequence[int], room: int) -> tuple[int, ...]:
        """Up to `room` drafted tokens to follow `tokens` (the sequence's prompt and output so far)."""
        if len(tokens) > self.indexed:
            self.index.extend(list(tokens[self.indexed:]))
            self.indexed = len(tokens)
        k = min(self.length.next_k(), room)
        if k <= 0:
            return ()
        draft = tuple(self.index.propose(k, self.config.n))
        if not draft:
            self.length.record(0, 0)  # nothing matched: costs nothing, says nothing about acceptance
        return draft

    def record(self, proposed: int, accepted: int) -> None:
        """A verified draft: `accepted` of its `proposed` tokens were kept."""
        self.length.record(proposed, accepted)
        self.proposed += proposed
        self.accepted += accepted
        self.verify_steps += 1


__all__ = ["SpeculationState"]
