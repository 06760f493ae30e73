"""Taking a disk-tier directory: it is created if needed and must be writable (`open_directory`), and it has one
owner at a time (`DirectoryLock`): an exclusive `flock` on DIR/lock, with the owner's pid written in it.

`flock` locks belong to an open file description, so a second store in the same process is refused too, and the
kernel drops the lock when its owner dies (a SIGKILLed server does not leave the directory locked)."""

from __future__ import annotations

import fcntl
import os

from cortexstream.kv.disk.errors import DiskTierLockedError, DiskTierUnavailableError

LOCK_FILE_NAME = "lock"


def open_directory(directory: str) -> None:
    """Create `directory` if needed and check it is a writable directory; DiskTierUnavailableError otherwise."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise DiskTierUnavailableError(f"KV disk tier {directory}: exists and is not a directory")
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise DiskTierUnavailableError(
            f"KV disk tier {directory}: cannot create the directory: {exc.strerror or exc}") from exc
    if not os.access(directory, os.W_OK | os.X_OK):
        raise DiskTierUnavailableError(f"KV disk tier {directory}: the directory is not writable")


class DirectoryLock:
    """Holds the lock on `directory` from construction until `release()`."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_FILE_NAME)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DiskTierUnavailableError(
                f"KV disk tier {directory}: cannot open its lock file {self.path}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            owner = self._read_owner()
            os.close(self._fd)
            self._fd = -1
            if isinstance(exc, BlockingIOError):
                raise DiskTierLockedError(
                    f"another process owns the KV disk tier at {directory} (pid {owner}); give this one another "
                    "directory or stop the other") from exc
            raise DiskTierUnavailableError(
                f"KV disk tier {directory}: cannot lock {self.path}: {exc.strerror or exc}") from exc
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is for people reading the error message; the lock itself is held

    def _read_owner(self) -> str:
        try:
            text = os.pread(self._fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            text = ""
        return text if text.isdigit() else "unknown"

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Unlock and close; idempotent. The file stays (removing it would race with a process about to lock it)."""
        if self._fd < 0:
            return
        fd, self._fd = self._fd, -1
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


__all__ = ["DirectoryLock", "LOCK_FILE_NAME", "open_directory"]
