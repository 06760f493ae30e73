"""Expected Attention (after kvpress): keep the keys future queries are expected to attend to, without seeing them.

Query-agnostic: the score of a key is the attention a query drawn from the prompt's query distribution (mean and
covariance per head, before RoPE, moved to the next `future` positions) is expected to pay it, times its value's
norm (`engine.query_statistics`). Nothing about a later question is needed, which is what a document compressed in
one turn and asked about in a later one requires. Kept as H2O keeps: the first `sinks` tokens, the last `recent`,
and the best-scored rest, per layer and KV head, evicting after every forward pass once over budget. Queries of
the prompt being prefilled feed the statistics (generated tokens do not, so a batched decode and a lone one score
alike).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cortexstream.policies.base import check_count
from cortexstream.policies.h2o import H2O


@dataclass(frozen=True)
class ExpectedAttention(H2O):
    recent: int | None = 16
    future: int = 512

    name = "expected"
    needs_attention_scores = False
    needs_query_statistics = True
    # Per KV head too: a key's score is a softmax over the keys per query head of its group, from that head's own
    # query statistics, averaged over the group only (`engine.query_statistics`); H2O's fixed counts.
    selects_per_head = True
    parse_keys: ClassVar[dict[str, str]] = {"budget": "budget", "sinks": "count", "recent": "count",
                                            "keep_prefix": "count", "future": "count"}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_count("future", self.future, 1)

    def describe(self) -> str:
        prefix = f",keep_prefix={self.keep_prefix}" if self.keep_prefix else ""
        return (f"expected:budget={self.budget},sinks={self.sinks},recent={self.recent},future={self.future}"
                f"{prefix}")
