"""`cortexstream serve --kv-disk`: a restarted server reads a prompt's blocks back from disk (same answer, counted
in /metrics and /v1/kv), an unusable directory or a full disk keeps the server serving from RAM and says so."""

from __future__ import annotations

import errno
import time

import httpx
import numpy as np

from cortexstream.kv.disk.segment_writer import SegmentWriter
from tests.server_harness import LiveServer

PROMPT = " ".join(f"word{i}" for i in np.random.default_rng(0).integers(0, 500, size=120))


def _ask(server: LiveServer) -> str:
    out = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    return out.choices[0].text


def _metric(server: LiveServer, name: str) -> list[str]:
    text = httpx.get(f"{server.url}/metrics").text
    return [line for line in text.splitlines() if line.startswith(f"cortexstream:{name}")]


def _value(server: LiveServer, name: str) -> float:
    lines = _metric(server, name)
    assert lines, name
    return float(lines[0].rsplit(" ", 1)[1])


def test_restarted_server_restores_the_prompt_from_disk(tiny, tmp_path):
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_disk=str(tmp_path), kv_disk_size="64MiB", block_size=4) as first:
        answer = _ask(first)
        assert _value(first, "kv_disk_enabled") == 1
        assert _value(first, "kv_disk_restored_tokens_total") == 0
    with LiveServer(model, tokenizer, kv_disk=str(tmp_path), kv_disk_size="64MiB", block_size=4) as second:
        assert _ask(second) == answer
        restored = _value(second, "kv_disk_restored_tokens_total")
        assert restored >= 4 * 10
        disk = second.wait_idle()["disk"]
        assert disk["restored_tokens"] == restored and disk["blocks"] > 0


def test_unusable_directory_serves_from_ram_and_says_why(tiny, tmp_path):
    model, tokenizer = tiny
    not_a_dir = tmp_path / "taken"
    not_a_dir.write_text("a file, not a directory")
    with LiveServer(model, tokenizer, kv_disk=str(not_a_dir)) as server:
        assert _ask(server)
        [line] = _metric(server, "kv_disk_enabled")
        assert line.endswith(" 0") and "taken" in line and "reason=" in line
        assert server.wait_idle()["disk"] is None


def test_full_disk_keeps_serving_and_says_so(tiny, tmp_path, monkeypatch):
    def full(writer, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SegmentWriter, "write_bytes", full)
    model, tokenizer = tiny
    with LiveServer(model, tokenizer, kv_disk=str(tmp_path), block_size=4) as server:
        first = _ask(server)
        assert _ask(server) == first  # served from the RAM prefix cache
        for _ in range(50):
            [line] = _metric(server, "kv_disk_enabled")
            if "ENOSPC" in line:
                break
            time.sleep(0.1)  # the store's thread meets the full disk after the answer went out
        assert "ENOSPC" in line and line.endswith(" 1")
        assert _value(server, "kv_disk_puts_total") == 0
