"""The KV disk tier's block store: round trips, restarts, LRU eviction by bytes, namespaces, foreign files, the
start-up index, and the config. Faults (byte flips, truncation, SIGKILL, locks, full disks) are in
test_disk_store_faults.py; the background worker in test_disk_background.py."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.disk import DiskBlockStore, DiskTierClosedError, DiskTierConfig, parse_size
from cortexstream.kv.disk.record import encode_header, payload_view, token_bytes
from cortexstream.kv.disk.segments import segment_file_name

from disk_store_helpers import NS, OTHER_NS, dir_bytes, open_store, payload_for, segment_files, tokens_for


def test_round_trip_of_many_blocks_with_random_sizes_and_tokens(tmp_path):
    rng = random.Random(1)
    blocks = {}
    with open_store(tmp_path, segment_bytes=64 * 1024) as store:
        for _ in range(400):
            key = rng.getrandbits(64)
            tokens = [rng.randrange(2**31) for _ in range(rng.randrange(0, 40))]
            payload = rng.randbytes(rng.randrange(0, 5000))
            blocks[key] = (tokens, payload)
            assert store.put(key, tokens, payload) is True
        for key, (tokens, payload) in blocks.items():
            assert store.contains(key)
            assert store.get(key, tokens) == payload
        stats = store.stats()
        assert stats.blocks == 400 and stats.hits == 400 and stats.puts == 400
        assert stats.put_bytes == sum(len(p) for _, p in blocks.values())
        assert stats.segments == len(segment_files(tmp_path)) > 1  # many blocks per file, several files
        assert stats.bytes_on_disk == dir_bytes(tmp_path)


def test_payload_kinds_and_refused_rewrite(tmp_path):
    array = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    with open_store(tmp_path) as store:
        assert store.put(1, [5, 6], array)
        assert store.put(2, np.array([7], dtype=np.int64), memoryview(b"abc"))
        assert store.put(3, [], array[:, :, ::2])  # not contiguous: stored as its contiguous copy
        assert store.put(1, [5, 6], b"other") is False  # a key names its content; never rewritten
        assert store.get(1, [5, 6]) == array.tobytes()
        assert store.get(2, [7]) == b"abc"
        assert store.get(3, []) == np.ascontiguousarray(array[:, :, ::2]).tobytes()
        assert store.get(4, []) is None
        assert store.stats().misses == 1 and store.stats().puts == 3


def test_wrong_tokens_miss_and_bad_arguments_name_themselves(tmp_path):
    with open_store(tmp_path) as store:
        store.put(9, [1, 2, 3], b"x" * 10)
        assert store.get(9, [1, 2, 4]) is None  # same key, other tokens: a collision is never served
        assert not store.contains(9)
        with pytest.raises(InvalidArgumentError, match="key"):
            store.put(-1, [1], b"")
        with pytest.raises(InvalidArgumentError, match="key"):
            store.get(2**64, [1])
        with pytest.raises(InvalidArgumentError, match="tokens"):
            store.put(1, [1.5], b"")
        with pytest.raises(InvalidArgumentError, match="tokens"):
            store.put(1, [2**31], b"")
        with pytest.raises(InvalidArgumentError, match="payload"):
            store.put(1, [1], "text")
    with pytest.raises(InvalidArgumentError, match="namespace"):
        DiskBlockStore(DiskTierConfig(str(tmp_path), max_bytes=10**6), b"short")


def test_reopen_finds_the_blocks_after_a_restart(tmp_path):
    keys = list(range(1000, 1300))
    with open_store(tmp_path, segment_bytes=32 * 1024) as store:
        for key in keys:
            store.put(key, tokens_for(key), payload_for(key))
    with open_store(tmp_path, segment_bytes=32 * 1024) as store:
        stats = store.stats()
        assert stats.blocks == len(keys) and stats.torn_tails == 0 and stats.corrupt_skipped == 0
        assert all(store.get(key, tokens_for(key)) == payload_for(key) for key in keys)
        before = set(segment_files(tmp_path))
        store.put(5, tokens_for(5), payload_for(5))
        assert len(set(segment_files(tmp_path)) - before) == 1  # appends go to a new segment
    with open_store(tmp_path) as store:
        assert store.get(5, tokens_for(5)) == payload_for(5) and store.stats().blocks == len(keys) + 1


def test_close_is_idempotent_and_later_calls_are_refused(tmp_path):
    store = open_store(tmp_path)
    store.put(1, [1], b"a")
    store.close()
    store.close()
    with pytest.raises(DiskTierClosedError, match=str(tmp_path)):
        store.get(1, [1])
    with pytest.raises(DiskTierClosedError):
        store.put(2, [1], b"a")
    assert store.stats().blocks == 1


def _fill(store, keys, size=1000):
    for key in keys:
        assert store.put(key, [key % 1000], bytes([key % 256]) * size)


def test_lru_eviction_by_bytes_deletes_the_least_recently_used_segment(tmp_path):
    # Records of 1056 bytes, 4 KiB segments of 3 records (3200 bytes with the file header): room for 4 of them.
    config = {"max_bytes": 14_000, "segment_bytes": 4096}
    with open_store(tmp_path, **config) as store:
        _fill(store, range(12))  # segments 0..3 hold keys 0-2, 3-5, 6-8, 9-11
        assert len(segment_files(tmp_path)) == 4
        assert store.get(0, [0]) is not None  # segment 0 is now the most recently used closed one
        first_files = segment_files(tmp_path)
        _fill(store, range(12, 18))  # two more segments: over the cap, something must go
        stats = store.stats()
        assert stats.bytes_on_disk == dir_bytes(tmp_path) <= 14_000
        assert first_files[1] not in segment_files(tmp_path)  # keys 3-5: least recently used
        assert first_files[0] in segment_files(tmp_path)
        assert store.contains(0) and not store.contains(3)
        assert stats.evicted_segments >= 1 and stats.evicted_blocks == 3 * stats.evicted_segments
        for key in range(200, 260):  # a long run: the cap holds after every put
            _fill(store, [key])
            assert dir_bytes(tmp_path) <= 14_000
            assert store.stats().bytes_on_disk == dir_bytes(tmp_path)


def test_recency_survives_a_restart(tmp_path):
    config = {"max_bytes": 14_000, "segment_bytes": 4096}
    with open_store(tmp_path, **config) as store:
        _fill(store, range(12))
        store.get(0, [0])
    first_files = segment_files(tmp_path)
    with open_store(tmp_path, **config) as store:
        _fill(store, range(12, 18))
        assert first_files[0] in segment_files(tmp_path) and first_files[1] not in segment_files(tmp_path)


def test_other_namespaces_count_toward_the_cap_and_go_first_when_older(tmp_path):
    with open_store(tmp_path, OTHER_NS, segment_bytes=4096) as other:
        _fill(other, range(9))
    other_files = segment_files(tmp_path, OTHER_NS)
    with open_store(tmp_path, max_bytes=14_000, segment_bytes=4096) as store:
        assert store.stats().bytes_on_disk == dir_bytes(tmp_path) > 0 and store.stats().blocks == 0
        _fill(store, range(100, 106))
        assert dir_bytes(tmp_path) <= 14_000
        assert segment_files(tmp_path, OTHER_NS) == other_files[1:]  # the oldest file went, nothing of ours


def test_a_different_namespace_never_hits(tmp_path):
    with open_store(tmp_path) as store:
        for key in range(50):
            store.put(key, tokens_for(key), payload_for(key))
    with open_store(tmp_path, OTHER_NS) as other:
        assert other.stats().blocks == 0
        assert not any(other.contains(key) or other.get(key, tokens_for(key)) for key in range(50))
        for key in range(50):
            other.put(key, tokens_for(key), b"other model " + payload_for(key))
    with open_store(tmp_path) as store:
        assert all(store.get(key, tokens_for(key)) == payload_for(key) for key in range(50))


def test_foreign_files_with_our_name_are_skipped_and_never_appended_to(tmp_path):
    garbage = tmp_path / segment_file_name(NS, 5)
    garbage.write_bytes(os.urandom(3000))
    # A sound segment header of another namespace under our name is not ours either.
    with open_store(tmp_path / "elsewhere", OTHER_NS) as other:
        other.put(1, [1], b"theirs")
    theirs = segment_files(tmp_path / "elsewhere", OTHER_NS)[0]
    os.replace(tmp_path / "elsewhere" / theirs, tmp_path / segment_file_name(NS, 6))
    (tmp_path / "notes.txt").write_text("not a segment")
    with open_store(tmp_path) as store:
        stats = store.stats()
        assert stats.foreign_files == 2 and stats.blocks == 0
        assert stats.bytes_on_disk == 3000 + os.path.getsize(tmp_path / segment_file_name(NS, 6))
        assert store.get(1, [1]) is None
        store.put(2, [2], b"ours")
    assert garbage.read_bytes() != b"" and len(garbage.read_bytes()) == 3000
    assert segment_files(tmp_path)[-1] == segment_file_name(NS, 7)
    assert (tmp_path / "notes.txt").exists()


def test_a_record_of_another_namespace_inside_our_segment_is_skipped(tmp_path):
    with open_store(tmp_path) as store:
        store.put(1, [1], b"first")
    path = tmp_path / segment_files(tmp_path)[0]
    tokens, payload = token_bytes([2]), payload_view(b"planted")
    tail = encode_header(OTHER_NS, 2, tokens, payload) + tokens + bytes(payload)
    ours = encode_header(NS, 3, token_bytes([3]), payload_view(b"third")) + token_bytes([3]) + b"third"
    with open(path, "ab") as fh:
        fh.write(tail + ours)
    with open_store(tmp_path) as store:
        assert store.stats().corrupt_skipped == 1
        assert store.get(2, [2]) is None
        assert store.get(1, [1]) == b"first" and store.get(3, [3]) == b"third"  # the scan went on past it


def test_index_of_many_small_records(tmp_path):
    count = 20_000
    with open_store(tmp_path, segment_bytes=2**20) as store:
        for key in range(count):
            store.put(key, [key % 30_000], key.to_bytes(4, "little") * 4)
    with open_store(tmp_path) as store:
        stats = store.stats()
        assert stats.blocks == count and stats.segments > 1 and stats.index_seconds > 0
        for key in range(0, count, 997):
            assert store.get(key, [key % 30_000]) == key.to_bytes(4, "little") * 4


def test_parse_size():
    assert parse_size("20GiB") == 20 * 2**30
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("1.5GB") == 1_500_000_000
    assert parse_size("1.1GB") == 1_100_000_000
    assert parse_size("100000") == 100_000
    assert parse_size(" 4 kib ") == 4096
    assert parse_size("1.5KiB") == 1536
    assert parse_size("10B") == 10
    for text in ("20G", "abc", "-1", "", "1e9", "GiB", "1.2.3MB"):
        with pytest.raises(InvalidArgumentError, match="--kv-disk-size") as info:
            parse_size(text, "--kv-disk-size")
        assert repr(text) in str(info.value)
    with pytest.raises(InvalidArgumentError, match="string"):
        parse_size(5)


def test_config_validation_and_segment_size():
    assert DiskTierConfig("d", max_bytes=20 * 2**30).segment_size == 64 * 2**20
    assert DiskTierConfig("d", max_bytes=80 * 2**20).segment_size == 10 * 2**20
    assert DiskTierConfig("d", max_bytes=4 * 2**20).segment_size == 2**20
    assert DiskTierConfig("d", max_bytes=100_000).segment_size == 100_000
    assert DiskTierConfig("d", max_bytes=10**6, segment_bytes=5000).segment_size == 5000
    bad = [({"max_bytes": 0}, "max_bytes"), ({"max_bytes": -5}, "max_bytes"), ({"max_bytes": True}, "max_bytes"),
           ({"max_bytes": "1GiB"}, "max_bytes"), ({"max_bytes": 10, "segment_bytes": -1}, "segment_bytes"),
           ({"max_bytes": 10, "segment_bytes": 11}, "segment_bytes"),
           ({"max_bytes": 10, "writer_queue_bytes": 0}, "writer_queue_bytes")]
    for fields, name in bad:
        with pytest.raises(InvalidArgumentError, match=f"DiskTierConfig.{name}"):
            DiskTierConfig("d", **fields)
    with pytest.raises(InvalidArgumentError, match="DiskTierConfig.directory"):
        DiskTierConfig("", max_bytes=10)
