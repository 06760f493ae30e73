"""Start and stop the two servers under test as subprocesses on 127.0.0.1 (ephemeral ports), and read their
peak resident memory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SYSTEMS = ("cortexstream", "mlx_lm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _blas_env(system: str) -> dict[str, str]:
    """Both servers get the same BLAS: OpenBLAS preloaded when installed. cortexstream also gets what its own
    command would re-exec into: the small-batch matmul interposer in front of it (backend/small_batch.py)."""
    from cortexstream.backend import find_openblas, preload_libraries

    if os.environ.get("CORTEXSTREAM_NO_OPENBLAS"):
        libs = []
    else:
        libs = preload_libraries() if system == "cortexstream" else [lib for lib in [find_openblas()] if lib]
    return {"LD_PRELOAD": ":".join(libs), "CORTEXSTREAM_NO_OPENBLAS": "1"} if libs else {"CORTEXSTREAM_NO_OPENBLAS": "1"}


def command(system: str, model_dir: str, port: int, kv_tokens: int, max_num_seqs: int) -> list[str]:
    if system == "cortexstream":
        return [sys.executable, "-m", "cortexstream.cli.main", "serve", "--model", model_dir, "--port", str(port),
                "--kv-tokens", str(kv_tokens), "--max-num-seqs", str(max_num_seqs), "--model-name", "default_model"]
    if system == "mlx_lm":
        return [sys.executable, "-m", "mlx_lm.server", "--model", model_dir, "--host", "127.0.0.1", "--port",
                str(port), "--max-tokens", "512", "--log-level", "WARNING"]
    raise ValueError(f"system: {system!r} must be one of {SYSTEMS}")


@dataclass
class ServerProcess:
    system: str
    proc: subprocess.Popen
    url: str
    log: Path
    _peak_rss: int = 0
    _sampler: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start_rss_sampling(self) -> None:
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            self._peak_rss = max(self._peak_rss, rss_bytes(self.proc.pid, peak=True))
            self._stop.wait(0.1)

    @property
    def peak_rss(self) -> int:
        return max(self._peak_rss, rss_bytes(self.proc.pid, peak=True))

    def stop(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def rss_bytes(pid: int, peak: bool) -> int:
    """VmHWM (peak) or VmRSS from /proc on Linux; psutil's current RSS elsewhere (sampled, so a lower bound)."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmHWM:" if peak else "VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return 0
        return 0
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:  # noqa: BLE001 - the process may be gone
        return 0


def start_server(system: str, model_dir: str, kv_tokens: int, max_num_seqs: int, log_dir: Path,
                 timeout: float = 180.0) -> ServerProcess:
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **_blas_env(system)}
    # mlx_lm.server lists models from the hub cache and answers /v1/models only when that directory exists.
    Path(os.path.expanduser("~/.cache/huggingface/hub")).mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{system}.log"
    handle = open(log, "w")
    proc = subprocess.Popen(command(system, model_dir, port, kv_tokens, max_num_seqs), stdout=handle,
                            stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir())
    import httpx  # the `bench` extra; bench serve checks for it before starting anything

    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{system} server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                server = ServerProcess(system, proc, url, log)
                server.start_rss_sampling()
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"{system} server did not answer /v1/models within {timeout:.0f} s")
