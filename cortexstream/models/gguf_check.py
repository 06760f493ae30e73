"""Check a GGUF file's header against its own size before anything allocates on its word.

`mx.load` is not a validation boundary: its C++ GGUF reader trusts counts and offsets (a GGUF whose tensor count
is corrupt crashes the process). This walk is pure Python over an mmap and applies the rules of llama.cpp's
hardened reader (`gguf.cpp`): counts and string/array lengths must fit in the bytes left, keys are non-empty and
unique, `general.alignment` is a UINT32 power of two, tensors have at most 4 dims, non-negative sizes whose
element and byte counts do not overflow, a known type whose block divides the first dim, an offset equal to the
running padded sum, and the data section must hold every tensor. Any violation is a `ModelLoadError` naming the
file and the field.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass

from cortexstream.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)  # version 1 used 32-bit counts; llama.cpp refuses it too
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_TENSOR_NAME = 63  # GGML_MAX_NAME (64) including the terminating NUL
INT64_MAX = 2**63 - 1

# GGUF metadata value types -> fixed byte size (STRING = 8, ARRAY = 9 are variable).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, a 1-byte key, type, smallest value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, 1-byte name, n_dims, one dim, type, offset


def _ggml_type_sizes() -> dict[int, tuple[int, int]]:
    """GGML tensor type -> (elements per block, bytes per block); types removed from GGML are absent."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(kind): (int(block), int(size)) for kind, (block, size) in GGML_QUANT_SIZES.items() if size > 0}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # GGML order: fastest-varying dim first
    ggml_type: int
    offset: int  # relative to the data section
    nbytes: int


@dataclass(frozen=True)
class GGUFLayout:
    """What the header claims, once every claim has been checked against the file."""

    version: int
    alignment: int
    metadata_keys: tuple[str, ...]
    scalars: dict[str, int | float]  # the numeric metadata values (block_count, head_count, ...)
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset: int
    file_size: int


class _Cursor:
    """Reads little-endian fields from a buffer, refusing to read past its end."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def left(self) -> int:
        return self.size - self.pos

    def fail(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: malformed GGUF: {message}")

    def take(self, fmt: str, field: str) -> int:
        width = struct.calcsize(fmt)
        if width > self.left():
            raise self.fail(f"{field} at byte {self.pos} runs past the end of the file ({self.size} bytes)")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += width
        return value

    def skip(self, nbytes: int, field: str) -> None:
        if nbytes > self.left():
            raise self.fail(f"{field} claims {nbytes} bytes at byte {self.pos}, only {self.left()} are left")
        self.pos += nbytes

    def string(self, field: str) -> bytes:
        length = self.take("Q", f"{field} length")
        if length > self.left():
            raise self.fail(f"{field} length {length} exceeds the {self.left()} bytes left at byte {self.pos}")
        value = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        return value


def check_gguf(path: str) -> GGUFLayout:
    """Validate `path`'s whole GGUF header and data extent; return the checked layout or raise ModelLoadError."""
    if not os.path.exists(path):
        raise ModelLoadError(f"{path}: file not found")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: not a regular file")
    file_size = os.path.getsize(path)
    if file_size < 4:
        raise ModelLoadError(f"{path}: not a GGUF file ({file_size} bytes, too short for the magic)")
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _walk(_Cursor(buf, path), file_size)


