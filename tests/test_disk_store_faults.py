"""The disk tier under faults: flipped bytes, truncated records, a writer SIGKILLed mid-loop, two owners of one
directory, unusable directories and a full disk. Whatever happens, a get returns the exact bytes put or None."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortexstream.kv.disk import DiskTierLockedError, DiskTierUnavailableError
from cortexstream.kv.disk.segment_writer import SegmentWriter

from disk_store_helpers import NS, open_store, payload_for, segment_files, tokens_for

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(REPO, "tests")
KEYS = list(range(40, 64))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """(file name, bytes) of one segment holding KEYS."""
    directory = tmp_path_factory.mktemp("pristine")
    with open_store(directory) as store:
        for key in KEYS:
            store.put(key, tokens_for(key), payload_for(key, 300))
    (name,) = segment_files(directory)
    return name, (directory / name).read_bytes()


def _reopen_with(name: str, content: bytes):
    """Open a store on a fresh directory holding only `content` as segment `name`; returns (dir, store)."""
    directory = tempfile.mkdtemp()
    with open(os.path.join(directory, name), "wb") as fh:
        fh.write(content)
    return directory, open_store(directory)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_flipped_bytes_never_give_wrong_payloads(pristine, data):
    name, content = pristine
    damaged = bytearray(content)
    for _ in range(data.draw(st.integers(1, 6), label="flips")):
        position = data.draw(st.integers(0, len(content) - 1), label="position")
        damaged[position] ^= data.draw(st.integers(1, 255), label="xor")
    directory, store = _reopen_with(name, bytes(damaged))
    try:
        with store:
            opened = store.stats()
            for key in KEYS:
                got = store.get(key, tokens_for(key))
                assert got is None or got == payload_for(key, 300)
            stats = store.stats()
            # An indexed record either came back whole or was counted as corrupt and left the index.
            caught = stats.corrupt_skipped - opened.corrupt_skipped
            assert stats.hits == stats.blocks == opened.blocks - caught
    finally:
        shutil.rmtree(directory)


def test_a_flipped_payload_byte_is_caught_by_the_checksum(pristine):
    name, content = pristine
    damaged = bytearray(content)
    damaged[-1] ^= 0x40  # the last payload byte of the last record
    directory, store = _reopen_with(name, bytes(damaged))
    try:
        with store:
            assert store.stats().blocks == len(KEYS)  # the scan reads headers only
            assert store.get(KEYS[-1], tokens_for(KEYS[-1])) is None
            assert store.stats().corrupt_skipped == 1 and not store.contains(KEYS[-1])
            assert store.get(KEYS[0], tokens_for(KEYS[0])) == payload_for(KEYS[0], 300)
    finally:
        shutil.rmtree(directory)


def test_truncation_at_every_offset_of_the_last_record(pristine):
    name, content = pristine
    last = KEYS[-1]
    record_length = 52 + 4 * len(tokens_for(last)) + len(payload_for(last, 300))
    start = len(content) - record_length
    for cut in range(start, len(content)):
        directory, store = _reopen_with(name, content[:cut])
        try:
            with store:
                stats = store.stats()
                assert stats.torn_tails == (0 if cut == start else 1), cut
                assert stats.blocks == len(KEYS) - 1
                assert store.get(last, tokens_for(last)) is None
                assert all(store.get(key, tokens_for(key)) == payload_for(key, 300) for key in KEYS[:-1])
                store.put(last, tokens_for(last), payload_for(last, 300))  # to a new segment, not after the tear
            assert os.path.getsize(os.path.join(directory, name)) == cut
            with open_store(directory) as again:
                assert again.get(last, tokens_for(last)) == payload_for(last, 300)
        finally:
            shutil.rmtree(directory)


def test_a_zero_filled_tail_counts_as_torn(pristine):
    name, content = pristine
    directory, store = _reopen_with(name, content + bytes(4096))
    try:
        with store:
            assert store.stats().torn_tails == 1 and store.stats().blocks == len(KEYS)
    finally:
        shutil.rmtree(directory)


_WRITER = """
import sys
sys.path.insert(0, {tests!r})
from disk_store_helpers import open_store, payload_for, tokens_for
store = open_store({directory!r}, segment_bytes=64 * 1024)
key = 0
while True:
    store.put(key, tokens_for(key), payload_for(key, 20_000))
    print(key, flush=True)
    key += 1
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_sigkill_while_writing_leaves_only_exact_payloads(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", _WRITER.format(tests=TESTS, directory=str(tmp_path))],
                             stdout=subprocess.PIPE, text=True, env=_child_env())
    written = []
    try:
        for line in child.stdout:
            written.append(int(line))
            if len(written) >= 150:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert len(written) >= 150, "the writer died before it wrote enough"
    with open_store(tmp_path) as store:  # the kernel released the dead writer's lock
        stats = store.stats()
        assert stats.segments > 1
        # Whatever the kill interrupted, every block whose put returned is there and exact (its bytes reached
        # the page cache), and nothing else loads wrong.
        for key in range(max(written) + 50):
            got = store.get(key, tokens_for(key))
            assert got is None or got == payload_for(key, 20_000)
            if key in written:
                assert got == payload_for(key, 20_000), key


