"""A sequence bound to a caller's prompt cache (mlx-lm's `prompt_cache=`): the engine's one decode loop runs it.

`stream_generate(..., prompt_cache=cache)` continues a conversation on a cache the caller keeps between calls
(an mlx-lm `KVCache` list, `cortexstream.make_prompt_cache`, or a policy cache). Such a sequence takes no arena
blocks: its KV lives in that cache. The engine schedules it like any other (its sampling, stop strings, logits
processors, pipelined decode), and the runner gives it forward passes of its own, because a foreign cache cannot
join a batched forward over the arena. A KV policy on an arena prompt cache travels with the cache and evicts
after every forward pass, exactly as it does in the arena.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from cortexstream.engine.policy_prompt_cache import apply_policy, attach_policy, policy_state_of
from cortexstream.errors import InvalidArgumentError


class BoundCache:
    """The caller's per-layer caches, and the eviction to run after each forward pass (None: no policy)."""

    def __init__(self, caches: list[Any], evict: Callable[[], int] | None = None) -> None:
        self.caches = caches
        self.evict = evict

    @classmethod
    def bind(cls, prompt_cache: Any, model: nn.Module, kv_policy: Any, context_tokens: int,
             prompt_tokens: int | None = None) -> "BoundCache":
        """Check `prompt_cache` against `model` and attach `kv_policy` to it (in place, as mlx-lm callers expect);
        `context_tokens` (what this turn can reach) resolves fractional policy budgets; `prompt_tokens` (this
        turn's prompt) tells a query-aware policy where the question ends."""
        from cortexstream.kv.prompt_cache_check import check_cache_for_model

        if not isinstance(prompt_cache, list):
            raise InvalidArgumentError(
                f"prompt_cache: expected a list of per-layer caches, got {type(prompt_cache).__name__}")
        check_cache_for_model(prompt_cache, model)  # a short or foreign cache would run silently wrong
        evict = None
        if (kv_policy is not None and kv_policy.evicts) or policy_state_of(prompt_cache) is not None:
            state = attach_policy(prompt_cache, kv_policy, model)
            if state is not None:
                context = prompt_cache[0].offset + context_tokens
                if prompt_tokens is not None:
                    state.expect_prompt_end(prompt_cache[0].offset + prompt_tokens)
                evict = functools.partial(apply_policy, prompt_cache, context)
        return cls(prompt_cache, evict)

    @property
    def offset(self) -> int:
        return int(self.caches[0].offset)

    def forward(self, model: nn.Module, head: Any, tokens: mx.array, want_logits: bool) -> mx.array | None:
        """Run `tokens` `[1, n]` through the model on this cache; logits `[1, V]` of the last position when
        `want_logits`, else None. `head`: the model's output projection (see `runner.head_of`), or None to call the
        whole model. The forward is evaluated before an eviction; without one the logits stay lazy (pipelining)."""
        if head is None:
            hidden = model(tokens, cache=self.caches)
            out = hidden[:, -1, :] if want_logits else None
        else:
            hidden = model.model(tokens, cache=self.caches)
            out = head(hidden[:, -1:, :])[:, 0, :] if want_logits else None
        if self.evict is not None or out is None:
            mx.eval(hidden if out is None else out)
        if self.evict is not None:
            self.evict()
        return out
