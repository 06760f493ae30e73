"""Checks for prompt caches: a saved file's metadata against its own tensors (before any arena is sized on the
metadata's word), and a cache in memory against the model it is about to run with.

A saved cache is a safetensors file whose header (checked by `safetensors_check`) gives every tensor's shape
without reading it; the `cortexstream` metadata entry must agree with those shapes exactly, so the private arena
`load_prompt_cache` allocates is never larger than the data the file really holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cortexstream.errors import InvalidArgumentError, ModelLoadError
from cortexstream.kv.kv_center import CENTER_NAME
from cortexstream.kv.kv_rotation import ROTATION_NAME, Rotation
from cortexstream.kv.kv_dtype import KeyLayout, KVDtype, StorageType
from cortexstream.models.safetensors_check import SafetensorsLayout

FORMAT = "cortexstream-prompt-cache/1"
METADATA_KEY = "cortexstream"
FLOAT_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
MAX_POSITION = 2**31 - 1  # RoPE offsets are int32 in MLX


@dataclass(frozen=True)
class PromptCacheInfo:
    num_layers: int
    lengths: list[int]
    offsets: list[int]
    kv_heads: int
    head_dim: int
    v_head_dim: int
    dtype: str  # "float32", "float16" or "bfloat16": the floats rows are read in
    kv_dtype: KVDtype | None = None  # quantized storage of the saved rows (None: floats of `dtype`)
    key_centered: bool = False  # keys stored centered (kv_center.py); the centers are "<layer>.keys.center"
    block_size: int | None = None  # keys grouped per channel: tokens per block (one scale per channel per block)

    @property
    def cache_key(self) -> str:
        """The stored rows' kind as `ArenaConfig.cache_key` spells an arena's."""
        if self.kv_dtype is None:
            return self.dtype
        block = f",block={self.block_size}" if self.block_size else ""
        return self.kv_dtype.cache_key + block + (f",center={CENTER_NAME}" if self.key_centered else "")


def storage_from_metadata(path: str, raw: Any) -> KVDtype:
    """The `kv_dtype` entry `save_prompt_cache` writes for a quantized cache, as a KVDtype."""
    fields = ("key", "value", "group_size", "float_type")
    rotation_fields = ("rotation", "rotation_matrix")  # absent in files written before rotated storage: none
    allowed = [set(fields), set(fields + rotation_fields), set(fields + rotation_fields + ("key_center",))]
    allowed += [names | {"rotated"} for names in allowed[1:]]  # "rotated": the sides, written since it can vary
    allowed += [names | {"key_layout"} for names in allowed]  # written since keys can be grouped per channel
    allowed += [names | {"block_size"} for names in allowed if "key_layout" in names]
    if not isinstance(raw, dict) or set(raw) not in allowed:
        raise ModelLoadError(f"{path}: prompt cache metadata 'kv_dtype' must have exactly {', '.join(fields)} "
                             f"(and {', '.join(rotation_fields)}, key_center, rotated), got {raw!r:.80}")
    if raw.get("key_center", CENTER_NAME) != CENTER_NAME:
        raise ModelLoadError(f"{path}: prompt cache keys are centered by {raw['key_center']!r:.40}, this version "
                             f"centers by {CENTER_NAME!r}: the cache cannot be read")
    try:
        # files written before key_layout was recorded grouped keys per token
        storage = KVDtype(StorageType(raw["key"]), StorageType(raw["value"]), StorageType(raw["float_type"]),
                          raw["group_size"], raw.get("rotation", Rotation.OFF), centered_keys="key_center" in raw,
                          key_layout=raw.get("key_layout", KeyLayout.TOKEN.value))
    except (ValueError, InvalidArgumentError, TypeError) as exc:
        raise ModelLoadError(f"{path}: prompt cache metadata 'kv_dtype' {raw!r:.80} is not valid: {exc}") from None
    # Files written before "rotated" was recorded rotated centered 4-bit keys too (AUTO does not, since): their
    # layout cannot be told from this version's, so they are refused rather than read wrong.
    written = raw.get("rotated")
    if written is None and storage.centered_keys and storage.rotation == Rotation.AUTO and storage.key.bits == 4:
        raise ModelLoadError(f"{path}: prompt cache of centered 4-bit keys saved by an earlier version (they were "
                             "stored rotated, this version stores them as they are): save it again")
    if written is not None and written != storage.rotated_sides:
        raise ModelLoadError(f"{path}: prompt cache metadata says sides {written!r:.10} are rotated, this version "
                             f"rotates {storage.rotated_sides!r} for {storage.text!r}: the cache cannot be read")
    if not storage.quantized:
        raise ModelLoadError(f"{path}: prompt cache metadata 'kv_dtype' quantizes nothing ({raw!r:.80})")
    if (storage.key_rotated or storage.value_rotated) and raw.get("rotation_matrix") != ROTATION_NAME:
        raise ModelLoadError(f"{path}: prompt cache rows are rotated by {raw.get('rotation_matrix')!r:.40}, this "
                             f"version rotates by {ROTATION_NAME!r}: the cache cannot be read")
    return storage


def _side_shape(path: str, layout: SafetensorsLayout, name: str, kind: StorageType | None,
                storage: KVDtype | None, block_size: int | None = None) -> tuple[int, int, int, str]:
    """(kv_heads, tokens, dim, float dtype name) of one saved side, `name` = "<layer>.keys" or "<layer>.values";
    a quantized side is three tensors whose shapes must agree with its bits and group size."""
    if kind is None or not kind.quantized:
        tensor = layout.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{path}: prompt cache has no '{name}' tensor")
        if len(tensor.shape) != 4 or tensor.shape[0] != 1 or tensor.dtype not in FLOAT_DTYPES:
            raise ModelLoadError(f"{path}: prompt cache '{name}' is {tensor.dtype} {tensor.shape}, expected a "
                                 f"[1, kv_heads, tokens, head_dim] array of {', '.join(FLOAT_DTYPES)}")
        return tensor.shape[1], tensor.shape[2], tensor.shape[3], FLOAT_DTYPES[tensor.dtype]
    assert storage is not None
    parts = {part: layout.tensors.get(f"{name}.{part}") for part in ("packed", "scales", "biases")}
    missing = [f"{name}.{part}" for part, tensor in parts.items() if tensor is None]
    if missing:
        raise ModelLoadError(f"{path}: prompt cache has no {', '.join(repr(m) for m in missing)} tensor")
    packed, scales, biases = parts["packed"], parts["scales"], parts["biases"]
    ok = (len(packed.shape) == 4 and packed.shape[0] == 1 and packed.dtype == "U32"
          and scales.shape == biases.shape and scales.dtype == biases.dtype and scales.dtype in FLOAT_DTYPES
          and len(scales.shape) == 4)
    if ok and block_size:  # keys grouped per channel: one scale per channel per block of block_size tokens
        ok = (scales.shape[:2] == packed.shape[:2] and scales.shape[2] == -(-packed.shape[2] // block_size)
              and scales.shape[3] == packed.shape[3] * 32 // kind.bits)
    elif ok:
        ok = (scales.shape[:3] == packed.shape[:3]
              and scales.shape[3] * storage.group_size == packed.shape[3] * 32 // kind.bits)
    if not ok or FLOAT_DTYPES[scales.dtype] != storage.float_type.value:
        raise ModelLoadError(
            f"{path}: prompt cache '{name}' packed {packed.dtype} {packed.shape}, scales {scales.dtype} "
            f"{scales.shape}, biases {biases.dtype} {biases.shape} do not hold {kind.value} codes in groups of "
            f"{storage.group_size} with {storage.float_type.value} scales")
    return packed.shape[1], packed.shape[2], packed.shape[3] * 32 // kind.bits, FLOAT_DTYPES[scales.dtype]


def _int_list(path: str, info: dict[str, Any], field: str, count: int) -> list[int]:
    values = info.get(field)
    if not isinstance(values, list) or len(values) != count or not all(type(v) is int for v in values):
        raise ModelLoadError(f"{path}: prompt cache metadata '{field}' must be a list of {count} integers, "
                             f"got {values!r:.80}")
    return values


def check_prompt_cache_file(path: str, layout: SafetensorsLayout) -> PromptCacheInfo:
    """The file's `cortexstream` metadata, checked against itself and against the tensors the header lists."""
    raw = layout.metadata.get(METADATA_KEY)
    if raw is None:
        raise ModelLoadError(f"{path}: not a CortexStream prompt cache (no '{METADATA_KEY}' metadata)")
    try:
        info = json.loads(raw)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: prompt cache metadata '{METADATA_KEY}' is not JSON ({exc})") from exc
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        found = info.get("format") if isinstance(info, dict) else info
        raise ModelLoadError(f"{path}: unknown prompt cache format {found!r:.80} (expected {FORMAT!r})")
    layers = info.get("num_layers")
    stored = {name for name in layout.tensors}
    storage = storage_from_metadata(path, info["kv_dtype"]) if "kv_dtype" in info else None
    centered = storage is not None and "key_center" in info["kv_dtype"]
    block_size = info["kv_dtype"].get("block_size") if storage is not None and storage.key_channels else None
    if storage is not None and storage.key_channels and (type(block_size) is not int or block_size < 1):
        raise ModelLoadError(f"{path}: prompt cache metadata 'kv_dtype' groups keys per channel and needs a "
                             f"positive integer 'block_size', got {block_size!r:.40}")
    if centered and not storage.key.quantized:
        raise ModelLoadError(f"{path}: prompt cache metadata says keys are centered, but they are stored as "
                             f"{storage.key.value}")
    per_layer = 2 if storage is None else sum(3 if k.quantized else 1 for k in (storage.key, storage.value))
    per_layer += int(centered)
    if type(layers) is not int or not 1 <= layers or per_layer * layers != len(stored):
        raise ModelLoadError(f"{path}: prompt cache metadata 'num_layers' is {layers!r:.40}, but the file holds "
                             f"{len(stored)} tensors ({per_layer} per layer)")
    lengths = _int_list(path, info, "lengths", layers)
    offsets = _int_list(path, info, "offsets", layers)
    first = None
    for layer in range(layers):
        k_heads, k_tokens, k_dim, k_dtype = _side_shape(path, layout, f"{layer}.keys",
                                                        storage.key if storage else None, storage, block_size)
        v_heads, v_tokens, v_dim, v_dtype = _side_shape(path, layout, f"{layer}.values",
                                                        storage.value if storage else None, storage)
        if (k_heads, k_tokens, k_dtype) != (v_heads, v_tokens, v_dtype):
            raise ModelLoadError(f"{path}: prompt cache layer {layer} keys ({k_heads} heads, {k_tokens} tokens, "
                                 f"{k_dtype}) and values ({v_heads}, {v_tokens}, {v_dtype}) differ")
        shape = (k_heads, k_dim, v_dim, k_dtype)
        if first is None:
            first = shape
        elif shape != first:
            raise ModelLoadError(f"{path}: prompt cache layer {layer} has (kv_heads, head_dim, v_head_dim, dtype) "
                                 f"{shape}, layer 0 has {first}")
        if lengths[layer] != k_tokens:
            raise ModelLoadError(f"{path}: prompt cache metadata 'lengths'[{layer}] is {lengths[layer]}, "
                                 f"the layer's tensors hold {k_tokens} tokens")
        if not lengths[layer] <= offsets[layer] <= MAX_POSITION:
            raise ModelLoadError(f"{path}: prompt cache metadata 'offsets'[{layer}] is {offsets[layer]}, must be "
                                 f"between the layer's length {lengths[layer]} and {MAX_POSITION}")
    kv_heads, head_dim, v_head_dim, dtype = first
    if kv_heads < 1 or head_dim < 1 or v_head_dim < 1:
        raise ModelLoadError(f"{path}: prompt cache has empty dims (kv_heads {kv_heads}, head_dim {head_dim})")
    if storage is not None:
        try:
            storage.check_head_dims(head_dim, v_head_dim)
        except InvalidArgumentError as exc:
            raise ModelLoadError(f"{path}: prompt cache 'kv_dtype' does not fit its tensors: {exc}") from None
    for layer in range(layers) if centered else ():
        tensor = layout.tensors.get(f"{layer}.keys.center")
        if tensor is None or tuple(tensor.shape) != (kv_heads, head_dim) or tensor.dtype != "F32":
            raise ModelLoadError(f"{path}: prompt cache '{layer}.keys.center' is "
                                 f"{'missing' if tensor is None else f'{tensor.dtype} {tensor.shape}'}, expected "
                                 f"a float32 [{kv_heads}, {head_dim}] array (the keys are centered)")
    return PromptCacheInfo(layers, lengths, offsets, kv_heads, head_dim, v_head_dim, dtype, storage, centered,
                           block_size)


