"""`--kv-policy` on the CLI, and the chat REPL continuing an evicted cache turn after turn."""

from __future__ import annotations

import os
import subprocess
import sys

from cortexstream.cli.commands import _ChatCache
from cortexstream.generation.stream import stream_generate
from cortexstream.policies import H2O
from cortexstream.engine.policy_prompt_cache import policy_state_of


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cortexstream.cli.main", *args], capture_output=True, text=True,
                          input=stdin, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_generate_and_chat_accept_a_kv_policy(tiny_gguf):
    result = run_cli("generate", "--model", tiny_gguf, "--prompt", "the cat sat on the mat " * 6, "--max-tokens", "8",
                     "--kv-policy", "h2o:budget=16,sinks=2,recent=4")
    assert result.returncode == 0, result.stderr
    result = run_cli("chat", "--model", tiny_gguf, "--max-tokens", "6", "--kv-policy", "streaming:budget=24",
                     stdin="hello there, how are you today?\nand again a second question\n/quit\n")
    assert result.returncode == 0, result.stderr


def test_a_bad_kv_policy_is_one_line_naming_the_key(tiny_gguf):
    result = run_cli("generate", "--model", tiny_gguf, "--prompt", "x", "--kv-policy", "h2o:budgt=0.2")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("cortexstream: error:") and "budgt" in lines[0]


def test_bench_quality_is_wired():
    from cortexstream.cli.main import build_parser

    args = build_parser().parse_args(["bench", "quality", "--quick", "--parts", "perplexity"])
    assert args.bench_kind == "quality" and args.quick and args.passkey_trials == 20


def test_chat_cache_feeds_only_the_new_turn(tiny):
    model, tokenizer = tiny
    policy = H2O(budget=40, sinks=2, recent=8)
    chat = _ChatCache(model, tokenizer, policy)
    history = [{"role": "user", "content": "the cat sat on the mat and looked at the hat " * 3}]
    first = chat.turn_tokens(history)
    replies = [r for r in stream_generate(model, tokenizer, first, 6, prompt_cache=chat.cache, kv_policy=policy)]
    chat.after_reply([r.token for r in replies])
    cache = chat.cache
    offset = cache[0].offset
    state = policy_state_of(cache)
    assert state.num_evictions > 0 and cache[0].size() <= 40
    history += [{"role": "assistant", "content": "".join(r.text for r in replies)},
                {"role": "user", "content": "and the dog?"}]
    second = chat.turn_tokens(history)
    assert chat.cache is cache  # continued, not rebuilt
    full = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
    assert len(second) <= len(full) - len(first)  # the first turn is not fed again
    list(stream_generate(model, tokenizer, second, 4, prompt_cache=cache, kv_policy=policy))
    assert cache[0].offset >= offset + len(second) and policy_state_of(cache) is state
