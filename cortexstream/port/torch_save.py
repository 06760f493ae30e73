"""Write `torch.save`-compatible checkpoints (zip format) without importing torch.

Why hand-written pickle opcodes: the standard Pickler resolves every global it writes by importing its module,
so writing `torch._utils._rebuild_tensor_v2` with it would import torch (or need fake modules in sys.modules).
A state dict only needs a handful of opcodes, all in the set torch's `weights_only` unpickler accepts.

Layout written (as torch 2.x `torch.save` does, see torch/serialization.py `_save` and
caffe2/serialize/inline_container.cc): a zip with every record STORED (uncompressed) under `<archive>/`:
`data.pkl` (the pickle), `.format_version` ("1"), `.storage_alignment` ("64"), `byteorder` ("little"),
`data/<i>` (one storage per tensor, raw little-endian bytes, each aligned to 64 bytes in the file through padding
in the local header's extra field, like torch's writer), `version` ("3") and `.data/serialization_id`.
The pickle (protocol 2) is `OrderedDict` of `_rebuild_tensor_v2(pid, 0, size, stride, False, OrderedDict())` where
pid = `('storage', torch.<X>Storage, '<i>', 'cpu', numel)` is emitted through BINPERSID.
"""

from __future__ import annotations

import hashlib
import struct
import zipfile
from typing import Mapping

import mlx.core as mx
import numpy as np

from cortexstream.atomic_files import atomic_write
from cortexstream.errors import InvalidArgumentError

ALIGNMENT = 64
# our dtype -> torch storage class (what torch.save pickles for a typed storage of that dtype)
STORAGE_CLASSES = {
    "float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage", "bfloat16": "BFloat16Storage",
    "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage",
    "uint8": "ByteStorage", "bool": "BoolStorage",
}


class _Pickle:
    """Just the protocol-2 opcodes a state dict needs."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2

    def global_(self, module: str, name: str) -> None:
        self.out += b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL

    def str_(self, text: str) -> None:
        data = text.encode("utf-8")
        self.out += b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE

    def int_(self, value: int) -> None:
        if -(2**31) <= value < 2**31:
            self.out += b"J" + struct.pack("<i", value)  # BININT
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            self.out += b"\x8a" + bytes([len(data)]) + data  # LONG1

    def bool_(self, value: bool) -> None:
        self.out += b"\x88" if value else b"\x89"  # NEWTRUE / NEWFALSE

    def ints(self, values: tuple[int, ...]) -> None:
        self.out += b"("  # MARK
        for v in values:
            self.int_(int(v))
        self.out += b"t"  # TUPLE

    def ordered_dict(self) -> None:
        self.global_("collections", "OrderedDict")
        self.out += b")R"  # EMPTY_TUPLE, REDUCE

    def raw(self, opcodes: bytes) -> None:
        self.out += opcodes


def _dtype_name(array: mx.array | np.ndarray) -> str:
    if isinstance(array, mx.array):
        return str(array.dtype).rsplit(".", 1)[-1]
    return np.dtype(array.dtype).name


def _bytes_of(array: mx.array | np.ndarray, dtype: str) -> bytes:
    if isinstance(array, mx.array):
        if dtype == "bfloat16":  # no numpy bfloat16: write the 16-bit payload as it is
            return np.array(array.view(mx.uint16)).astype("<u2").tobytes()
        array = np.array(array)
    return np.ascontiguousarray(array).astype(np.dtype(array.dtype).newbyteorder("<")).tobytes()


def _pickle_state(tensors: Mapping[str, mx.array | np.ndarray]) -> tuple[bytes, list[bytes]]:
    p, storages = _Pickle(), []
    p.ordered_dict()
    p.raw(b"(")  # MARK for SETITEMS
    for i, (key, value) in enumerate(tensors.items()):
        dtype = _dtype_name(value)
        if dtype not in STORAGE_CLASSES:
            raise InvalidArgumentError(f"save_torch: tensor '{key}' has dtype {dtype}, which has no torch storage")
        shape = tuple(int(s) for s in value.shape)
        stride = tuple(int(np.prod(shape[j + 1:], dtype=np.int64)) for j in range(len(shape)))
        numel = int(np.prod(shape, dtype=np.int64))
        storages.append(_bytes_of(value, dtype))
        p.str_(key)
        p.global_("torch._utils", "_rebuild_tensor_v2")
        p.raw(b"(")  # MARK: the rebuild call's arguments
        p.raw(b"(")  # MARK: the persistent id tuple
        p.str_("storage")
        p.global_("torch", STORAGE_CLASSES[dtype])
        p.str_(str(i))
        p.str_("cpu")
        p.int_(numel)
        p.raw(b"tQ")  # TUPLE, BINPERSID
        p.int_(0)
        p.ints(shape)
        p.ints(stride)
        p.bool_(False)
        p.ordered_dict()
        p.raw(b"tR")  # TUPLE, REDUCE
    p.raw(b"u.")  # SETITEMS, STOP
    return bytes(p.out), storages


def _write_aligned(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    """A STORED record whose data starts at a multiple of ALIGNMENT bytes (padding in the extra field)."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    start = zf.fp.tell() + 30 + len(name.encode())  # local header: 30 bytes + file name + extra
    pad = (-(start + 4)) % ALIGNMENT  # 4: the extra field's own header (id, size)
    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # id "FB", as torch's writer uses
    zf.writestr(info, data)


def save_torch(path: str, tensors: Mapping[str, mx.array | np.ndarray], *, archive: str = "archive") -> None:
    """Write a flat state dict `{name: array}` as a torch.save zip that `torch.load(path, weights_only=True)`
    reads as an OrderedDict of CPU tensors (and `cortexstream.port.load_torch` reads back identically)."""
    if not tensors:
        raise InvalidArgumentError("save_torch: no tensors to save")
    pickled, storages = _pickle_state(tensors)
    atomic_write(path, lambda tmp: _write_zip(tmp, archive, pickled, storages))


def _write_zip(path: str, archive: str, pickled: bytes, storages: list[bytes]) -> None:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        _write_aligned(zf, f"{archive}/data.pkl", pickled)
        _write_aligned(zf, f"{archive}/.format_version", b"1")
        _write_aligned(zf, f"{archive}/.storage_alignment", str(ALIGNMENT).encode())
        _write_aligned(zf, f"{archive}/byteorder", b"little")
        for i, data in enumerate(storages):
            _write_aligned(zf, f"{archive}/data/{i}", data)
        _write_aligned(zf, f"{archive}/version", b"3\n")
        serial = hashlib.sha1(pickled).hexdigest()[:20]
        _write_aligned(zf, f"{archive}/.data/serialization_id", serial.encode())
