"""How the KV arena stores keys and values: a float type, or 8/4-bit affine quantization in groups. Pure Python.

`KVDtype` names the storage type of K and of V separately (they may differ, as in llama.cpp's `-ctk/-ctv`: keys
are usually more sensitive to quantization than values), the group size of the quantized ones, and the float type
rows arrive in from the model (`float_type`). The arena will size itself with `bytes_per_token` (so a byte budget
holds 2x to 4x more tokens at 8/4 bits), allocate one `QuantizedRows` per layer for each quantized side (see
`quantized_blocks.py`), and put `cache_key` in the prefix-cache hash and the prompt-cache metadata, so that blocks of
different dtypes are never mixed.

Scales and biases of a quantized side are stored in `float_type`: `mx.quantize` returns them in the dtype of its
input, and the arena quantizes rows in the model's float type (casting them first would only lose precision
before the quantizer sees them). So one group of `group_size` values costs `group_size * bits / 8` bytes plus two
`float_type` numbers.

Group sizes are 32 or 64: `mx.quantize` supports 32, 64 and 128 and needs the last axis (the head dim) divisible
by the group; 128 would not divide the 64-wide heads of small models. 64 is the default, as in mlx-lm's
`QuantizedKVCache`.

Quantized sides may be stored rotated (`kv_rotation.py`): by default (AUTO) 4-bit sides are, 8-bit ones are not,
and nor are keys stored centered (`kv_center.py`): once a model's key bias is taken out, what is left of its keys is
quantized better as it is than rotated (Qwen2.5-Coder-0.5B, 4-bit keys: bench/results/kv_key_schemes.md). The
spelling takes `rotate=on|off|auto` as a last part ("int4,rotate=off", "k=int8,v=int4,rotate=on").

Quantized keys are grouped per token (`keys=token`: one scale per group of channels of one token, as above) or per
channel (`keys=channel`: one scale per channel per arena block, channel_quantized.py). AUTO groups 4-bit keys per
channel and 8-bit keys per token: per-channel is what makes 4-bit keys usable on models with outlier key channels
(bench/results/kv_key_schemes.md), and 8-bit keys are within rounding of float either way. Per-channel keys are
neither rotated nor centered (their per-channel range already follows each channel).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.kv_rotation import ROTATION_NAME, Rotation, rotation, rotation_supported


class KeyLayout(str, Enum):
    """How a quantized key side is grouped: per token (groups of channels) or per channel (over a block)."""

    AUTO = "auto"
    TOKEN = "token"
    CHANNEL = "channel"


class StorageType(str, Enum):
    """Storage type of one side (K or V) of the arena."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def quantized(self) -> bool:
        return self in (StorageType.INT8, StorageType.INT4)

    @property
    def bits(self) -> int:
        """Bits per stored value (scales and biases of quantized types not included)."""
        return _BITS[self]


_BITS = {
    StorageType.FLOAT32: 32,
    StorageType.FLOAT16: 16,
    StorageType.BFLOAT16: 16,
    StorageType.INT8: 8,
    StorageType.INT4: 4,
}
FLOAT_TYPES = (StorageType.FLOAT32, StorageType.FLOAT16, StorageType.BFLOAT16)
GROUP_SIZES = (32, 64)
DEFAULT_GROUP_SIZE = 64
AUTO = "auto"
_CHOICES = (", ".join([AUTO] + [t.value for t in StorageType]) + ", or k=<type>,v=<type>; optionally "
            "followed by ,rotate=on|off|auto and/or ,keys=token|channel|auto")


def storage_type(value: str | StorageType, argument: str) -> StorageType:
    """`value` as a StorageType; an unknown name is refused naming `argument` and listing the choices."""
    return _member(StorageType, value, argument, "storage type")


def _member(kind: type[Enum], value: object, argument: str, noun: str) -> Any:
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise InvalidArgumentError(f"{argument}: {value!r} is not a {noun}; choose one of {choices}") from None


