"""Segment files: how they are named, their file header, and the start-up scan that indexes their records.

A segment is `<namespace hex>-<sequence:08d>.cskv`: a 32-byte file header (magic, version, namespace, crc) and then
records back to back (see `record.py`). The name lets a store find its own segments without opening anyone
else's; the header makes sure a file that only looks like ours is never read as ours.

The scan reads each record's header and seeks over its tokens and payload, so its time grows with the number of
records, not their bytes. It stops at the first header it cannot trust; what lies behind is unreachable.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import NamedTuple

from cortexstream.kv.disk.record import HEADER_SIZE, RECORD_VERSION, decode_header

SEGMENT_SUFFIX = ".cskv"
SEGMENT_MAGIC = b"CSKVSEG\x00"
SEGMENT_VERSION = 1
_FILE_FIELDS = struct.Struct("<8sHH16s")
FILE_HEADER_SIZE = _FILE_FIELDS.size + 4
_NAME = re.compile(r"^([0-9a-f]{32})-(\d{8,})\.cskv$")


class SegmentName(NamedTuple):
    namespace_hex: str
    sequence: int


def segment_file_name(namespace: bytes, sequence: int) -> str:
    return f"{namespace.hex()}-{sequence:08d}{SEGMENT_SUFFIX}"


def parse_segment_name(name: str) -> SegmentName | None:
    """The namespace and sequence number of a file named like a segment (any namespace's), or None."""
    match = _NAME.match(name)
    return SegmentName(match.group(1), int(match.group(2))) if match else None


def encode_file_header(namespace: bytes) -> bytes:
    fields = _FILE_FIELDS.pack(SEGMENT_MAGIC, SEGMENT_VERSION, 0, namespace)
    return fields + struct.pack("<I", zlib.crc32(fields))


def file_header_matches(head: bytes, namespace: bytes) -> bool:
    """True when `head` is a sound segment file header of `namespace`."""
    if len(head) < FILE_HEADER_SIZE:
        return False
    fields = head[:_FILE_FIELDS.size]
    magic, version, _flags, stored_namespace = _FILE_FIELDS.unpack(fields)
    (crc,) = struct.unpack_from("<I", head, _FILE_FIELDS.size)
    return (crc == zlib.crc32(fields) and magic == SEGMENT_MAGIC and version == SEGMENT_VERSION
            and stored_namespace == namespace)


class ScannedRecord(NamedTuple):
    key: int
    offset: int
    length: int


@dataclass
class SegmentScan:
    """What the scan of one segment found. `foreign`: the file header is not ours (nothing was indexed);
    `torn_tail`: the last record is cut short (a crash mid-append); `corrupt_records`: records skipped because
    their header is damaged or belongs to another namespace or format version."""

    foreign: bool = False
    records: list[ScannedRecord] = field(default_factory=list)
    torn_tail: bool = False
    corrupt_records: int = 0


def scan_segment(path: str, namespace: bytes) -> SegmentScan:
    """Index the records of the segment at `path` by reading their headers. Raises OSError when the file cannot
    be read."""
    scan = SegmentScan()
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if not file_header_matches(os.pread(fd, FILE_HEADER_SIZE, 0), namespace):
            scan.foreign = True
            return scan
        offset = FILE_HEADER_SIZE
        while offset < size:
            remaining = size - offset
            if remaining < HEADER_SIZE:
                scan.torn_tail = True
                break
            raw = os.pread(fd, HEADER_SIZE, offset)
            header = decode_header(raw)
            if header is None:
                # Zeros are what a file system leaves when a crash extended the file before its data landed.
                if raw.count(0) == len(raw):
                    scan.torn_tail = True
                else:
                    scan.corrupt_records += 1
                break
            if header.record_length > remaining:
                scan.torn_tail = True
                break
            if header.version != RECORD_VERSION or header.namespace != namespace:
                scan.corrupt_records += 1
            else:
                scan.records.append(ScannedRecord(header.key, offset, header.record_length))
            offset += header.record_length
    finally:
        os.close(fd)
    return scan


__all__ = ["FILE_HEADER_SIZE", "ScannedRecord", "SegmentName", "SegmentScan", "encode_file_header",
           "file_header_matches", "parse_segment_name", "scan_segment", "segment_file_name"]
