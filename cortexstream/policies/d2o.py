"""D2O-style eviction with merging (after D2O, Wan et al. 2024, and CaM, Zhang et al. 2024): H2O's choice of what
to keep, and every dropped token whose key is close enough (cosine >= `threshold`) to a kept key of the same head
folded into that kept token's value instead of lost (`engine.evict_merge`). Same budget and memory as H2O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cortexstream.policies.base import check_real
from cortexstream.policies.h2o import H2O


@dataclass(frozen=True)
class D2O(H2O):
    threshold: float = 0.5

    name = "d2o"
    merges_evicted = True
    # H2O's per-head choice; a dropped slot folds into a kept slot of its own head (keys and values of that head
    # only), which changes values, never the counts.
    selects_per_head = True
    parse_keys: ClassVar[dict[str, str]] = {"budget": "budget", "sinks": "count", "recent": "count",
                                            "keep_prefix": "count", "threshold": "float"}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_real(type(self).__name__, "threshold", self.threshold, -1.0, 1.0, "a cosine in [-1, 1]")

    @property
    def merge_threshold(self) -> float:  # type: ignore[override]
        return float(self.threshold)

    def describe(self) -> str:
        recent = "" if self.recent is None else f",recent={self.recent}"
        prefix = f",keep_prefix={self.keep_prefix}" if self.keep_prefix else ""
        return f"d2o:budget={self.budget},sinks={self.sinks}{recent}{prefix},threshold={self.threshold:g}"
