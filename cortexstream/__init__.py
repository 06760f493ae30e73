"""CortexStream: an MLX-native LLM inference engine with a paged KV arena and KV memory policies."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = [
    "load", "generate", "stream_generate", "batch_generate", "make_prompt_cache", "Engine", "ThreadedEngine",
    "EngineClient", "InProcessClient", "ThreadedClient", "SamplingParams", "perplexity", "__version__",
]


def __getattr__(name: str) -> Any:
    # Lazy imports keep `import cortexstream` cheap and mlx-free for the pure-Python parts (allocator, scheduler).
    if name == "load":
        from cortexstream.models.loader import load

        return load
    if name in ("generate", "stream_generate"):
        from cortexstream.generation import stream

        return getattr(stream, name)
    if name == "batch_generate":
        from cortexstream.generation.batch import batch_generate

        return batch_generate
    if name == "Engine":
        from cortexstream.engine.engine import Engine

        return Engine
    if name == "ThreadedEngine":
        from cortexstream.engine.threaded import ThreadedEngine

        return ThreadedEngine
    if name in ("EngineClient", "InProcessClient", "ThreadedClient"):
        from cortexstream.engine import client

        return getattr(client, name)
    if name == "make_prompt_cache":
        from cortexstream.kv.prompt_cache import make_prompt_cache

        return make_prompt_cache
    if name == "SamplingParams":
        from cortexstream.engine.sampling import SamplingParams

        return SamplingParams
    if name == "perplexity":
        from cortexstream.evaluation.perplexity import perplexity

        return perplexity
    raise AttributeError(f"module 'cortexstream' has no attribute {name!r}")
