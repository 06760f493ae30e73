"""Read `torch.save` checkpoints without importing torch: a restricted unpickler that only rebuilds tensors.

Why: a `.pth`/`.pt`/`pytorch_model.bin` is a pickle, and unpickling calls whatever callables the file names
(`os.system` via `__reduce__` is the classic exploit). We never need torch's own loader: this module resolves only
an allowlist of globals (tensor rebuilders, storage/dtype names, `collections.OrderedDict`) to *our* inert
stand-ins, and refuses every other global with `ModelLoadError` naming it, before anything is called.

Facts used (torch 2.13 `torch/serialization.py`, `torch/_utils.py`, `torch/_tensor.py`, `torch/nn/parameter.py`):
- zip format (default since 1.6): `<archive>/data.pkl` holds the object; tensors are
  `torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks[, metadata])`
  whose storage is a persistent id `('storage', torch.<X>Storage, key, location, numel)`; the bytes live in
  `<archive>/data/<key>`; `<archive>/byteorder` says "little"/"big" (absent = little). `<archive>` is the file stem.
- new dtypes (uint16/32/64, float8...) use `_rebuild_tensor_v3(..., dtype, metadata)` over an untyped byte storage.
- Parameters pickle as `_rebuild_parameter(data, requires_grad, hooks)` / `_rebuild_parameter_with_state(...)`.
- legacy format (`_use_new_zipfile_serialization=False`): back-to-back pickles MAGIC 0x1950A86A20F9469CFC6C,
  PROTOCOL_VERSION 1001, sys_info, the object (persistent ids add a 6th field `view_metadata`), the sorted list of
  storage keys; then per key an int64 little-endian element count and the raw bytes (always little-endian).
- strides and offsets are in elements; several tensors may share one storage (views, tied weights).
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import tarfile
import zipfile
from math import prod
from typing import Any, BinaryIO, Callable

import numpy as np

from cortexstream.errors import ModelLoadError

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
BROADCAST_COPY_LIMIT = 64 << 20  # bytes a broadcast (overlapping-stride) view may expand to when copied out

# torch storage class name -> element dtype (UntypedStorage: raw bytes).
STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool", "UntypedStorage": "uint8",
}
# torch dtype attribute names (as pickled: `torch.float32`) -> our dtype name.
TORCH_DTYPES = {
    "float32": "float32", "float": "float32", "float64": "float64", "double": "float64", "float16": "float16",
    "half": "float16", "bfloat16": "bfloat16", "int64": "int64", "long": "int64", "int32": "int32", "int": "int32",
    "int16": "int16", "short": "int16", "int8": "int8", "uint8": "uint8", "bool": "bool", "uint16": "uint16",
    "uint32": "uint32", "uint64": "uint64",
}
# bfloat16 has no numpy dtype: its raw 16-bit payload is carried as uint16 and reinterpreted by the caller.
NUMPY_DTYPES = {
    "float32": "<f4", "float64": "<f8", "float16": "<f2", "bfloat16": "<u2", "int64": "<i8", "int32": "<i4",
    "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8",
}


class _Inert:
    """Base of the stand-ins the pickle may reference: BUILD/`__setstate__` on them is refused."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise ModelLoadError(f"malformed checkpoint: pickle tries to set state on {type(self).__name__}")


class _Marker(_Inert):
    """Stand-in for a torch global: kind "dtype" (`torch.float32`), "storage" (`torch.FloatStorage`; name = its
    element dtype) or "type" (`torch.Tensor` / `Parameter` as `new_type` of `_rebuild_from_type_v2`)."""

    __slots__ = ("kind", "name")

    def __init__(self, kind: str, name: str) -> None:
        self.kind, self.name = kind, name


