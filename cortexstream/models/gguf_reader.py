"""Read a GGUF file into (tensors, metadata) in the form `mx.load(path, return_metadata=True)` gives.

`mx.load` reads F32/F16/Q4_0/Q4_1/Q8_0 natively (the quantised ones as MLX (weight, scales, biases) triplets with
group size 32). Other types make it fail for the whole file (Q5_x, IQ*) or, worse, load wrong values: mlx 0.32's
reader accepts Q4_K and Q6_K, and its Q4_K weights differ from the reference dequantisation by up to 1.9 (a
Qwen2.5-Coder-1.5B Q4_K_M then writes garbage). So `mx.load` is used only when every tensor is one of the five
types it reads correctly; any other file goes to the `gguf` package, which dequantises every tensor to float32 on
the host.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from cortexstream.errors import ModelLoadError, UnsupportedModelError
from cortexstream.models.gguf_check import GGUF_MAGIC, check_gguf

__all__ = ["GGUF_MAGIC", "check_gguf_file", "read_gguf"]


def check_gguf_file(path: str) -> None:
    """Fail early, naming the file and the field, when it is missing, not a GGUF, or its header lies about the
    file (counts, lengths, offsets, alignment): `mx.load` trusts the header and may crash the process."""
    check_gguf(path)


def read_gguf(path: str) -> tuple[dict[str, mx.array], dict[str, Any], str]:
    """Return (tensors, metadata, reader) where reader is "mlx" or "gguf-py" (the dequantising fallback)."""
    check_gguf_file(path)
    native_message = "not tried: the file has tensor types mx.load does not read correctly"
    if _native_types_only(path):
        try:
            tensors, metadata = mx.load(path, return_metadata=True)
            return tensors, metadata, "mlx"
        except Exception as native_error:  # mlx raises RuntimeError/ValueError with terse messages
            native_message = str(native_error)
    try:
        tensors, metadata = _read_with_gguf_py(path)
    except UnsupportedModelError:
        raise
    except Exception as fallback_error:
        raise ModelLoadError(
            f"{path}: cannot read GGUF (truncated or corrupt?): mlx said '{native_message}', "
            f"gguf said '{fallback_error}'"
        ) from fallback_error
    return tensors, metadata, "gguf-py"


# The GGML types `mx.load` decodes to the reference values (checked against gguf-py's dequantisation).
_NATIVE_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})


def _native_types_only(path: str) -> bool:
    """Whether every tensor of the file is of a type `mx.load` reads correctly (the header only, memory-mapped)."""
    try:
        from gguf import GGUFReader
    except ImportError:  # without gguf-py there is no other reader: let mx.load try
        return True
    try:
        return all(t.tensor_type.name in _NATIVE_TYPES for t in GGUFReader(path, "r").tensors)
    except Exception:  # noqa: BLE001 - a file gguf-py cannot parse: its reader below reports it, naming the file
        return False


def _read_with_gguf_py(path: str) -> tuple[dict[str, mx.array], dict[str, Any]]:
    import gguf

    reader = gguf.GGUFReader(path, "r")
    metadata: dict[str, Any] = {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue
        metadata[field.name] = _field_value(field, gguf)
    tensors: dict[str, mx.array] = {}
    for tensor in reader.tensors:
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(
                f"{path}: tensor '{tensor.name}' uses quantisation {tensor.tensor_type.name}, "
                "which the gguf package cannot dequantise"
            ) from exc
        # GGML lists dims fastest-first; numpy/MLX want them slowest-first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        tensors[tensor.name] = mx.array(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))
    return tensors, metadata


def _field_value(field: Any, gguf: Any) -> Any:
    """Convert a GGUFReader field into what mx.load reports: str, list[str], or an mx.array."""
    value = field.contents()
    main_type = field.types[0] if field.types else None
    if main_type == gguf.GGUFValueType.STRING:
        return value
    if main_type == gguf.GGUFValueType.ARRAY:
        if field.types[-1] == gguf.GGUFValueType.STRING:
            return list(value)
        return mx.array(np.asarray(value))
    return mx.array(value)
