"""Which queries vote, and when a policy may evict, for policies with an observation window (SnapKV).

A query-aware policy must see the question before it drops anything: the question sits at the end of the prompt,
so the prompt is compressed only once it is complete, and only the queries of its last `window` positions (and the
ones after them: generated tokens, later turns) add attention scores. `prompt_end` is the end of the prompt being
prefilled (a logical position, kept by `PolicyState`); None when unknown, e.g. perplexity over a text: then each
forward pass's last `window` queries vote and eviction follows every pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from cortexstream.policies.base import KVPolicy


@dataclass(frozen=True)
class Observation:
    window: int

    def first_voting_row(self, prompt_end: int | None, end: int, num_queries: int) -> int | None:
        """Of a pass whose `num_queries` queries sit at logical positions [end - num_queries, end): the first
        row whose attention counts, or None when none does."""
        if prompt_end is None:
            return max(0, num_queries - self.window)
        first = prompt_end - self.window - (end - num_queries)
        if first >= num_queries:
            return None
        return max(0, first)

    @staticmethod
    def may_evict(prompt_end: int | None, logical_length: int) -> bool:
        """Whether the prompt being prefilled is complete (eviction before its question voted would be blind)."""
        return prompt_end is None or logical_length >= prompt_end


def observation_for(policy: KVPolicy) -> Observation | None:
    """The window rule of a policy that declares one (`KVPolicy.observation_window`), else None."""
    window = policy.observation_window
    return None if window is None else Observation(int(window))