class Storage(_Inert):
    """One storage: element dtype and, once read, a 1-D little-endian numpy array of it."""

    __slots__ = ("key", "dtype", "numel", "data")

    def __init__(self, key: str, dtype: str, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel
        self.data: np.ndarray | None = None


class TorchTensor(_Inert):
    """A tensor as torch describes it: a (storage, offset, size, stride) view; `numpy()` copies it out."""

    __slots__ = ("storage", "offset", "size", "stride", "dtype", "neg")

    def __init__(self, storage: Storage, offset: int, size: tuple, stride: tuple, dtype: str, neg: bool) -> None:
        self.storage, self.offset, self.size, self.stride, self.dtype, self.neg = (
            storage, offset, size, stride, dtype, neg)

    def numpy(self, source: str = "checkpoint", key: str = "?") -> np.ndarray:
        """Contiguous copy (bfloat16 as its uint16 payload); out-of-bounds views are a ModelLoadError."""
        base = self.storage.data
        if base is None:
            raise ModelLoadError(f"{source}: tensor '{key}': storage '{self.storage.key}' was never read")
        np_dtype = np.dtype(NUMPY_DTYPES[self.dtype])
        if base.dtype != np_dtype:  # v3: typed view over untyped bytes
            raw = base.view(np.uint8)
            base = raw[: raw.size - raw.size % np_dtype.itemsize].view(np_dtype)
        if prod(self.size) == 0:
            return np.zeros(self.size, dtype=np_dtype)
        last = self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride, strict=True))
        if self.offset < 0 or any(s < 0 for s in self.stride) or last >= base.size:
            raise ModelLoadError(
                f"{source}: tensor '{key}' (size {self.size}, stride {self.stride}, offset {self.offset}) "
                f"reads past its storage '{self.storage.key}' of {base.size} elements (corrupt checkpoint?)")
        copy_bytes = prod(self.size) * np_dtype.itemsize
        if prod(self.size) > base.size and copy_bytes > BROADCAST_COPY_LIMIT:
            # Only overlapping strides (0 or repeated) can do this; copying such a view out could allocate far
            # more than the file holds (a 1.5 kB file asking for 37 GiB), so a file never gets that on its word.
            # Small broadcast views (torch's expand) are legitimate and still load.
            raise ModelLoadError(
                f"{source}: tensor '{key}' (size {self.size}, stride {self.stride}) has {prod(self.size)} elements "
                f"({copy_bytes} bytes) but its storage '{self.storage.key}' holds {base.size}: overlapping "
                f"(broadcast) views are copied out only up to {BROADCAST_COPY_LIMIT} bytes")
        view = np.lib.stride_tricks.as_strided(
            base[self.offset:], shape=self.size, strides=[s * np_dtype.itemsize for s in self.stride], writeable=False)
        out = np.array(view, copy=True)
        if self.neg:  # lazily negated view (metadata {'neg': True}); bfloat16: flip the sign bit of the payload
            out = out ^ np.uint16(0x8000) if self.dtype == "bfloat16" else np.negative(out)
        return out


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ModelLoadError(f"malformed checkpoint: tensor {what} must be a tuple of ints, got {value!r:.80}")
    return tuple(value)


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, dtype: str | None, metadata: Any) -> TorchTensor:
    if not isinstance(storage, Storage) or not isinstance(offset, int):
        raise ModelLoadError("malformed checkpoint: tensor rebuild without a storage/offset")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride) or any(n < 0 for n in size) or isinstance(offset, bool):
        raise ModelLoadError(f"malformed checkpoint: invalid tensor size {size} / stride {stride} / offset")
    neg = bool(metadata.get("neg", False)) if isinstance(metadata, dict) else False
    return TorchTensor(storage, offset, size, stride, dtype or storage.dtype, neg)


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                hooks: Any = None, metadata: Any = None) -> TorchTensor:
    """Also serves the 4-argument `_rebuild_tensor` of old files."""
    return _tensor(storage, offset, size, stride, None, metadata)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any,
                dtype: Any, metadata: Any = None) -> TorchTensor:
    if not isinstance(dtype, _Marker) or dtype.kind != "dtype":
        raise ModelLoadError("malformed checkpoint: _rebuild_tensor_v3 without a torch dtype")
    return _tensor(storage, offset, size, stride, dtype.name, metadata)


def _rebuild_parameter(data: Any, requires_grad: Any = False, hooks: Any = None, state: Any = None) -> TorchTensor:
    if not isinstance(data, TorchTensor):
        raise ModelLoadError("malformed checkpoint: Parameter rebuilt from a non-tensor")
    return data


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any = None) -> TorchTensor:
    if func not in (_rebuild_v2, _rebuild_v3, _rebuild_parameter) or not isinstance(new_type, _Marker) \
            or new_type.kind != "type":
        raise ModelLoadError("malformed checkpoint: _rebuild_from_type_v2 with a non-tensor rebuild function")
    return func(*args)


