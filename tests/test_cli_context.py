"""`--context-overflow`: a prompt longer than the model's context is warned about in one line (and generated) or
refused, as the user chooses (issue #24 repro 2, CLI side)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

LONG_PROMPT = " ".join(["hello world"] * 200)  # 2199 tokens for the tiny tokenizer; the tiny model's context is 2048


def generate(model: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CORTEXSTREAM_NO_OPENBLAS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "cortexstream.cli.main", "generate", "--model", model,
                           "--no-chat-template", "-m", "2", "-p", LONG_PROMPT, *extra],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("mode, rc, line", [
    ("warn", 0, "cortexstream: warning: prompt: 2199 tokens, longer than the model's context of 2048 tokens"),
    ("error", 1, "cortexstream: error: prompt: 2199 tokens, longer than the model's context of 2048 tokens"),
])
def test_prompt_longer_than_the_context(tiny_gguf, mode, rc, line):
    result = generate(tiny_gguf, "--context-overflow", mode)
    assert result.returncode == rc, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line)
