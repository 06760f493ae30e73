"""Ratios to the full cache, the issue's targets, Markdown tables and the PNG of `bench retrieval` (matplotlib is
optional: the `bench` extra). Everything here is computed from the stored cells, so a resumed or partial run
reports what it has."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from cortexstream.benchmarks.machine import machine_sentence
from cortexstream.benchmarks.retrieval_settings import Placement, Task

QUERY_AWARE = frozenset({"snapkv", "adakv", "pyramidkv"})  # families that compress on the question's votes
MARKERS = ("*", "o", "s", "^", "D", "v", "P", "X")


class Status(str, Enum):
    MET = "met"
    MISSED = "missed"
    NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class Target:
    text: str
    placement: Placement
    budget: float
    query_aware: bool  # True: the best query-aware policy; False: the best other evicting policy
    threshold: float   # of the full cache's accuracy
    tasks: tuple[Task, ...] = (Task.PASSKEY, Task.NEEDLE)


TARGETS = (
    Target("question in the same prompt: at 20% the best query-aware policy keeps >= 90% of the full cache's "
           "passkey and needle accuracy", Placement.SAME_PROMPT, 0.2, True, 0.9),
    Target("question in a later turn: at 33% the best query-agnostic policy keeps >= 80% of the full cache's "
           "passkey and needle accuracy", Placement.LATER_TURN, 0.33, False, 0.8),
)


def same_budget(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and math.isclose(a, b, abs_tol=1e-9)


def full_row(rows: list[dict[str, Any]], task: str, placement: str, context: int) -> dict[str, Any] | None:
    return next((r for r in rows if not r["evicts"] and r["task"] == task and r["placement"] == placement
                 and r["context"] == context), None)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each cell's accuracy over the full cache's in the same (task, placement, context): `ratio_to_full` (None
    without a full cell, or when the full cache answered nothing right)."""
    for r in rows:
        full = full_row(rows, r["task"], r["placement"], r["context"])
        r["full_accuracy"] = full["accuracy"] if full else None
        r["ratio_to_full"] = r["accuracy"] / full["accuracy"] if full and full["accuracy"] > 0 else None


def judge(target: Target, data: dict[str, Any]) -> dict[str, Any]:
    """The target's status from the stored cells, with one line per (task, context) it needs."""
    rows, details, states = data["cells"], [], []
    for task in target.tasks:
        for context in data["settings"]["contexts"]:
            where = f"{task.value} {context}"
            full = full_row(rows, task.value, target.placement.value, context)
            candidates = [r for r in rows if r["evicts"] and r["task"] == task.value and r["context"] == context
                          and r["placement"] == target.placement.value and same_budget(r["budget"], target.budget)
                          and (r["family"] in QUERY_AWARE) == target.query_aware]
            if full is None or not candidates:
                states.append(Status.NOT_MEASURED)
                details.append(f"{where}: not measured ({'no full cache' if full is None else 'no such policy'} "
                               f"cell)")
                continue
            if full["accuracy"] == 0:
                states.append(Status.NOT_MEASURED)
                details.append(f"{where}: the full cache answered 0/{full['trials']}: no ratio")
                continue
            best = max(candidates, key=lambda r: r["accuracy"])
            ratio = best["accuracy"] / full["accuracy"]
            states.append(Status.MET if ratio >= target.threshold else Status.MISSED)
            details.append(f"{where}: {best['policy']} {best['correct']}/{best['trials']} vs full "
                           f"{full['correct']}/{full['trials']} = {ratio:.2f}")
    status = Status.MISSED if Status.MISSED in states else Status.NOT_MEASURED if Status.NOT_MEASURED in states \
        else Status.MET
    return {"target": target.text, "status": status.value, "details": details}


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [judge(t, data) for t in TARGETS]


def _label(r: dict[str, Any]) -> str:
    return r["policy"]


def _cell_text(r: dict[str, Any] | None) -> str:
    if r is None:
        return "—"
    ratio = "n/a" if r.get("ratio_to_full") is None else f"{r['ratio_to_full']:.2f}"
    text = f"{r['accuracy'] * 100:.0f}% ({ratio})"
    if len(r["question_accuracy"]) > 1:
        text += "; " + ", ".join(f"q{i + 1} {a * 100:.0f}%" for i, a in enumerate(r["question_accuracy"]))
    return text


def _policy_rows(rows: list[dict[str, Any]]) -> list[tuple[str, float | None]]:
    """(policy, budget) in the order measured, the full cache first, then by budget."""
    seen: dict[str, float | None] = {}
    for r in rows:
        seen.setdefault(_label(r), r["budget"])
    return sorted(seen.items(), key=lambda kv: (kv[1] is not None, kv[1] or 0.0))


def _task_table(rows: list[dict[str, Any]], contexts: list[int]) -> list[str]:
    lines = ["| policy | budget | " + " | ".join(f"{c} tokens" for c in contexts) + " |",
             "|---|---:|" + "---:|" * len(contexts)]
    for label, budget in _policy_rows(rows):
        cells = [_cell_text(next((r for r in rows if _label(r) == label and r["context"] == c), None))
                 for c in contexts]
        lines.append(f"| {label} | {'—' if budget is None else f'{budget:g}'} | " + " | ".join(cells) + " |")
    return lines


