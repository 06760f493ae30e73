"""Summaries, ratios against the issue's targets, and the Markdown + PNG report of `cortexstream bench serve`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cortexstream.benchmarks.serve_client import WorkloadRun
from cortexstream.benchmarks.serve_memory_report import memory_markdown, plot_memory
from cortexstream.benchmarks.serve_processes import Peer

# workload -> (min output tok/s ratio, max p50 TTFT ratio or None), cortexstream / mlx_lm.server
TARGETS = {"shared_system_chat": (1.5, 0.5), "multi_turn": (1.3, None), "unrelated": (1.0, None)}


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(run: WorkloadRun, peak_rss: int) -> dict[str, Any]:
    # A request fails on an error (HTTP, transport, timeout) or a stream that neither sent text nor ended. One that
    # ended normally without any text (the model's first token was its end) is an empty reply, not a failure.
    ok = [r for r in run.records if r.error is None and (r.first_token is not None or r.done)]
    empty = [r for r in ok if r.first_token is None]
    wall = max(run.finished - run.started, 1e-9)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(run.records),
        "failed": len(run.records) - len(ok),
        "empty_replies": len(empty),
        "errors": sorted({r.error for r in run.records if r.error})[:5],
        "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": _pct(ttfts, 50), "ttft_p95_s": _pct(ttfts, 95), "ttft_p99_s": _pct(ttfts, 99),
        "tpot_p50_s": _pct(tpots, 50), "tpot_p99_s": _pct(tpots, 99),
        "peak_rss_mib": peak_rss / 2**20,
    }


def ratios(name: str, ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        a, b = ours.get(key), theirs.get(key)
        return a / b if a is not None and b else None

    tps_target, ttft_target = TARGETS.get(name, (None, None))
    out = {"output_tokens_per_s": ratio("output_tokens_per_s"), "ttft_p50": ratio("ttft_p50_s"),
           "peak_rss": ratio("peak_rss_mib"), "target_output_tokens_per_s": tps_target,
           "target_ttft_p50": ttft_target}
    out["meets_throughput"] = None if out["output_tokens_per_s"] is None or tps_target is None else \
        out["output_tokens_per_s"] >= tps_target
    out["meets_ttft"] = None if ttft_target is None or out["ttft_p50"] is None else out["ttft_p50"] <= ttft_target
    out["meets_rss"] = None if out["peak_rss"] is None else out["peak_rss"] <= 1.0
    return out


SPECULATIVE_SYSTEM = "cortexstream_speculative"  # cortexstream serve --speculative SPEC, beside plain cortexstream
DEFAULT_SPECULATIVE = "ngram:k=4,n=3"


def speculative_ratios(speculative: dict[str, Any], plain: dict[str, Any]) -> dict[str, Any]:
    """Speculation on vs off on the same workload; the issue's target: never slower (output tok/s >= 1.0x)."""
    def ratio(key: str) -> float | None:
        a, b = speculative.get(key), plain.get(key)
        return a / b if a is not None and b else None

    tps = ratio("output_tokens_per_s")
    return {"output_tokens_per_s": tps, "ttft_p50": ratio("ttft_p50_s"), "tpot_p50": ratio("tpot_p50_s"),
            "never_slower": None if tps is None else tps >= 1.0}


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


OURS = "cortexstream serve"


def system_name(system: str) -> str:
    """How the report names a server (a workload's system key, a memory-bound run's `system`): its command."""
    if system == "cortexstream":
        return OURS
    if system == SPECULATIVE_SYSTEM:
        return f"{OURS} --speculative"
    if system == "mlx_lm":
        return "mlx_lm.server"
    peers = {peer.value: peer for peer in Peer}
    return peers[system].script if system in peers else system


def servers_compared(result: dict[str, Any]) -> str:
    """The report's title names every server that ran, in the order they first ran: "cortexstream serve vs X, Y"
    (a memory-bound run that did not start is left out)."""
    ran = [system for workload in result["workloads"] for system in workload["systems"]]
    memory = result.get("memory_bound")
    if memory:
        ran += [run["system"] for run in memory["runs"] if "error" not in run]
    names = list(dict.fromkeys(system_name(system) for system in ran))
    others = ", ".join(name for name in names if name != OURS)
    if OURS not in names:
        return others or "no server ran"
    return f"{OURS} vs {others}" if others else OURS


