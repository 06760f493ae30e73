"""Arena geometry: how many blocks of how many token slots, for which model shape. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cortexstream.errors import InvalidArgumentError

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

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_blocks", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgumentError(f"ArenaConfig.{name}: {value!r} must be a positive integer")
        if self.v_head_dim is not None and (not isinstance(self.v_head_dim, int) or self.v_head_dim <= 0):
            raise InvalidArgumentError(f"ArenaConfig.v_head_dim: {self.v_head_dim!r} must be a positive integer or None")
        if self.dtype not in _ITEMSIZE:
            raise InvalidArgumentError(f"ArenaConfig.dtype: {self.dtype!r} must be one of {', '.join(_ITEMSIZE)}")

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes of one token over all layers and KV heads."""
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
    ) -> "ArenaConfig":
        """Size an arena for `model` from exactly one of a token count, a byte budget or a fraction of device memory."""
        given = [x for x in (num_tokens, num_bytes, memory_fraction) if x is not None]
        if len(given) != 1:
            raise InvalidArgumentError("ArenaConfig.for_model: give exactly one of num_tokens, num_bytes, memory_fraction")
        layers, kv_heads, head_dim, model_dtype = model_kv_shape(model)
        probe = cls(layers, kv_heads, head_dim, 1, block_size, dtype or model_dtype)
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
        return cls(layers, kv_heads, head_dim, blocks, block_size, dtype or model_dtype)


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
