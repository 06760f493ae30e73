"""The KV prefix cache's disk tier: full blocks kept in segment files under one directory, found again after a
restart by their prefix-chain key. Pure Python and NumPy; the engine decides what to put and when to read."""

from __future__ import annotations

from cortexstream.kv.disk.background import BackgroundDiskStore
from cortexstream.kv.disk.config import DiskTierConfig, parse_size
from cortexstream.kv.disk.errors import (DiskTierClosedError, DiskTierError, DiskTierLockedError,
                                         DiskTierUnavailableError)
from cortexstream.kv.disk.stats import DiskStoreStats
from cortexstream.kv.disk.store import DiskBlockStore

__all__ = ["BackgroundDiskStore", "DiskBlockStore", "DiskStoreStats", "DiskTierClosedError", "DiskTierConfig",
           "DiskTierError", "DiskTierLockedError", "DiskTierUnavailableError", "parse_size"]
