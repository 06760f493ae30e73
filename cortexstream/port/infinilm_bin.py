"""InfiniLM's `.bin` KV-compressor weight format: read and write, without torch.

Why: InfiniLM (InfiniTensor/InfiniLM) runs FastCache-style compressors from this flat file instead of a pickle,
so supporting it lets weights move both ways between the two engines.

Facts used (InfiniTensor/InfiniLM `docs/KVCacheCompressionWeightFormat.md`, `csrc/cache/kv_compression.cpp`,
`scripts/convert_kv_compressor_pth_to_bin.py`):
- all integers little-endian; 44-byte header `struct.pack("<IIHHIIIIIIII")`: magic 0x4B56434D, version (1),
  dtype_code (uint16: 0 fp16, 1 bf16 raw payload, 2 fp32), reserved (uint16, 0), num_layers, num_heads (optional,
  may be 0), head_dim, hidden_size (both "sanity" fields), compression_factor, min_seq_len,
  weight_count_per_layer (Linears per layer, biases not counted), metadata_size_bytes (skipped by the reader);
- then for each layer, for each of its Linears: WeightMeta `<III` (rows, cols, has_bias), rows*cols weight elements
  (row-major, torch `[out, in]` layout), then `rows` bias elements if has_bias == 1;
- per-layer order: prefixes compress_tk, compress_tv, compress_ik, compress_iv, each with the Sequential slots 0, 3, 6
  (12 Linears; 6 for a text-only export). The C++ loader uses slots prefix*3 + {0,1,2}.
- InfiniLM's converters write hidden_size = in_features of the first Linear (head_dim * factor) and
  head_dim = its out_features; the C++ loader only checks magic, version 1 and non-zero counts.

Our choices where the sources are silent: weight_count_per_layer must be 6 or 12 (the C++ needs text K and V);
shapes are validated against head_dim/compression_factor when those fields are non-zero; trailing bytes after the
last weight are an error (the format has no trailer, so they signal a mismatched writer).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx
import numpy as np

from cortexstream.atomic_files import atomic_write
from cortexstream.errors import InvalidArgumentError, ModelLoadError

MAGIC = 0x4B56434D
VERSION = 1
HEADER = struct.Struct("<IIHHIIIIIIII")
WEIGHT_META = struct.Struct("<III")
DTYPE_CODES = {0: "float16", 1: "bfloat16", 2: "float32"}
PREFIXES = ("compress_tk", "compress_tv", "compress_ik", "compress_iv")
SLOTS = (0, 3, 6)
_NP = {"float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"), "float32": np.dtype("<f4")}
_MX = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@dataclass(frozen=True)
class InfiniLMHeader:
    """The header fields (dtype as a name: "float16", "bfloat16" or "float32")."""

    dtype: str
    num_layers: int
    num_heads: int
    head_dim: int
    hidden_size: int
    compression_factor: int
    min_seq_len: int
    weight_count_per_layer: int
    version: int = VERSION
    metadata: bytes = b""


def linear_names(weight_count_per_layer: int, layer: int) -> list[str]:
    """State-dict names ('compress_tk.<layer>.<slot>') of a layer's Linears in file order."""
    prefixes = PREFIXES[: weight_count_per_layer // len(SLOTS)]
    return [f"{p}.{layer}.{s}" for p in prefixes for s in SLOTS]


def _to_mx(raw: bytes, dtype: str, shape: tuple[int, ...]) -> mx.array:
    arr = mx.array(np.frombuffer(raw, dtype=_NP[dtype]).reshape(shape))
    return arr.view(mx.bfloat16) if dtype == "bfloat16" else arr


def read_infinilm_bin(path: str) -> tuple[InfiniLMHeader, dict[str, mx.array]]:
    """Parse a `.bin` into its header and a state dict with FastCache names ('compress_tk.0.0.weight', ...)."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read InfiniLM compressor file: {exc}") from exc
    if len(blob) < HEADER.size:
        raise ModelLoadError(f"{path}: truncated header ({len(blob)} bytes, need {HEADER.size})")
    (magic, version, code, _reserved, layers, heads, head_dim, hidden, factor, min_len, count,
     meta_size) = HEADER.unpack_from(blob, 0)
    if magic != MAGIC:
        raise ModelLoadError(
            f"{path}: bad magic 0x{magic:08X} (expected 0x{MAGIC:08X}: not an InfiniLM compressor .bin)")
    if version != VERSION:
        raise ModelLoadError(f"{path}: unsupported InfiniLM compressor format version {version} (supported: {VERSION})")
    if code not in DTYPE_CODES:
        raise ModelLoadError(f"{path}: unknown dtype_code {code} (known: 0 fp16, 1 bf16, 2 fp32)")
    if layers == 0 or count not in (6, 12):
        raise ModelLoadError(
            f"{path}: invalid header: num_layers={layers}, weight_count_per_layer={count} (need 6 or 12)")
    dtype, pos = DTYPE_CODES[code], HEADER.size + meta_size
    if pos > len(blob):
        raise ModelLoadError(f"{path}: truncated: metadata of {meta_size} bytes runs past the end of the file")
    header = InfiniLMHeader(dtype, layers, heads, head_dim, hidden, factor, min_len, count, version,
                            blob[HEADER.size:pos])
    item = _NP[dtype].itemsize
    state: dict[str, mx.array] = {}
    for layer in range(layers):
        for name in linear_names(count, layer):
            if pos + WEIGHT_META.size > len(blob):
                raise ModelLoadError(f"{path}: truncated before the meta of '{name}.weight' (offset {pos})")
            rows, cols, has_bias = WEIGHT_META.unpack_from(blob, pos)
            pos += WEIGHT_META.size
            if rows == 0 or cols == 0 or has_bias not in (0, 1):
                raise ModelLoadError(
                    f"{path}: invalid meta for '{name}.weight': rows={rows} cols={cols} has_bias={has_bias}")
            need = rows * cols * item + (rows * item if has_bias else 0)
            if pos + need > len(blob):
                raise ModelLoadError(
                    f"{path}: truncated in '{name}.weight' (need {need} bytes at offset {pos}, file has {len(blob)})")
            state[f"{name}.weight"] = _to_mx(blob[pos:pos + rows * cols * item], dtype, (rows, cols))
            pos += rows * cols * item
            if has_bias:
                state[f"{name}.bias"] = _to_mx(blob[pos:pos + rows * item], dtype, (rows,))
                pos += rows * item
            _check_shape(path, header, name, rows, cols)
    if pos != len(blob):
        raise ModelLoadError(f"{path}: {len(blob) - pos} unexpected trailing bytes after the last weight")
    return header, state


def _check_shape(path: str, header: InfiniLMHeader, name: str, rows: int, cols: int) -> None:
    if header.head_dim and rows != header.head_dim:
        raise ModelLoadError(f"{path}: '{name}.weight' has {rows} rows but header head_dim is {header.head_dim}")
    if not name.endswith(".0"):
        want = rows  # slots 3 and 6 are Linear(D, D)
    else:  # slot 0 is Linear(D * factor, D)
        want = rows * header.compression_factor if header.compression_factor else cols
    if cols != want:
        raise ModelLoadError(f"{path}: '{name}.weight' has shape ({rows}, {cols}), expected ({rows}, {want})")


def _payload(arr: mx.array, dtype: str) -> bytes:
    arr = arr.astype(_MX[dtype])
    if dtype == "bfloat16":
        arr = arr.view(mx.uint16)
    return np.ascontiguousarray(np.array(arr), dtype=_NP[dtype]).tobytes()


def write_infinilm_bin(
    path: str,
    state: Mapping[str, mx.array],
    *,
    compression_factor: int | None = None,
    min_seq_len: int = 1,
    num_heads: int = 0,
    dtype: str = "float16",
    metadata: bytes = b"",
) -> InfiniLMHeader:
    """Write a FastCache-named state dict ('compress_tk.<l>.<0|3|6>.weight/bias') as an InfiniLM `.bin`.

    Text-only states (no compress_ik/iv) give 6 Linears per layer, full ones 12. compression_factor=None infers
    in_features // out_features of the first Linear. Biases are written when present (has_bias=1).
    """
    if dtype not in _NP:
        raise InvalidArgumentError(f"dtype: '{dtype}' is not one of {', '.join(_NP)}")
    image = any(k.startswith(("compress_ik.", "compress_iv.")) for k in state)
    count = 12 if image else 6
    indices = (k.split(".")[1] for k in state if k.startswith("compress_tk."))
    layers = 1 + max((int(i) for i in indices if i.isdigit()), default=-1)
    first = state.get("compress_tk.0.0.weight")
    if layers == 0 or first is None or first.ndim != 2:
        raise InvalidArgumentError(f"{path}: state has no 2-D 'compress_tk.0.0.weight'; nothing to write")
    head_dim, in_dim = first.shape
    factor = compression_factor or in_dim // head_dim
    if in_dim != head_dim * factor:
        raise InvalidArgumentError(
            f"{path}: 'compress_tk.0.0.weight' {tuple(first.shape)} does not fit factor {factor}")
    header = InfiniLMHeader(dtype, layers, num_heads, head_dim, in_dim, factor, min_seq_len, count, VERSION, metadata)
    chunks = [HEADER.pack(MAGIC, VERSION, {v: k for k, v in DTYPE_CODES.items()}[dtype], 0, layers, num_heads,
                          head_dim, in_dim, factor, min_seq_len, count, len(metadata)), metadata]
    for layer in range(layers):
        for name in linear_names(count, layer):
            weight, bias = state.get(f"{name}.weight"), state.get(f"{name}.bias")
            if weight is None or weight.ndim != 2:
                raise InvalidArgumentError(f"{path}: state lacks a 2-D '{name}.weight'")
            if bias is not None and tuple(bias.shape) != (weight.shape[0],):
                raise InvalidArgumentError(
                    f"{path}: '{name}.bias' has shape {tuple(bias.shape)}, expected ({weight.shape[0]},)")
            chunks.append(WEIGHT_META.pack(weight.shape[0], weight.shape[1], int(bias is not None)))
            chunks.append(_payload(weight, dtype))
            if bias is not None:
                chunks.append(_payload(bias, dtype))
    payload = b"".join(chunks)

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(payload)

    atomic_write(path, write)  # a failed export never leaves a torn .bin behind
    return header
