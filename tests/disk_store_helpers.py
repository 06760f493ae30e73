"""Shared pieces of the disk-tier tests: namespaces, blocks whose content follows from their key (so a reader,
even another process, knows what each must hold), and a store factory."""

from __future__ import annotations

import hashlib
import os

from cortexstream.kv.disk import DiskBlockStore, DiskTierConfig

NS = bytes(range(16))
OTHER_NS = bytes(range(16, 32))


def tokens_for(key: int) -> list[int]:
    return [(key * 31 + i * 7) % 50_000 for i in range(1 + key % 24)]


def payload_for(key: int, max_len: int = 900) -> bytes:
    """Deterministic bytes of a key-dependent length (0..max_len)."""
    length = int.from_bytes(hashlib.blake2b(key.to_bytes(8, "little"), digest_size=4).digest(), "little")
    length %= max_len + 1
    out = bytearray()
    counter = 0
    while len(out) < length:
        out += hashlib.blake2b(key.to_bytes(8, "little") + counter.to_bytes(4, "little")).digest()
        counter += 1
    return bytes(out[:length])


def open_store(directory: str, namespace: bytes = NS, **config: int) -> DiskBlockStore:
    config.setdefault("max_bytes", 64 * 2**20)
    return DiskBlockStore(DiskTierConfig(str(directory), **config), namespace)


def segment_files(directory: str, namespace: bytes | None = NS) -> list[str]:
    """Segment file names in `directory` (of `namespace`, or all when None), in sequence order."""
    prefix = namespace.hex() if namespace is not None else ""
    return sorted(name for name in os.listdir(directory) if name.endswith(".cskv") and name.startswith(prefix))


def dir_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, name)) for name in segment_files(directory, None))