def _latin1_encode(text: Any, encoding: str = "utf-8") -> bytes:
    # Protocol-2 pickles store `bytes` as _codecs.encode(str, 'latin1'); no other codec may be looked up.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise ModelLoadError("malformed checkpoint: _codecs.encode is only allowed with latin1")
    return text.encode("latin1")


_CALLABLES: dict[str, Callable[..., Any]] = {
    "collections.OrderedDict": collections.OrderedDict,
    "torch._utils._rebuild_tensor": _rebuild_v2,
    "torch._utils._rebuild_tensor_v2": _rebuild_v2,
    "torch._utils._rebuild_tensor_v3": _rebuild_v3,
    "torch._utils._rebuild_parameter": _rebuild_parameter,
    "torch._utils._rebuild_parameter_with_state": _rebuild_parameter,
    "torch._tensor._rebuild_from_type_v2": _rebuild_from_type,
    "torch.tensor._rebuild_from_type_v2": _rebuild_from_type,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "_codecs.encode": _latin1_encode,
}
_TYPES = {"torch.Tensor", "torch.nn.parameter.Parameter", "torch.nn.Parameter"}


class _RestrictedUnpickler(pickle.Unpickler):
    """`find_class` returns only inert stand-ins; `persistent_load` hands out `Storage`s via `open_storage`."""

    def __init__(self, file: BinaryIO, source: str, open_storage: Callable[[tuple], Storage]) -> None:
        super().__init__(file, encoding="utf-8")
        self._source, self._open_storage = source, open_storage

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module  # protocol <= 2 spells it the Python 2 way
        full = f"{module}.{name}"
        if full in _CALLABLES:
            return _CALLABLES[full]
        if full in _TYPES:
            return _Marker("type", full)
        if module in ("torch", "torch.storage") and name in STORAGE_DTYPES:
            return _Marker("storage", STORAGE_DTYPES[name])
        if module == "torch" and name in TORCH_DTYPES:
            return _Marker("dtype", TORCH_DTYPES[name])
        if module == "torch" and (name.endswith("Storage") or name.startswith(("float8", "complex", "qint", "quint"))):
            raise ModelLoadError(f"{self._source}: tensors of type '{full}' are not supported")
        raise ModelLoadError(
            f"{self._source}: refusing to unpickle global '{full}': a weights checkpoint may only contain tensors, "
            "containers and numbers, and unpickling this global could run code (nothing was executed)")

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid:
            raise ModelLoadError(f"{self._source}: malformed persistent id {pid!r:.80}")
        kind = pid[0].decode("ascii") if isinstance(pid[0], bytes) else pid[0]
        if kind != "storage":
            raise ModelLoadError(f"{self._source}: refusing persistent object of kind '{kind}' (only storages)")
        return self._open_storage(pid[1:])


def _storage_from_pid(source: str, data: tuple, storages: dict[str, Storage]) -> Storage:
    """Shared validation of ('storage', type, key, location, numel[, view]) ids; one Storage per key."""
    if len(data) not in (4, 5) or not isinstance(data[0], _Marker) or data[0].kind != "storage" \
            or not isinstance(data[3], int) or data[3] < 0:
        raise ModelLoadError(f"{source}: malformed storage id {data!r:.120}")
    if len(data) == 5 and data[4] is not None:
        raise ModelLoadError(f"{source}: storage views (pre-1.0 legacy checkpoints) are not supported")
    key = str(data[1])
    if key not in storages:
        storages[key] = Storage(key, data[0].name, data[3])
    return storages[key]


