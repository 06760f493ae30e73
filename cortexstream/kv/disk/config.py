"""Settings of the KV disk tier, and `parse_size` for sizes written by people ("20GiB", "512MiB", "1.5GB")."""

from __future__ import annotations

import re
from dataclasses import dataclass

from cortexstream.errors import InvalidArgumentError

MIB = 2**20
_DEFAULT_SEGMENT_MAX = 64 * MIB
_DEFAULT_SEGMENT_MIN = MIB

# Unit (lower case) -> bytes. Decimal units are powers of 1000, binary ones (KiB...) powers of 1024. A bare "G" is
# refused rather than guessed, because tools disagree on whether it means GB or GiB.
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, what: str = "size") -> int:
    """Bytes in `text`: a number of bytes ("100000") or a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB,
    TiB; any case). A fraction of a byte is rounded down. `what` names the argument in the error message."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{what}: {text!r} must be a string such as '20GiB', '512MiB' or '100000'")
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidArgumentError(
            f"{what}: {text!r} is not a size; write a number of bytes or a number with a unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '20GiB' or '1.5GB'")
    number = match.group(1)
    if "." in number:
        whole, _, fraction = number.partition(".")
        # Exact decimal arithmetic: float would turn "1.1GB" into 1100000000.0000002 or 1099999999.9999998.
        scale = 10 ** len(fraction)
        return (int(whole or "0") * scale + int(fraction or "0")) * _UNITS[unit] // scale
    return int(number) * _UNITS[unit]


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise InvalidArgumentError(f"DiskTierConfig.{name}: {value!r} must be {bound} (bytes)")


@dataclass(frozen=True)
class DiskTierConfig:
    """Where the disk tier keeps its blocks and how much room it may take.

    `max_bytes` caps the bytes of all segment files in `directory` (every model's that shares it); past it the
    least recently used segments are deleted. `segment_bytes` is the size at which a segment file is closed and a
    new one started (0: an eighth of `max_bytes`, between 1 MiB and 64 MiB, and never above `max_bytes`).
    `writer_queue_bytes` caps the payload bytes waiting for the background writer; a put past it is dropped (and
    counted). 64 MiB holds several 512-token prefill chunks of a small float32 model's blocks while the writer, at
    disk speed, drains far faster than a CPU prefills; it is memory a server's budget must reserve."""

    directory: str
    max_bytes: int
    segment_bytes: int = 0
    writer_queue_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory.strip():
            raise InvalidArgumentError(f"DiskTierConfig.directory: {self.directory!r} must be a non-empty path")
        _check_int("max_bytes", self.max_bytes, 1)
        _check_int("segment_bytes", self.segment_bytes, 0)
        _check_int("writer_queue_bytes", self.writer_queue_bytes, 1)
        if self.segment_bytes > self.max_bytes:
            raise InvalidArgumentError(
                f"DiskTierConfig.segment_bytes: {self.segment_bytes} must not exceed max_bytes {self.max_bytes}, "
                "because whole segments are what eviction deletes")

    @property
    def segment_size(self) -> int:
        """The size past which the segment being written is closed and a new one started."""
        if self.segment_bytes:
            return self.segment_bytes
        return min(_DEFAULT_SEGMENT_MAX, max(_DEFAULT_SEGMENT_MIN, self.max_bytes // 8), self.max_bytes)


__all__ = ["DiskTierConfig", "parse_size"]
