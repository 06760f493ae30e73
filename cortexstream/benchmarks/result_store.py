"""The one resumable result store of the benchmarks: a JSON document rewritten atomically after every cell.

A long benchmark (`bench quality`, `bench frontier`) measures cells one by one. After each, the whole document is
written to a temporary file and renamed over the old one (`atomic_files.write_json_atomic`: temp file +
`os.replace`), so a run killed at any moment leaves the previous complete document, and `resume=True` continues
from it: the cells already measured are kept (`has` says which), settings lists named in `merged_settings` grow
by this run's new entries, and parts named in `fresh` start empty (what this run found, e.g. missing assets).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from cortexstream.atomic_files import read_json_file, write_json_atomic
from cortexstream.benchmarks.machine import machine


class ResultStore:
    """`data` = {"benchmark", "settings", "machine", *parts}: each part a list of row dicts."""

    def __init__(self, path: str, benchmark: str, settings: dict[str, Any], parts: Sequence[str], *,
                 resume: bool, fresh: Sequence[str] = (), merged_settings: Sequence[str] = ()) -> None:
        unknown = set(fresh) - set(parts)
        if unknown:
            raise ValueError(f"ResultStore: fresh parts {sorted(unknown)} are not among the parts {list(parts)}")
        self.path = path
        old = read_json_file(path, "results file") if resume and os.path.exists(path) else {}
        for key in merged_settings:  # a resumed run adds to these lists (settings is the caller's dict)
            earlier = old.get("settings", {}).get(key, [])
            settings[key] = earlier + [x for x in settings[key] if x not in earlier]
        self.data: dict[str, Any] = {"benchmark": benchmark, "settings": settings, "machine": machine()}
        for part in parts:
            self.data[part] = [] if part in fresh else old.get(part, [])

    def has(self, part: str, **key: Any) -> bool:
        """Whether a row of `part` matches every `key=value` given (a cell measured already)."""
        return any(all(row.get(k) == v for k, v in key.items()) for row in self.data[part])

    def add(self, part: str, row: dict[str, Any]) -> None:
        """Append a measured cell and write the document."""
        self.data[part].append(row)
        self.save()

    def save(self) -> None:
        write_json_atomic(self.path, self.data)  # a kill mid-write leaves the previous cells intact


__all__ = ["ResultStore"]
