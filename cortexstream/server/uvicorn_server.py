"""Run the app under uvicorn: start-up banner, graceful SIGTERM/SIGINT and exit code 0.

On SIGTERM the server stops accepting connections, lets open requests finish for up to `shutdown_timeout`
seconds (uvicorn's graceful shutdown), then cancels the rest, whose handlers abort their engine requests; the
lifespan then stops the engine thread. uvicorn re-raises a captured signal after shutting down (so the process
would die of SIGTERM); the server here handles the signals itself and returns normally instead.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator

import uvicorn


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame: Any) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C: stop waiting for requests
        self.should_exit = True


def serve_app(app: Any, host: str, port: int, shutdown_timeout: float, max_header_bytes: int,
              log_level: str = "warning") -> int:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout,
                            h11_max_incomplete_event_size=max_header_bytes)
    _Server(config).run()
    return 0


def banner(url: str, model: str, backend: str, arena: str, tenants: str) -> str:
    return "\n".join([
        f"cortexstream serve: listening on {url}  (OpenAI API at {url}/v1)",
        f"  model:   {model}",
        f"  backend: {backend}",
        f"  arena:   {arena}",
        f"  tenants: {tenants}",
    ])
