"""`Engine` is single-threaded: two threads stepping one engine at once would corrupt its scheduler and arena and
fail inside MLX with errors that say nothing about threads. `@single_threaded` methods refuse a second thread at
once, naming `ThreadedEngine`, the supported way to share an engine.

The guard is a re-entrant lock taken without blocking: the thread inside the engine may call other guarded
methods (step -> abort), any other thread gets an error instead of a wait or a race.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

from cortexstream.errors import CortexStreamError

F = TypeVar("F", bound=Callable[..., Any])
_CREATE = threading.Lock()


class EngineBusyError(CortexStreamError, RuntimeError):
    """Another thread is inside this engine right now."""


def _guard(obj: Any) -> threading.RLock:
    lock = obj.__dict__.get("_single_thread_lock")
    if lock is None:
        with _CREATE:
            lock = obj.__dict__.setdefault("_single_thread_lock", threading.RLock())
    return lock


def single_threaded(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        lock = _guard(self)
        if not lock.acquire(blocking=False):
            raise EngineBusyError(
                f"{type(self).__name__}.{method.__name__}: another thread is using this engine; an Engine is "
                "single-threaded, share it between threads with ThreadedEngine(engine)")
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return wrapper  # type: ignore[return-value]