def check_user_metadata(path: str, metadata: Any) -> dict[str, str]:
    """User metadata for `save_prompt_cache`: a str -> str map that does not overwrite our own entry."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise InvalidArgumentError(f"metadata: {path}: must be a dict of str -> str, got {metadata!r:.80}")
    if METADATA_KEY in metadata:
        raise InvalidArgumentError(f"metadata: key '{METADATA_KEY}' is reserved for the cache's own counters")
    return dict(metadata)


def check_cache_for_model(cache: Any, model: Any, name: str = "prompt_cache") -> None:
    """A cache handed to generation must have one layer cache per model layer, shaped like the model's KV."""
    from cortexstream.kv.arena_cache import ArenaKVCache
    from cortexstream.kv.arena_config import model_kv_shape

    if not isinstance(cache, (list, tuple)) or not cache:
        raise InvalidArgumentError(f"{name}: expected the list of per-layer caches from make_prompt_cache, "
                                   f"got {type(cache).__name__}")
    layers, kv_heads, head_dim, _ = model_kv_shape(model)
    if len(cache) != layers:
        raise InvalidArgumentError(f"{name}: has {len(cache)} layer caches, the model has {layers} layers")
    for layer, layer_cache in enumerate(cache):
        if not isinstance(layer_cache, ArenaKVCache):
            continue  # mlx-lm's own caches shape themselves on first use
        cfg = layer_cache.sequence.arena.config
        if (cfg.num_kv_heads, cfg.head_dim) != (kv_heads, head_dim) or layer_cache.layer != layer:
            raise InvalidArgumentError(
                f"{name}: layer {layer} holds {cfg.num_kv_heads} KV heads x {cfg.head_dim} (arena layer "
                f"{layer_cache.layer}), the model's layer {layer} needs {kv_heads} x {head_dim}: a cache made for "
                "another model?")
