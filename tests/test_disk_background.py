"""BackgroundDiskStore: write-behind puts visible at once, FIFO reads, flush, queue overflow and close."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.disk import BackgroundDiskStore, DiskTierClosedError

from disk_store_helpers import open_store, payload_for, tokens_for


class _Gate:
    """Holds the worker inside the store's put until opened, so the queue can be observed while it is full."""

    def __init__(self, store, monkeypatch):
        self.open = threading.Event()
        self.entered = threading.Event()
        put = store.put

        def gated_put(key, tokens, payload):
            self.entered.set()
            assert self.open.wait(10)
            return put(key, tokens, payload)

        monkeypatch.setattr(store, "put", gated_put)


def test_queued_puts_are_found_at_once_and_written_by_flush(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    gate = _Gate(store, monkeypatch)
    with BackgroundDiskStore(store, queue_bytes=2**20) as background:
        for key in range(5):
            background.put_async(key, tokens_for(key), payload_for(key))
        assert gate.entered.wait(10)
        assert all(background.contains(key) for key in range(5))
        assert not store.contains(4)  # not on disk yet: found through the queue
        assert background.stats().queued_puts == 5
        assert background.flush(timeout=0.05) is False
        gate.open.set()
        assert background.flush(timeout=10) is True
        assert all(store.contains(key) for key in range(5))
        stats = background.stats()
        assert stats.queued_puts == 0 and stats.queued_bytes == 0 and stats.puts == 5


def test_get_async_returns_payloads_in_order(tmp_path):
    with BackgroundDiskStore(open_store(tmp_path), queue_bytes=2**20) as background:
        for key in range(20):
            background.put_async(key, tokens_for(key), payload_for(key))
        # No flush: the reads queue behind the puts, so every block is found.
        future = background.get_async([(key, tokens_for(key)) for key in (3, 99, 0, 19)])
        assert future.result(timeout=10) == [payload_for(3), None, payload_for(0), payload_for(19)]
        bad = background.get_async([(-1, [1])])
        with pytest.raises(InvalidArgumentError, match="key"):
            bad.result(timeout=10)
        assert background.get_async([(5, tokens_for(5))]).result(timeout=10) == [payload_for(5)]  # still alive


def test_queue_overflow_is_dropped_and_counted(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    gate = _Gate(store, monkeypatch)
    with BackgroundDiskStore(store, queue_bytes=10_000) as background:
        background.put_async(0, [0], b"a" * 4000)
        assert gate.entered.wait(10)  # the worker holds this one; it still counts against the queue
        background.put_async(1, [1], b"b" * 4000)
        background.put_async(2, [2], b"c" * 4000)  # 12000 > 10000: dropped
        background.put_async(3, [3], b"d" * 2000)  # fits exactly
        assert background.stats().dropped_puts == 1 and background.stats().queued_bytes == 10_000
        assert not background.contains(2)
        gate.open.set()
        assert background.flush(10)
        assert [store.contains(key) for key in range(4)] == [True, True, False, True]


def test_the_caller_may_reuse_its_buffer_and_close_writes_everything(tmp_path):
    buffer = np.zeros(256, dtype=np.uint8)
    background = BackgroundDiskStore(open_store(tmp_path), queue_bytes=2**20)
    for key in range(30):
        buffer[:] = key
        background.put_async(key, [key], buffer)
    with pytest.raises(InvalidArgumentError, match="tokens"):
        background.put_async(99, [-3], b"x")  # bad input is refused at the call, not on the worker
    background.close()
    background.close()
    assert background.flush() is True
    with pytest.raises(DiskTierClosedError):
        background.put_async(100, [1], b"x")
    with pytest.raises(DiskTierClosedError):
        background.get_async([(1, [1])])
    with open_store(tmp_path) as store:
        assert all(store.get(key, [key]) == bytes([key]) * 256 for key in range(30))


def test_a_repeated_put_is_written_once(tmp_path):
    with BackgroundDiskStore(open_store(tmp_path), queue_bytes=2**20) as background:
        for _ in range(3):
            background.put_async(7, [7], b"seven")
            background.flush(10)
        assert background.stats().puts == 1 and background.stats().dropped_puts == 0
