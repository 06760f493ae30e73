"""`--kv-dtype` / `--kv-group-size`: how the KV arena stores keys and values, chosen on the command line, and
the storage table `cortexstream info --model` prints.

The options are checked before a model loads (the spelling, a group size with no quantized side); what depends on
the model (the group dividing its head dim, a float side in its float type) is checked once it is loaded, before
any text is generated. Either way the message names the flag rather than the keyword argument behind it.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from dataclasses import dataclass
from typing import Any, Iterator

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.kv_dtype import DEFAULT_GROUP_SIZE, GROUP_SIZES, StorageType, parse_kv_dtype

GIB = 1024**3
KV_DTYPE_HELP = (
    "how the KV arena stores keys and values: auto (the model's float type, the default), float32, float16, "
    "bfloat16, int8, int4, or k=<type>,v=<type> (K and V may differ only if one of them is int8/int4); "
    "4-bit sides are stored rotated unless followed by ,rotate=off (,rotate=on rotates 8-bit sides too)"
)
KV_GROUP_SIZE_HELP = (
    f"values per scale/bias group of int8/int4 storage: {' or '.join(map(str, GROUP_SIZES))} "
    f"(default {DEFAULT_GROUP_SIZE}); must divide the model's head dim"
)
_FLAGS = {"kv_dtype": "--kv-dtype", "kv_group_size": "--kv-group-size"}
_KEYWORD = re.compile(r"(?<![.\w-])(kv_dtype|kv_group_size)\b")


def add_kv_storage_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-dtype", default=None, metavar="TYPE", help=KV_DTYPE_HELP)
    parser.add_argument("--kv-group-size", type=int, default=None, choices=GROUP_SIZES, help=KV_GROUP_SIZE_HELP)


def flag_message(message: str) -> str:
    """`message` with the keyword arguments kv_dtype / kv_group_size spelt as their command-line flags."""
    return _KEYWORD.sub(lambda match: _FLAGS[match.group(1)], message)


@contextlib.contextmanager
def flag_errors() -> Iterator[None]:
    """Re-raise a ValueError about kv_dtype / kv_group_size as an InvalidArgumentError naming the flags."""
    try:
        yield
    except ValueError as exc:
        text = str(exc)
        if not _KEYWORD.search(text):
            raise
        raise InvalidArgumentError(flag_message(text)) from exc


def kv_storage_options(args: argparse.Namespace) -> tuple[str | None, int | None]:
    """(kv_dtype, kv_group_size) from the command line, refused now if no model could take them.

    The placeholder float type only decides what "auto" means, which no check here depends on."""
    kv_dtype, group_size = getattr(args, "kv_dtype", None), getattr(args, "kv_group_size", None)
    if kv_dtype is not None or group_size is not None:
        with flag_errors():
            parse_kv_dtype(kv_dtype, group_size, model_dtype=StorageType.FLOAT32)
    return kv_dtype, group_size


def check_for_model(model: Any, kv_dtype: str | None, group_size: int | None) -> None:
    """Refuse storage this model cannot take (e.g. a group size that does not divide its head dim), naming the
    flag, before a command starts generating."""
    if kv_dtype is None and group_size is None:
        return
    from cortexstream.kv.arena_config import ArenaConfig

    with flag_errors():
        ArenaConfig.for_model(model, num_tokens=16, kv_dtype=kv_dtype, kv_group_size=group_size)


@dataclass(frozen=True)
class StorageRow:
    """One way to store the model's KV: its bytes per token, or None with the reason it is not available."""

    label: str
    bytes_per_token: int | None
    note: str = ""

    @property
    def tokens_per_gib(self) -> int | None:
        return None if self.bytes_per_token is None else GIB // self.bytes_per_token


def storage_rows(model: Any) -> list[StorageRow]:
    """The model's float type, float16, int8 and int4 (group 64, else 32 when 64 does not divide the head dim)."""
    from cortexstream.kv.arena_config import ArenaConfig

    native = ArenaConfig.for_model(model, num_tokens=16)
    rows = [StorageRow(f"{native.dtype} (model)", native.bytes_per_token)]
    if native.dtype != StorageType.FLOAT16.value:
        half = ArenaConfig.for_model(model, num_tokens=16, kv_dtype=StorageType.FLOAT16.value)
        rows.append(StorageRow(StorageType.FLOAT16.value, half.bytes_per_token))
    for kind in (StorageType.INT8, StorageType.INT4):
        rows.append(_quantized_row(model, kind, native.head_dim))
    return rows


def _quantized_row(model: Any, kind: StorageType, head_dim: int) -> StorageRow:
    from cortexstream.kv.arena_config import ArenaConfig

    for group in sorted(GROUP_SIZES, reverse=True):  # the largest group that fits: fewest scales and biases
        if head_dim % group:
            continue
        cfg = ArenaConfig.for_model(model, num_tokens=16, kv_dtype=kind.value, kv_group_size=group)
        note = "" if group == DEFAULT_GROUP_SIZE else f"group {DEFAULT_GROUP_SIZE} does not divide head dim {head_dim}"
        return StorageRow(f"{kind.value} (group {group})", cfg.bytes_per_token, note)
    sizes = " or ".join(map(str, GROUP_SIZES))
    return StorageRow(kind.value, None, f"not available: group size {sizes} does not divide head dim {head_dim}")


def storage_lines(rows: list[StorageRow]) -> list[str]:
    """`rows` as an aligned table for `cortexstream info`."""
    width = max(len(row.label) for row in rows)
    lines = [f"  {'kv storage':{width + 2}}  {'bytes/token':>11}  {'tokens/GiB':>12}"]
    for row in rows:
        if row.bytes_per_token is None:
            lines.append(f"    {row.label:{width}}  {row.note}")
            continue
        note = f"  ({row.note})" if row.note else ""
        lines.append(f"    {row.label:{width}}  {row.bytes_per_token:>11,}  {row.tokens_per_gib:>12,}{note}")
    return lines