def float_storage_type(value: str | StorageType, argument: str) -> StorageType:
    kind = storage_type(value, argument)
    if kind not in FLOAT_TYPES:
        choices = ", ".join(t.value for t in FLOAT_TYPES)
        raise InvalidArgumentError(f"{argument}: {kind.value!r} must be a float type, one of {choices}")
    return kind


@dataclass(frozen=True)
class KVDtype:
    """Storage of K and V: `key` and `value` types, the `group_size` of quantized ones, and `float_type`, the
    model's float type (rows arrive and are dequantized in it; quantized sides keep scales and biases in it)."""

    key: StorageType
    value: StorageType
    float_type: StorageType
    group_size: int = DEFAULT_GROUP_SIZE
    rotation: Rotation = Rotation.AUTO  # which quantized sides are stored rotated (kv_rotation.py)
    # Keys stored centered by the model's key bias (kv_center.py). Set by ArenaConfig from its key_centers, not
    # spelled by users: AUTO does not rotate centered keys.
    centered_keys: bool = False
    key_layout: KeyLayout = KeyLayout.AUTO  # per-token or per-channel groups for quantized keys

    def __post_init__(self) -> None:
        object.__setattr__(self, "rotation", rotation(self.rotation, "kv_dtype (rotate)"))
        object.__setattr__(self, "key_layout", key_layout(self.key_layout, "kv_dtype (keys)"))
        object.__setattr__(self, "key", storage_type(self.key, "kv_dtype (key)"))
        object.__setattr__(self, "value", storage_type(self.value, "kv_dtype (value)"))
        object.__setattr__(self, "float_type", float_storage_type(self.float_type, "model_dtype"))
        if type(self.group_size) is not int or self.group_size not in GROUP_SIZES:
            raise InvalidArgumentError(
                f"kv_group_size: {self.group_size!r} is not supported; choose one of "
                f"{', '.join(map(str, GROUP_SIZES))}"
            )
        if type(self.centered_keys) is not bool or (self.centered_keys and not self.key.quantized):
            raise InvalidArgumentError(f"kv_dtype (centered_keys): {self.centered_keys!r}: only a quantized key side "
                                       "is stored centered")
        if self.centered_keys and self.key_channels:
            raise InvalidArgumentError("kv_dtype (centered_keys): keys grouped per channel are not centered")

    @property
    def key_channels(self) -> bool:
        """Whether quantized keys are grouped per channel over a block (channel_quantized.py)."""
        if not self.key.quantized:
            return False
        return self.key_layout == KeyLayout.CHANNEL or (self.key_layout == KeyLayout.AUTO
                                                        and self.key == StorageType.INT4)

    @property
    def quantized(self) -> bool:
        """True when K or V (or both) is stored quantized."""
        return self.key.quantized or self.value.quantized

    def rotates(self, kind: StorageType, *, centered: bool = False, channels: bool = False) -> bool:
        """Whether a side stored as `kind` (and `centered` or grouped per `channels`, for keys) is stored rotated."""
        if not kind.quantized or self.rotation == Rotation.OFF or channels:
            return False
        return self.rotation == Rotation.ON or (kind == StorageType.INT4 and not centered)

    @property
    def key_rotated(self) -> bool:
        return self.rotates(self.key, centered=self.centered_keys, channels=self.key_channels)

    @property
    def value_rotated(self) -> bool:
        return self.rotates(self.value)

    @property
    def rotated_sides(self) -> str:
        """Which sides are stored rotated: "", "k", "v" or "kv"."""
        return "".join(name for name, on in (("k", self.key_rotated), ("v", self.value_rotated)) if on)

    @property
    def key_bits(self) -> int:
        return self.key.bits

    @property
    def value_bits(self) -> int:
        return self.value.bits

    @property
    def text(self) -> str:
        """Canonical spelling, accepted back by `parse_kv_dtype`: "int8", or "k=int8,v=int4" when they differ.
        A rotation other than the default is spelled after it. Group size and float type are not in it; `cache_key`
        has all of it."""
        sides = self.sides_text
        if self.rotation != Rotation.AUTO and self.quantized:
            sides += f",rotate={self.rotation.value}"
        if self.key_layout != KeyLayout.AUTO and self.key.quantized:
            sides += f",keys={self.key_layout.value}"
        return sides

    @property
    def sides_text(self) -> str:
        """The storage types alone: "int8", or "k=int8,v=int4" when they differ."""
        return self.key.value if self.key == self.value else f"k={self.key.value},v={self.value.value}"

    @property
    def cache_key(self) -> str:
        """Everything that decides the stored bytes of a block, for prefix-cache hashes and saved-cache metadata."""
        group = f",group={self.group_size}" if self.quantized else ""
        rotated = self.rotated_sides
        turned = f",rot={ROTATION_NAME}:{rotated}" if rotated else ""
        channels = ",keys=channel" if self.key_channels else ""
        return f"{self.sides_text}{group},float={self.float_type.value}{turned}{channels}"

    def check_head_dims(self, head_dim: int, v_head_dim: int | None = None) -> None:
        """Refuse head dims a quantized side cannot be grouped along (mx.quantize needs the last axis divisible by
        the group size) or, for a rotated side, rotate (kv_rotation.py)."""
        dims = (("head_dim", head_dim, self.key, self.key_rotated, self.key_channels),
                ("v_head_dim", v_head_dim or head_dim, self.value, self.value_rotated, False))
        for name, dim, kind, rotated, channels in dims:
            if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
                raise InvalidArgumentError(f"{name}: {dim!r} must be a positive integer")
            if channels and dim * kind.bits % 32:
                raise InvalidArgumentError(f"kv_dtype: {self.text!r} packs the model's {name} {dim} of "
                                           f"{kind.value} into 32-bit words, which it does not fill; add ,keys=token")
            if kind.quantized and not channels and dim % self.group_size:
                fits = [g for g in GROUP_SIZES if dim % g == 0]
                hint = f"use kv_group_size={fits[0]}" if fits else "use a float kv_dtype for this model"
                raise InvalidArgumentError(
                    f"kv_group_size: {self.group_size} does not divide the model's {name} {dim} "
                    f"({kind.value} groups run along the head dim); {hint}"
                )
            if rotated and not rotation_supported(dim):
                raise InvalidArgumentError(
                    f"kv_dtype: {self.text!r} stores {kind.value} rotated, which needs a power-of-two head dim; the "
                    f"model's {name} is {dim}: add ,rotate=off"
                )

    def side_bytes(self, kind: StorageType, dim: int, block_size: int = 1, channels: bool = False) -> int:
        """Bytes of `block_size` tokens of one KV head stored as `kind` with `dim` values (grouped per channel
        over the block when `channels`)."""
        if not kind.quantized:
            return block_size * dim * kind.bits // 8
        if channels:
            return block_size * dim * kind.bits // 8 + 2 * dim * self.float_type.bits // 8
        groups = dim // self.group_size
        return block_size * (dim * kind.bits // 8 + 2 * groups * self.float_type.bits // 8)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int, v_head_dim: int | None = None,
                        block_size: int = 16) -> int:
        """K + V bytes of one token over all layers and KV heads: packed values plus, for quantized sides, one
        scale and one bias per group in `float_type` (per-channel keys: per channel per block of `block_size`
        tokens, shared by its tokens; rounded up to whole bytes per token)."""
        for name, count in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("block_size", block_size)):
            if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
                raise InvalidArgumentError(f"{name}: {count!r} must be a positive integer")
        self.check_head_dims(head_dim, v_head_dim)
        per_block = (self.side_bytes(self.key, head_dim, block_size, self.key_channels)
                     + self.side_bytes(self.value, v_head_dim or head_dim, block_size))
        return num_layers * num_kv_heads * -(-per_block // block_size)


def parse_kv_dtype(
    text: str | None, group_size: int | None = None, *, model_dtype: str | StorageType
) -> KVDtype:
    """A `KVDtype` from a user's spelling: "int8", "int4", "float16", ..., "k=int8,v=int4", or "auto"/None (the
    model's float type for both). `group_size` None means the default (64); giving one with no quantized side is
    refused, since it would have no effect. `model_dtype` is the model's float type."""
    model = float_storage_type(model_dtype, "model_dtype")
    if text is None:
        text = AUTO
    if not isinstance(text, str):
        raise InvalidArgumentError(f"kv_dtype: {text!r} must be a string: {_CHOICES}")
    spelled, turn, layout = _split_options(text, text.strip().lower())
    if "=" in spelled or "," in spelled:
        key, value = _parse_sides(text, spelled, model)
    else:
        key = value = _side(spelled, text, model)
    if group_size is None:
        group = DEFAULT_GROUP_SIZE
    elif not (key.quantized or value.quantized):
        raise InvalidArgumentError(
            f"kv_group_size: {group_size!r} given, but kv_dtype {text!r} quantizes nothing; "
            "a group size applies only to int8 and int4"
        )
    else:
        group = group_size
    if turn != Rotation.AUTO and not (key.quantized or value.quantized):
        raise InvalidArgumentError(f"kv_dtype: {text!r} gives rotate= but quantizes nothing; rotation applies only "
                                   "to int8 and int4 sides")
    if layout != KeyLayout.AUTO and not key.quantized:
        raise InvalidArgumentError(f"kv_dtype: {text!r} gives keys= but its keys are not quantized; keys= applies "
                                   "only to int8 and int4 keys")
    return KVDtype(key, value, model, group, turn, key_layout=layout)


def key_layout(value: str | KeyLayout, argument: str) -> KeyLayout:
    """`value` as a KeyLayout; an unknown name is refused naming `argument` and listing the choices."""
    return _member(KeyLayout, value, argument, "key layout")


_OPTIONS = ("rotate", "keys")


def _split_options(text: str, spelled: str) -> tuple[str, Rotation, KeyLayout]:
    """The spelling without its trailing `rotate=...` / `keys=...` parts, and their settings (AUTO when absent)."""
    found: dict[str, str] = {}
    head = spelled
    while True:
        rest, comma, last = head.rpartition(",")
        name, eq, setting = (part.strip() for part in last.partition("="))
        if name not in _OPTIONS or not eq:
            break
        if name in found:
            raise InvalidArgumentError(f"kv_dtype: {text!r} gives {name}= twice")
        if not comma or not rest.strip():
            raise InvalidArgumentError(f"kv_dtype: {text!r} gives {name}= without a storage type, e.g. int4,{name}=...")
        found[name], head = setting, rest
    for name in _OPTIONS:
        if name not in found and f"{name}=" in head.replace(" ", ""):
            raise InvalidArgumentError(f"kv_dtype: {text!r}: rotate= and keys= must come after the storage types")
    return (head, rotation(found.get("rotate", "auto"), "kv_dtype (rotate)"),
            key_layout(found.get("keys", "auto"), "kv_dtype (keys)"))


def _side(name: str, text: str, model: StorageType) -> StorageType:
    if name == AUTO:
        return model
    try:
        return StorageType(name)
    except ValueError:
        where = "" if name == text.strip().lower() else f" ({name!r})"
        raise InvalidArgumentError(f"kv_dtype: {text!r}{where} is not a KV dtype; choose {_CHOICES}") from None


def _parse_sides(text: str, spelled: str, model: StorageType) -> tuple[StorageType, StorageType]:
    sides: dict[str, StorageType] = {}
    for part in spelled.split(","):
        name, eq, kind = (s.strip() for s in part.partition("="))
        if not eq or name not in ("k", "v") or not kind:
            raise InvalidArgumentError(
                f"kv_dtype: {text!r}: {part.strip()!r} is not k=<type> or v=<type>; write e.g. k=int8,v=int4"
            )
        if name in sides:
            raise InvalidArgumentError(f"kv_dtype: {text!r} gives {name}= twice")
        sides[name] = _side(kind, text, model)
    if set(sides) != {"k", "v"}:
        missing = "k" if "k" not in sides else "v"
        raise InvalidArgumentError(f"kv_dtype: {text!r} lacks {missing}=<type>; give both, e.g. k=int8,v=int4")
    return sides["k"], sides["v"]
