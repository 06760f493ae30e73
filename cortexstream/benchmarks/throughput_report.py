"""Markdown report for `bench throughput`, and writing JSON + Markdown + heat map through the shared writer."""

from __future__ import annotations

import math
import os
from typing import Any

from cortexstream.benchmarks.common import write_results
from cortexstream.benchmarks.throughput_heatmap import write_heatmap
from cortexstream.benchmarks.throughput_ranks import on_ranks

COLUMNS = """Columns. *ours / mlx-lm median (s)*: median wall time of the whole public call over the rounds
(`cortexstream.batch_generate` vs `mlx_lm.batch_generate`, from the call to its return, engine construction
included). *ratio median / best*: mlx-lm's median (best) wall time / ours, > 1 means CortexStream is faster;
*paired*: the median over rounds of the per-round ratio. *target*: the ratio the issue asks for (judged on the
median ratio). *peak MLX mem*: `mx.get_peak_memory()` during the call, highest over the rounds (both include the
same model weights). *identical*: outputs whose greedy token ids equal mlx-lm's (first round; the eos token is
not compared, because mlx-lm drops it; mlx-lm pads ragged batches, which can change float rounding).
Diagnostics: *TTFT p50/p99*: CortexStream's per-request time to first token (`BatchStats.ttft`, pooled over the
rounds; measured from the first request's arrival inside the call). mlx_lm.batch_generate exposes no per-request
first-token time, only its total prompt-processing time (*mlx-lm prompt time*). *decode tok/s*: each system's
own `stats.generation_tps` (definitions differ slightly: a diagnostic, not the headline). *peak RSS*: process
peak resident memory during the call (Linux `VmHWM`, reset before each call). Before every call MLX's buffer
cache is emptied, so neither system starts with the other's buffers."""

COLUMNS_ON_RANKS = """Columns. *median / best (s)*: wall time of the whole public call over the rounds
(`cortexstream.batch_generate(..., ranks=session)`, or `cortexstream.generate` on a private engine attached to the
ranks), from the call to its return, engine construction and attaching included. *TTFT p50/p99*: per-request time
to first token (`BatchStats.ttft`, pooled over the rounds). *decode tok/s*: `stats.generation_tps`. *generated*:
tokens the first round generated. *peak MLX mem*: `mx.get_peak_memory()` on rank 0 during the call, highest over
the rounds (rank 0's shard of the weights included). *peak RSS*: rank 0's peak resident memory during the call."""


def _jit(m: dict[str, Any]) -> str:
    """How MLX built its CPU JIT kernels in that run; older records do not say (they ran with MLX's own flags)."""
    if "mlx_jit_flags" not in m:
        return ""
    return ", MLX CPU JIT kernels " + ("vectorised (kernels/mlx_jit.py)" if m["mlx_jit_flags"] else "with MLX's own flags")


def _f(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}{suffix}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _yes(flag: bool) -> str:
    return "yes" if flag else "**no**"


def _header(payload: dict[str, Any]) -> list[str]:
    m, model, s = payload["machine"], payload["model"], payload["settings"]
    if on_ranks(payload) > 1:
        return [
            f"# Throughput on {s['ranks']} ranks ({s['rank_backend']} backend): CortexStream's engine alone",
            "",
            f"Model: {model.get('source')} ({model.get('weights', 'weights as loaded')}), loaded on every rank with "
            f"`cortexstream.load()` and split tensor-parallel over the {s['ranks']} ranks; rank 0 schedules and "
            "measures, every rank computes each step. Real-text prompts (Python docs) as token ids; greedy; "
            f"{s['max_tokens']} new tokens; {_count(s['rounds'], 'round')} after one warm-up call.",
            f"Machine (rank 0): {m.get('platform')}, {m.get('cpu_count')} cores, {m.get('device')}, BLAS: "
            f"{m.get('blas')}, mlx {m.get('mlx')}{_jit(m)}. Run took {_f(payload.get('elapsed_minutes'), 1)} minutes.",
            "",
            "## mlx-lm not measured",
            "",
            payload.get("mlx_lm_skipped", "") + ".",
            "",
        ]
    return [
        "# Throughput: what a user feels, CortexStream vs mlx-lm (issue #17)",
        "",
        f"Model: {model.get('source')} ({model.get('weights', 'weights as loaded')}), loaded once with "
        "`cortexstream.load()` and given to both systems; real-text prompts (Python docs) as token ids; greedy; "
        f"{s['max_tokens']} new tokens; {_count(s['rounds'], 'round')} in alternating order after one warm-up call "
        "per system.",
        f"Machine: {m.get('platform')}, {m.get('cpu_count')} cores, {m.get('device')}, BLAS: {m.get('blas')}, "
        f"mlx {m.get('mlx')}{_jit(m)}. Run took {_f(payload.get('elapsed_minutes'), 1)} minutes.",
        "",
    ]


