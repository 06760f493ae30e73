"""`cortexstream serve` as a process: start-up banner, a request, SIGTERM drains and exits 0."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(gguf: str, *extra: str) -> tuple[subprocess.Popen, str, list[str]]:
    port = _free_port()
    env = {**os.environ, "CORTEXSTREAM_NO_OPENBLAS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cortexstream.cli.main", "serve", "--model", gguf, "--port", str(port),
         "--kv-tokens", "8192", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            if proc.poll() is not None:
                pytest.fail(f"server exited: {proc.stdout.read()}")
            time.sleep(0.2)
    return proc, url, lines


def _stop(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"server did not exit after SIGTERM: {out}")
    return proc.returncode, out


def test_banner_request_and_graceful_sigterm(tiny_gguf):
    proc, url, _ = _start(tiny_gguf, "--shutdown-timeout", "20")
    result: dict = {}

    def long_request() -> None:
        body = {"prompt": "in the", "max_tokens": 1500, "temperature": 0}
        result["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    thread.join(60)
    code, out = _stop(proc)
    assert code == 0, out
    assert f"listening on {url}" in out and "model:   tiny" in out and "arena:   512 blocks x 16 tokens" in out
    assert "no API keys: one tenant" in out and "backend:" in out
    # The request that was running when SIGTERM came finished normally within the shutdown timeout.
    assert result["response"].status_code == 200
    assert result["response"].json()["choices"][0]["finish_reason"] == "length"


def test_sigterm_aborts_what_outlives_the_shutdown_timeout(tiny_gguf):
    proc, url, _ = _start(tiny_gguf, "--shutdown-timeout", "0.5")
    outcome: dict = {}

    def endless() -> None:
        body = {"prompt": "in the", "max_tokens": 8000, "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                outcome["text"] = "".join(response.iter_text())
        except httpx.HTTPError as exc:
            outcome["error"] = type(exc).__name__

    thread = threading.Thread(target=endless)
    thread.start()
    time.sleep(1.0)
    started = time.time()
    proc.send_signal(signal.SIGTERM)
    code, out = _stop(proc)
    thread.join(30)
    assert code == 0, out
    assert time.time() - started < 15
    assert "[DONE]" not in outcome.get("text", "")  # cut off, not completed


def test_bad_option_fails_before_loading(tiny_gguf):
    run = subprocess.run([sys.executable, "-m", "cortexstream.cli.main", "serve", "--model", tiny_gguf,
                          "--kv-policy", "bogus:x=1"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CORTEXSTREAM_NO_OPENBLAS": "1"})
    assert run.returncode == 1 and "cortexstream: error:" in run.stderr
