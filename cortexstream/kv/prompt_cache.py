"""Per-sequence prompt caches backed by the arena, mlx-lm style: make, save, load."""

from __future__ import annotations

import json
import os

import mlx.core as mx
import mlx.nn as nn

from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.arena_config import ArenaConfig, model_kv_shape
from cortexstream.kv.sequence_kv import SequenceKV

FORMAT = "cortexstream-prompt-cache/1"
DEFAULT_PRIVATE_TOKENS = 1024


def private_sequence(
    num_layers: int, kv_heads: int, head_dim: int, v_head_dim: int, num_tokens: int, dtype: str,
    block_size: int = 16,
) -> SequenceKV:
    """A sequence in an arena of its own, sized for `num_tokens` and regrown (doubling) when exceeded."""
    dtype = dtype.split(".")[-1]
    blocks = max(1, -(-max(num_tokens, 1) // block_size))
    config = ArenaConfig(num_layers, kv_heads, head_dim, blocks, block_size, dtype,
                         None if v_head_dim == head_dim else v_head_dim)
    seq = SequenceKV(KVArena(config), owner=0, contiguous=True, private=True)
    seq.ensure_capacity(num_tokens)
    return seq


def make_prompt_cache(
    model: nn.Module,
    max_tokens: int | None = None,
    *,
    arena: KVArena | None = None,
    contiguous: bool = True,
    owner: int = 0,
) -> list[ArenaKVCache]:
    """Per-layer caches for one sequence. Without `arena`, the sequence gets a private arena sized for
    `max_tokens` (default 1024), grown on demand; with one, it takes blocks from the shared arena."""
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
        raise InvalidArgumentError(f"max_tokens: {max_tokens!r} must be a non-negative integer")
    if arena is None:
        layers, kv_heads, head_dim, dtype = model_kv_shape(model)
        seq = private_sequence(layers, kv_heads, head_dim, head_dim, max_tokens or DEFAULT_PRIVATE_TOKENS, dtype)
    else:
        layers, kv_heads, head_dim, _ = model_kv_shape(model)
        cfg = arena.config
        if (layers, kv_heads, head_dim) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise InvalidArgumentError(
                f"arena: shaped for {cfg.num_layers} layers x {cfg.num_kv_heads} KV heads x {cfg.head_dim}, "
                f"model has {layers} x {kv_heads} x {head_dim}"
            )
        seq = SequenceKV(arena, owner=owner, contiguous=contiguous)
        if max_tokens:
            seq.ensure_capacity(max_tokens)
    return [ArenaKVCache(seq, layer) for layer in range(seq.arena.config.num_layers)]


def save_prompt_cache(path: str, cache: list[ArenaKVCache], metadata: dict[str, str] | None = None) -> None:
    """Save one sequence's KV (physical tokens of every layer) and its counters to a safetensors file."""
    if not path.endswith(".safetensors"):
        raise InvalidArgumentError(f"{path}: prompt cache files must end in .safetensors")
    arrays: dict[str, mx.array] = {}
    for layer, layer_cache in enumerate(cache):
        state = layer_cache.state
        if state:
            arrays[f"{layer}.keys"], arrays[f"{layer}.values"] = state
    info = {
        "format": FORMAT,
        "num_layers": len(cache),
        "offsets": [c.offset for c in cache],
        "lengths": [c.size() for c in cache],
    }
    mx.save_safetensors(path, arrays, metadata={"cortexstream": json.dumps(info), **(metadata or {})})


def load_prompt_cache(
    path: str, *, arena: KVArena | None = None, return_metadata: bool = False
) -> list[ArenaKVCache] | tuple[list[ArenaKVCache], dict[str, str]]:
    """Load a cache written by `save_prompt_cache`, into `arena` or a private one."""
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: file not found")
    try:
        arrays, metadata = mx.load(path, return_metadata=True)
        info = json.loads(metadata["cortexstream"])
    except (KeyError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: not a CortexStream prompt cache ({exc})") from exc
    if info.get("format") != FORMAT:
        raise ModelLoadError(f"{path}: unknown prompt cache format {info.get('format')!r}")
    layers = info["num_layers"]
    lengths, offsets = info["lengths"], info["offsets"]
    if "0.keys" not in arrays:
        raise ModelLoadError(f"{path}: prompt cache holds no tokens")
    k0, v0 = arrays["0.keys"], arrays["0.values"]
    if arena is None:
        seq = private_sequence(layers, k0.shape[1], k0.shape[3], v0.shape[3], max(lengths), str(k0.dtype))
    else:
        cfg = arena.config
        if (layers, k0.shape[1], k0.shape[3]) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ModelLoadError(f"{path}: cache shape does not match the arena")
        seq = SequenceKV(arena, owner=0)
    caches = [ArenaKVCache(seq, layer) for layer in range(layers)]
    for layer, layer_cache in enumerate(caches):
        keys, values = arrays.get(f"{layer}.keys"), arrays.get(f"{layer}.values")
        if keys is None or keys.shape[2] != lengths[layer]:
            raise ModelLoadError(f"{path}: layer {layer} data missing or its length differs from the metadata")
        layer_cache.state = (keys, values)
        layer_cache.offset = offsets[layer]
    mx.eval(seq.arena.keys, seq.arena.values)
    user_meta = {k: v for k, v in metadata.items() if k != "cortexstream"}
    return (caches, user_meta) if return_metadata else caches
