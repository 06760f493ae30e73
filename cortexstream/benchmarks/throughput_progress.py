"""`bench throughput` results as they grow: the report rewritten after every finished unit, and `--resume`.

After every finished unit (a matrix cell, the ITL part, a single-stream prompt) the whole report, JSON + Markdown
+ heat map, is rewritten through `throughput_report.write_report`, whose files are written atomically
(`atomic_files`: temporary file, then rename), with `"complete": false` and `planned_cells`, the number of matrix
cells the settings ask for. A run killed at any moment thus leaves the units finished before it, and the
Markdown says how many of the planned cells are done. The last write has `"complete": true`: the run reached its
end (cells `--max-minutes` left out are listed in `skipped`).

`--resume` reads that JSON back. When it was made with the same configuration (every setting but those in
`FREE_SETTINGS`, the same model, and the machine fields in `MACHINE_FIELDS`) its finished units are kept and only
the missing ones are measured; any difference is refused with an error naming the file and the field. A setting
added since a file was written (`ADDED_SETTINGS`: the rank count and backend) counts as the value it had then.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from cortexstream.atomic_files import read_json_file
from cortexstream.errors import InvalidArgumentError, ModelLoadError

# Settings a resumed run may change: the time budget, and --quick (it only picks defaults of compared settings).
FREE_SETTINGS = ("max_minutes", "quick")
# Settings added after results files were first written, with the value every run before them had (one process).
ADDED_SETTINGS = {"ranks": 1, "rank_backend": None}
# What the numbers depend on besides the settings and the model (the platform string may change with a reboot).
MACHINE_FIELDS = ("cpu", "cpu_count", "device", "blas", "mlx", "mlx_lm")
HINT = "--resume continues only a run of the same configuration; rerun without --resume or with another --name"


def _plain(value: Any) -> Any:
    """The value as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value))


def _same(path: str, what: str, earlier: dict[str, Any], now: dict[str, Any], fields: Any = None,
          absent: dict[str, Any] | None = None) -> None:
    """`absent`: the value a key missing from `earlier` stands for."""
    keys = fields if fields is not None else sorted((set(earlier) | set(now)) - set(FREE_SETTINGS))
    now = _plain(now)
    absent = absent or {}
    for key in keys:
        was = earlier.get(key, absent.get(key))
        if was != now.get(key):
            raise InvalidArgumentError(f"{path}: its {what} {key} is {was!r}, this run's is {now.get(key)!r}; {HINT}")


def find_unit(payload: dict[str, Any], part: str, what: Any) -> Any:
    """The result of one unit in a payload, or None when it is not there."""
    if part == "itl":
        return payload.get("itl")
    if part == "single":
        return next((r for r in payload.get("single") or [] if r.get("prompt_tokens") == what), None)
    kind, c, n = what
    return next((r for r in payload.get("matrix") or []
                 if (r.get("kind"), r.get("concurrency"), r.get("prompt_tokens")) == (kind, c, n)), None)


def _put(payload: dict[str, Any], part: str, result: Any) -> None:
    if part == "itl":
        payload["itl"] = result
    else:
        payload[part].append(result)


class ThroughputResults:
    """The result files of one `bench throughput` run: the earlier run's units (with `resume`) and the partial
    reports. Built before the model is loaded, so a configuration that cannot be resumed fails in a second."""

    def __init__(self, out_dir: str, name: str, settings: dict[str, Any], resume: bool) -> None:
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, f"{name}.json")
        self.earlier: dict[str, Any] | None = None
        self.kept = 0
        if resume and os.path.exists(self.path):
            earlier = read_json_file(self.path, "results file")
            if not isinstance(earlier, dict) or not isinstance(earlier.get("settings"), dict) \
                    or not isinstance(earlier.get("matrix"), list):
                raise ModelLoadError(f"{self.path}: not a `bench throughput` results file; {HINT}")
            _same(self.path, "setting", earlier["settings"], settings, absent=ADDED_SETTINGS)
            self.earlier = earlier

    def begin(self, payload: dict[str, Any], planned_cells: int) -> None:
        """Check the model and machine against the earlier run's, and mark `payload` as partial."""
        if self.earlier is not None:
            _same(self.path, "model field", self.earlier.get("model") or {}, payload["model"])
            _same(self.path, "machine field", self.earlier.get("machine") or {}, payload["machine"], MACHINE_FIELDS)
        payload.update({"complete": False, "planned_cells": planned_cells, "resumed_cells": 0})

    def take_earlier(self, payload: dict[str, Any], part: str, what: Any) -> bool:
        """Copy the unit's earlier result into `payload`; False when the earlier run lacks it (measure it)."""
        result = find_unit(self.earlier, part, what) if self.earlier is not None else None
        if result is None:
            return False
        _put(payload, part, result)
        self.kept += 1
        payload["resumed_cells"] += part == "matrix"
        return True

    def add(self, payload: dict[str, Any], part: str, result: Any, started: float) -> None:
        """Put a measured unit into `payload` and rewrite the partial report."""
        _put(payload, part, result)
        self.save(payload, started, complete=False)

    def save(self, payload: dict[str, Any], started: float, complete: bool) -> None:
        from cortexstream.benchmarks.throughput_report import write_report

        earlier_minutes = 0.0
        if self.kept and self.earlier is not None:  # the minutes that measured the units kept
            earlier_minutes = self.earlier.get("elapsed_minutes") or 0.0
        payload["complete"] = complete
        payload["elapsed_minutes"] = earlier_minutes + (time.perf_counter() - started) / 60
        write_report(payload, self.out_dir)


__all__ = ["ADDED_SETTINGS", "FREE_SETTINGS", "MACHINE_FIELDS", "ThroughputResults", "find_unit"]
