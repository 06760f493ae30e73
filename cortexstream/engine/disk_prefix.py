"""The block manager's side of the disk tier: prefix blocks found on disk, their restore, and blocks to write.

Pure Python. The file I/O runs on the disk store's own thread (`kv.disk.BackgroundDiskStore`); this class only
decides and keeps count:

* Matching: after the prefix cache's RAM hits end, the chain continues on disk while the store holds the next key;
  those blocks are allocated at admission like fresh ones and their payloads are read in the background. The
  sequence takes no prefill work until its reads are done (other requests keep decoding meanwhile); then the
  scheduler hands the payloads to the runner in the next plan (`StepPlan.restores`), written before anything else,
  and the sequence's prompt continues after them. A payload that does not come back (evicted or corrupt since the
  match) ends the restore at that block: the rest is recomputed, never loaded wrong.
* Reads go in batches of at most `RESTORE_BATCH_BLOCKS` blocks, one batch in flight per sequence, so the payload
  bytes a restore holds at once stay bounded (a 4k-token float32 prefix of a small model is ~190 MB) whatever the
  length of the prefix; the sequence waits until its last batch is written.
* Writing: every block that enters the RAM prefix cache and is not on disk yet is queued here; the engine exports
  the queued blocks' KV from the arena and hands the bytes to the store (write-behind).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Iterable, Iterator


# Blocks one restore reads at a time (see the module docstring).
RESTORE_BATCH_BLOCKS = 32


@dataclass
class _Restore:
    seq: Any  # the Sequence being restored
    blocks: list[int]
    entries: list[tuple[int, tuple[int, ...]]]
    future: Future
    started: float
    done: int = 0  # blocks of this restore already delivered


@dataclass(frozen=True)
class Restored:
    """A finished restore: write `payloads` into `blocks` (same length; possibly fewer than planned)."""

    seq: Any
    blocks: tuple[int, ...]
    payloads: tuple[bytes, ...]


class DiskPrefix:
    """Restores and writes of prefix blocks through a disk store (see the module docstring)."""

    def __init__(self, store: Any) -> None:
        self.store = store  # contains(key), get_async([(key, tokens)]) -> Future, put_async(key, tokens, payload)
        self._restores: dict[int, _Restore] = {}  # sequence owner id -> its restore in progress
        self._to_write: list[tuple[int, int, tuple[int, ...]]] = []  # (block, key, tokens)
        self._queued: set[int] = set()
        self.hit_blocks = 0  # blocks matched on disk at admission
        self.restored_blocks = 0  # ... read back into the arena
        self.failed_blocks = 0  # ... matched but not read back (recomputed instead)
        self.restore_seconds = 0.0  # from admission to payloads ready, summed over restores
        self.queued_blocks = 0  # blocks handed to the store for writing

    # --- restore ----------------------------------------------------------------------------------------------
    def on_disk(self, chain: Iterator[tuple[int, tuple[int, ...]]]) -> list[tuple[int, tuple[int, ...]]]:
        """The leading (key, tokens) entries of `chain` the store holds (stops at the first it does not)."""
        found = []
        for key, tokens in chain:
            if not self.store.contains(key):
                break
            found.append((key, tokens))
        return found

    def start(self, seq: Any, blocks: list[int], entries: list[tuple[int, tuple[int, ...]]]) -> None:
        """Read `entries` from disk in the background, for `blocks` of `seq` (one block per entry)."""
        self.hit_blocks += len(entries)
        self._restores[seq.owner] = _Restore(seq, list(blocks), list(entries), self._read(entries, 0),
                                             time.perf_counter())

    def _read(self, entries: list[tuple[int, tuple[int, ...]]], start: int) -> Future:
        return self.store.get_async(list(entries[start:start + RESTORE_BATCH_BLOCKS]))

    def restoring(self, seq: Any) -> bool:
        return seq.owner in self._restores

    def cancel(self, seq: Any) -> None:
        """Forget a restore in progress (its sequence was released); the read finishes unseen."""
        self._restores.pop(seq.owner, None)

    @property
    def num_restoring(self) -> int:
        return len(self._restores)

    def finished(self) -> list[Restored]:
        """Batches whose reads are done, each cut at its first missing payload (which ends its restore); a restore
        with more batches reads the next one."""
        out = []
        for owner, restore in list(self._restores.items()):
            if not restore.future.done():
                continue
            try:
                payloads = list(restore.future.result())
            except Exception:  # noqa: BLE001 - a failed read means recompute, never a failed request
                payloads = []
            good = 0
            while good < len(payloads) and payloads[good] is not None:
                good += 1
            first = restore.done
            out.append(Restored(restore.seq, tuple(restore.blocks[first:first + good]), tuple(payloads[:good])))
            self.restored_blocks += good
            restore.done += good
            wanted = min(RESTORE_BATCH_BLOCKS, len(restore.blocks) - first)
            if good == wanted and restore.done < len(restore.blocks):
                restore.future = self._read(restore.entries, restore.done)
                continue
            del self._restores[owner]
            self.restore_seconds += time.perf_counter() - restore.started
            self.failed_blocks += len(restore.blocks) - restore.done
        return out

    # --- write-behind -----------------------------------------------------------------------------------------
    def queue_write(self, block: int, key: int, tokens: tuple[int, ...]) -> None:
        """A block that just entered the RAM prefix cache: write it unless the store has it or it is queued."""
        if key in self._queued or self.store.contains(key):
            return
        self._queued.add(key)
        self._to_write.append((block, key, tokens))

    def take_writes(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """The queued (block, key, tokens), oldest first; the caller exports and stores them now."""
        out, self._to_write = self._to_write, []
        return out

    def written(self, entries: Iterable[tuple[int, tuple[int, ...], bytes]]) -> None:
        """Hand exported payloads (key, tokens, bytes) to the store."""
        for key, tokens, payload in entries:
            self.store.put_async(key, tokens, payload)
            self._queued.discard(key)
            self.queued_blocks += 1

    def stats(self) -> dict[str, float | int]:
        return {"disk_hit_blocks": self.hit_blocks, "disk_restored_blocks": self.restored_blocks,
                "disk_failed_blocks": self.failed_blocks, "disk_restore_seconds": round(self.restore_seconds, 6),
                "disk_restoring": self.num_restoring, "disk_queued_blocks": self.queued_blocks}


__all__ = ["DiskPrefix", "Restored"]
