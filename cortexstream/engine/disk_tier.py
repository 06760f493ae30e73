"""The engine's disk tier: a KV block store on disk under the prefix cache (`Engine(kv_disk=DIR)`).

It joins three parts: the store (kv/disk: segment files, checksums, LRU by bytes, a lock, one I/O thread), the
block manager's `DiskPrefix` (which prefix blocks are on disk, their restore, the blocks to write) and the export
of arena blocks to bytes (kv/block_io). Blocks are keyed by the prefix chain rooted in `namespace`, which names
the model (a digest of its configuration and weights, models/identity.py), how the arena stores KV and its block
size; the tenant roots each chain as in RAM. So another model, KV dtype or block size never reads these blocks.

Write-behind: a block entering the RAM prefix cache is exported lazily after the step that registered it and
handed to the store's thread after the next step (when the pass that wrote it has finished anyway), so the engine
never waits for a forward pass or the disk to write a block. `flush()` (and `close()`) write everything queued.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Callable

from cortexstream.engine.disk_prefix import DiskPrefix
from cortexstream.kv.arena import KVArena
from cortexstream.kv.block_io import BlockExport
from cortexstream.kv.disk import (BackgroundDiskStore, DiskBlockStore, DiskTierConfig, DiskTierUnavailableError,
                                   parse_size)
from cortexstream.models.identity import model_identity

log = logging.getLogger(__name__)


def tier_namespace(model: Any, arena: KVArena) -> str:
    """What a stored block must match to be read back: model identity, KV storage, block size and shapes."""
    c = arena.config
    return (f"model={model_identity(model)}|kv={c.cache_key}|dtype={c.dtype}|block={c.block_size}|"
            f"layers={c.num_layers}|kv_heads={c.num_kv_heads}|head_dim={c.head_dim}|v_head_dim={c.value_head_dim}")


class EngineDiskTier:
    """See the module docstring. Built by `open`; the engine calls `after_step()` once per step."""

    def __init__(self, arena: KVArena, store: Any, namespace: str) -> None:
        self.arena = arena
        self.store = store  # a BackgroundDiskStore (or anything with its methods)
        self.namespace = namespace
        self.prefix = DiskPrefix(store)
        self._export: tuple[list[tuple[int, int, tuple[int, ...]]], BlockExport] | None = None
        self._closed = False

    @classmethod
    def open(cls, model: Any, arena: KVArena, directory: str, max_bytes: int | str,
             on_problem: Callable[[str], None] | None = None) -> "EngineDiskTier":
        """Open (or create) the tier in `directory`, holding at most `max_bytes` (an int or "20GiB"). Raises
        the store's errors (another process owns the directory, it cannot be created) with their messages."""
        size = parse_size(max_bytes) if isinstance(max_bytes, str) else max_bytes
        config = DiskTierConfig(directory=directory, max_bytes=size)
        namespace = tier_namespace(model, arena)
        digest = hashlib.blake2b(namespace.encode(), digest_size=16).digest()
        store = DiskBlockStore(config, digest, on_problem=on_problem or log.warning)
        return cls(arena, BackgroundDiskStore(store, config.writer_queue_bytes), namespace)

    def after_step(self) -> None:
        """Hand the blocks exported after the previous step to the store; start exporting the newly cached ones."""
        self._hand_over()
        writes = self.prefix.take_writes()
        if writes:
            self._export = (writes, BlockExport(self.arena, [block for block, _, _ in writes]))

    def _hand_over(self) -> None:
        if self._export is None:
            return
        entries, export = self._export
        self._export = None
        self.prefix.written((key, tokens, payload)
                            for (_, key, tokens), payload in zip(entries, export.payloads()))

    def flush(self, timeout: float | None = None) -> bool:
        """Write every cached block not on disk yet, and wait for the store to have written it."""
        self._hand_over()
        self.after_step()
        self._hand_over()
        return self.store.flush(timeout)

    def stats(self) -> dict[str, Any]:
        """The block manager's restore/write counters and the store's (`DiskStoreStats`), all prefixed `disk_`;
        `disk_restored_tokens` counts prompt tokens read back instead of recomputed."""
        stats: dict[str, Any] = dict(self.prefix.stats())
        stats["disk_restored_tokens"] = self.prefix.restored_blocks * self.arena.config.block_size
        stats.update({f"disk_{name}": value for name, value in dataclasses.asdict(self.store.stats()).items()})
        return stats

    def close(self) -> None:
        """Flush and release the directory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self.store.close()


def working_bytes(bytes_per_block: int, block_size: int, prefill_step_size: int) -> int:
    """Block bytes the tier holds in memory outside its writer queue, at most: one restore batch read back (its
    payloads, their joined copy and the MLX copy written into the arena) and one step's export (the gathered rows
    and their per-block bytes), a step computing at most `prefill_step_size` tokens of blocks."""
    from cortexstream.engine.disk_prefix import RESTORE_BATCH_BLOCKS

    export_blocks = -(-prefill_step_size // block_size) + 1
    return bytes_per_block * (3 * RESTORE_BATCH_BLOCKS + 2 * export_blocks)


def open_disk_tier(model: Any, arena: KVArena, directory: str | None, max_bytes: int | str,
                   required: bool = True) -> tuple[EngineDiskTier | None, str | None]:
    """(tier, None), or (None, None) without a directory. A directory that cannot be used (or that another
    process owns) raises, or with `required` False gives (None, the reason), logged once."""
    if directory is None:
        return None, None
    try:
        return EngineDiskTier.open(model, arena, directory, max_bytes), None
    except DiskTierUnavailableError as exc:
        if required:
            raise
        log.warning("KV disk tier off, the prefix cache stays in RAM only: %s", exc)
        return None, str(exc)


__all__ = ["EngineDiskTier", "open_disk_tier", "tier_namespace"]
