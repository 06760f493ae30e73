"""Arena geometry: how many blocks of how many token slots, for which model shape. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.kv_center import CENTER_NAME, KeyCenters, check_key_centers, model_key_centers
from cortexstream.kv.kv_dtype import KVDtype, StorageType

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ArenaConfig:
    """Shape of the KV arena. One block holds `block_size` token slots of every layer and KV head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16
    dtype: str = "float32"
    v_head_dim: int | None = None  # None: same as head_dim
    # Quantized storage of K and/or V (None: both stored as `dtype`). `dtype` stays the float type rows arrive
    # and are read back in; a float side of a quantized arena is stored in it. See `storage`.
    kv_dtype: KVDtype | None = None
    # Per layer and KV head, what a quantized key side subtracts before storing (kv_center.py; `for_model` takes
    # the model's key bias); None: keys stored as they are. Only with quantized keys.
    key_centers: KeyCenters | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"ArenaConfig.{name}: {value!r} must be a positive integer")
        if self.v_head_dim is not None and (not isinstance(self.v_head_dim, int) or self.v_head_dim <= 0):
            raise InvalidArgumentError(f"ArenaConfig.v_head_dim: {self.v_head_dim!r} must be a positive integer or None")
        if self.dtype not in _ITEMSIZE:
            raise InvalidArgumentError(f"ArenaConfig.dtype: {self.dtype!r} must be one of {', '.join(_ITEMSIZE)}")
        if self.kv_dtype is not None:
            self._check_kv_dtype(self.kv_dtype)
        if (self.kv_dtype is not None and self.kv_dtype.key.quantized
                and self.kv_dtype.centered_keys != (self.key_centers is not None)):
            # The storage says whether its keys are centered (it decides their rotation): follow key_centers.
            object.__setattr__(self, "kv_dtype", replace(self.kv_dtype, centered_keys=self.key_centers is not None))
        if self.key_centers is not None:
            if not self.storage.key.quantized:
                raise InvalidArgumentError("ArenaConfig.key_centers: only a quantized key side is centered; this "
                                           f"arena stores keys as {self.storage.key.value}")
            check_key_centers(self.key_centers, self.num_layers, self.num_kv_heads, self.head_dim)

    def _check_kv_dtype(self, kv: KVDtype) -> None:
        if not isinstance(kv, KVDtype):
            raise InvalidArgumentError(f"ArenaConfig.kv_dtype: {kv!r} must be a KVDtype or None")
        if not kv.quantized:
            raise InvalidArgumentError(
                f"ArenaConfig.kv_dtype: {kv.text!r} quantizes nothing; a float arena is ArenaConfig.dtype "
                "(ArenaConfig.for_model(kv_dtype=...) does this for you)")
        if kv.float_type.value != self.dtype:
            raise InvalidArgumentError(
                f"ArenaConfig.kv_dtype: its float type {kv.float_type.value} differs from dtype {self.dtype}")
        for side, kind in (("k", kv.key), ("v", kv.value)):
            if not kind.quantized and kind.value != self.dtype:
                raise InvalidArgumentError(
                    f"kv_dtype: {kv.text!r}: the float side {side}={kind.value} must be the model's float type "
                    f"{self.dtype} when the other side is quantized")
        kv.check_head_dims(self.head_dim, self.value_head_dim)

    @property
    def storage(self) -> KVDtype:
        """How K and V are stored: `kv_dtype`, or both sides in `dtype`."""
        if self.kv_dtype is not None:
            return self.kv_dtype
        kind = StorageType(self.dtype)
        return KVDtype(kind, kind, kind)

    @property
    def quantized(self) -> bool:
        return self.kv_dtype is not None

    @property
    def cache_key(self) -> str:
        """What decides a block's stored bytes (prefix-cache hashes, saved prompt caches)."""
        block = f",block={self.block_size}" if self.storage.key_channels else ""  # per-channel keys: scales per block
        return self.storage.cache_key + block + (f",center={CENTER_NAME}" if self.key_centers is not None else "")

    def with_key_centers(self, model: Any) -> "ArenaConfig":
        """This config with the centers `model` gives (its key bias, kv_center.py) when keys are quantized; for a
        rank after the model was split, whose heads are its own."""
        centered = self.storage.key.quantized and not self.storage.key_channels  # per-channel keys need no center
        centers = model_key_centers(model, self.num_kv_heads, self.head_dim) if centered else None
        return replace(self, key_centers=centers)

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers and KV heads."""
        if self.kv_dtype is not None:
            return self.kv_dtype.bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                                 self.value_head_dim, self.block_size)
        per_layer = self.num_kv_heads * (self.head_dim + self.value_head_dim) * _ITEMSIZE[self.dtype]
        return per_layer * self.num_layers

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @classmethod
    def for_model(
        cls,
        model: Any,
        *,
        num_tokens: int | None = None,
        num_bytes: int | None = None,
        memory_fraction: float | None = None,
        block_size: int = 16,
        dtype: str | None = None,
        kv_dtype: str | KVDtype | None = None,
        kv_group_size: int | None = None,
    ) -> "ArenaConfig":
        """Size an arena for `model` from exactly one of a token count, a byte budget or a fraction of device memory.

        `kv_dtype`: how K/V are stored ("auto" / None: `dtype`, else the model's float type; "float16", "int8",
        "int4", "k=int8,v=int4", ... see `kv_dtype.parse_kv_dtype`); a byte budget then holds the matching
        multiple of tokens. `kv_group_size`: 32 or 64 for quantized sides."""
        given = [x for x in (num_tokens, num_bytes, memory_fraction) if x is not None]
        if len(given) != 1:
            raise InvalidArgumentError("ArenaConfig.for_model: give exactly one of num_tokens, num_bytes, memory_fraction")
        layers, kv_heads, head_dim, model_dtype = model_kv_shape(model)
        dtype, storage = resolve_storage(dtype or model_dtype, kv_dtype, kv_group_size)
        probe = cls(layers, kv_heads, head_dim, 1, block_size, dtype, kv_dtype=storage)
        if num_tokens is not None:
            if not isinstance(num_tokens, int) or num_tokens <= 0:
                raise InvalidArgumentError(f"num_tokens: {num_tokens!r} must be a positive integer")
            from cortexstream.kv.memory_check import check_kv_fits

            check_kv_fits(num_tokens, probe.bytes_per_token, "num_tokens (the arena's kv_tokens)",
                          device_memory_bytes())
            blocks = probe.blocks_for_tokens(num_tokens)
        else:
            if memory_fraction is not None:
                if not 0.0 < memory_fraction <= 0.9:
                    raise InvalidArgumentError(f"memory_fraction: {memory_fraction!r} must be in (0, 0.9]")
                num_bytes = int(device_memory_bytes() * memory_fraction)
            if not isinstance(num_bytes, int) or num_bytes < probe.bytes_per_block:
                raise InvalidArgumentError(
                    f"num_bytes: {num_bytes!r} is smaller than one block ({probe.bytes_per_block} bytes)"
                )
            blocks = num_bytes // probe.bytes_per_block
        return cls(layers, kv_heads, head_dim, blocks, block_size, dtype, kv_dtype=storage).with_key_centers(model)


def check_arena_storage(arena: Any, model: Any, kv_dtype: str | KVDtype | None,
                        group_size: int | None = None) -> None:
    """Refuse a `kv_dtype` that contradicts the storage of an arena given alongside it (None: nothing asked)."""
    if kv_dtype is None and group_size is None:
        return
    cfg = arena.config
    model_dtype = model_kv_shape(model)[3]
    wanted = resolve_storage(model_dtype, kv_dtype, group_size)
    if wanted != (cfg.dtype, cfg.kv_dtype):
        asked = wanted[1].cache_key if wanted[1] is not None else wanted[0]
        raise InvalidArgumentError(
            f"kv_dtype: {asked} was asked for, but the arena given stores {cfg.cache_key}; build the arena with "
            "ArenaConfig.for_model(..., kv_dtype=...) or leave kv_dtype out")


def resolve_storage(float_dtype: str, kv_dtype: str | KVDtype | None,
                    group_size: int | None = None) -> tuple[str, KVDtype | None]:
    """(ArenaConfig.dtype, ArenaConfig.kv_dtype) for a user's `kv_dtype` on rows of `float_dtype`: a float
    kv_dtype on both sides becomes the arena's dtype; a quantized one keeps `float_dtype` for scales and reads."""
    from cortexstream.kv.kv_dtype import parse_kv_dtype

    if isinstance(kv_dtype, KVDtype):
        if group_size is not None and group_size != kv_dtype.group_size:
            raise InvalidArgumentError(f"kv_group_size: {group_size} contradicts the KVDtype's {kv_dtype.group_size}")
        parsed = kv_dtype
    else:
        parsed = parse_kv_dtype(kv_dtype, group_size, model_dtype=float_dtype)
    if not parsed.quantized:
        if parsed.key != parsed.value:
            raise InvalidArgumentError(
                f"kv_dtype: {parsed.text!r}: K and V may differ only when one is quantized (int8/int4)")
        return parsed.key.value, None
    return parsed.float_type.value, parsed


def model_kv_shape(model: Any) -> tuple[int, int, int, str]:
    """(layers, kv_heads, head_dim, dtype name) of an mlx-lm model, read from its attention modules.

    head_dim comes from the module (config.head_dim), never hidden/heads, which is wrong for many GQA models.
    """
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)) or not layers:
        raise InvalidArgumentError(f"model: expected an mlx-lm model with `layers`, got {type(model).__name__}")
    attention = getattr(layers[0], "self_attn", None)
    if attention is None:
        raise InvalidArgumentError("model: its layers have no `self_attn`; only attention-only decoders are supported")
    kv_heads = int(getattr(attention, "n_kv_heads", 0) or getattr(attention, "num_key_value_heads", 0))
    head_dim = getattr(attention, "head_dim", None)
    if head_dim is None:
        head_dim = attention.k_proj.weight.shape[0] // kv_heads
    weight = attention.k_proj.weight
    dtype = str(weight.dtype).split(".")[-1] if str(weight.dtype).split(".")[-1] in _ITEMSIZE else "float16"
    return len(layers), kv_heads, int(head_dim), dtype


def device_memory_bytes() -> int:
    import mlx.core as mx

    if mx.metal.is_available():
        return int(mx.metal.device_info()["memory_size"])
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