def _best_table(data: dict[str, Any]) -> list[str]:
    rows, s = data["cells"], data["settings"]
    pairs = [(t, p) for t in s["tasks"] for p in s["placements"]
             if any(r["task"] == t and r["placement"] == p for r in rows)]
    lines = ["| budget | " + " | ".join(f"{t} / {p}" for t, p in pairs) + " |", "|---:|" + "---|" * len(pairs)]
    for budget in s["budgets"]:
        cells = []
        for task, placement in pairs:
            scored: dict[str, list[float]] = {}
            for r in rows:
                if r["task"] == task and r["placement"] == placement and r["evicts"] \
                        and same_budget(r["budget"], budget):
                    scored.setdefault(r["policy"], []).append(r["accuracy"])
            if not scored:
                cells.append("—")
                continue
            means = {p: sum(a) / len(a) for p, a in scored.items()}
            top = max(means.values())
            best = ", ".join(p.split(":")[0] for p, m in means.items() if m == top) if top > 0 else "none right"
            cells.append(f"{best} {top * 100:.0f}%")
        lines.append(f"| {budget:g} | " + " | ".join(cells) + " |")
    return lines


def _cells_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| task | placement | context | policy | budget (tokens) | KV MiB | correct / trials | accuracy | "
             "vs full | by depth (10% → 90%) | seconds |", "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        marks = "".join("✓" if t["correct"] else "·" for t in r["results"])
        ratio = "n/a" if r.get("ratio_to_full") is None else f"{r['ratio_to_full']:.2f}"
        lines.append(f"| {r['task']} | {r['placement']} | {r['context']} | {r['policy']} | {r['budget_tokens']} | "
                     f"{r['kv_bytes'] / 2**20:.1f} | {r['correct']} / {r['trials']} | {r['accuracy'] * 100:.0f}% | "
                     f"{ratio} | `{marks}` | {r['seconds']:.0f} |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    s, rows = data["settings"], data["cells"]
    out = ["# Retrieval from a compressed KV cache (`cortexstream bench retrieval`)", "",
           f"Model: {s['model']}. Machine: {machine_sentence(data['machine'])}.", "",
           f"Command: `{s['command']}`. {s['trials']} trials per cell (depths 10% → 90%, keys and names from seed "
           f"{s['seed']} per task, placement and context: every policy gets the same trials), prompts in chunks of "
           f"{s['chunk']} tokens with the policy acting after each chunk and each answer token, greedy answers of "
           f"at most {s['answer_tokens']} tokens, exact match of the first number. A context counts the document "
           "and its questions; budgets are fractions of the context plus every answer's tokens.", "",
           "Placements: `same_prompt`: document and question are one prompt, compressed once it is complete; "
           "`later_turn`: the document alone is compressed, then the question arrives as the next turn on the "
           "compressed cache. multiquery asks its second question after the first answer, on the same cache; a "
           "trial counts when both answers are right (q1, q2: each question's accuracy).", "",
           "Perplexity at these budgets is not this benchmark's job: `cortexstream bench quality` (and `bench "
           "frontier`) measure it.", ""]
    if data.get("targets"):
        out += ["## Targets", "", "| target | measured | status |", "|---|---|---|"]
        out += [f"| {t['target']} | {'<br>'.join(t['details'])} | **{t['status']}** |" for t in data["targets"]]
        out += [""]
    if rows:
        out += ["## Best policy per budget", "", "Evicting policies by accuracy (mean over contexts).", ""]
        out += _best_table(data) + [""]
    for task in s["tasks"]:
        for placement in s["placements"]:
            part = [r for r in rows if r["task"] == task and r["placement"] == placement]
            if part:
                out += [f"## {task} — {placement}", "", "Accuracy (ratio to the full cache's accuracy):", ""]
                out += _task_table(part, [c for c in s["contexts"] if any(r["context"] == c for r in part)]) + [""]
    if rows:
        out += ["## Cells", ""] + _cells_table(rows) + [""]
    if data.get("missing"):
        out += ["## Not measured", ""] + [f"- {m}" for m in data["missing"]] + [""]
    for run in data.get("runs", []):
        out.append(f"Run: {run['seconds'] / 60:.1f} min" + (f" (time budget {run['max_minutes']} min)"
                                                            if run.get("max_minutes") else "") + ".")
    return "\n".join(out) + "\n"


def plot(data: dict[str, Any], path: str) -> bool:
    """Accuracy against KV bytes (budget tokens x bytes per token), one panel per task and placement."""
    import matplotlib  # ImportError without the `bench` extra: common.write_report says so

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, s = data["cells"], data["settings"]
    pairs = [(t, p) for t in s["tasks"] for p in s["placements"]
             if any(r["task"] == t and r["placement"] == p for r in rows)]
    if not pairs:
        return False
    cols = min(2, len(pairs))
    fig, axes = plt.subplots((len(pairs) + cols - 1) // cols, cols, figsize=(6.5 * cols, 4.2 * len(pairs) / cols + 1),
                             squeeze=False)
    for ax, (task, placement) in zip(axes.flat, pairs):
        part = [r for r in rows if r["task"] == task and r["placement"] == placement]
        for i, template in enumerate(dict.fromkeys(r["template"] for r in part)):
            marker = MARKERS[i % len(MARKERS)]  # overlapping points stay visible by their shapes
            for context in sorted({r["context"] for r in part}):
                pts = sorted((r["kv_bytes"] / 2**20, r["accuracy"] * 100) for r in part
                             if r["template"] == template and r["context"] == context)
                if pts:
                    ax.plot(*zip(*pts), marker + ("-" if len(pts) > 1 else ""), markersize=10 - i, alpha=0.75,
                            markerfacecolor="none", label=f"{template.split(':')[0]} {context}")
        ax.set(xlabel="KV cache (MiB)", ylabel="accuracy %", title=f"{task} / {placement}", ylim=(-5, 105))
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(pairs):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


__all__ = ["QUERY_AWARE", "Status", "TARGETS", "Target", "add_ratios", "judge", "markdown", "plot", "targets"]
