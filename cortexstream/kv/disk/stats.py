"""Counters of a disk block store at one moment."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DiskStoreStats:
    """`blocks`, `segments`: this namespace's indexed blocks and segment files. `bytes_on_disk`: all segment files
    in the directory, every namespace's (what `max_bytes` caps). `hits`/`misses`: gets that returned a payload or
    None. `puts`/`put_bytes`: records written (payload bytes). `dropped_puts`: puts not written (writer queue full,
    larger than `max_bytes`, writing turned off). `corrupt_skipped`: records found damaged (at the scan or when
    read) and left out. `torn_tails`: segments whose last record was cut short. `foreign_files`: files named like
    our segments whose file header is not ours. `evicted_blocks`/`evicted_segments`: what LRU eviction deleted.
    `read_errors`: gets that failed with an OS error. `write_disabled_reason`: why writing is off, or None.
    `index_seconds`: how long the start-up scan took. `queued_puts`/`queued_bytes`: puts waiting for the
    background writer (0 for a synchronous store)."""

    blocks: int = 0
    bytes_on_disk: int = 0
    segments: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_bytes: int = 0
    dropped_puts: int = 0
    corrupt_skipped: int = 0
    torn_tails: int = 0
    foreign_files: int = 0
    evicted_blocks: int = 0
    evicted_segments: int = 0
    read_errors: int = 0
    write_disabled_reason: str | None = None
    index_seconds: float = 0.0
    queued_puts: int = 0
    queued_bytes: int = 0


__all__ = ["DiskStoreStats"]
