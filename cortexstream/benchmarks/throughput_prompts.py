"""Prompt sets for `bench throughput`: equal-length, ragged and shared-prefix token-id prompts of real text.

Every kind is cut from `common.prompt_token_lists`'s windows of real text (Python docs), so both systems get
the very same token ids.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from cortexstream.benchmarks.common import prompt_token_lists, real_text

KINDS = ("equal", "ragged", "shared")
SHARED_PREFIX_FRACTION = 0.75  # the "prompts sharing a 75% prefix"
RAGGED_MIN_FRACTION = 0.25  # ragged lengths are uniform in [0.25, 1] x the cell's length


_TOKENIZED: dict[int, tuple[Any, list[int]]] = {}


def text_windows(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`common.prompt_token_lists`, with the text tokenised once per tokenizer instead of once per call.

    Every cell, ITL round and single prompt needs prompts; re-encoding the whole text each time costs seconds.
    The windows are checked against `prompt_token_lists` on first use, so the two cannot drift apart.
    """
    cached = _TOKENIZED.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        cached = (tokenizer, list(tokenizer.encode(real_text())))
        _TOKENIZED[id(tokenizer)] = cached
        if prompt_token_lists(tokenizer, 2, 8) != _slice(cached[1], 2, 8):
            raise RuntimeError("text_windows disagrees with common.prompt_token_lists")
    return _slice(cached[1], count, length)


def _slice(tokens: list[int], count: int, length: int) -> list[list[int]]:
    stride = max(length, 997)  # as in prompt_token_lists: prompts start in different parts of the text
    if count * stride + length > len(tokens):
        raise ValueError(f"not enough text for {count} prompts of {length} tokens")
    return [tokens[i * stride : i * stride + length] for i in range(count)]


@dataclass(frozen=True)
class PromptSet:
    kind: str
    prompts: list[list[int]]
    shared_prefix_tokens: int  # 0 unless kind == "shared"

    def describe(self) -> dict[str, Any]:
        lengths = [len(p) for p in self.prompts]
        return {"count": len(lengths), "min": min(lengths), "mean": sum(lengths) / len(lengths),
                "max": max(lengths), "total": sum(lengths), "shared_prefix_tokens": self.shared_prefix_tokens}


def build_prompts(tokenizer: Any, kind: str, count: int, length: int, seed: int = 0) -> PromptSet:
    """`count` prompts of the given kind for a cell of `length` tokens.

    ragged: prompt i keeps its first n_i tokens, n_i uniform in [0.25, 1] x length (seeded per cell, so a rerun of
    the same cell gets the same lengths). shared: one common prefix of 75% of `length` (the first prompt's start)
    followed by each prompt's own distinct 25% tail, taken from a different place in the text.
    """
    if kind not in KINDS:
        raise ValueError(f"kind: '{kind}' is not one of {', '.join(KINDS)}")
    if length < 4:
        raise ValueError(f"prompt length {length} is too short to build '{kind}' prompts (need >= 4 tokens)")
    base = text_windows(tokenizer, count, length)
    if kind == "equal":
        return PromptSet(kind, base, 0)
    if kind == "ragged":
        rng = random.Random(f"ragged:{seed}:{count}:{length}")
        low = max(1, round(RAGGED_MIN_FRACTION * length))
        return PromptSet(kind, [p[: rng.randint(low, length)] for p in base], 0)
    prefix_len = round(SHARED_PREFIX_FRACTION * length)
    prefix = base[0][:prefix_len]
    tail_len = length - prefix_len
    # Tails come from the end of each distinct text window, so no two prompts share more than the prefix.
    return PromptSet(kind, [prefix + p[-tail_len:] for p in base], prefix_len)
