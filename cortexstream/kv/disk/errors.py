"""Errors of the KV disk tier. A caller that can run without the tier catches `DiskTierUnavailableError` (which
`DiskTierLockedError` is too) and serves from RAM; every message names the directory and the reason."""

from __future__ import annotations

from cortexstream.errors import CortexStreamError


class DiskTierError(CortexStreamError, RuntimeError):
    """Base class of the disk tier's errors."""


class DiskTierUnavailableError(DiskTierError):
    """The tier's directory cannot be used: it cannot be created, is not a directory, or is not writable."""


class DiskTierLockedError(DiskTierUnavailableError):
    """Another process (or another store in this one) owns the directory; its lock file names the owner's pid."""


class DiskTierClosedError(DiskTierError):
    """A call reached a store after its `close()`; nothing was read or written."""


__all__ = ["DiskTierClosedError", "DiskTierError", "DiskTierLockedError", "DiskTierUnavailableError"]
