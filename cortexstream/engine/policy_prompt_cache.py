"""Policies on an explicit prompt cache (the mlx-lm style direct path): multi-turn chat, perplexity, forks.

Multi-turn continuation. A prompt cache given to `stream_generate(..., prompt_cache=cache, kv_policy=policy)` is
upgraded in place to `PolicyKVCache` objects that carry the policy state, so the next call with the same list
continues on the evicted cache: only the new turn's tokens are computed, positions continue from the logical
length, and H2O's scores keep accumulating across turns. The conversation's text lives with the caller (it is
never evicted); `cortexstream.cli` chat re-templates the whole history and feeds only the part the cache lacks.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from cortexstream.backend.sdpa import route_loaded_modules, route_sdpa
from cortexstream.engine.policy_kv_cache import PolicyKVCache, policy_caches
from cortexstream.engine.policy_runtime import PolicyState
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.sequence_kv import private_sequence
from cortexstream.policies.base import KVPolicy
from cortexstream.policies.parsing import parse_policy


def policy_state_of(prompt_cache: list[Any]) -> PolicyState | None:
    """The policy state a prompt cache carries (its layers are `PolicyKVCache`s), else None."""
    if prompt_cache and isinstance(prompt_cache[0], PolicyKVCache):
        return prompt_cache[0].policy_state
    return None


def attach_policy(prompt_cache: list[Any], kv_policy: "KVPolicy | str | None", model: Any = None) -> PolicyState | None:
    """Give an arena prompt cache a policy (in place); returns its state, or None for no/full policy.

    A cache that already carries a state keeps it (and its scores) when the policy is equal; a different policy
    starts a new state, which is only possible while nothing has been evicted. `model` is needed by policies that
    re-rotate keys (StreamingLLM rerotate=True).
    """
    policy = parse_policy(kv_policy)
    current = policy_state_of(prompt_cache)
    if policy is None or not policy.evicts:
        return current
    if current is not None and current.policy == policy:
        return current
    if not prompt_cache or not all(isinstance(c, ArenaKVCache) for c in prompt_cache):
        raise InvalidArgumentError("kv_policy with prompt_cache: use cortexstream.make_prompt_cache (arena caches)")
    seq = prompt_cache[0].sequence
    if any(c.sequence is not seq for c in prompt_cache):
        raise InvalidArgumentError("kv_policy: the prompt cache's layers must belong to one sequence")
    state = PolicyState.for_sequence(policy, seq, model)
    if policy.needs_attention_hook:
        # The caches' hooks are reached only through routed SDPA (an engine's backend routes its own model).
        route_sdpa(model) if model is not None else route_loaded_modules()
    prompt_cache[:] = policy_caches(seq, state)
    return state


def apply_policy(prompt_cache: list[Any], context: int) -> int:
    """After a forward pass on `prompt_cache`: evaluate its KV and scores, then evict. Returns tokens evicted."""
    state = policy_state_of(prompt_cache)
    if state is None:  # nothing to evict (any cache, mlx-lm's own included)
        return 0
    seq = prompt_cache[0].sequence
    mx.eval(seq.arena.arrays(), state.pending_arrays())
    return state.after_forward(seq, context)


def make_policy_cache(model: Any, kv_policy: "KVPolicy | str | None", max_tokens: int | None = None) -> list[Any]:
    """A private-arena prompt cache with `kv_policy` attached, sized for the policy's bound when known."""
    from cortexstream.kv.prompt_cache import make_prompt_cache

    cache = make_prompt_cache(model, max_tokens=max_tokens)
    attach_policy(cache, kv_policy, model)
    return cache


def fork_cache(prompt_cache: list[Any]) -> list[Any]:
    """An independent copy of a prompt cache (KV, counters, policy state), e.g. to branch one long prefix. The
    copy keeps the storage (`kv_dtype`): stored rows are copied as they are (quantized codes with their scales)."""
    seq = prompt_cache[0].sequence
    cfg = seq.arena.config
    copy = private_sequence(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.value_head_dim,
                            max(seq.capacity, 1), cfg.dtype, cfg.block_size, kv_dtype=cfg.kv_dtype,
                            key_centers=cfg.key_centers)
    for layer in range(cfg.num_layers):
        length = seq.lengths[layer]
        if length:
            rows = seq.arena.table_blocks(layer, seq.blocks, length)
            copy.arena.put_table_blocks(layer, copy.blocks[:cfg.blocks_for_tokens(length)], *rows)
    copy.lengths, copy.offsets = list(seq.lengths), list(seq.offsets)
    mx.eval(copy.arena.arrays())
    state = policy_state_of(prompt_cache)
    if state is None:
        return [type(c)(copy, layer) for layer, c in enumerate(prompt_cache)]
    return policy_caches(copy, state.clone())
