"""The one segment file a store appends to: whole records or nothing, fsync on demand."""

from __future__ import annotations

import os
from typing import Sequence

from cortexstream.kv.disk.segments import encode_file_header

Buffer = bytes | memoryview


def sync_directory(directory: str) -> None:
    """Make the creation and removal of files in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentWriter:
    """Appends records to a new segment file. A failed append is cut off again (best effort), so the file ends
    after its last whole record whenever the file system allows; a crash can still leave a torn tail, which the
    scan recognises."""

    def __init__(self, path: str, namespace: bytes) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o644)
        self._size = 0
        try:
            self.append([encode_file_header(namespace)])
        except OSError:
            os.close(self._fd)
            self._fd = -1
            try:
                os.unlink(path)
            except OSError:
                pass
            raise

    @property
    def size(self) -> int:
        return self._size

    def write_bytes(self, parts: Sequence[Buffer]) -> None:
        """Write `parts` at the end of the file, all of them (os.writev may write fewer bytes than asked)."""
        views = [memoryview(part).cast("B") for part in parts if len(part)]
        while views:
            written = os.writev(self._fd, views)
            while views and written >= views[0].nbytes:
                written -= views[0].nbytes
                views.pop(0)
            if views and written:
                views[0] = views[0][written:]

    def append(self, parts: Sequence[Buffer]) -> int:
        """Write one record (its parts in order) and return its offset. On OSError the file is cut back to where
        the record began, then the error is raised."""
        offset = self._size
        try:
            self.write_bytes(parts)
        except OSError:
            try:
                os.ftruncate(self._fd, offset)
            except OSError:
                pass
            raise
        self._size = offset + sum(memoryview(part).nbytes for part in parts)
        return offset

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        """fsync and close; idempotent. The file is closed even when the fsync fails (the error is raised)."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = ["SegmentWriter", "sync_directory"]
