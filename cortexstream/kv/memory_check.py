"""Refuse a KV reservation that cannot fit in this machine's memory, with the numbers, before allocating it.

Without this, a request for 10**12 tokens dies in the allocator with an empty MemoryError (or, for sizes the
allocator accepts lazily, with an out-of-memory kill later). Physical memory is the bound on both backends (on
Apple silicon the GPU shares it); an arena may take at most MAX_MEMORY_FRACTION of it, leaving room for weights.
"""

from __future__ import annotations

from cortexstream.errors import InvalidArgumentError

MAX_MEMORY_FRACTION = 0.9


def check_kv_fits(num_tokens: int, bytes_per_token: int, argument: str, memory_bytes: int) -> None:
    """InvalidArgumentError naming `argument` when `num_tokens` x `bytes_per_token` exceeds the memory share of
    `memory_bytes` (the caller passes `arena_config.device_memory_bytes()`; this module imports nothing of kv/)."""
    have = memory_bytes
    need = num_tokens * bytes_per_token
    if bytes_per_token > 0 and need > MAX_MEMORY_FRACTION * have:
        fit = int(MAX_MEMORY_FRACTION * have // bytes_per_token)
        raise InvalidArgumentError(
            f"{argument}: {num_tokens} tokens need {need / 2**30:.1f} GiB of KV arena ({bytes_per_token} bytes per "
            f"token), this machine has {have / 2**30:.1f} GiB; at most about {fit} tokens fit")
