"""How big a private engine's KV arena should be: what the job needs, within the model's context and the memory
this machine has, with an error that gives the numbers when even one request cannot fit.

The public calls (`generate`, `stream_generate`, `batch_generate`) build a private engine per call. An arena's
buffers grow to what its requests reserve (first-touch page faults cost about 2.5 s per GB on this class of
machine, and each growth copies), so its budget is sized to the job: each request's prompt plus max_tokens (or its
policy's bound), in blocks, plus one block each for a copy-on-write of a shared last block.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any, Sequence

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.arena_config import ArenaConfig
from cortexstream.policies.base import KVPolicy

if TYPE_CHECKING:
    from cortexstream.kv.arena import KVArena

# Of the memory available when the call starts, the most a private arena may take (the rest: weights already
# loaded aside, activations and the allocator's cache).
MEMORY_SHARE = 0.8
CONTEXT_OVERFLOW = ("warn", "error")


def model_context(model: Any) -> int | None:
    """The model's trained context length (`max_position_embeddings`), or None when it does not say."""
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None) if args is not None else None
    return int(value) if isinstance(value, int) and value > 0 else None


def fit_to_context(model: Any, prompt_tokens: int, max_tokens: int, on_overflow: str = "warn") -> int:
    """`max_tokens` cut so prompt + output stay within the model's context. A prompt that is already longer than
    the context is warned about (`on_overflow="warn"`, the output is then likely degraded) or refused ("error")."""
    if on_overflow not in CONTEXT_OVERFLOW:
        raise InvalidArgumentError(f"context_overflow: {on_overflow!r} must be one of {CONTEXT_OVERFLOW}")
    context = model_context(model)
    if context is None:
        return max_tokens
    if prompt_tokens >= context:
        message = (f"prompt: {prompt_tokens} tokens, longer than the model's context of {context} tokens "
                   "(max_position_embeddings)")
        if on_overflow == "error":
            raise InvalidArgumentError(message + "; shorten it, or pass context_overflow='warn' to run anyway")
        warnings.warn(message + "; generating anyway", stacklevel=3)
        return max_tokens
    return min(max_tokens, context - prompt_tokens)


def available_memory_bytes() -> int:
    """Memory a new allocation can get now: unified memory on Apple silicon, else the OS's available pages."""
    import mlx.core as mx

    if mx.metal.is_available():
        info = mx.metal.device_info()
        return int(info.get("max_recommended_working_set_size", info["memory_size"])) - int(mx.get_active_memory())
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def job_kv_tokens(requests: Sequence[tuple[int, int, KVPolicy]], block_size: int, prefill_step_size: int) -> int:
    """Token slots for requests given as (prompt tokens, max_tokens, policy): each one's physical bound in whole
    blocks plus one block for copy-on-write."""
    blocks = 0
    for prompt_tokens, max_tokens, policy in requests:
        peak = policy.peak_tokens(prompt_tokens + max_tokens, prefill_step_size, prompt_tokens)
        blocks += -(-peak // block_size) + 1
    return blocks * block_size


def private_arena_tokens(model: Any, requests: Sequence[tuple[int, int, KVPolicy]], *, block_size: int,
                         prefill_step_size: int, kv_dtype: str | None = None,
                         kv_group_size: int | None = None) -> int:
    """The arena size for a private engine running `requests`: all of them at once when memory allows, else as
    many slots as memory allows (requests then queue), never less than the largest single request needs."""
    need = job_kv_tokens(requests, block_size, prefill_step_size)
    probe = ArenaConfig.for_model(model, num_tokens=block_size, block_size=block_size, kv_dtype=kv_dtype,
                                  kv_group_size=kv_group_size)
    per_token = probe.bytes_per_token
    budget = int(available_memory_bytes() * MEMORY_SHARE)
    if need * per_token <= budget:
        return need
    largest = max(job_kv_tokens([r], block_size, prefill_step_size) for r in requests)
    if largest * per_token > budget:
        raise InvalidArgumentError(
            f"max_tokens: a request needs {largest} KV slots x {per_token} bytes = {largest * per_token / 1e9:.2f} GB "
            f"of KV cache, but only {budget / 1e9:.2f} GB of memory can be given to it "
            f"({MEMORY_SHARE:.0%} of {budget / MEMORY_SHARE / 1e9:.2f} GB available); lower max_tokens, shorten the "
            "prompt, or use a KV policy with a budget (kv_policy='h2o:budget=...')"
        )
    return max(largest, budget // per_token // block_size * block_size)


def private_arena(model: Any, requests: Sequence[tuple[int, int, KVPolicy]], *, block_size: int,
                  prefill_step_size: int, kv_dtype: str | None = None, kv_group_size: int | None = None) -> KVArena:
    """The arena of a private engine (`private_arena_tokens` slots), committed at once: a job-sized arena is
    used in full, so one zero-fill costs less than growing it in doublings (each a copy)."""
    from cortexstream.kv.arena import KVArena

    tokens = private_arena_tokens(model, requests, block_size=block_size, prefill_step_size=prefill_step_size,
                                  kv_dtype=kv_dtype, kv_group_size=kv_group_size)
    return KVArena(ArenaConfig.for_model(model, num_tokens=tokens, block_size=block_size, kv_dtype=kv_dtype,
                                         kv_group_size=kv_group_size), preallocate=True)


def engine_arena(model: Any, arena: "KVArena | None", kv_tokens: int | None, kv_bytes: int | None, block_size: int,
                 kv_dtype: str | None, kv_group_size: int | None) -> "KVArena":
    """The arena an `Engine` runs on: the one given (whose storage a `kv_dtype` given too must match), else one
    of `kv_tokens` or `kv_bytes` (default 16384 tokens) storing K/V as `kv_dtype`."""
    from cortexstream.kv.arena import KVArena
    from cortexstream.kv.arena_config import check_arena_storage

    if arena is not None:
        check_arena_storage(arena, model, kv_dtype, kv_group_size)
        return arena
    if kv_tokens is None and kv_bytes is None:
        kv_tokens = 16384
    return KVArena(ArenaConfig.for_model(model, num_tokens=kv_tokens, num_bytes=kv_bytes, block_size=block_size,
                                         kv_dtype=kv_dtype, kv_group_size=kv_group_size))
