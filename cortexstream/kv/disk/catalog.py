"""The segment files of a disk-tier directory, every namespace's: their sizes, when each was last used, and which
one least recently (the next to evict)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CatalogFile:
    """One segment file. `last_use` is wall-clock seconds: the latest get or put of any of its blocks for our own
    segments, the modification time for files we do not read (another namespace's, or not ours after all)."""

    name: str
    size: int
    last_use: float
    own: bool


class SegmentCatalog:
    """Sizes and recency of the segment files in one directory; `total_bytes` is what the byte cap applies to."""

    def __init__(self) -> None:
        self._files: dict[str, CatalogFile] = {}
        self._total = 0

    @property
    def total_bytes(self) -> int:
        return self._total

    def add(self, name: str, size: int, last_use: float, own: bool) -> None:
        if name in self._files:
            raise ValueError(f"segment {name} is already in the catalog")
        self._files[name] = CatalogFile(name, size, last_use, own)
        self._total += size

    def grow(self, name: str, nbytes: int) -> None:
        self._files[name].size += nbytes
        self._total += nbytes

    def use(self, name: str, when: float) -> None:
        entry = self._files[name]
        entry.last_use = max(entry.last_use, when)

    def remove(self, name: str) -> CatalogFile:
        entry = self._files.pop(name)
        self._total -= entry.size
        return entry

    def least_recent(self, keep: str | None) -> CatalogFile | None:
        """The least recently used file other than `keep` (the segment being written), or None."""
        candidates = [entry for name, entry in self._files.items() if name != keep]
        return min(candidates, key=lambda entry: (entry.last_use, entry.name)) if candidates else None

    def own_files(self) -> list[CatalogFile]:
        return [entry for entry in self._files.values() if entry.own]


__all__ = ["CatalogFile", "SegmentCatalog"]
