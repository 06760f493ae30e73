"""The memory-bound section of the `cortexstream bench serve` report: ratios against the float arena at the same
KV budget, the issue's targets judged from the measured numbers, the Markdown table and the plot panels."""

from __future__ import annotations

from typing import Any

# kv_dtype -> least running-sequence peak, as a multiple of the float arena's at the same KV byte budget
CONCURRENCY_TARGETS = {"int8": 1.9, "int4": 3.5}
# least output tokens/s of those same arenas, as a multiple of the float arena's
THROUGHPUT_TARGET = 1.0

_RATIO_KEYS = ("running_peak", "running_mean", "streaming_peak", "streaming_mean", "output_tokens_per_s",
               "peak_rss_mib")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def float_reference(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first CortexStream run with a float (unquantized) arena that ran."""
    return next((r for r in runs if r["system"] == "cortexstream" and "error" not in r
                 and r.get("kv_quantized") is False), None)


def memory_ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every other run that ran against the float arena; targets only for CortexStream's int8 and int4."""
    reference = float_reference(runs)
    if reference is None:
        return []
    out = []
    for run in runs:
        if run is reference or "error" in run:
            continue
        target = CONCURRENCY_TARGETS.get(run.get("kv_dtype", "")) if run["system"] == "cortexstream" else None
        row: dict[str, Any] = {"label": run["label"], "reference": reference["label"]}
        row.update({key: _ratio(run.get(key), reference.get(key)) for key in _RATIO_KEYS})
        row["target_running_peak"] = target
        row["target_output_tokens_per_s"] = THROUGHPUT_TARGET if target is not None else None
        row["meets_running"] = None if target is None or row["running_peak"] is None else \
            row["running_peak"] >= target
        row["meets_throughput"] = None if target is None or row["output_tokens_per_s"] is None else \
            row["output_tokens_per_s"] >= THROUGHPUT_TARGET
        out.append(row)
    return out


def _fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _verdict(flag: bool | None) -> str:
    return "n/a" if flag is None else ("met" if flag else "missed")


def _row(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"| {run['label']} | {run['kv_storage']} | did not start | " + " | ".join(["n/a"] * 12) + " |"
    budget = _fmt(run["kv_bytes"], 2**-20, 2) if run["kv_budget_enforced"] else "not enforced"
    cells = [run["label"], run["kv_storage"], budget, _fmt(run.get("bytes_per_token"), 1, 0),
             _fmt(run.get("kv_tokens"), 1, 0), _fmt(run["running_peak"], 1, 0), _fmt(run["running_mean"], 1, 1),
             _fmt(run["streaming_peak"], 1, 0), _fmt(run["streaming_mean"], 1, 1),
             _fmt(run["output_tokens_per_s"], 1, 1), _fmt(run["ttft_p50_s"], 1e3, 0), _fmt(run["ttft_p95_s"], 1e3, 0),
             str(run["completed"]) + (f" ({run['empty_replies']} empty)" if run.get("empty_replies") else ""),
             str(run["failed"]), _fmt(run["peak_rss_mib"], 1, 0)]
    return "| " + " | ".join(cells) + " |"


def _ratio_line(row: dict[str, Any]) -> str:
    head = f"- {row['label']} / {row['reference']}: running peak {_times(row['running_peak'])}"
    if row["target_running_peak"] is not None:
        head += f" (target >= {row['target_running_peak']}x: {_verdict(row['meets_running'])})"
    head += f", running mean {_times(row['running_mean'])}, streaming peak {_times(row['streaming_peak'])}, " \
            f"output tok/s {_times(row['output_tokens_per_s'])}"
    if row["target_output_tokens_per_s"] is not None:
        head += f" (target >= {row['target_output_tokens_per_s']}x: {_verdict(row['meets_throughput'])})"
    return head + f", peak RSS {_times(row['peak_rss_mib'])}."


def memory_markdown(section: dict[str, Any]) -> list[str]:
    lines = [f"## {section['name']}", "", section["description"] + ".", "",
             f"KV budget {section['kv_budget_mib']:g} MiB for every CortexStream arena: its --kv-tokens is what that "
             "storage type fits in the budget, and the arena the server built is read back from /v1/kv (the KV MiB "
             f"column). --max-num-seqs is {section['sessions']}, so only the budget limits how many run. Running: the "
             f"server's running-sequences gauge from /metrics, sampled every {section['sample_interval_s']:g} s "
             "(n/a: the server has no such gauge); streaming: requests between their first and last token at once, "
             "as the client saw them. mlx_lm.server and the peers have no KV byte budget, so their KV is not held "
             "to it as CortexStream's is: their rows are as measured, at whatever process memory (peak RSS) they "
             f"reached. Longest conversation: {section['longest_conversation_tokens']} tokens (chat template not "
             "counted).", "",
             "| server | KV storage | KV MiB | bytes/token | KV tokens | running peak | running mean | streaming peak "
             "| streaming mean | output tok/s | TTFT p50 (ms) | TTFT p95 (ms) | completed | failed | peak RSS (MiB) |",
             "|" + "---|" * 15]
    lines += [_row(run) for run in section["runs"]]
    if section["ratios"]:
        lines += ["", f"Against the float arena ({section['ratios'][0]['reference']}) at the same budget:", ""]
        lines += [_ratio_line(row) for row in section["ratios"]]
    else:
        lines += ["", "No float arena ran, so no ratios (add float32 or auto to --kv-dtypes)."]
    problems = [(run["label"], run["error"]) for run in section["runs"] if "error" in run]
    problems += [(run["label"], "; ".join(run["errors"])) for run in section["runs"] if run.get("errors")]
    if problems:
        lines += ["", "Errors:", ""] + [f"- {label}: {text[:300]}" for label, text in problems]
    return lines + [""]


def plot_memory(section: dict[str, Any], ax_tps: Any, ax_running: Any) -> None:
    """Output tokens/s, and sequences at once: the server's running gauge (peak) beside the client's streaming
    peak, so the two measures are never mixed in one bar."""
    runs = [r for r in section["runs"] if "error" not in r]
    xs = list(range(len(runs)))
    ax_tps.bar(xs, [r["output_tokens_per_s"] for r in runs])
    running = [r["running_peak"] if r["running_peak"] is not None else float("nan") for r in runs]
    ax_running.bar([x - 0.2 for x in xs], running, 0.4, label="running gauge (server)")
    ax_running.bar([x + 0.2 for x in xs], [r["streaming_peak"] for r in runs], 0.4, label="streaming (client)")
    ax_running.legend(fontsize=7)
    for ax, title in ((ax_tps, f"{section['name']}: output tokens/s"),
                      (ax_running, f"{section['name']}: sequences at once (peak)")):
        ax.set_xticks(xs)
        ax.set_xticklabels([r["label"] for r in runs], fontsize=7, rotation=20, ha="right")
        ax.set_title(title, fontsize=9)
