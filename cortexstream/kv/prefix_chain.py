"""The prefix cache's hash chain: a stable 64-bit key per full block, the same in every process.

A block's key is a hash of its parent's key and its token ids, so a key names the whole prefix up to and including
the block. The chain starts from a root that hashes the namespace (how the arena stores KV, and with a disk tier the
model's identity) and the tenant, so a prefix never crosses tenants, storages or models. Python's `hash()` would do
within one process but strings are salted per process; the disk tier (kv/disk) finds blocks again after a restart,
so the keys are BLAKE2b digests instead (about a microsecond per 16-token block).
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

_ROOT_TAG = b"cortexstream-prefix-root\x00"


def chain_root(namespace: str, tenant: str | None) -> int:
    """The key a tenant's chains start from in `namespace`."""
    h = hashlib.blake2b(_ROOT_TAG, digest_size=8)
    h.update(namespace.encode("utf-8"))
    # None and "" are different tenants: mark which one it is before the name.
    h.update(b"\x00" if tenant is None else b"\x01" + tenant.encode("utf-8"))
    return int.from_bytes(h.digest(), "little")


def chain_next(parent: int, tokens: Sequence[int]) -> int:
    """The key of a block holding `tokens` after the prefix whose key is `parent`."""
    h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


__all__ = ["chain_next", "chain_root"]
