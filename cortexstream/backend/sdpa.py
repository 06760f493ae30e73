"""Routing mlx-lm's attention call to a cache's own attention: `dispatch_sdpa` and `route_sdpa(model)`.

mlx-lm models call `cache.update_and_fetch(keys, values)` and then `scaled_dot_product_attention(queries, keys,
values, cache=cache, ...)`, a function every model module imports by name from `mlx_lm.models.base`. Caches that
attend their own way (the engine's batch caches attend straight from the KV arena; score-collecting caches for
KV policies) need that call. `route_sdpa(model)` replaces the name, in the mlx-lm modules that define the classes
the model is built of, by `dispatch_sdpa`: a cache with an `attention_hook` gets the call, any other cache the
original function with the same arguments (bit-identical outputs; the cost is one `getattr` per layer call).

Explicit: a model's modules are routed when something that needs it is built for that model (an engine's
backend, `ComputeBackend.for_engine(model=...)`), once; nothing is patched on import. `mlx_lm.models.base` itself
is never patched, so its attribute is always the original. `unroute_sdpa()` puts the original back everywhere.
"""

from __future__ import annotations

import sys
from functools import cache
from typing import Any, Callable

PREFIX = "mlx_lm.models."


@cache
def mlx_lm_sdpa() -> Callable[..., Any]:
    """mlx-lm's own `scaled_dot_product_attention` (base's attribute, which is never replaced)."""
    from mlx_lm.models import base

    return base.scaled_dot_product_attention


def original_sdpa(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
                  sinks: Any = None) -> Any:
    """mlx-lm's own `scaled_dot_product_attention`, whatever is routed."""
    return mlx_lm_sdpa()(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)


def dispatch_sdpa(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
                  sinks: Any = None) -> Any:
    """Drop-in for mlx-lm's SDPA: a cache with an `attention_hook` gets the call, every other cache the original."""
    hook = getattr(cache, "attention_hook", None)
    if hook is None:
        return mlx_lm_sdpa()(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
    return hook(queries, keys, values, scale, mask, sinks)


def model_modules(model: Any) -> list[str]:
    """The mlx-lm modules defining the classes `model` is built of (the model, its layers, their attention)."""
    parts = model.modules() if hasattr(model, "modules") else [model]
    names = {type(part).__module__ for part in [model, *parts]}
    return sorted(name for name in names if name.startswith(PREFIX))


def _route(name: str) -> bool:
    """Route one loaded module's SDPA; True when it is routed now (already or by this call)."""
    module = sys.modules.get(name)
    current = getattr(module, "scaled_dot_product_attention", None)
    if current is dispatch_sdpa:
        return True
    if current is None or current is not mlx_lm_sdpa() or name == PREFIX + "base":
        return False
    setattr(module, "scaled_dot_product_attention", dispatch_sdpa)
    return True


def route_sdpa(model: Any) -> list[str]:
    """Route the SDPA of `model`'s mlx-lm modules through `dispatch_sdpa` (idempotent). Returns the modules that
    are routed; empty for a model that is not built from mlx-lm modules (its attention never reaches hooks)."""
    return [name for name in model_modules(model) if _route(name)]


def is_routed(model: Any) -> bool:
    """Whether every mlx-lm module of `model` that calls mlx-lm's SDPA calls `dispatch_sdpa`."""
    names = model_modules(model)
    return bool(names) and all(
        getattr(sys.modules.get(n), "scaled_dot_product_attention", dispatch_sdpa) is not mlx_lm_sdpa() for n in names)


def route_loaded_modules() -> list[str]:
    """Route every loaded `mlx_lm.models.*` module (for callers that have no model at hand). Scans sys.modules:
    call it once where such a cache is built, not per step."""
    return [name for name in list(sys.modules) if name.startswith(PREFIX) and _route(name)]


def routed_modules() -> list[str]:
    """The loaded mlx-lm modules whose SDPA is `dispatch_sdpa` now."""
    return [name for name, module in list(sys.modules.items())
            if name.startswith(PREFIX) and getattr(module, "scaled_dot_product_attention", None) is dispatch_sdpa]


def unroute_sdpa() -> None:
    """Put the original function back in every routed module (tests use this to prove the unrouted path)."""
    for name in routed_modules():
        setattr(sys.modules[name], "scaled_dot_product_attention", mlx_lm_sdpa())
