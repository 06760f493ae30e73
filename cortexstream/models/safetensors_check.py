"""Check a safetensors file's JSON header against the file before `mx.load` reads it.

The rules are the reference `safetensors` crate's: an 8-byte little-endian header length of at most 100 MB that
fits in the file, a JSON object (no duplicate keys) whose entries each have a known dtype, a shape of
non-negative integers and `data_offsets` [begin, end] with end - begin = element count x dtype size; the
entries, sorted by offset, tile the data section exactly from 0 to its end (no gaps, overlaps or trailing
bytes); `__metadata__` is a str -> str map. Violations are `ModelLoadError`s naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Any

from cortexstream.errors import ModelLoadError

MAX_HEADER_BYTES = 100_000_000
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}


@dataclass(frozen=True)
class SafetensorsEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets inside the data section
    end: int


@dataclass(frozen=True)
class SafetensorsLayout:
    tensors: dict[str, SafetensorsEntry]
    metadata: dict[str, str]
    data_offset: int


def _no_duplicates(path: str):
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise ModelLoadError(f"{path}: malformed safetensors: key '{key}' appears twice in the header")
            out[key] = value
        return out
    return hook


def check_safetensors(path: str) -> SafetensorsLayout:
    """Validate `path` as safetensors; return its checked layout or raise ModelLoadError."""
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: file not found" if not os.path.exists(path) else f"{path}: not a regular file")
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte header size)")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or header_len > size - 8:
            raise ModelLoadError(f"{path}: malformed safetensors: header length {header_len} exceeds "
                                 f"{'the 100 MB limit' if header_len > MAX_HEADER_BYTES else f'the file ({size} bytes)'}")
        raw = fh.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(path))
    except ModelLoadError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ModelLoadError(f"{path}: malformed safetensors: header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: malformed safetensors: header is a {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:  # MLX writes null when there is none; the reference crate reads it as absent
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ModelLoadError(f"{path}: malformed safetensors: '__metadata__' must map strings to strings")
    tensors = {name: _entry(path, name, spec) for name, spec in header.items()}
    data_size = size - 8 - header_len
    position = 0
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            what = "overlaps the previous tensor" if entry.begin < position else f"leaves a gap after byte {position}"
            raise ModelLoadError(f"{path}: malformed safetensors: tensor '{name}' starts at {entry.begin} and {what}")
        position = entry.end
    if position != data_size:
        raise ModelLoadError(f"{path}: malformed safetensors: tensors cover {position} bytes, the data section has "
                             f"{data_size} ({'truncated' if position > data_size else 'trailing bytes'})")
    return SafetensorsLayout(tensors, dict(metadata), 8 + header_len)


def _entry(path: str, name: str, spec: Any) -> SafetensorsEntry:
    def bad(rule: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: malformed safetensors: tensor '{name}' {rule}")

    if not isinstance(spec, dict):
        raise bad("is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise bad(f"has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"has shape {shape!r:.80}, expected a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise bad(f"has data_offsets {offsets!r:.80}, expected [begin, end] with 0 <= begin <= end")
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * DTYPE_SIZES[dtype] != offsets[1] - offsets[0]:
        raise bad(f"of shape {shape} and dtype {dtype} needs {numel * DTYPE_SIZES[dtype]} bytes, "
                  f"its data_offsets span {offsets[1] - offsets[0]}")
    return SafetensorsEntry(dtype, tuple(shape), offsets[0], offsets[1])
