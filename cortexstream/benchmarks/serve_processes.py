"""Start and stop the servers under test as subprocesses on 127.0.0.1 (ephemeral ports), and read their peak
resident memory.

`cortexstream` and `mlx_lm` run from this interpreter. The peers (`Peer`) live in venvs of their own (they pin
other versions of mlx-lm and transformers): each is started through the console script beside the python it is
given (`--peer-python NAME=/venv/bin/python`), never installed from here."""

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
from enum import Enum
from pathlib import Path

SYSTEMS = ("cortexstream", "mlx_lm")
PEER_KV_BITS = (4, 8)


class Peer(str, Enum):
    """Peer servers with KV quantization of their own, run from their own venvs."""

    MLX_VLM = "mlx_vlm"
    RAPID_MLX = "rapid_mlx"
    VLLM_MLX = "vllm_mlx"

    def __str__(self) -> str:
        return self.value

    @property
    def script(self) -> str:
        """The console script, next to the venv's python."""
        return {Peer.MLX_VLM: "mlx_vlm.server", Peer.RAPID_MLX: "rapid-mlx", Peer.VLLM_MLX: "vllm-mlx"}[self]

    def kv_flags(self, bits: int | None) -> list[str]:
        """The peer's own KV quantization flags for `bits` (None: its default storage)."""
        if bits is None:
            return []
        if self is Peer.MLX_VLM:
            return ["--kv-bits", str(bits)]
        if self is Peer.RAPID_MLX:
            return ["--kv-cache-dtype", f"int{bits}"]
        return ["--kv-cache-quantization", "--kv-cache-quantization-bits", str(bits)]


@dataclass(frozen=True)
class Launch:
    """How to start one server. `kv_tokens`, `kv_dtype`, `kv_group_size`: cortexstream's arena size and storage
    (None: its default storage); `python` and `kv_bits`: a peer's venv interpreter and KV quantization bits;
    `tool_parser`: the tool-call parser a peer that parses calls only on request is started with (vllm-mlx,
    rapid-mlx: `--enable-auto-tool-choice --tool-call-parser NAME`; cortexstream and mlx_lm.server pick theirs
    from the chat template); `env`: extra environment variables for the server (a peer's own switches), shown in
    its label; `fresh_home`: HOME is a new empty folder, so nothing a peer keeps on disk between runs (vllm-mlx
    saves its prefix cache under ~/.cache at exit and loads it at start) carries into this one; `kv_disk`:
    cortexstream's prefix-cache disk tier directory (`serve --kv-disk DIR`)."""

    system: str
    kv_tokens: int | None
    max_num_seqs: int
    kv_dtype: str | None = None
    kv_group_size: int | None = None
    python: str | None = None
    kv_bits: int | None = None
    tool_parser: str | None = None
    env: tuple[tuple[str, str], ...] = ()
    fresh_home: bool = False
    kv_disk: str | None = None
    speculative: str | None = None  # cortexstream's `serve --speculative` default (e.g. "ngram:k=4,n=3")
    max_memory: str | None = None  # cortexstream's `serve --max-memory` budget, in place of kv_tokens

    def __post_init__(self) -> None:
        peers = [p.value for p in Peer]
        if self.system not in SYSTEMS and self.system not in peers:
            raise ValueError(f"system: {self.system!r} must be one of {', '.join(SYSTEMS + tuple(peers))}")
        if self.max_memory is not None and (self.system != "cortexstream" or self.kv_tokens is not None):
            raise ValueError("max_memory: only cortexstream takes one, in place of kv_tokens (give kv_tokens=None)")
        if self.system == "cortexstream" and self.max_memory is None and (
                not isinstance(self.kv_tokens, int) or self.kv_tokens < 1):
            raise ValueError(f"kv_tokens: {self.kv_tokens!r} must be an integer >= 1 for cortexstream")
        if (self.kv_dtype is not None or self.kv_group_size is not None) and self.system != "cortexstream":
            raise ValueError(f"kv_dtype / kv_group_size: only cortexstream takes them, not {self.system}")
        if self.speculative is not None and (self.system != "cortexstream" or not str(self.speculative).strip()):
            raise ValueError(f"speculative: {self.speculative!r} must be a speculation spec, and only cortexstream "
                             "takes one")
        if self.kv_disk is not None and (self.system != "cortexstream" or not str(self.kv_disk).strip()):
            raise ValueError(f"kv_disk: {self.kv_disk!r} must be a directory, and only cortexstream takes one")
        if self.system in peers:
            if self.python is None:
                raise ValueError(f"python: {self.system} runs from its own venv; give its python")
            if self.kv_bits is not None and self.kv_bits not in PEER_KV_BITS:
                raise ValueError(f"kv_bits: {self.kv_bits!r} must be one of {PEER_KV_BITS} or None")
        elif self.python is not None or self.kv_bits is not None:
            raise ValueError(f"python / kv_bits: only peers take them, not {self.system}")
        if self.tool_parser is not None and self.system not in (Peer.VLLM_MLX.value, Peer.RAPID_MLX.value):
            raise ValueError(f"tool_parser: only vllm_mlx and rapid_mlx take one, not {self.system}")

    @property
    def label(self) -> str:
        """How the report names this server."""
        if self.system == "cortexstream":
            return (f"cortexstream {self.kv_dtype or 'auto'}" + (" kv-disk" if self.kv_disk is not None else "")
                    + (f" speculative {self.speculative}" if self.speculative is not None else ""))
        extra = "".join(f" {key}={value}" for key, value in self.env)
        if self.system == "mlx_lm":
            return "mlx_lm.server" + extra
        return self.system + extra  # the report shows a peer's KV flags beside its name

    @property
    def request_model(self) -> str | None:
        """The `model` a request names: None means the model directory (mlx-vlm requires the name it loaded)."""
        return "default_model" if self.system in SYSTEMS else None


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
    return {"LD_PRELOAD": ":".join(libs), "CORTEXSTREAM_NO_OPENBLAS": "1"} if libs else \
        {"CORTEXSTREAM_NO_OPENBLAS": "1"}


