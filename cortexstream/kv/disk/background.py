"""BackgroundDiskStore: a DiskBlockStore whose file I/O all happens on one worker thread, in the order asked.

Puts are write-behind: `put_async` queues the block and returns at once, and the block counts as present
(`contains`) from that moment, so a prefix lookup finds it whether or not it has reached the disk yet. The queue
is capped in payload bytes; a put past the cap is dropped and counted rather than making the caller wait.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Sequence

import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.disk.errors import DiskTierClosedError
from cortexstream.kv.disk.record import check_key, payload_view, token_bytes
from cortexstream.kv.disk.stats import DiskStoreStats
from cortexstream.kv.disk.store import DiskBlockStore

_LOG = logging.getLogger(__name__)


class _Task(enum.Enum):
    PUT = "put"
    TOUCH = "touch"
    GET = "get"
    FLUSH = "flush"
    CLOSE = "close"


class BackgroundDiskStore:
    """Runs `store`'s reads and writes on a worker thread; owns `store` from now on (closing this closes it)."""

    def __init__(self, store: DiskBlockStore, queue_bytes: int) -> None:
        if not isinstance(store, DiskBlockStore):
            raise TypeError(f"store: {type(store).__name__} must be a DiskBlockStore")
        if not isinstance(queue_bytes, int) or isinstance(queue_bytes, bool) or queue_bytes <= 0:
            raise InvalidArgumentError(f"queue_bytes: {queue_bytes!r} must be a positive integer (bytes)")
        self._store = store
        self._queue_cap = queue_bytes
        self._tasks: queue.SimpleQueue[tuple[_Task, Any]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}  # key -> payload bytes of its queued put
        self._queued_bytes = 0
        self._dropped = 0
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="kv-disk-io", daemon=True)
        self._worker.start()

    def contains(self, key: int) -> bool:
        """Whether `key` is on disk or queued to be written. Never waits for disk I/O."""
        key = check_key(key)
        with self._lock:
            self._check_open()
            if key in self._pending:
                return True
        # The worker writes a block before it leaves `_pending`, so a key is always in one place or the other.
        return self._store.contains(key)

    def put_async(self, key: int, tokens: Sequence[int], payload: bytes | memoryview | np.ndarray) -> None:
        """Queue a block to be written. Bad arguments raise here, at the call. A payload that is not `bytes` is
        copied now, so the caller may reuse its buffer at once. Dropped (and counted) when the queue is full."""
        key = check_key(key)
        ids = np.frombuffer(token_bytes(tokens), dtype="<i4")
        with self._lock:
            self._check_open()
        if self._store.contains(key):
            with self._lock:
                self._check_open()
                self._tasks.put((_Task.TOUCH, key))
            return
        data = payload if isinstance(payload, bytes) else payload_view(payload).tobytes()
        with self._lock:
            self._check_open()
            if key in self._pending:
                return
            if self._queued_bytes + len(data) > self._queue_cap:
                self._dropped += 1
                return
            self._pending[key] = len(data)
            self._queued_bytes += len(data)
            self._tasks.put((_Task.PUT, (key, ids, data)))

    def get_async(self, requests: list[tuple[int, Sequence[int]]]) -> Future[list[bytes | None]]:
        """Read blocks (key, tokens) in order on the worker; the future's list holds each payload or None. Reads
        queue behind the puts asked for before them, so a block put and then read is found."""
        future: Future[list[bytes | None]] = Future()
        with self._lock:
            self._check_open()
            self._tasks.put((_Task.GET, (list(requests), future)))
        return future

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every put queued before this call has been written (or refused by the store); False when
        `timeout` seconds passed first."""
        done: Future[None] = Future()
        with self._lock:
            if self._closed:
                return True  # close() wrote everything
            self._tasks.put((_Task.FLUSH, done))
        try:
            done.result(timeout)
        except FutureTimeoutError:
            return False
        return True

    def stats(self) -> DiskStoreStats:
        stats = self._store.stats()
        with self._lock:
            return dataclasses.replace(stats, dropped_puts=stats.dropped_puts + self._dropped,
                                       queued_puts=len(self._pending), queued_bytes=self._queued_bytes)

    def close(self) -> None:
        """Write everything queued, close the store on the worker, and stop it; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tasks.put((_Task.CLOSE, None))
        self._worker.join()

    def __enter__(self) -> BackgroundDiskStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise DiskTierClosedError(f"KV disk tier {self._store.directory}: the background store is closed")

    def _run(self) -> None:
        while True:
            task, argument = self._tasks.get()
            try:
                if task is _Task.PUT:
                    self._write(*argument)
                elif task is _Task.TOUCH:
                    self._store.touch(argument)
                elif task is _Task.GET:
                    self._read(*argument)
                elif task is _Task.FLUSH:
                    argument.set_result(None)
                else:
                    self._store.close()
                    return
            except Exception:  # the worker must outlive any one failed task
                _LOG.exception("KV disk tier %s: background %s failed", self._store.directory, task.value)

    def _write(self, key: int, ids: np.ndarray, data: bytes) -> None:
        try:
            self._store.put(key, ids, data)
        finally:
            with self._lock:
                self._queued_bytes -= self._pending.pop(key)

    def _read(self, requests: list[tuple[int, Sequence[int]]], future: Future[list[bytes | None]]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result([self._store.get(key, tokens) for key, tokens in requests])
        except Exception as exc:
            future.set_exception(exc)


__all__ = ["BackgroundDiskStore"]