def markdown(result: dict[str, Any]) -> str:
    lines = [f"# Serving benchmark: {servers_compared(result)}", "",
             f"Machine: {result['machine']}. Model: {result['model']} (same weights for every server: the GGUF "
             f"converted with `cortexstream convert`), greedy decoding, streaming over HTTP. Seed {result['seed']}."
             + (" **Quick smoke run: not a measurement.**" if result["quick"] else ""), ""]
    for workload in result["workloads"]:
        lines += [f"## {workload['name']}", "", workload["description"] + f"; order: {', '.join(workload['order'])}.",
                  "", "| system | req/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) "
                  "| peak RSS (MiB) | failed |", "|---|---|---|---|---|---|---|---|---|"]
        for system, s in workload["systems"].items():
            lines.append(f"| {system} | {_fmt(s['request_throughput'])} | {_fmt(s['output_tokens_per_s'], 1, 1)} | "
                         f"{_fmt(s['ttft_p50_s'], 1e3, 0)} | {_fmt(s['ttft_p99_s'], 1e3, 0)} | "
                         f"{_fmt(s['tpot_p50_s'], 1e3, 1)} | {_fmt(s['tpot_p99_s'], 1e3, 1)} | "
                         f"{_fmt(s['peak_rss_mib'], 1, 0)} | {s['failed']} |")
        r = workload.get("ratios")
        if r:
            ttft = "" if r["target_ttft_p50"] is None else \
                f", p50 TTFT {_fmt(r['ttft_p50'])}x (target <= {r['target_ttft_p50']}x: {_verdict(r['meets_ttft'])})"
            lines += ["", f"cortexstream / mlx_lm.server: output tok/s {_fmt(r['output_tokens_per_s'])}x (target >= "
                      f"{r['target_output_tokens_per_s']}x: {_verdict(r['meets_throughput'])}){ttft}, peak RSS "
                      f"{_fmt(r['peak_rss'])}x (target <= 1.0x: {_verdict(r['meets_rss'])})."]
        sr = workload.get("speculative_ratios")
        if sr:
            lines += ["", f"{SPECULATIVE_SYSTEM} / cortexstream (speculation on vs off, batching on in both): output "
                      f"tok/s {_fmt(sr['output_tokens_per_s'])}x (target >= 1.0x: {_verdict(sr['never_slower'])}), "
                      f"p50 TTFT {_fmt(sr['ttft_p50'])}x, p50 TPOT {_fmt(sr['tpot_p50'])}x."]
        lines.append("")
    if result.get("memory_bound"):
        lines += memory_markdown(result["memory_bound"])
    lines += ["Rerun: `" + result["command"] + "`", ""]
    return "\n".join(lines)


def _verdict(flag: bool | None) -> str:
    return "n/a" if flag is None else ("met" if flag else "missed")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    memory = result.get("memory_bound")
    rows = int(bool(result["workloads"])) + int(bool(memory))
    fig, axes = plt.subplots(rows, 2, figsize=(11, 4 * rows), squeeze=False)
    if memory:
        plot_memory(memory, *axes[-1])
    if result["workloads"]:
        _plot_workloads(result, *axes[0])
    fig.suptitle(f"{servers_compared(result)} ({result['model']}, {result['machine']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_workloads(result: dict[str, Any], ax_tps: Any, ax_ttft: Any) -> None:
    names = [w["name"] for w in result["workloads"]]
    systems = sorted({s for w in result["workloads"] for s in w["systems"]})
    width = 0.8 / max(1, len(systems))
    for i, system in enumerate(systems):
        xs = np.arange(len(names)) + i * width
        tps = [w["systems"].get(system, {}).get("output_tokens_per_s") or 0 for w in result["workloads"]]
        ttft = [(w["systems"].get(system, {}).get("ttft_p50_s") or 0) * 1e3 for w in result["workloads"]]
        ax_tps.bar(xs, tps, width, label=system)
        ax_ttft.bar(xs, ttft, width, label=system)
    for ax, title in ((ax_tps, "output tokens/s (higher is better)"), (ax_ttft, "p50 TTFT, ms (lower is better)")):
        ax.set_xticks(np.arange(len(names)) + width * (len(systems) - 1) / 2)
        ax.set_xticklabels(names, fontsize=8)
        ax.set_title(title)
        ax.legend()
