"""Porting weights from PyTorch-world files into MLX, shared by the compressor, C2C and sidecar capabilities.

- `load_torch(path)`: a `torch.save` file (zip or legacy) -> flat `{"a.b.weight": mx.array}`, without importing
  torch; any pickle global outside a tensor allowlist is refused (see `torch_pickle`).
- `map_state_dict` (pure renaming), `check_strict` / `load_strict` (exact names and shapes, errors name the keys).
- `read_infinilm_bin` / `write_infinilm_bin`: InfiniLM's KV-compressor `.bin`.
- `save_torch(path, tensors)`: write a `torch.save`-compatible zip without torch (see `torch_save`).
- `load_safetensors` / `save_safetensors`, and `load_checkpoint`, which sniffs the format from the file's bytes
  (a `.bin` may be a torch zip, a legacy torch pickle, or InfiniLM's format, so extensions are not trusted).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, Mapping

import mlx.core as mx
import numpy as np

from cortexstream.atomic_files import atomic_write
from cortexstream.errors import ModelLoadError
from cortexstream.port.infinilm_bin import InfiniLMHeader, read_infinilm_bin, write_infinilm_bin
from cortexstream.port.strict import check_strict, load_strict, map_state_dict, shapes_of
from cortexstream.port.torch_pickle import TorchTensor, read_torch_file
from cortexstream.port.torch_save import save_torch

__all__ = [
    "Checkpoint", "InfiniLMHeader", "check_strict", "flatten_tensors", "load_checkpoint", "load_safetensors",
    "load_strict", "load_torch", "map_state_dict", "read_infinilm_bin", "read_torch_file", "save_safetensors",
    "save_torch", "shapes_of", "write_infinilm_bin",
]


def flatten_tensors(obj: Any, prefix: str = "") -> dict[str, TorchTensor]:
    """Nested dicts/lists of tensors -> {'a.b.0': tensor}; non-tensor leaves (epoch counters, configs) are dropped."""
    out: dict[str, TorchTensor] = {}
    if isinstance(obj, TorchTensor):
        out[prefix.rstrip(".")] = obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, (str, int)) and not isinstance(key, bool):
                out.update(flatten_tensors(value, f"{prefix}{key}."))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            out.update(flatten_tensors(value, f"{prefix}{i}."))
    return out


def _to_mx(tensor: TorchTensor, path: str, key: str) -> mx.array:
    arr = tensor.numpy(path, key)
    if tensor.dtype == "bfloat16":
        return mx.array(arr).view(mx.bfloat16)
    if tensor.dtype == "float64":  # MLX keeps float64 for CPU only; weights never need it
        return mx.array(arr.astype(np.float32))
    return mx.array(arr)


def load_torch(path: str) -> dict[str, mx.array]:
    """Read a `torch.save` checkpoint (state dict or nested dict of tensors) as flat MLX arrays, torch-free.

    Tensor dtypes keep their type (float32/16, bfloat16, int8..64, uint8..64, bool), except float64 -> float32.
    Views and shared storages are copied out into independent contiguous arrays.
    """
    tree = read_torch_file(path)
    return {key: _to_mx(t, path, key) for key, t in flatten_tensors(tree).items()}


def load_safetensors(path: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """A safetensors file -> (tensors, string metadata); the header is checked against the file first."""
    from cortexstream.models.safetensors_check import check_safetensors

    check_safetensors(path)  # mx.load trusts the header's offsets
    try:
        tensors, metadata = mx.load(path, return_metadata=True)
    except Exception as exc:  # noqa: BLE001 - MLX raises RuntimeError/ValueError with terse messages
        raise ModelLoadError(f"{path}: cannot read safetensors: {exc}") from exc
    return dict(tensors), dict(metadata or {})


def save_safetensors(path: str, tensors: Mapping[str, mx.array], metadata: Mapping[str, Any] | None = None) -> None:
    """Write tensors to safetensors; metadata values are stored as strings (the format only allows strings)."""
    meta = {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (metadata or {}).items()}
    arrays = dict(tensors)
    if not path.endswith(".safetensors"):
        path += ".safetensors"  # what MLX does to such names anyway; the temporary file must match it
    atomic_write(path, lambda tmp: mx.save_safetensors(tmp, arrays, metadata=meta))


@dataclass
class Checkpoint:
    """Tensors from any supported file plus its format name and string metadata."""

    tensors: dict[str, mx.array]
    format: str  # "torch-zip", "torch-legacy", "infinilm-bin" or "safetensors"
    metadata: dict[str, str] = field(default_factory=dict)
    header: InfiniLMHeader | None = None


def _sniff(path: str) -> str:
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot open: {exc}") from exc
    if head[:4] == b"PK\x03\x04":
        return "torch-zip"
    if head[:1] == b"\x80":
        return "torch-legacy"
    if len(head) >= 4 and struct.unpack("<I", head[:4])[0] == 0x4B56434D:
        return "infinilm-bin"
    if len(head) >= 9 and head[8:9] == b"{":
        return "safetensors"
    raise ModelLoadError(f"{path}: unknown weight format (expected torch.save, safetensors or InfiniLM .bin)")


def load_checkpoint(path: str) -> Checkpoint:
    """Load weights from a torch.save file, safetensors or InfiniLM `.bin`, recognised by content."""
    kind = _sniff(path)
    if kind == "infinilm-bin":
        header, tensors = read_infinilm_bin(path)
        meta = {"factor": str(header.compression_factor), "min_seq_len": str(header.min_seq_len),
                "head_dim": str(header.head_dim), "num_layers": str(header.num_layers)}
        return Checkpoint(tensors, kind, meta, header)
    if kind == "safetensors":
        tensors, meta = load_safetensors(path)
        return Checkpoint(tensors, kind, meta)
    return Checkpoint(load_torch(path), kind)