def _walk(cur: _Cursor, file_size: int) -> GGUFLayout:
    magic = bytes(cur.buf[:4])
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{cur.path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    cur.pos = 4
    version = cur.take("I", "version")
    if version not in SUPPORTED_VERSIONS:
        hint = " (byte-swapped: big-endian file?)" if version & 0xFFFF == 0 and version else ""
        raise cur.fail(f"version {version} is not supported (supported: {SUPPORTED_VERSIONS}){hint}")
    n_tensors = cur.take("Q", "tensor count")
    n_kv = cur.take("Q", "metadata count")
    if n_kv > cur.left() // _MIN_KV_BYTES:
        raise cur.fail(f"metadata count {n_kv} cannot fit in the {cur.left()} bytes left")
    keys, alignment, scalars = _walk_metadata(cur, n_kv)
    if n_tensors > cur.left() // _MIN_TENSOR_INFO_BYTES:
        raise cur.fail(f"tensor count {n_tensors} cannot fit in the {cur.left()} bytes left")
    tensors = _walk_tensor_infos(cur, n_tensors, alignment)
    data_offset = -(-cur.pos // alignment) * alignment
    # Like llama.cpp, the data section must hold every tensor padded to the alignment, the last one included.
    data_size = sum(-(-t.nbytes // alignment) * alignment for t in tensors)
    if data_offset + data_size > file_size:
        raise cur.fail(
            f"tensor data needs {data_size} bytes from byte {data_offset}, the file ends at {file_size} "
            "(truncated?)")
    return GGUFLayout(version, alignment, tuple(keys), scalars, tuple(tensors), data_offset, file_size)


def _walk_metadata(cur: _Cursor, n_kv: int) -> tuple[list[str], int, dict[str, int | float]]:
    keys: list[str] = []
    scalars: dict[str, int | float] = {}
    seen: set[bytes] = set()
    alignment = DEFAULT_ALIGNMENT
    for index in range(n_kv):
        raw_key = cur.string(f"metadata key #{index}")
        key = raw_key.decode("utf-8", "replace")
        if not raw_key:
            raise cur.fail(f"metadata key #{index} is empty")
        if raw_key in seen:
            raise cur.fail(f"metadata key '{key}' appears twice")
        seen.add(raw_key)
        value_type = cur.take("i", f"type of '{key}'")
        if key == "general.alignment":
            if value_type != _UINT32:
                raise cur.fail(f"'general.alignment' has type {value_type}, must be UINT32 ({_UINT32})")
            alignment = cur.take("I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise cur.fail(f"'general.alignment' is {alignment}, must be a power of two")
        elif value_type in _SCALAR_FORMATS:
            scalars[key] = cur.take(_SCALAR_FORMATS[value_type], f"value of '{key}'")
        else:
            _skip_value(cur, value_type, key)
        keys.append(key)
    return keys, alignment, scalars


def _skip_value(cur: _Cursor, value_type: int, key: str) -> None:
    if value_type in _SCALAR_SIZES:
        cur.skip(_SCALAR_SIZES[value_type], f"value of '{key}'")
    elif value_type == _STRING:
        cur.string(f"string value of '{key}'")
    elif value_type == _ARRAY:
        item_type = cur.take("i", f"array type of '{key}'")
        count = cur.take("Q", f"array length of '{key}'")
        if item_type in _SCALAR_SIZES:
            if count > cur.left() // _SCALAR_SIZES[item_type]:
                raise cur.fail(f"array '{key}' claims {count} items, more than the {cur.left()} bytes left hold")
            cur.skip(count * _SCALAR_SIZES[item_type], f"array '{key}'")
        elif item_type == _STRING:
            if count > cur.left() // 8:
                raise cur.fail(f"array '{key}' claims {count} strings, more than the {cur.left()} bytes left hold")
            for i in range(count):
                length = cur.take("Q", f"'{key}'[{i}] length")
                cur.skip(length, f"'{key}'[{i}]")
        else:
            raise cur.fail(f"array '{key}' has invalid item type {item_type}")
    else:
        raise cur.fail(f"'{key}' has invalid value type {value_type}")


def _walk_tensor_infos(cur: _Cursor, n_tensors: int, alignment: int) -> list[GGUFTensorInfo]:
    type_sizes = _ggml_type_sizes()
    tensors: list[GGUFTensorInfo] = []
    names: set[str] = set()
    expected_offset = 0
    for index in range(n_tensors):
        name = cur.string(f"tensor #{index} name").decode("utf-8", "replace")
        if len(name.encode()) > MAX_TENSOR_NAME:
            raise cur.fail(f"tensor #{index} name is {len(name.encode())} bytes, at most {MAX_TENSOR_NAME} allowed")
        if name in names:
            raise cur.fail(f"tensor name '{name}' appears twice")
        names.add(name)
        n_dims = cur.take("I", f"tensor '{name}' n_dims")
        if n_dims > MAX_DIMS:
            raise cur.fail(f"tensor '{name}' has {n_dims} dims, at most {MAX_DIMS} allowed")
        shape = tuple(cur.take("q", f"tensor '{name}' dim {d}") for d in range(n_dims))
        numel = 1
        for dim in shape:
            if dim < 0:
                raise cur.fail(f"tensor '{name}' has negative dim {dim} in shape {shape}")
            if dim and numel > INT64_MAX // dim:
                raise cur.fail(f"tensor '{name}' shape {shape} overflows a 64-bit element count")
            numel *= dim
        ggml_type = cur.take("i", f"tensor '{name}' type")
        if ggml_type not in type_sizes:
            raise cur.fail(f"tensor '{name}' has unknown type {ggml_type}")
        block, block_bytes = type_sizes[ggml_type]
        if shape and shape[0] % block:
            raise cur.fail(f"tensor '{name}' first dim {shape[0]} is not a multiple of its type's block {block}")
        nbytes = numel // block * block_bytes
        if nbytes > INT64_MAX:
            raise cur.fail(f"tensor '{name}' shape {shape} overflows a 64-bit byte count")
        offset = cur.take("Q", f"tensor '{name}' offset")
        if offset != expected_offset:
            raise cur.fail(f"tensor '{name}' has offset {offset}, expected {expected_offset} (tensors must be "
                           f"packed in order, each padded to the alignment {alignment})")
        expected_offset += -(-nbytes // alignment) * alignment
        if expected_offset > INT64_MAX:
            raise cur.fail(f"tensor data size overflows at tensor '{name}'")
        tensors.append(GGUFTensorInfo(name, shape, ggml_type, offset, nbytes))
    return tensors
