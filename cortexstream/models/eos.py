"""The tokens that end a generation: a tokenizer's `eos_token_ids` when it has them (mlx-lm's wrapper gathers every
end-of-turn token there), else its single `eos_token_id`."""

from __future__ import annotations

from typing import Any


def eos_ids(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])


__all__ = ["eos_ids"]
