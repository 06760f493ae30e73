"""The console script: streaming output, `info`, and one-line errors with a non-zero exit code."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cortexstream.cli.main", *args],
        capture_output=True, text=True, input=stdin, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("cortexstream: error:")
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_generate_streams_text_from_a_tiny_gguf(tiny_gguf):
    result = run_cli("generate", "--model", tiny_gguf, "--prompt", "the cat", "--max-tokens", "6", "--verbose")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() != ""
    assert "generation:" in result.stderr and "tok/s" in result.stderr


def test_info_names_backend_and_blas():
    result = run_cli("info")
    assert result.returncode == 0, result.stderr
    assert "device:" in result.stdout and "blas:" in result.stdout and "kernels:" in result.stdout
    # the backend an Engine would be built with, chosen once (backend/compute.py)
    backend = [line for line in result.stdout.splitlines() if line.startswith("compute backend: ")]
    assert len(backend) == 1 and backend[0].split(": ", 1)[1].split(" ")[0] in ("cpu", "metal"), result.stdout


def test_missing_model_file(tmp_path):
    missing = str(tmp_path / "missing.gguf")
    assert_one_line_error(run_cli("generate", "--model", missing, "--prompt", "x"), missing, "not found")


def test_truncated_model_file(tiny_gguf, tmp_path):
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(open(tiny_gguf, "rb").read()[:5000])
    assert_one_line_error(run_cli("generate", "--model", str(truncated), "--prompt", "x"), "cut.gguf")


@pytest.mark.parametrize("flag, value, name", [("--temp", "-2", "temperature"), ("--top-p", "0", "top_p"),
                                               ("--max-tokens", "-4", "max_tokens")])
def test_bad_sampling_value_fails_before_loading(flag, value, name):
    assert_one_line_error(run_cli("generate", "--model", "/nonexistent.gguf", "--prompt", "x", flag, value), name)


def test_debug_shows_the_traceback(tmp_path):
    result = run_cli("--debug", "generate", "--model", str(tmp_path / "x.gguf"), "--prompt", "x")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_chat_repl_answers_and_quits(tiny_gguf):
    result = run_cli("chat", "--model", tiny_gguf, "--max-tokens", "4", stdin="hello\n/reset\n/quit\n")
    assert result.returncode == 0, result.stderr
    assert "conversation cleared" in result.stdout
