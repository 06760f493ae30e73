"""Policy strings for the CLI and config files: `name[:key=value,key=value...]`.

Examples: `full`, `streaming:window=1020`, `streaming:budget=0.2,sinks=4`, `h2o:budget=0.2,sinks=4,recent=64`,
`h2o:budget=512,keep_prefix=40`. Values with a '.' are fractions, others token counts. Errors name the bad
key or value and list what is accepted.
"""

from __future__ import annotations

import importlib
from typing import Any

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import FullCache, KVPolicy
from cortexstream.policies.h2o import H2O
from cortexstream.policies.streaming_llm import StreamingLLM

_NAMES: dict[str, type[KVPolicy]] = {
    "full": FullCache, "fullcache": FullCache, "none": FullCache,
    "streaming": StreamingLLM, "streamingllm": StreamingLLM, "streaming_llm": StreamingLLM, "sllm": StreamingLLM,
    "h2o": H2O,
}
# Policies defined in their own modules, imported on first use. Every class declares `parse_keys` (key -> kind:
# "count" int, "budget" int or fraction, "float", "bool" (0/1/true/false), "str" (e.g. a path)).
_LAZY: dict[str, tuple[str, str]] = {
    "meanpool": ("cortexstream.policies.mean_pool", "MeanPool"),
    "compressor": ("cortexstream.policies.compressor", "Compressor"),
    "sidecar": ("cortexstream.policies.sidecar", "Sidecar"),
    "tome": ("cortexstream.policies.token_merging", "TokenMerging"),
    "snapkv": ("cortexstream.policies.snapkv", "SnapKV"),
    "adakv": ("cortexstream.policies.adakv", "AdaKV"),
    "pyramidkv": ("cortexstream.policies.pyramidkv", "PyramidKV"),
    "expected": ("cortexstream.policies.expected_attention", "ExpectedAttention"),
    "d2o": ("cortexstream.policies.d2o", "D2O"),
    "merger": ("cortexstream.policies.learned_merger", "LearnedMerger"),
    "kvzip": ("cortexstream.policies.kvzip", "KVzip"),
    "kvzip_heads": ("cortexstream.policies.kvzip_heads", "KVzipHeads"),
}
def _value(policy: str, key: str, text: str, kind: str) -> Any:
    if kind == "str":
        return text
    if kind == "bool":
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise InvalidArgumentError(f"kv_policy '{policy}': {key}={text!r} is not a boolean (0/1/true/false)")
    if kind == "float":
        try:
            return float(text)
        except ValueError:
            raise InvalidArgumentError(f"kv_policy '{policy}': {key}={text!r} is not a number") from None
    try:
        if kind == "budget" and any(c in text for c in ".eE"):
            return float(text)
        return int(text)
    except ValueError:
        want = "an integer" if kind == "count" else "an integer token count or a fraction like 0.2"
        raise InvalidArgumentError(f"kv_policy '{policy}': {key}={text!r} is not {want}") from None


def _policy_class(name: str) -> type[KVPolicy] | None:
    if name in _NAMES:
        return _NAMES[name]
    if name in _LAZY:
        module, attr = _LAZY[name]
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    return None


def parse_policy(spec: "str | KVPolicy | None") -> KVPolicy:
    """A policy from its string form ('full', 'streaming:window=1020', 'h2o:budget=0.2,sinks=4,recent=64');
    policies pass through unchanged and None (no policy named) is `FullCache()`."""
    if spec is None:
        return FullCache()
    if isinstance(spec, KVPolicy):
        return spec
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"kv_policy: expected a string or a KVPolicy, got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    cls = _policy_class(name.strip().lower())
    if cls is None:
        known = ", ".join(["full", "streaming", "h2o", *_LAZY])
        raise InvalidArgumentError(f"kv_policy: unknown policy '{name}' in '{spec}' (known: {known})")
    allowed = cls.parse_keys
    kwargs: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, text = item.partition("=")
        key = key.strip().lower().replace("-", "_")
        if not eq or not text.strip():
            raise InvalidArgumentError(f"kv_policy '{spec}': '{item}' must be key=value")
        if key not in allowed:
            known = ", ".join(allowed) or "none"
            raise InvalidArgumentError(f"kv_policy '{spec}': unknown key '{key}' for {cls.name} (known: {known})")
        if key in kwargs:
            raise InvalidArgumentError(f"kv_policy '{spec}': key '{key}' given twice")
        kwargs[key] = _value(spec, key, text.strip(), allowed[key])
    try:
        return cls(**kwargs)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"kv_policy '{spec}': {exc}") from None
