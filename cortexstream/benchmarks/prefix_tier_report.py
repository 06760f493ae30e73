"""Medians over rounds, the ratios against the issue's targets (met / missed, as measured) and the Markdown report of
`bench prefix-tier`, all from the results dict alone."""

from __future__ import annotations

import statistics
from typing import Any, Sequence

from cortexstream.benchmarks.machine import machine_sentence
from cortexstream.benchmarks.prefix_tier_settings import AgentSystem

RESTART_TARGET = 10.0  # cold / after-restart TTFT of the document, at least
# ratio (CortexStream with the disk tier / mlx_lm.server) -> (the metric in a summary, "max" or "min", target)
AGENT_TARGETS = {"ttft_mean": ("ttft_mean_s", "max", 0.5), "output_tokens_per_s": ("output_tokens_per_s", "min", 1.3),
                 "peak_rss": ("peak_rss_mib", "max", 1.0)}
AGENT_MEDIANS = ("ttft_mean_s", "ttft_p50_s", "ttft_p95_s", "output_tokens_per_s", "peak_rss_mib", "wall_s")
DISK_COLUMNS = ("restored_blocks", "restored_tokens", "hit_blocks", "failed_blocks", "restore_seconds", "puts",
                "evicted_blocks")


def median(values: Sequence[float | None]) -> float | None:
    """The median of the values that are not None (None when there are none)."""
    present = [v for v in values if v is not None]
    return float(statistics.median(present)) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def restart_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Median TTFTs over the rounds, cold / after restart (of the medians) against the target, and the median
    tokens one after-restart request restored and recomputed."""
    if not rows:
        return None
    cold, warm, after = ([r[key]["ttft_s"] for r in rows] for key in ("cold", "warm", "after_restart"))
    ratio = _ratio(median(cold), median(after))
    return {"rounds": len(rows), "cold_ttft_s": median(cold), "warm_ttft_s": median(warm),
            "after_restart_ttft_s": median(after), "cold_over_after_restart": ratio,
            "round_ratios": [_ratio(c, a) for c, a in zip(cold, after)], "target": RESTART_TARGET,
            "met": None if ratio is None else ratio >= RESTART_TARGET,
            "restored_tokens": median([r["second_server"]["request"]["restored_tokens"] for r in rows]),
            "recomputed_tokens": median([r["second_server"]["request"]["recomputed_tokens"] for r in rows]),
            "same_output_rounds": sum(bool(r["same_output"]) for r in rows)}


def agent_summary(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Per server: medians over its runs, and turns expected/completed/failed summed over them; the ratios of each
    CortexStream server to mlx_lm.server, with the targets judged for the one with the disk tier."""
    if not rows:
        return None
    systems: dict[str, dict[str, Any]] = {}
    for system in AgentSystem:
        runs = [r for r in rows if r["system"] == system.value]
        if not runs:
            continue
        ran = [r for r in runs if "error" not in r]
        systems[system.value] = {"runs": len(runs), "not_started": len(runs) - len(ran),
                                 **{key: median([r.get(key) for r in ran]) for key in AGENT_MEDIANS},
                                 **{f"{key}_total": sum(r[key] for r in runs)
                                    for key in ("expected", "completed", "failed")}}
    ratios = {}
    theirs = systems.get(AgentSystem.MLX_LM.value)
    for system in (AgentSystem.CORTEXSTREAM_DISK, AgentSystem.CORTEXSTREAM_RAM):
        ours = systems.get(system.value)
        if ours is None or theirs is None:
            continue
        ratios[system.value] = {name: _ratio(ours[key], theirs[key]) for name, (key, _, _) in AGENT_TARGETS.items()}
    return {"systems": systems, "ratios": ratios, "targets": agent_targets(systems, ratios)}


