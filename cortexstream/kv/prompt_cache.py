"""Per-sequence prompt caches backed by the arena, mlx-lm style: make, save, load."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cortexstream.atomic_files import atomic_write
from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.kv.arena import KVArena
from cortexstream.kv.arena_cache import ArenaKVCache
from cortexstream.kv.arena_config import (
    ArenaConfig, check_arena_storage, device_memory_bytes, model_kv_shape, resolve_storage,
)
from cortexstream.kv.kv_center import CENTER_NAME, KeyCenters, check_key_centers
from cortexstream.kv.kv_dtype import KVDtype, StorageType
from cortexstream.kv.kv_rotation import ROTATION_NAME, rotation_signs
from cortexstream.kv.channel_quantized import ChannelBlocks
from cortexstream.kv.quantized_blocks import QuantizedRows
from cortexstream.kv.memory_check import check_kv_fits
from cortexstream.kv.prompt_cache_check import (
    FORMAT, METADATA_KEY, PromptCacheInfo, check_prompt_cache_file, check_user_metadata,
)
from cortexstream.kv.sequence_kv import SequenceKV, private_sequence
from cortexstream.models.safetensors_check import check_safetensors

__all__ = ["FORMAT", "load_prompt_cache", "make_prompt_cache", "save_prompt_cache"]
DEFAULT_PRIVATE_TOKENS = 1024


def make_prompt_cache(
    model: nn.Module,
    max_tokens: int | None = None,
    *,
    arena: KVArena | None = None,
    contiguous: bool = True,
    owner: int = 0,
    kv_dtype: str | KVDtype | None = None,
    kv_group_size: int | None = None,
) -> list[ArenaKVCache]:
    """Per-layer caches for one sequence. Without `arena`, the sequence gets a private arena sized for
    `max_tokens` (default 1024), grown on demand, storing K/V as `kv_dtype` ("int8", "int4", "k=int8,v=int4",
    "float16", ...; `kv_group_size` 32 or 64); with one, it takes blocks from the shared arena (whose storage a
    `kv_dtype` given too must match)."""
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 0):
        raise InvalidArgumentError(f"max_tokens: {max_tokens!r} must be a non-negative integer")
    if not isinstance(getattr(model, "layers", None), (list, tuple)) or not model.layers:
        raise InvalidArgumentError(f"model: expected an mlx-lm model with `layers`, got {type(model).__name__}")
    if arena is None:
        layers, kv_heads, head_dim, model_dtype = model_kv_shape(model)
        dtype, storage = resolve_storage(model_dtype, kv_dtype, kv_group_size)
        probe = ArenaConfig(layers, kv_heads, head_dim, 1, 16, dtype, kv_dtype=storage)
        check_kv_fits(max_tokens or DEFAULT_PRIVATE_TOKENS, probe.bytes_per_token, "max_tokens", device_memory_bytes())
        seq = private_sequence(layers, kv_heads, head_dim, head_dim, max_tokens or DEFAULT_PRIVATE_TOKENS, dtype,
                               kv_dtype=storage, key_centers=probe.with_key_centers(model).key_centers)
    else:
        check_arena_storage(arena, model, kv_dtype, kv_group_size)
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
    """Save one sequence's KV (physical tokens of every layer) and its counters to a safetensors file, written to a
    temporary file and renamed into place."""
    if not isinstance(path, str) or not path.endswith(".safetensors"):
        raise InvalidArgumentError(f"{path}: prompt cache files must end in .safetensors")
    if not isinstance(cache, (list, tuple)) or not cache or not all(isinstance(c, ArenaKVCache) for c in cache):
        raise InvalidArgumentError("cache: expected the list of per-layer caches from make_prompt_cache")
    user = check_user_metadata(path, metadata)
    arrays: dict[str, mx.array] = {}
    seq = cache[0].sequence
    for layer, layer_cache in enumerate(cache):
        if layer_cache.size() == 0:
            raise InvalidArgumentError(f"cache: layer {layer} holds no tokens; only filled caches can be saved")
        if seq.arena.quantized:  # stored rows as they are: codes, scales and biases, never requantized
            rows = seq.arena.table_rows(layer, seq.blocks, layer_cache.size())
            if seq.arena.config.storage.key_channels:  # the codes of its tokens, the scales of its blocks
                rows = (seq.arena.key_rows_of_blocks(layer, seq.blocks, layer_cache.size()), rows[1])
            for side, stored in zip(("keys", "values"), rows):
                if isinstance(stored, ChannelBlocks):
                    for part, array in zip(("packed", "scales", "biases"), stored):
                        arrays[f"{layer}.{side}.{part}"] = array
                elif isinstance(stored, QuantizedRows):
                    for part, array in zip(("packed", "scales", "biases"), stored.arrays()):
                        arrays[f"{layer}.{side}.{part}"] = array
                    if stored.center is not None:  # only keys are centered (kv_center.py)
                        arrays[f"{layer}.{side}.center"] = stored.center[0, :, 0, :].astype(mx.float32)
                else:
                    arrays[f"{layer}.{side}"] = stored
        else:
            arrays[f"{layer}.keys"], arrays[f"{layer}.values"] = layer_cache.state
    info: dict[str, object] = {
        "format": FORMAT,
        "num_layers": len(cache),
        "offsets": [c.offset for c in cache],
        "lengths": [c.size() for c in cache],
    }
    if seq.arena.quantized:
        info["kv_dtype"] = storage_metadata(seq.arena.config.storage)
        if seq.arena.config.key_centers is not None:
            info["kv_dtype"]["key_center"] = CENTER_NAME
        if seq.arena.config.storage.key_channels:
            info["kv_dtype"]["block_size"] = seq.arena.config.block_size
    atomic_write(path, lambda tmp: mx.save_safetensors(tmp, arrays, metadata={METADATA_KEY: json.dumps(info), **user}))


def load_prompt_cache(
    path: str, *, arena: KVArena | None = None, return_metadata: bool = False
) -> list[ArenaKVCache] | tuple[list[ArenaKVCache], dict[str, str]]:
    """Load a cache written by `save_prompt_cache`, into `arena` or a private one. The file's header and counters
    are checked against its tensors before anything is allocated (a malformed file is a ModelLoadError)."""
    if not isinstance(path, str):
        raise InvalidArgumentError(f"path: expected a file path, got {type(path).__name__}")
    info = check_prompt_cache_file(path, check_safetensors(path))
    try:
        arrays, metadata = mx.load(path, return_metadata=True)
    except (ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{path}: cannot read prompt cache tensors: {exc}") from exc
    centers = saved_key_centers(path, arrays, info)
    if arena is None:
        seq = private_sequence(info.num_layers, info.kv_heads, info.head_dim, info.v_head_dim, max(info.lengths),
                               info.dtype, info.block_size or 16, kv_dtype=info.kv_dtype, key_centers=centers)
    else:
        cfg = arena.config
        if (info.num_layers, info.kv_heads, info.head_dim) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            raise ModelLoadError(
                f"{path}: cache is {info.num_layers} layers x {info.kv_heads} KV heads x {info.head_dim}, the arena "
                f"is {cfg.num_layers} x {cfg.num_kv_heads} x {cfg.head_dim}")
        stored = info.cache_key
        wanted = cfg.cache_key if cfg.quantized else cfg.dtype
        if stored != wanted:
            raise ModelLoadError(
                f"{path}: the cache stores K/V as {stored}, the arena as {wanted}: load it into an arena of the same "
                "kv_dtype (or without an arena: it gets a private one of its own kind)")
        if centers != cfg.key_centers:
            raise ModelLoadError(f"{path}: the cache's keys are centered by another model's key bias than the "
                                 "arena's (kv_center.py): it was saved from a different model")
        seq = SequenceKV(arena, owner=0)
    caches = [ArenaKVCache(seq, layer) for layer in range(info.num_layers)]
    if info.kv_dtype is not None:
        seq.ensure_capacity(max(info.lengths))
    for layer, layer_cache in enumerate(caches):
        if info.kv_dtype is None:
            layer_cache.state = (arrays[f"{layer}.keys"], arrays[f"{layer}.values"])
        else:
            rows = [stored_rows(arrays, f"{layer}.{side}", kind, info.kv_dtype.group_size,
                                rotation_of(rotated, dim),
                                arrays.get(f"{layer}.{side}.center") if side == "keys" else None,
                                channels=side == "keys" and info.kv_dtype.key_channels)
                    for side, kind, dim, rotated in (
                        ("keys", info.kv_dtype.key, info.head_dim, info.kv_dtype.key_rotated),
                        ("values", info.kv_dtype.value, info.v_head_dim, info.kv_dtype.value_rotated))]
            seq.arena.put_rows(layer, seq.arena.slots_array(seq.blocks, info.lengths[layer]), *rows)
            seq.lengths[layer] = info.lengths[layer]
        layer_cache.offset = info.offsets[layer]
    mx.eval(seq.arena.arrays())
    user_meta = {k: v for k, v in metadata.items() if k != METADATA_KEY}
    return (caches, user_meta) if return_metadata else caches


def storage_metadata(storage: KVDtype) -> dict[str, object]:
    """How a saved quantized cache's rows are stored (read back by `prompt_cache_check.storage_from_metadata`)."""
    return {"key": storage.key.value, "value": storage.value.value, "group_size": storage.group_size,
            "float_type": storage.float_type.value, "rotation": storage.rotation.value,
            "rotation_matrix": ROTATION_NAME, "rotated": storage.rotated_sides,
            "key_layout": storage.key_layout.value}