def _read_zip(path: str) -> Any:
    with zipfile.ZipFile(path) as zf:
        for info in zf.infolist():
            # torch.save stores every record uncompressed; inflating one would let a small file ask for any
            # amount of memory (a zip bomb), and reading a stored record takes at most the file's own size.
            if info.compress_type != zipfile.ZIP_STORED:
                raise ModelLoadError(f"{path}: record '{info.filename}' is compressed; torch.save checkpoints "
                                     "store every record uncompressed")
        names = zf.namelist()
        pkls = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            hint = " (a TorchScript archive?)" if any(n.endswith("constants.pkl") for n in names) else ""
            raise ModelLoadError(
                f"{path}: zip file is not a torch.save checkpoint: no unique '<archive>/data.pkl'{hint}")
        prefix = pkls[0][: -len("data.pkl")]
        order = zf.read(prefix + "byteorder").decode() if prefix + "byteorder" in names else "little"
        if order not in ("little", "big"):
            raise ModelLoadError(f"{path}: unknown byteorder record '{order}'")
        storages: dict[str, Storage] = {}

        def open_storage(data: tuple) -> Storage:
            st = _storage_from_pid(path, data, storages)
            if st.data is None:
                record = f"{prefix}data/{st.key}"
                if record not in names:
                    raise ModelLoadError(f"{path}: storage record '{record}' is missing (truncated checkpoint?)")
                raw = zf.read(record)
                dt = np.dtype(NUMPY_DTYPES[st.dtype])
                if len(raw) < st.numel * dt.itemsize:
                    raise ModelLoadError(
                        f"{path}: storage '{record}' has {len(raw)} bytes, needs {st.numel * dt.itemsize}")
                arr = np.frombuffer(raw, dtype=dt.newbyteorder(">") if order == "big" else dt, count=st.numel)
                st.data = arr.astype(dt) if order == "big" else arr
            return st

        return _RestrictedUnpickler(io.BytesIO(zf.read(pkls[0])), path, open_storage).load()


def _read_legacy(path: str, f: BinaryIO) -> Any:
    def load_plain() -> Any:
        return _RestrictedUnpickler(f, path, lambda pid: _refuse(path)).load()

    if load_plain() != LEGACY_MAGIC:
        raise ModelLoadError(f"{path}: not a torch.save checkpoint (bad legacy magic number)")
    version = load_plain()
    if version != LEGACY_PROTOCOL:
        raise ModelLoadError(f"{path}: unsupported legacy torch protocol version {version!r:.40}")
    load_plain()  # sys_info: storages are always written little-endian, so it is not needed
    storages: dict[str, Storage] = {}
    obj = _RestrictedUnpickler(f, path, lambda data: _storage_from_pid(path, data, storages)).load()
    keys = load_plain()
    if not isinstance(keys, list):
        raise ModelLoadError(f"{path}: malformed legacy checkpoint: storage key list missing")
    for key in keys:
        st = storages.get(str(key))
        if st is None:
            raise ModelLoadError(f"{path}: storage '{key}' is listed but no tensor uses it")
        head = f.read(8)
        dt = np.dtype(NUMPY_DTYPES[st.dtype])
        numel = struct.unpack("<q", head)[0] if len(head) == 8 else -1
        left = os.fstat(f.fileno()).st_size - f.tell()
        if numel * dt.itemsize > left:  # never ask the allocator for more than the file still holds
            raise ModelLoadError(f"{path}: storage '{key}' claims {numel} elements ({numel * dt.itemsize} bytes), "
                                 f"only {left} bytes are left (truncated or corrupt legacy checkpoint)")
        raw = f.read(numel * dt.itemsize) if numel >= 0 else b""
        if numel < 0 or len(raw) != numel * dt.itemsize:
            raise ModelLoadError(f"{path}: truncated legacy checkpoint while reading storage '{key}'")
        st.data = np.frombuffer(raw, dtype=dt)
    return obj


def _refuse(path: str) -> Storage:
    raise ModelLoadError(f"{path}: malformed legacy checkpoint: storage reference outside the object pickle")


def read_torch_file(path: str) -> Any:
    """Unpickle a torch.save file (zip or legacy) into plain containers with `TorchTensor` leaves."""
    try:
        if zipfile.is_zipfile(path):
            return _read_zip(path)
        with open(path, "rb") as f:
            if f.read(1) != b"\x80":
                raise ModelLoadError(
                    f"{path}: legacy tar-format torch checkpoints are not supported" if tarfile.is_tarfile(path)
                    else f"{path}: not a torch.save checkpoint (neither a zip archive nor a pickle)")
            f.seek(0)
            return _read_legacy(path, f)
    except ModelLoadError as exc:
        if str(exc).startswith(path):
            raise
        raise ModelLoadError(f"{path}: {exc}") from exc
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path}: no such file") from exc
    except Exception as exc:  # noqa: BLE001 - any failure inside a hostile/corrupt pickle is a load error
        raise ModelLoadError(f"{path}: malformed torch checkpoint: {type(exc).__name__}: {exc}") from exc
