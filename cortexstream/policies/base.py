"""KV memory policies: small objects attached to a request that decide what stays in its physical KV cache."""

from __future__ import annotations

from dataclasses import dataclass

class KVPolicy:
    """Base class. A policy never changes a sequence's text; it only evicts/compresses the sequence's KV."""

    name = "base"
    needs_attention_scores = False  # True: the runner must provide the attention each key received

    def max_physical_tokens(self, max_total_tokens: int, chunk: int) -> int | None:
        """Upper bound on the physical KV slots a sequence can hold (None: no bound beyond its length)."""
        return None

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class FullCache(KVPolicy):
    """Keep every token (the default)."""

    name = "full"


def parse_policy(spec: str | KVPolicy | None) -> KVPolicy | None:
    """Turn a CLI string such as 'full' into a policy; policies and None pass through."""
    if spec is None or isinstance(spec, KVPolicy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"kv_policy: expected a string or a KVPolicy, got {type(spec).__name__}")
    name = spec.split(":", 1)[0].strip().lower()
    if name in ("full", "fullcache", "none"):
        return FullCache()
    from cortexstream.errors import InvalidArgumentError

    raise InvalidArgumentError(f"kv_policy: unknown policy '{name}' in '{spec}' (known: full)")