def peer_script(python: str, peer: Peer) -> Path:
    """The peer's console script beside `python` (not resolved: a venv's python is often a symlink)."""
    return Path(python).parent / peer.script


def command(launch: Launch, model_dir: str, port: int) -> list[str]:
    if launch.system == "cortexstream":
        arena = ["--max-memory", launch.max_memory] if launch.max_memory is not None else \
            ["--kv-tokens", str(launch.kv_tokens)]
        cmd = [sys.executable, "-m", "cortexstream.cli.main", "serve", "--model", model_dir, "--port", str(port),
               *arena, "--max-num-seqs", str(launch.max_num_seqs), "--model-name", "default_model"]
        cmd += ["--kv-dtype", launch.kv_dtype] if launch.kv_dtype is not None else []
        cmd += ["--kv-disk", launch.kv_disk] if launch.kv_disk is not None else []
        cmd += ["--speculative", launch.speculative] if launch.speculative is not None else []
        return cmd + (["--kv-group-size", str(launch.kv_group_size)] if launch.kv_group_size is not None else [])
    if launch.system == "mlx_lm":
        return [sys.executable, "-m", "mlx_lm.server", "--model", model_dir, "--host", "127.0.0.1", "--port",
                str(port), "--max-tokens", "512", "--decode-concurrency", str(launch.max_num_seqs), "--log-level",
                "WARNING"]
    peer = Peer(launch.system)
    script, flags = str(peer_script(launch.python or "", peer)), peer.kv_flags(launch.kv_bits)
    if launch.tool_parser is not None:
        flags += ["--enable-auto-tool-choice", "--tool-call-parser", launch.tool_parser]
    if peer is Peer.MLX_VLM:
        return [script, "--host", "127.0.0.1", "--port", str(port), "--model", model_dir, "--max-num-seqs",
                str(launch.max_num_seqs), *flags]
    if peer is Peer.RAPID_MLX:  # telemetry is on by default; --no-telemetry goes before `serve`
        return [script, "--no-telemetry", "serve", model_dir, "--host", "127.0.0.1", "--port", str(port),
                "--disable-disk-caches", *flags]
    return [script, "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), "--continuous-batching", *flags]


def peer_env(system: str) -> dict[str, str]:
    """mlx-vlm keeps a prefix cache only with APC on (in memory: the others keep theirs in memory too)."""
    return {"APC_ENABLED": "1", "APC_DISK_ENABLED": "0"} if system == Peer.MLX_VLM.value else {}


@dataclass
class ServerProcess:
    system: str
    proc: subprocess.Popen
    url: str
    log: Path
    model: str = "default_model"  # what requests name as `model`
    _peak_rss: int = 0
    _samples: int = 0
    _sampler: threading.Thread | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def start_rss_sampling(self) -> None:
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            value = rss_bytes(self.proc.pid, peak=True)
            if value:
                self._peak_rss = max(self._peak_rss, value)
                self._samples += 1
            self._stop.wait(0.1)

    @property
    def rss_samples(self) -> int:
        """How many memory samples were taken (every 0.1 s; the peak is VmHWM where /proc has it)."""
        return self._samples

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


def start_server(launch: Launch, model_dir: str, log_dir: Path, timeout: float = 180.0) -> ServerProcess:
    """Start `launch` on an ephemeral port and wait until it answers /v1/models (or /health)."""
    system = launch.system
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **_blas_env(system), **peer_env(system),
           **dict(launch.env)}
    if launch.fresh_home:
        env["HOME"] = tempfile.mkdtemp(prefix="home-", dir=log_dir)
    # mlx_lm.server lists models from the hub cache and answers /v1/models only when that directory exists.
    Path(os.path.expanduser("~/.cache/huggingface/hub")).mkdir(parents=True, exist_ok=True)
    log = log_dir / (launch.label.replace(" ", "_").replace("/", "_").replace("=", "-") + ".log")
    with open(log, "w") as handle:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(command(launch, model_dir, port), stdout=handle, stderr=subprocess.STDOUT, env=env,
                                cwd=tempfile.gettempdir())
    import httpx  # the `bench` extra; bench serve checks for it before starting anything

    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{launch.label} server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        for path in ("/v1/models", "/health"):
            try:
                if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                    server = ServerProcess(system, proc, url, log, launch.request_model or model_dir)
                    server.start_rss_sampling()
                    return server
            except httpx.HTTPError:
                pass
        time.sleep(0.25)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"{launch.label} server did not answer /v1/models or /health within {timeout:.0f} s")