_HOLDER = """
import sys
sys.path.insert(0, {tests!r})
from disk_store_helpers import open_store
store = open_store({directory!r})
print("locked", flush=True)
sys.stdin.readline()
store.close()
print("released", flush=True)
"""


def test_two_stores_on_one_directory(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER.format(tests=TESTS, directory=str(tmp_path))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_child_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DiskTierLockedError) as info:
            open_store(tmp_path)
        message = str(info.value)
        assert f"another process owns the KV disk tier at {tmp_path}" in message
        assert f"(pid {holder.pid})" in message
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
    finally:
        holder.kill()
        holder.wait()
        holder.stdin.close()
        holder.stdout.close()
    with open_store(tmp_path) as store:  # free again; a second store in this process is refused too
        with pytest.raises(DiskTierLockedError, match=str(os.getpid())):
            open_store(tmp_path)
    open_store(tmp_path).close()


def test_a_directory_path_that_is_a_file_is_unavailable(tmp_path):
    path = tmp_path / "plain"
    path.write_text("x")
    with pytest.raises(DiskTierUnavailableError, match=f"{path}.*not a directory"):
        open_store(path)
    with pytest.raises(DiskTierUnavailableError, match=str(path / "sub")):
        open_store(path / "sub")


def test_an_unwritable_directory_is_unavailable(tmp_path):
    locked = tmp_path / "readonly"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running with privileges that ignore directory permissions")
        with pytest.raises(DiskTierUnavailableError, match=str(locked)):
            open_store(locked)
        with pytest.raises(DiskTierUnavailableError, match=str(locked / "sub")):
            open_store(locked / "sub")
    finally:
        locked.chmod(0o700)


def test_a_full_disk_turns_writing_off_once_and_reads_keep_working(tmp_path, monkeypatch):
    problems = []
    from cortexstream.kv.disk import DiskBlockStore, DiskTierConfig

    store = DiskBlockStore(DiskTierConfig(str(tmp_path), max_bytes=2**20), NS, on_problem=problems.append)
    for key in range(10):
        assert store.put(key, tokens_for(key), payload_for(key))
    original = SegmentWriter.write_bytes

    def half_then_full(writer, parts):  # part of the record lands, then the disk is full
        original(writer, [bytes(parts[0])[:20]])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SegmentWriter, "write_bytes", half_then_full)
    assert store.put(100, tokens_for(100), payload_for(100)) is False
    assert store.put(101, tokens_for(101), payload_for(101)) is False
    stats = store.stats()
    assert "ENOSPC" in stats.write_disabled_reason and "No space left" in stats.write_disabled_reason
    assert stats.dropped_puts == 2 and stats.puts == 10
    assert len(problems) == 1 and str(tmp_path) in problems[0] and "ENOSPC" in problems[0]
    assert all(store.get(key, tokens_for(key)) == payload_for(key) for key in range(10))
    assert not store.contains(100)
    monkeypatch.undo()
    assert store.put(102, [1], b"x") is False  # off for good, even once the disk has room again
    store.close()
    assert len(problems) == 1
    with open_store(tmp_path) as again:  # the half-written record was cut off again: no torn tail
        assert again.stats().torn_tails == 0 and again.stats().blocks == 10


def test_a_full_disk_at_segment_creation(tmp_path, monkeypatch):
    def full(writer, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SegmentWriter, "write_bytes", full)
    with open_store(tmp_path) as store:
        assert store.put(1, [1], b"a") is False
        assert store.stats().write_disabled_reason.startswith("ENOSPC")
        assert store.get(1, [1]) is None
    assert segment_files(tmp_path) == []  # the segment whose header could not be written was removed
