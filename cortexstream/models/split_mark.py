"""Whether a model object holds only its share of the weights: split over ranks (distributed/sharding.py).

A split model's forward pass runs collectives (all-sums) that every rank must join, so running it on rank 0 alone
waits forever for ranks that are not running it. The sharding marks the model; an engine stepping a marked model
that no rank session relays refuses instead of hanging (engine/engine.py).
"""

from __future__ import annotations

from typing import Any

SPLIT_ATTRIBUTE = "cortexstream_split_ranks"  # an attribute on the model object: the number of ranks it is split over


def mark_split(model: Any, ranks: int) -> None:
    """Record that `model` now holds 1/`ranks` of its weights."""
    setattr(model, SPLIT_ATTRIBUTE, int(ranks))


def split_ranks(model: Any) -> int:
    """The number of ranks `model` is split over (1: the whole model)."""
    value = getattr(model, SPLIT_ATTRIBUTE, 1)
    return value if isinstance(value, int) and value > 1 else 1


__all__ = ["SPLIT_ATTRIBUTE", "mark_split", "split_ranks"]
