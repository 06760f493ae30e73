"""One round of `bench prefix-tier`'s restart part: TTFT of one document prompt, measured with the `openai` SDK
(streaming, greedy, a few new tokens) against `cortexstream serve --kv-disk DIR` on a fresh DIR.

cold: the first request with the document; warm: the same request again (its prefix in RAM); then the server is
stopped cleanly (SIGTERM, waited for: the write-behind queue is flushed) and a new one started on the same DIR:
after_restart is the same request once more, its prefix read back from disk. Each server first answers a short
warm-up request that shares no prefix block with the document, so its one-time start-up costs are not timed.
The disk tier's counters (`GET /v1/kv`, "disk") are read before and after the timed request on the new server:
their difference is what that request restored.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from cortexstream.benchmarks.prefix_tier_settings import PrefixTierSettings
from cortexstream.benchmarks.prefix_tier_workloads import warmup_messages
from cortexstream.benchmarks.serve_processes import Launch, ServerProcess, start_server

# Disk counters whose change over the timed request is recorded (engine/disk_tier.py's, without "disk_").
RESTORE_COUNTERS = ("hit_blocks", "restored_blocks", "restored_tokens", "failed_blocks", "restore_seconds")


def chat_ttft(url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
              timeout: float) -> dict[str, Any]:
    """One streamed chat completion through the `openai` SDK: seconds to the first content token and to the end,
    the prompt tokens and those the server served from its cache (its usage), and the text."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
    sent = time.perf_counter()
    first, pieces, usage = None, [], None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                first = first or time.perf_counter()
                pieces.append(choice.delta.content)
    done = time.perf_counter()
    client.close()
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    return {"ttft_s": None if first is None else first - sent, "total_s": done - sent,
            "prompt_tokens": usage.prompt_tokens if usage is not None else None,
            "cached_tokens": getattr(details, "cached_tokens", None), "text": "".join(pieces)}


def disk_counters(url: str) -> dict[str, Any]:
    """The disk tier's counters from `GET /v1/kv` ({} when the server runs without one)."""
    import httpx

    response = httpx.get(f"{url}/v1/kv", timeout=30)
    response.raise_for_status()
    return response.json().get("disk") or {}


def _ms(measured: dict[str, Any]) -> str:
    return "n/a" if measured["ttft_s"] is None else f"{measured['ttft_s'] * 1e3:.0f}"


def _stop(server: ServerProcess) -> dict[str, Any]:
    """SIGTERM and wait (ServerProcess.stop); how long it took and the exit code (0: a clean shutdown)."""
    tic = time.perf_counter()
    server.stop()
    return {"stop_seconds": round(time.perf_counter() - tic, 3), "exit_code": server.proc.returncode}


def restart_round(index: int, messages: list[dict[str, str]], settings: PrefixTierSettings, model_dir: str,
                  work: Path, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Cold, warm and after-restart TTFT of `messages` on a fresh disk directory, with the restore counters."""
    disk_dir = tempfile.mkdtemp(prefix=f"kv-disk-restart-{index}-", dir=work)
    kv_tokens = -(-(2 * settings.doc_tokens + 1024) // 16) * 16  # the document twice over: it stays in RAM
    launch = Launch("cortexstream", kv_tokens, max_num_seqs=4, kv_disk=disk_dir)
    ask = {"max_tokens": settings.answer_tokens, "timeout": settings.timeout}
    row: dict[str, Any] = {"round": index, "kv_tokens": kv_tokens}
    first = start_server(launch, model_dir, work)
    try:
        chat_ttft(first.url, first.model, warmup_messages(2 * index), **ask)
        row["cold"] = chat_ttft(first.url, first.model, messages, **ask)
        row["warm"] = chat_ttft(first.url, first.model, messages, **ask)
        row["first_server"] = {"disk_before_stop": disk_counters(first.url)}
    finally:
        stopped = _stop(first)
    row["first_server"].update(stopped)
    say(f"[bench prefix-tier] restart round {index}: cold {_ms(row['cold'])} ms, warm "
        f"{_ms(row['warm'])} ms; stopped in {stopped['stop_seconds']:.1f} s (exit "
        f"{stopped['exit_code']})")
    second = start_server(launch, model_dir, work)
    try:
        at_start = disk_counters(second.url)
        chat_ttft(second.url, second.model, warmup_messages(2 * index + 1), **ask)
        before = disk_counters(second.url)
        row["after_restart"] = chat_ttft(second.url, second.model, messages, **ask)
        after = disk_counters(second.url)
    finally:
        second.stop()
    restored = {key: round(after.get(key, 0) - before.get(key, 0), 6) for key in RESTORE_COUNTERS}
    prompt = row["after_restart"]["prompt_tokens"]
    cached = row["after_restart"]["cached_tokens"]
    restored["recomputed_tokens"] = None if prompt is None or cached is None else prompt - cached
    row["second_server"] = {"blocks_at_start": at_start.get("blocks"), "index_seconds": at_start.get("index_seconds"),
                            "corrupt_skipped": at_start.get("corrupt_skipped"), "request": restored}
    row["same_output"] = row["cold"]["text"] == row["warm"]["text"] == row["after_restart"]["text"]
    say(f"[bench prefix-tier] restart round {index}: after restart {_ms(row['after_restart'])} ms, "
        f"{restored['restored_tokens']} tokens restored, {restored['recomputed_tokens']} recomputed")
    return row


__all__ = ["RESTORE_COUNTERS", "chat_ttft", "disk_counters", "restart_round"]