def rotation_of(rotated: bool, dim: int) -> mx.array | None:
    """The rotation (signs) of a side of width `dim` stored `rotated`, None when it is not."""
    return mx.array(rotation_signs(dim)) if rotated else None


def stored_rows(arrays: dict[str, mx.array], name: str, kind: StorageType, group_size: int,
                rotation: mx.array | None = None, center: mx.array | None = None, channels: bool = False
                ) -> QuantizedRows | ChannelBlocks | mx.array:
    """One side of one layer of a saved quantized cache as the arena stores it (shapes were checked against the
    metadata by `check_prompt_cache_file`); keys grouped per `channels`: their tokens' codes and blocks' scales."""
    if not kind.quantized:
        return arrays[name]
    packed, scales, biases = (arrays[f"{name}.{part}"] for part in ("packed", "scales", "biases"))
    if channels:
        return ChannelBlocks(packed, scales, biases)
    return QuantizedRows(packed, scales, biases, kind.bits, group_size,
                         None if rotation is None else rotation.astype(scales.dtype),
                         None if center is None else center.astype(scales.dtype))


def saved_key_centers(path: str, arrays: dict[str, mx.array], info: PromptCacheInfo) -> KeyCenters | None:
    """The key centers a saved cache's keys were stored with (None when they were not centered)."""
    if not info.key_centered:
        return None
    centers = tuple(tuple(tuple(float(x) for x in row) for row in np.array(arrays[f"{layer}.keys.center"]))
                    for layer in range(info.num_layers))
    try:
        check_key_centers(centers, info.num_layers, info.kv_heads, info.head_dim)
    except InvalidArgumentError as exc:
        raise ModelLoadError(f"{path}: {exc}") from None
    return centers
