"""Which queries vote, and when a policy may evict, for policies with an observation window (SnapKV).

A query-aware policy must see the question before it drops anything: the question sits at the end of the prompt,
so the prompt is compressed only once it is complete, and only the queries of its last `window` positions (and the
ones after them: generated tokens, later turns) add attention scores. `Observation` holds the end of the prompt
being prefilled (`prompt_end`, a logical position; None when unknown, e.g. perplexity over a text: then each
forward pass's last `window` queries vote and eviction follows every pass).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Observation:
    window: int
    prompt_end: int | None = None

    def first_voting_row(self, end: int, num_queries: int) -> int | None:
        """Of a pass whose `num_queries` queries sit at logical positions [end - num_queries, end): the first
        row whose attention counts, or None when none does."""
        if self.prompt_end is None:
            return max(0, num_queries - self.window)
        first = self.prompt_end - self.window - (end - num_queries)
        if first >= num_queries:
            return None
        return max(0, first)

    def may_evict(self, logical_length: int) -> bool:
        """Whether the prompt being prefilled is complete (eviction before its question voted would be blind)."""
        return self.prompt_end is None or logical_length >= self.prompt_end


def observation_for(policy: object) -> Observation | None:
    window = getattr(policy, "observation_window", None)
    return None if window is None else Observation(int(window))
