"""A prompt fed to a policy cache in chunks, and a greedy numeric answer read from it: the loop every retrieval
evaluation shares (`evaluation.needle`, `bench quality`'s passkey, `bench kv-dtype`, `bench retrieval`).

The KV policy acts after each chunk and after each answer token (`apply_policy`), as it does in the engine between
forward passes. Chunks before the last run the transformer without its output projection: only the last one's
logits are read.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import mlx.core as mx

from cortexstream.engine.policy_prompt_cache import apply_policy


def feed_chunks(model: Any, cache: list[Any], ids: Sequence[int], chunk: int, context: int,
                logits: bool = False) -> mx.array | None:
    """Prefill `ids` in chunks with eviction after each; the last position's logits `[1, V]` if asked."""
    last = None
    ids = list(ids)
    for start in range(0, len(ids), chunk):
        piece = mx.array(ids[start : start + chunk], dtype=mx.uint32)[None]
        final = logits and start + chunk >= len(ids)
        inner = getattr(model, "model", None)  # the transformer without the lm_head: no logits needed
        out = model(piece, cache=cache)[:, -1, :] if final or inner is None else inner(piece, cache=cache)
        mx.eval(out)
        apply_policy(cache, context)
        last = out if final else None
    return last


def greedy_tokens(model: Any, tokenizer: Any, cache: list[Any], logits: mx.array, context: int, digits: int,
                  max_tokens: int) -> list[int]:
    """Greedy tokens from `logits` until a `digits`-digit number, an end of sequence or `max_tokens`; every token
    but the last is fed to `cache` (a conversation feeds the last with its next prompt)."""
    tokens: list[int] = []
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    for step in range(max_tokens):
        token = int(mx.argmax(logits, axis=-1).item())
        tokens.append(token)
        if token in eos or re.search(rf"\d{{{digits}}}", tokenizer.decode(tokens)) or step == max_tokens - 1:
            break
        logits = model(mx.array([[token]], dtype=mx.uint32), cache=cache)[:, -1, :]
        mx.eval(logits)
        apply_policy(cache, context)
    return tokens


__all__ = ["feed_chunks", "greedy_tokens"]
