"""One server run of `bench prefix-tier`'s agent part: the agent workload driven through `bench serve`'s streaming
client (`serve_client.drive`: sessions concurrent, each session's turns one after another, every turn resending the
conversation with the replies this server gave), one fresh server process per run so its peak RSS (VmHWM) is this
workload's. CortexStream runs with the workload's small arena, with a fresh `--kv-disk` directory or without one;
mlx_lm.server with its default LRU prompt cache on the same converted weights.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any, Callable

from cortexstream.benchmarks.prefix_tier_restart import disk_counters
from cortexstream.benchmarks.prefix_tier_settings import AgentSystem
from cortexstream.benchmarks.prefix_tier_workloads import AgentWorkload
from cortexstream.benchmarks.serve_client import WorkloadRun
from cortexstream.benchmarks.serve_processes import Launch, start_server
from cortexstream.benchmarks.serve_report import summarize

# The arena counters (GET /v1/kv, "arena") kept beside the disk tier's for CortexStream.
ARENA_COUNTERS = ("preemptions", "prefix_hit_blocks", "prefix_cached_blocks")


def launch_for(system: AgentSystem, kv_tokens: int, sessions: int, work: Path) -> Launch:
    """How `system` is started: every server may run all sessions at once; CortexStream's arena is `kv_tokens`."""
    if system is AgentSystem.MLX_LM:
        return Launch("mlx_lm", None, sessions)
    disk = tempfile.mkdtemp(prefix="kv-disk-agent-", dir=work) if system is AgentSystem.CORTEXSTREAM_DISK else None
    return Launch("cortexstream", kv_tokens, sessions, kv_disk=disk)


def run_summary(run: WorkloadRun, peak_rss: int, expected: int) -> dict[str, Any]:
    """`serve_report.summarize` plus the mean TTFT, and completed/failed out of the `expected` turns (a session
    stops at its first failed turn: the turns it never sent count as failed)."""
    summary = summarize(run, peak_rss)
    ttfts = [r.ttft for r in run.records if r.error is None and r.ttft is not None]
    completed = summary["requests"] - summary["failed"]
    summary.update(ttft_mean_s=sum(ttfts) / len(ttfts) if ttfts else None, expected=expected, completed=completed,
                   failed=expected - completed)
    return summary


def _kv_counters(url: str) -> dict[str, Any]:
    import httpx

    response = httpx.get(f"{url}/v1/kv", timeout=30)
    response.raise_for_status()
    arena = response.json().get("arena") or {}
    return {key: arena.get(key) for key in ARENA_COUNTERS}


def agent_run(index: int, position: int, system: AgentSystem, workload: AgentWorkload, kv_tokens: int,
              timeout: float, model_dir: str, work: Path, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Drive `workload` against a fresh `system` server; the row of the results (an "error" if it did not start)."""
    from cortexstream.benchmarks.serve_client import drive

    sessions = len(workload.spec.sessions)
    expected = sum(len(s.turns) for s in workload.spec.sessions)
    row: dict[str, Any] = {"round": index, "position": position, "system": system.value,
                           "kv_tokens": None if system is AgentSystem.MLX_LM else kv_tokens}
    say(f"[bench prefix-tier] agent round {index}: {system.label}")
    try:
        server = start_server(launch_for(system, kv_tokens, sessions, work), model_dir, work)
    except RuntimeError as exc:  # a server that cannot start is reported, the others still run
        say(f"[bench prefix-tier]   did not start: {exc}")
        return {**row, "error": str(exc)[-1500:], "expected": expected, "completed": 0, "failed": expected}
    try:
        measured = asyncio.run(drive(server.url, workload.spec, timeout, server.model))
        peak_rss = server.peak_rss  # VmHWM while the process is there to read
        if system is not AgentSystem.MLX_LM:
            row["disk"] = disk_counters(server.url) or None
            row["arena"] = _kv_counters(server.url)
    finally:
        server.stop()
    row.update(run_summary(measured, peak_rss, expected))
    mean = row["ttft_mean_s"]
    say(f"[bench prefix-tier]   TTFT mean {'n/a' if mean is None else f'{mean * 1e3:.0f} ms'}, "
        f"{row['output_tokens_per_s']:.1f} output tok/s, peak RSS {row['peak_rss_mib']:.0f} MiB, "
        f"{row['completed']}/{expected} completed")
    return row


__all__ = ["ARENA_COUNTERS", "agent_run", "launch_for", "run_summary"]
