"""DiskBlockStore: KV blocks on disk, keyed by their prefix-chain hash, in segment files that hold many blocks.

Records are appended to the current segment; past `segment_size` it is fsynced and closed and a new one begins.
A block is never rewritten: the key names its content. Every read checks magic, namespace, key, tokens and a crc
before a byte is returned; a record that fails leaves the index and is counted.

Eviction is per segment: when the segment files in the directory (every namespace's) exceed `max_bytes`, whole
files are deleted, least recently used first (a segment's recency is the latest use of any block in it; files we
do not read count by their modification time). Deleting a file is the only way to give bytes back to the file
system without rewriting live blocks (compaction would cost a write per block kept), and blocks written together
belong to the same prompts, so they tend to go cold together. The segment being written is never deleted.

Recency survives a restart: `close()` sets each segment's modification time to its last use, which the start-up
scan reads back.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import Callable, NamedTuple, Sequence

import numpy as np

from cortexstream.kv.disk.catalog import SegmentCatalog
from cortexstream.kv.disk.config import DiskTierConfig
from cortexstream.kv.disk.errors import DiskTierClosedError
from cortexstream.kv.disk.lock import DirectoryLock, open_directory
from cortexstream.kv.disk.record import (HEADER_SIZE, check_key, check_namespace, decode_payload, encode_header,
                                         payload_view, token_bytes)
from cortexstream.kv.disk.segment_writer import SegmentWriter, sync_directory
from cortexstream.kv.disk.segments import FILE_HEADER_SIZE, parse_segment_name, scan_segment, segment_file_name
from cortexstream.kv.disk.stats import DiskStoreStats

_LOG = logging.getLogger(__name__)


class _Location(NamedTuple):
    segment: str
    offset: int
    length: int


def _reason(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno, "") if exc.errno is not None else ""
    text = exc.strerror or str(exc)
    return f"{name}: {text}" if name else text


class DiskBlockStore:
    """Synchronous and thread-safe (one lock). `namespace` (16 bytes) names the model, KV storage and block size;
    only records of this namespace are ever read. `on_problem` hears, once, that writing was turned off (default:
    this module's logger)."""

    def __init__(self, config: DiskTierConfig, namespace: bytes,
                 on_problem: Callable[[str], None] | None = None) -> None:
        if not isinstance(config, DiskTierConfig):
            raise TypeError(f"config: {type(config).__name__} must be a DiskTierConfig")
        self._namespace = check_namespace(namespace)
        self._config = config
        self._directory = os.path.abspath(config.directory)
        self._on_problem = on_problem if on_problem is not None else _LOG.warning
        self._lock = threading.Lock()
        self._closed = False
        self._index: dict[int, _Location] = {}
        self._keys_in: dict[str, set[int]] = {}  # own segment name -> its indexed keys
        self._catalog = SegmentCatalog()
        self._writer: SegmentWriter | None = None
        self._next_sequence = 0
        self._last_use = 0.0
        self._counts = dict.fromkeys(("hits", "misses", "puts", "put_bytes", "dropped_puts", "corrupt_skipped",
                                      "torn_tails", "foreign_files", "evicted_blocks", "evicted_segments",
                                      "read_errors"), 0)
        self._write_disabled_reason: str | None = None
        open_directory(self._directory)
        self._dir_lock = DirectoryLock(self._directory)
        try:
            started = time.perf_counter()
            self._index_directory()
            self._index_seconds = time.perf_counter() - started
            with self._lock:
                try:
                    self._make_room(0)
                except OSError as exc:
                    self._disable_writing(exc)
        except BaseException:
            self._dir_lock.release()
            raise

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def namespace(self) -> bytes:
        return self._namespace

    # ---- start-up scan ----

    def _index_directory(self) -> None:
        own_hex = self._namespace.hex()
        own: list[tuple[int, str]] = []
        with os.scandir(self._directory) as entries:
            for entry in entries:
                name = parse_segment_name(entry.name)
                if name is None:
                    continue
                if name.namespace_hex == own_hex:  # never reuse a name, whatever holds it
                    self._next_sequence = max(self._next_sequence, name.sequence + 1)
                if not entry.is_file(follow_symlinks=False):
                    continue
                stat = entry.stat(follow_symlinks=False)
                if name.namespace_hex == own_hex:
                    own.append((name.sequence, entry.name))
                self._catalog.add(entry.name, stat.st_size, stat.st_mtime, own=False)
        for _, file_name in sorted(own):
            self._index_segment(file_name)

    def _index_segment(self, file_name: str) -> None:
        try:
            scan = scan_segment(os.path.join(self._directory, file_name), self._namespace)
        except OSError:
            self._counts["read_errors"] += 1
            return  # stays in the catalog as a file we do not read
        if scan.foreign:
            self._counts["foreign_files"] += 1
            return
        self._counts["torn_tails"] += int(scan.torn_tail)
        self._counts["corrupt_skipped"] += scan.corrupt_records
        entry = self._catalog.remove(file_name)
        self._catalog.add(file_name, entry.size, entry.last_use, own=True)
        keys = self._keys_in.setdefault(file_name, set())
        for record in scan.records:
            previous = self._index.get(record.key)
            if previous is not None:  # a later segment's copy wins (the earlier one was dropped as damaged)
                self._keys_in[previous.segment].discard(record.key)
            self._index[record.key] = _Location(file_name, record.offset, record.length)
            keys.add(record.key)

    # ---- public calls ----

    def contains(self, key: int) -> bool:
        """Whether `key` is indexed. Takes no lock (a dict membership test is atomic), so it never waits behind
        disk I/O; the answer may be one concurrent put or eviction old."""
        self._check_open()
        return check_key(key) in self._index

    def touch(self, key: int) -> bool:
        """Mark `key` recently used without reading it; False when it is not on disk."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            return self._mark_used(key)

    def put(self, key: int, tokens: Sequence[int], payload: bytes | memoryview | np.ndarray) -> bool:
        """Write a block; False when it was not written (already on disk, larger than `max_bytes`, writing off)."""
        key = check_key(key)
        tokens_b = token_bytes(tokens)
        view = payload_view(payload)
        length = HEADER_SIZE + len(tokens_b) + view.nbytes
        with self._lock:
            self._check_open()
            if self._mark_used(key):
                return False
            if self._write_disabled_reason is not None or length + FILE_HEADER_SIZE > self._config.max_bytes:
                self._counts["dropped_puts"] += 1
                return False
            try:
                writer = self._prepare_writer(length)
                offset = writer.append([encode_header(self._namespace, key, tokens_b, view), tokens_b, view])
            except OSError as exc:
                self._disable_writing(exc)
                self._counts["dropped_puts"] += 1
                return False
            self._catalog.grow(writer.name, length)
            self._index[key] = _Location(writer.name, offset, length)
            self._keys_in[writer.name].add(key)
            self._mark_used(key)
            self._counts["puts"] += 1
            self._counts["put_bytes"] += view.nbytes
            return True

    def get(self, key: int, tokens: Sequence[int]) -> bytes | None:
        """The payload stored for `key` with these `tokens`, or None (not on disk, or the record failed a check)."""
        key = check_key(key)
        tokens_b = token_bytes(tokens)
        with self._lock:
            self._check_open()
            location = self._index.get(key)
            if location is None:
                self._counts["misses"] += 1
                return None
            try:
                payload = decode_payload(self._read(location), self._namespace, key, tokens_b)
            except OSError:
                self._counts["read_errors"] += 1
                payload = None
            else:
                if payload is None:
                    self._counts["corrupt_skipped"] += 1
            if payload is None:
                self._forget(key)
                self._counts["misses"] += 1
                return None
            self._counts["hits"] += 1
            self._mark_used(key)
            return payload

    def stats(self) -> DiskStoreStats:
        with self._lock:
            return DiskStoreStats(
                blocks=len(self._index), bytes_on_disk=self._catalog.total_bytes,
                segments=len(self._catalog.own_files()), write_disabled_reason=self._write_disabled_reason,
                index_seconds=self._index_seconds, **self._counts)

    def close(self) -> None:
        """fsync the segment being written, keep each segment's recency in its modification time, release the
        directory; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._writer is not None:
                    self._writer.close()
                    sync_directory(self._directory)
            except OSError as exc:
                self._disable_writing(exc)
            finally:
                self._writer = None
                self._keep_recency()
                self._dir_lock.release()

    def __enter__(self) -> DiskBlockStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- inside the lock ----

    def _check_open(self) -> None:
        if self._closed:
            raise DiskTierClosedError(f"KV disk tier {self._directory}: the store is closed")

    def _mark_used(self, key: int) -> bool:
        location = self._index.get(key)
        if location is not None:
            self._catalog.use(location.segment, self._now())
        return location is not None

    def _now(self) -> float:
        """Wall-clock seconds (comparable with file times), strictly increasing so two uses never tie."""
        self._last_use = max(time.time(), self._last_use + 1e-6)
        return self._last_use

    def _forget(self, key: int) -> None:
        location = self._index.pop(key)
        self._keys_in[location.segment].discard(key)

    def _read(self, location: _Location) -> bytes:
        fd = os.open(os.path.join(self._directory, location.segment), os.O_RDONLY)
        try:
            return os.pread(fd, location.length, location.offset)
        finally:
            os.close(fd)

    def _prepare_writer(self, length: int) -> SegmentWriter:
        """The writer a record of `length` bytes goes to, after rolling a full segment and evicting to make room."""
        writer = self._writer
        if writer is not None and writer.size > FILE_HEADER_SIZE and writer.size + length > self._config.segment_size:
            self._roll()
        self._make_room(length + (FILE_HEADER_SIZE if self._writer is None else 0))
        if self._writer is None:
            name = segment_file_name(self._namespace, self._next_sequence)
            self._writer = SegmentWriter(os.path.join(self._directory, name), self._namespace)
            self._next_sequence += 1
            self._catalog.add(name, self._writer.size, self._now(), own=True)
            self._keys_in[name] = set()
        return self._writer

    def _roll(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()
            sync_directory(self._directory)

    def _make_room(self, needed: int) -> None:
        """Delete least recently used segments until `needed` more bytes fit under max_bytes."""
        while self._catalog.total_bytes + needed > self._config.max_bytes:
            keep = self._writer.name if self._writer is not None else None
            victim = self._catalog.least_recent(keep)
            if victim is None:
                if self._writer is None or self._writer.size <= FILE_HEADER_SIZE:
                    return  # only an empty segment is left; the caller checked a record fits beside it
                self._roll()  # the segment being written is all there is: close it so it can go too
                needed += FILE_HEADER_SIZE
                continue
            try:
                os.unlink(os.path.join(self._directory, victim.name))
            except FileNotFoundError:
                pass
            self._catalog.remove(victim.name)
            keys = self._keys_in.pop(victim.name, set())
            for key in keys:
                del self._index[key]
            self._counts["evicted_blocks"] += len(keys)
            self._counts["evicted_segments"] += 1

    def _disable_writing(self, exc: OSError) -> None:
        if self._write_disabled_reason is not None:
            return
        self._write_disabled_reason = _reason(exc)
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except OSError:
                pass
        message = (f"KV disk tier {self._directory}: writing turned off ({self._write_disabled_reason}); blocks "
                   "already on disk are still read")
        try:
            self._on_problem(message)
        except Exception:  # a failing callback must not take the store down with it
            _LOG.exception("KV disk tier: on_problem raised while reporting: %s", message)

    def _keep_recency(self) -> None:
        for entry in self._catalog.own_files():
            try:
                path = os.path.join(self._directory, entry.name)
                if entry.last_use > os.stat(path).st_mtime:
                    os.utime(path, (entry.last_use, entry.last_use))
            except OSError:
                pass  # recency is a hint; a file we cannot touch keeps its own time


__all__ = ["DiskBlockStore"]
