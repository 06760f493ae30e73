"""Policy strings for the CLI and config files: `name[:key=value,key=value...]`.

Examples: `full`, `streaming:window=1020`, `streaming:budget=0.2,sinks=4`, `h2o:budget=0.2,sinks=4,recent=64`,
`h2o:budget=512,keep_prefix=40`. Values with a '.' are fractions, others token counts. Errors name the bad
key or value and list what is accepted.
"""

from __future__ import annotations

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
_KEYS: dict[type[KVPolicy], dict[str, str]] = {  # key -> kind ("count" int, "budget" int or fraction)
    FullCache: {},
    StreamingLLM: {"sinks": "count", "window": "budget", "budget": "budget"},
    H2O: {"budget": "budget", "sinks": "count", "recent": "count", "keep_prefix": "count"},
}


def _value(policy: str, key: str, text: str, kind: str) -> Any:
    try:
        if kind == "budget" and any(c in text for c in ".eE"):
            return float(text)
        return int(text)
    except ValueError:
        want = "an integer" if kind == "count" else "an integer token count or a fraction like 0.2"
        raise InvalidArgumentError(f"kv_policy '{policy}': {key}={text!r} is not {want}") from None


def parse_policy(spec: "str | KVPolicy | None") -> KVPolicy | None:
    """A policy from its string form; policies and None pass through unchanged."""
    if spec is None or isinstance(spec, KVPolicy):
        return spec
    if not isinstance(spec, str):
        raise InvalidArgumentError(f"kv_policy: expected a string or a KVPolicy, got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    cls = _NAMES.get(name.strip().lower())
    if cls is None:
        raise InvalidArgumentError(
            f"kv_policy: unknown policy '{name}' in '{spec}' (known: full, streaming, h2o)"
        )
    allowed = _KEYS[cls]
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
