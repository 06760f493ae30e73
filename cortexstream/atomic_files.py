"""Files the project writes (prompt caches, results, checkpoints) appear whole or not at all, and output folders
are checked before a long run starts.

`atomic_write` writes into a temporary file in the target's own folder (so the rename never crosses a file
system) and `os.replace`s it over the target: a crash or a full disk mid-write leaves the old file intact.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

from cortexstream.errors import InvalidArgumentError, ModelLoadError


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """Call `write(tmp_path)`, then rename the temporary file over `path`. The temporary name keeps `path`'s
    extension, because MLX appends `.safetensors` to names that lack it."""
    folder = os.path.dirname(os.path.abspath(path))
    suffix = os.path.splitext(path)[1]
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=f".tmp{suffix}", dir=folder)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; the result should look like any file we write
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())

    atomic_write(path, write)


def write_json_atomic(path: str, payload: Any, indent: int | None = 2) -> None:
    write_text_atomic(path, json.dumps(payload, indent=indent))


def read_json_file(path: str, what: str = "JSON file") -> Any:
    """Read JSON the project wrote earlier; a torn or unreadable file is an error that names it."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path}: {what} not found") from exc
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: {what} is unreadable or torn ({type(exc).__name__}: {exc}); "
                             "delete it or start without --resume") from exc


def check_output_dir(path: str, argument: str = "--out") -> str:
    """Create `path` if needed and prove it is writable before a long run, so results are not lost at the end."""
    if not isinstance(path, str) or not path:
        raise InvalidArgumentError(f"{argument}: {path!r} is not a folder path")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InvalidArgumentError(f"{argument}: {path}: cannot write results there ({exc.strerror or exc})") from exc
    return path


__all__ = ["atomic_write", "check_output_dir", "read_json_file", "write_json_atomic",
           "write_text_atomic"]