def agent_targets(systems: dict[str, dict[str, Any]], ratios: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets for CortexStream with the disk tier against mlx_lm.server: each ratio with its target
    and True (met), False (missed) or None (not measured); `all_completed`: every turn of its runs completed."""
    ours = systems.get(AgentSystem.CORTEXSTREAM_DISK.value)
    mine = ratios.get(AgentSystem.CORTEXSTREAM_DISK.value, {})
    out: dict[str, Any] = {}
    for name, (_, direction, target) in AGENT_TARGETS.items():
        value = mine.get(name)
        met = None if value is None else (value <= target if direction == "max" else value >= target)
        out[name] = {"ratio": value, "direction": direction, "target": target, "met": met}
    out["all_completed"] = None if ours is None else (ours["failed_total"] == 0 and ours["not_started"] == 0)
    return out


def summaries(data: dict[str, Any]) -> dict[str, Any]:
    return {"restart": restart_summary(data.get("restart", [])), "agent": agent_summary(data.get("agent", []))}


def _fmt(value: Any, scale: float = 1.0, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def verdict(flag: bool | None) -> str:
    return "n/a" if flag is None else ("met" if flag else "missed")


def _restart_lines(data: dict[str, Any]) -> list[str]:
    s, rows = data["summary"]["restart"], data["restart"]
    lines = ["## Restart: a repeated document", "",
             f"One ~{data['settings']['doc_tokens']}-token document per round (Wikipedia text), a fresh `--kv-disk` "
             "directory per round; TTFT through the `openai` SDK (streaming, greedy, "
             f"max_tokens {data['settings']['answer_tokens']}): cold (first request), warm (again, prefix in RAM), "
             "then SIGTERM, a new server on the same directory, and the request once more. Each server answers a "
             "short unrelated warm-up request first. Restored / recomputed: what the after-restart request read "
             "from disk (`/v1/kv` disk counters) and what it computed (prompt tokens minus the server's "
             "cached_tokens).", "",
             "| round | prompt tokens | cold TTFT (ms) | warm TTFT (ms) | after restart (ms) | cold / after restart "
             "| restored tokens | recomputed tokens | restore (s) | blocks on disk at start | first server exit "
             "| same output |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, ratio in zip(rows, s["round_ratios"]):
        req = r["second_server"]["request"]
        lines.append(f"| {r['round']} | {r['cold']['prompt_tokens']} | {_fmt(r['cold']['ttft_s'], 1e3)} | "
                     f"{_fmt(r['warm']['ttft_s'], 1e3)} | {_fmt(r['after_restart']['ttft_s'], 1e3)} | "
                     f"{_fmt(ratio, 1, 1)}x | {req['restored_tokens']} | {req['recomputed_tokens']} | "
                     f"{_fmt(req['restore_seconds'], 1, 3)} | {r['second_server']['blocks_at_start']} | "
                     f"{r['first_server']['exit_code']} | {'yes' if r['same_output'] else 'no'} |")
    lines += ["", f"Medians over {s['rounds']} round(s): cold {_fmt(s['cold_ttft_s'], 1e3)} ms, warm "
              f"{_fmt(s['warm_ttft_s'], 1e3)} ms, after restart {_fmt(s['after_restart_ttft_s'], 1e3)} ms; "
              f"cold / after restart **{_fmt(s['cold_over_after_restart'], 1, 1)}x** (target >= "
              f"{s['target']:g}x: **{verdict(s['met'])}**).", ""]
    return lines


def _agent_lines(data: dict[str, Any]) -> list[str]:
    s, rows, settings = data["summary"]["agent"], data["agent"], data["settings"]
    lines = ["## Agent workload", "", settings["agent_workload"] + ". CortexStream's arena: "
             f"{settings['kv_tokens']} tokens ({settings['agent']['arena_fraction']:.2f} of the sessions' final "
             f"{settings['final_tokens_total']} tokens, replies counted at max_tokens); mlx_lm.server with its default "
             "prompt cache settings. Servers run one after another, the order alternating between rounds.", "",
             "| server | runs | mean TTFT (ms) | TTFT p50 (ms) | TTFT p95 (ms) | output tok/s | peak RSS (MiB) | "
             "completed | failed |", "|---|---|---|---|---|---|---|---|---|"]
    for name, m in s["systems"].items():
        lines.append(f"| {AgentSystem(name).label} | {m['runs']} | {_fmt(m['ttft_mean_s'], 1e3)} | "
                     f"{_fmt(m['ttft_p50_s'], 1e3)} | {_fmt(m['ttft_p95_s'], 1e3)} | "
                     f"{_fmt(m['output_tokens_per_s'], 1, 1)} | {_fmt(m['peak_rss_mib'])} | "
                     f"{m['completed_total']}/{m['expected_total']} | {m['failed_total']} |")
    lines += ["", "Medians over the runs; completed and failed turns summed over them.", ""]
    disk_rows = [r for r in rows if r.get("disk")]
    if disk_rows:
        lines += ["| round | server | " + " | ".join(c.replace("_", " ") for c in DISK_COLUMNS) + " | preemptions |",
                  "|---|---|" + "---|" * (len(DISK_COLUMNS) + 1)]
        for r in disk_rows:
            lines.append(f"| {r['round']} | {AgentSystem(r['system']).label} | "
                         + " | ".join(str(r["disk"].get(c, "n/a")) for c in DISK_COLUMNS)
                         + f" | {(r.get('arena') or {}).get('preemptions', 'n/a')} |")
        lines.append("")
    t = s["targets"]
    if s["ratios"]:
        lines.append(f"{AgentSystem.CORTEXSTREAM_DISK.label} / mlx_lm.server: " + ", ".join(
            f"{name.replace('_', ' ')} {_fmt(t[name]['ratio'], 1, 2)}x (target "
            f"{'<=' if t[name]['direction'] == 'max' else '>='} {t[name]['target']:g}x: **{verdict(t[name]['met'])}**)"
            for name in AGENT_TARGETS) + f"; every turn completed: **{verdict(t['all_completed'])}**.")
        ram = s["ratios"].get(AgentSystem.CORTEXSTREAM_RAM.value)
        if ram:
            lines.append(f"\nReference, {AgentSystem.CORTEXSTREAM_RAM.label} / mlx_lm.server: " + ", ".join(
                f"{name.replace('_', ' ')} {_fmt(ram[name], 1, 2)}x" for name in AGENT_TARGETS) + ".")
    else:
        lines.append("No ratio against mlx_lm.server: it or CortexStream did not run.")
    errors = [r for r in rows if "error" in r]
    for r in errors:
        lines.append(f"\nRound {r['round']}: {AgentSystem(r['system']).label} did not start: "
                     f"`{r['error'].strip().splitlines()[-1] if r['error'].strip() else r['error']}`")
    return lines + [""]


def markdown(data: dict[str, Any]) -> str:
    settings = data["settings"]
    lines = ["# Prefix cache disk tier: TTFT after a restart, and an agent workload against mlx_lm.server", "",
             f"Model: {settings['model']} (the same converted weights for every server). Machine: "
             f"{machine_sentence(data['machine'])}. Text: {settings['text']}."
             + (" **Quick smoke run: not a measurement.**" if settings["quick"] else ""), "",
             f"Rerun: `{settings['command']}`", ""]
    if data["summary"]["restart"]:
        lines += _restart_lines(data)
    if data["summary"]["agent"]:
        lines += _agent_lines(data)
    return "\n".join(lines)


__all__ = ["AGENT_TARGETS", "RESTART_TARGET", "agent_summary", "agent_targets", "markdown", "median",
           "restart_summary", "summaries", "verdict"]
