"""The byte layout of one block record in a segment file, and its checks.

A record is a fixed header, then the block's token ids as int32 little-endian, then the payload:

    magic "CSKB" | version u16 | flags u16 | namespace 16 bytes | key u64 | token count u32 | payload length u64
    | data crc32 (over key, tokens, payload) u32 | header crc32 (over every header byte before it) u32

The header crc lets a scan trust the lengths before it jumps over the tokens and payload, so a flipped length
byte stops the scan instead of sending it somewhere arbitrary; the data crc is checked when a record is read.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple, Sequence

import numpy as np

from cortexstream.errors import InvalidArgumentError

RECORD_MAGIC = b"CSKB"
RECORD_VERSION = 1
NAMESPACE_BYTES = 16
_FIELDS = struct.Struct("<4sHH16sQIQI")
_CRC = struct.Struct("<I")
HEADER_SIZE = _FIELDS.size + _CRC.size
_KEY = struct.Struct("<Q")
_TOKEN_DTYPE = np.dtype("<i4")
_MAX_TOKEN = 2**31 - 1


class RecordHeader(NamedTuple):
    """A record header whose magic and header crc checked out (its version and namespace are not judged here)."""

    version: int
    namespace: bytes
    key: int
    token_count: int
    payload_length: int
    data_crc: int

    @property
    def record_length(self) -> int:
        return HEADER_SIZE + 4 * self.token_count + self.payload_length


def check_key(key: int) -> int:
    """`key` as an unsigned 64-bit block hash, or an error naming it."""
    if not isinstance(key, (int, np.integer)) or isinstance(key, bool) or not 0 <= int(key) < 2**64:
        raise InvalidArgumentError(f"key: {key!r} must be an unsigned 64-bit integer (a prefix-chain block hash)")
    return int(key)


def check_namespace(namespace: bytes) -> bytes:
    if not isinstance(namespace, bytes) or len(namespace) != NAMESPACE_BYTES:
        raise InvalidArgumentError(f"namespace: {namespace!r} must be {NAMESPACE_BYTES} bytes")
    return namespace


def token_bytes(tokens: Sequence[int]) -> bytes:
    """The token ids as stored (int32 little-endian), or an error naming `tokens`."""
    ids = np.asarray(tokens)
    if ids.size == 0:
        return b""
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise InvalidArgumentError(f"tokens: must be a flat sequence of integer token ids, got {ids.dtype} "
                                   f"with shape {ids.shape}")
    if int(ids.min()) < 0 or int(ids.max()) > _MAX_TOKEN:
        raise InvalidArgumentError(f"tokens: ids must lie in [0, {_MAX_TOKEN}], got {int(ids.min())}.."
                                   f"{int(ids.max())}")
    return ids.astype(_TOKEN_DTYPE, copy=False).tobytes()


def payload_view(payload: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    """A flat byte view of `payload` (a non-contiguous array is copied into a contiguous one first)."""
    if isinstance(payload, np.ndarray):
        return memoryview(np.ascontiguousarray(payload)).cast("B")
    if isinstance(payload, (bytes, bytearray, memoryview)):
        view = memoryview(payload)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    raise InvalidArgumentError(f"payload: {type(payload).__name__} must be bytes, a memoryview or a numpy array")


def data_crc(key: int, tokens: bytes, payload: memoryview | bytes) -> int:
    return zlib.crc32(payload, zlib.crc32(tokens, zlib.crc32(_KEY.pack(key))))


def encode_header(namespace: bytes, key: int, tokens: bytes, payload: memoryview) -> bytes:
    """The header of a record holding `tokens` (as from `token_bytes`) and `payload` (as from `payload_view`)."""
    fields = _FIELDS.pack(RECORD_MAGIC, RECORD_VERSION, 0, namespace, key, len(tokens) // 4, payload.nbytes,
                          data_crc(key, tokens, payload))
    return fields + _CRC.pack(zlib.crc32(fields))


def decode_header(buffer: bytes | memoryview) -> RecordHeader | None:
    """The header at the start of `buffer`, or None when it is short, has the wrong magic or fails its crc."""
    if len(buffer) < HEADER_SIZE:
        return None
    fields = bytes(buffer[:_FIELDS.size])
    magic, version, _flags, namespace, key, count, length, crc = _FIELDS.unpack(fields)
    if magic != RECORD_MAGIC or _CRC.unpack_from(buffer, _FIELDS.size)[0] != zlib.crc32(fields):
        return None
    return RecordHeader(version, namespace, key, count, length, crc)


def decode_payload(buffer: bytes, namespace: bytes, key: int, tokens: bytes) -> bytes | None:
    """The payload of the whole record in `buffer` when every check passes (magic, header crc, version, namespace,
    key, tokens, length, data crc); None otherwise."""
    header = decode_header(buffer)
    if (header is None or header.version != RECORD_VERSION or header.namespace != namespace or header.key != key
            or header.token_count * 4 != len(tokens) or header.record_length != len(buffer)):
        return None
    view = memoryview(buffer)
    stored_tokens = view[HEADER_SIZE:HEADER_SIZE + len(tokens)]
    payload = view[HEADER_SIZE + len(tokens):]
    if stored_tokens != tokens or data_crc(key, tokens, payload) != header.data_crc:
        return None
    return bytes(payload)


__all__ = ["HEADER_SIZE", "NAMESPACE_BYTES", "RecordHeader", "check_key", "check_namespace", "data_crc",
           "decode_header", "decode_payload", "encode_header", "payload_view", "token_bytes"]