def _summary(payload: dict[str, Any]) -> list[str]:
    lines = ["## Targets (reported, not enforced)", "", "| target | cells measured | met | not met |",
             "|---|---:|---:|---:|"]
    cells = payload["matrix"]
    base = [c for c in cells if c["ratio_target"] <= 1.0]
    strict = [c for c in cells if c["ratio_target"] > 1.0]

    def row(name: str, group: list[dict], key: str) -> None:
        met = [c for c in group if c[key]]
        missed = ", ".join(f"{c['kind']} c={c['concurrency']} {c['prompt_tokens']}" for c in group if not c[key])
        lines.append(f"| {name} | {len(group)} | {len(met)} | {missed or '-'} |")

    row("wall time >= 1.0x mlx_lm.batch_generate (median)", base, "meets_ratio_target")
    row("wall time >= 1.25x, ragged and shared prefix at concurrency >= 8", strict, "meets_ratio_target")
    row("peak MLX memory <= mlx-lm's", cells, "meets_memory_target")
    itl = payload.get("itl")
    if itl:
        lines.append(f"| ITL p99 while a {itl['admit_tokens']}-token prompt is admitted <= {itl['target']:.0f}x "
                     f"steady median | 1 | {int(itl['meets_target'])} | "
                     f"{'-' if itl['meets_target'] else _f(itl['window_p99_over_steady_median']) + 'x'} |")
    for r in payload["single"]:
        missed = "-" if r["meets_ratio_target"] else _f(r["ratio_median"]) + "x"
        lines.append(f"| single stream, {r['prompt_tokens']}-token prompt: generate >= 1.0x mlx_lm.generate | 1 | "
                     f"{int(r['meets_ratio_target'])} | {missed} |")
    return lines + [""]


