"""KV policies: `FullCache` (default); eviction policies StreamingLLM and H2O follow."""

from cortexstream.policies.base import FullCache, KVPolicy, parse_policy

__all__ = ["FullCache", "KVPolicy", "parse_policy"]
