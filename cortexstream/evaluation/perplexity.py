"""Perplexity with a KV policy active, like mlx-lm's perplexity tool but teacher-forced through the cache.

The text is fed in chunks of `chunk_size` tokens (1 = token by token, the decode regime) on a private arena
cache; after every chunk the policy evicts down to its budget, so later tokens are predicted from the evicted
cache exactly as in generation. Within a chunk, the cache holds at most budget + chunk_size tokens (the "+ one
prefill chunk" allowance), so chunk_size > 1 trades a slightly larger effective cache for speed. Without an
evicting policy nothing is ever evicted and chunking does not change the result, so a large chunk is used.
The policy's context (for fraction budgets) is the number of tokens scored. A policy that compresses a prompt only
after the model repeated it (KVzip, `reconstructs`) is refused: a scored text has no prompt end to repeat.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import KVPolicy
from cortexstream.policies.parsing import parse_policy

FULL_CHUNK = 512


def token_nlls(
    model: Any, tokens: Sequence[int], kv_policy: "KVPolicy | str | None" = None, *, chunk_size: int | None = None,
    prompt_cache: list[Any] | None = None, on_chunk: Callable[[int, list[Any]], None] | None = None,
) -> np.ndarray:
    """Negative log-likelihood (nats, float64) of tokens[1:], each given everything before it under the policy.

    `prompt_cache`: continue from an existing cache instead of a fresh one. `on_chunk(i, cache)` runs after the
    eviction that follows the chunk ending at token i (tests use it to inspect the cache).
    """
    from cortexstream.kv.prompt_cache import make_prompt_cache
    from cortexstream.engine.policy_prompt_cache import apply_policy, attach_policy, policy_state_of

    policy = parse_policy(kv_policy)
    evicting = policy is not None and policy.evicts
    if evicting and policy.reconstructs:
        raise InvalidArgumentError(f"kv_policy: {policy.describe()!r} compresses a prompt once the model has repeated "
                                   "it, after the prompt's end; perplexity scores a text with no prompt end, so "
                                   "nothing would ever be compressed (use it with generate or the engine)")
    if chunk_size is None:
        chunk_size = 1 if evicting else FULL_CHUNK
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise InvalidArgumentError(f"chunk_size: {chunk_size!r} must be an integer >= 1")
    ids = np.asarray(tokens, dtype=np.int64)
    if ids.ndim != 1 or ids.size < 2:
        raise InvalidArgumentError(f"perplexity: need at least 2 tokens, got {ids.size}")
    context = int(ids.size) + (prompt_cache[0].offset if prompt_cache else 0)
    if prompt_cache is None:
        bound = policy.max_physical_tokens(context, chunk_size) if evicting else None
        prompt_cache = make_prompt_cache(model, max_tokens=min(context, bound or context))
    attach_policy(prompt_cache, policy, model)
    inputs = mx.array(ids[:-1].astype(np.uint32))
    targets = mx.array(ids[1:].astype(np.int32))
    out = np.empty(ids.size - 1, dtype=np.float64)
    for start in range(0, ids.size - 1, chunk_size):
        stop = min(start + chunk_size, ids.size - 1)
        logits = model(inputs[start:stop][None], cache=prompt_cache)[0].astype(mx.float32)
        picked = mx.take_along_axis(logits, targets[start:stop, None], axis=-1)[:, 0]
        nll = mx.logsumexp(logits, axis=-1) - picked
        state = policy_state_of(prompt_cache)
        mx.eval(nll, state.pending_arrays() if state is not None else [])  # one evaluation: logits and scores
        out[start:stop] = np.asarray(nll, dtype=np.float64)
        apply_policy(prompt_cache, context)
        if on_chunk is not None:
            on_chunk(stop, prompt_cache)
    return out


def perplexity(
    model: Any, tokenizer: Any, text: str, kv_policy: "KVPolicy | str | None" = None,
    num_tokens: int | None = None, *, chunk_size: int | None = None,
) -> float:
    """exp(mean NLL) of the first `num_tokens` tokens of `text` (all of them by default), with `kv_policy`
    evicting while scoring. Token by token for evicting policies unless `chunk_size` says otherwise."""
    if not isinstance(text, str) or not text:
        raise InvalidArgumentError("perplexity: text must be a non-empty string")
    ids = list(tokenizer.encode(text))
    if num_tokens is not None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 2:
            raise InvalidArgumentError(f"num_tokens: {num_tokens!r} must be an integer >= 2")
        if num_tokens > len(ids):
            raise InvalidArgumentError(f"num_tokens: {num_tokens} requested but the text has {len(ids)} tokens")
        ids = ids[:num_tokens]
    return float(np.exp(token_nlls(model, ids, kv_policy, chunk_size=chunk_size).mean()))