def _matrix(payload: dict[str, Any]) -> list[str]:
    if not payload["matrix"]:
        return []
    lines = ["## Matrix: whole `batch_generate` call", "",
             "| kind | concurrency | prompt tokens | ours median (s) | mlx-lm median (s) | ratio median | ratio best "
             "| paired | target | met | peak MLX mem ours / mlx-lm (GB) | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    diag = ["### Latency and diagnostics", "",
            "| kind | concurrency | prompt tokens (min-max) | TTFT p50 (s) | TTFT p99 (s) | mlx-lm prompt time (s) "
            "| decode tok/s ours / mlx-lm | peak RSS ours / mlx-lm (GB) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c in payload["matrix"]:
        us, ref = c["cortexstream"], c["mlx_lm"]
        lines.append(
            f"| {c['kind']} | {c['concurrency']} | {c['prompt_tokens']} | {_f(us['wall_median_s'])} | "
            f"{_f(ref['wall_median_s'])} | **{_f(c['ratio_median'])}x** | {_f(c['ratio_best'])}x | "
            f"{_f(c['ratio_paired_median'])}x | {c['ratio_target']:.2f}x | {_yes(c['meets_ratio_target'])} | "
            f"{_f(us['peak_memory_gb'], 3)} / {_f(ref['peak_memory_gb'], 3)} | "
            f"{c['identical_outputs']}/{c['outputs']} |")
        p = c["prompts"]
        diag.append(
            f"| {c['kind']} | {c['concurrency']} | {p['min']}-{p['max']} | {_f(us['ttft_p50_s'])} | "
            f"{_f(us['ttft_p99_s'])} | {_f(ref['prompt_time_s'])} | {_f(us['decode_tps'], 1)} / "
            f"{_f(ref['decode_tps'], 1)} | {_f(us['peak_rss_gb'])} / {_f(ref['peak_rss_gb'])} |")
    mismatched = [c for c in payload["matrix"] if c["first_mismatches"]]
    notes = []
    for c in mismatched:
        where = "; ".join(f"prompt {m['prompt']} from token {m['first_difference_at_token']}"
                          for m in c["first_mismatches"])
        notes.append(f"- {c['kind']} c={c['concurrency']} {c['prompt_tokens']}: outputs differ ({where}).")
    return lines + ([""] + notes if notes else []) + [""] + diag + [""]


def _itl(itl: dict[str, Any] | None) -> list[str]:
    if not itl:
        return []
    rows = [(name, itl[key]) for name, key in (("steady (before admission)", "steady"),
                                                 ("admission window", "window"), ("after", "after"),
                                                 ("overall", "overall"))]
    ttfts = ", ".join(_f(t) for t in itl["admitted_ttft_s"])
    return [
        f"## Inter-token latency while a {itl['admit_tokens']}-token prompt is admitted", "",
        f"{itl['streams']} streams with {itl['stream_prompt_tokens']}-token prompts decode "
        f"{itl['warm_tokens']} tokens, then the long prompt arrives; each interval between two tokens of a running "
        "stream counts in the admission window when it overlaps the time from the long prompt's arrival to its first "
        "token. Engine stepped directly (tokens stamped when `step()` returns them); "
        f"{_count(itl['rounds'], 'fresh engine')}, intervals pooled.", "",
        "| intervals | count | median (ms) | p99 (ms) | max (ms) |", "|---|---:|---:|---:|---:|",
        *[f"| {name} | {v['count']} | {_f(v['median_s'] * 1e3, 1)} | {_f(v['p99_s'] * 1e3, 1)} | "
          f"{_f(v['max_s'] * 1e3, 1)} |" for name, v in rows],
        "",
        f"Window p99 / steady median: **{_f(itl['window_p99_over_steady_median'])}x** (target <= "
        f"{itl['target']:.0f}x: {_yes(itl['meets_target'])}); overall p99 / overall median: "
        f"{_f(itl['overall_p99_over_overall_median'])}x. The admitted prompt's TTFT per round (s): {ttfts}.", "",
    ]


def _matrix_on_ranks(cells: list[dict[str, Any]]) -> list[str]:
    if not cells:
        return []
    lines = ["## Matrix: whole `batch_generate(..., ranks=session)` call", "",
             "| kind | concurrency | prompt tokens (min-max) | median (s) | best (s) | TTFT p50 (s) | TTFT p99 (s) | "
             "decode tok/s | generated | peak MLX mem (GB) | peak RSS (GB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        us, p = c["cortexstream"], c["prompts"]
        lines.append(f"| {c['kind']} | {c['concurrency']} | {p['min']}-{p['max']} | {_f(us['wall_median_s'])} | "
                     f"{_f(us['wall_best_s'])} | {_f(us['ttft_p50_s'])} | {_f(us['ttft_p99_s'])} | "
                     f"{_f(us['decode_tps'], 1)} | {us['generated_tokens']} | {_f(us['peak_memory_gb'], 3)} | "
                     f"{_f(us['peak_rss_gb'])} |")
    return lines + [""]


def _single_on_ranks(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["## Single stream: `cortexstream.generate` on the ranks", "",
             "| prompt tokens | median (s) | best (s) | peak MLX mem (GB) |", "|---:|---:|---:|---:|"]
    for r in rows:
        us = r["cortexstream"]
        lines.append(f"| {r['prompt_tokens']} | {_f(us['wall_median_s'])} | {_f(us['wall_best_s'])} | "
                     f"{_f(us['peak_memory_gb'], 3)} |")
    return lines + [""]


def _single(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    lines = ["## Single stream: `cortexstream.generate` vs `mlx_lm.generate`", "",
             "| prompt tokens | ours median (s) | mlx-lm median (s) | ratio median | ratio best | paired | met | "
             "peak MLX mem ours / mlx-lm (GB) | identical text |", "|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        us, ref = r["cortexstream"], r["mlx_lm"]
        lines.append(f"| {r['prompt_tokens']} | {_f(us['wall_median_s'])} | {_f(ref['wall_median_s'])} | "
                     f"**{_f(r['ratio_median'])}x** | {_f(r['ratio_best'])}x | {_f(r['ratio_paired_median'])}x | "
                     f"{_yes(r['meets_ratio_target'])} | {_f(us['peak_memory_gb'], 3)} / "
                     f"{_f(ref['peak_memory_gb'], 3)} | {'yes' if r['identical_text'] else '**no**'} |")
    return lines + [""]


def _progress(payload: dict[str, Any]) -> list[str]:
    """A report written mid-run says so (reports without "complete" predate partial writes); a resumed one says
    how many cells an earlier run measured."""
    lines = []
    if not payload.get("complete", True):
        done, planned = len(payload["matrix"]), payload.get("planned_cells", len(payload["matrix"]))
        lines.append(f"**Partial results: {done} of {_count(planned, 'planned matrix cell')} done** (the run was "
                     "stopped or is still going; `--resume` measures the rest). Parts not yet run are missing.")
    if payload.get("resumed_cells"):
        lines.append(f"{_count(payload['resumed_cells'], 'matrix cell')} measured by an earlier run of the same "
                     "configuration (`--resume`); the minutes above include that run.")
    return lines + [""] if lines else []


def markdown(payload: dict[str, Any]) -> str:
    """The report; on several ranks our rows alone (no targets, ratios or mlx-lm columns)."""
    if on_ranks(payload) > 1:
        lines = _header(payload) + _progress(payload) + _matrix_on_ranks(payload["matrix"])
        lines += _itl(payload.get("itl")) + _single_on_ranks(payload["single"])
    else:
        lines = _header(payload) + _progress(payload) + _summary(payload) + _matrix(payload)
        lines += _itl(payload.get("itl")) + _single(payload["single"])
    if payload["skipped"]:
        lines += ["## Not measured (--max-minutes reached)", "", *[f"- {s}" for s in payload["skipped"]], ""]
    lines += [COLUMNS_ON_RANKS if on_ranks(payload) > 1 else COLUMNS, ""]
    return "\n".join(lines)


def write_report(payload: dict[str, Any], out_dir: str) -> None:
    name = payload["benchmark"]
    png = os.path.join(out_dir, f"{name}.png")
    # The heat map shows mlx-lm / ours per cell: nothing to show on several ranks.
    payload["heatmap"] = f"{name}.png" if on_ranks(payload) == 1 and write_heatmap(payload, png) else None
    write_results(out_dir, name, payload, markdown(payload))
