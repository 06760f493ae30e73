"""Medians, ratios to plain decoding, the issue's targets and the Markdown of `bench speculative`. Everything is
computed from the stored cells, so a resumed or partial run reports what it has.

Targets (issue #36, prompt lookup): decode tokens/s of prompt lookup over plain decoding >= 1.5x on the
input-grounded tasks at concurrency 1, >= 1.2x on them at concurrency 8 (applied here to every concurrency above 1),
>= 1.0x on open-ended chat at every concurrency; per model, decoding mode and prompt-lookup setting.
"""

from __future__ import annotations

import statistics
from enum import Enum
from typing import Any

from cortexstream.benchmarks.machine import machine_sentence
from cortexstream.benchmarks.speculative_measure import MLX_LM, PLAIN
from cortexstream.benchmarks.speculative_tasks import Task

GROUNDED_SINGLE = 1.5  # input-grounded tasks, concurrency 1
GROUNDED_BATCHED = 1.2  # input-grounded tasks, concurrency 8 in the issue
CHAT = 1.0  # open-ended chat (adaptive k must not lose)


class Status(str, Enum):
    MET = "met"
    MISSED = "missed"
    NOT_MEASURED = "not measured"


def gap_lines(data: dict[str, Any]) -> list[str]:
    """The report's list of what was skipped (with why) and what was not measured."""
    lines = [f"- skipped: {note['model']}: {note['reason']}" for note in data.get("skipped", [])]
    if data.get("missing"):
        lines.append(f"- not measured (time budget or interrupted): {', '.join(data['missing'])}")
    return lines


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def target_for(task: str, concurrency: int) -> float:
    """The decode tokens/s ratio (prompt lookup / plain) the issue asks of `task` at `concurrency`."""
    if not Task(task).grounded:
        return CHAT
    return GROUNDED_SINGLE if concurrency == 1 else GROUNDED_BATCHED


def spec_summary(counters: list[dict[str, int] | None]) -> dict[str, float | None]:
    """Over all rounds: the share of drafted tokens accepted, accepted and drafted tokens per verify pass (a
    sequence's drafts checked in one forward), and verify passes per round."""
    rows = [c for c in counters if c]
    verify = sum(c["verify_steps"] for c in rows)
    drafted = sum(c["drafted"] for c in rows)
    accepted = sum(c["accepted"] for c in rows)
    return {"acceptance_rate": accepted / drafted if drafted else None,
            "accepted_per_verify": accepted / verify if verify else None,
            "drafted_per_verify": drafted / verify if verify else None,
            "verify_steps_per_round": verify / len(rows) if rows else None}


def system_summary(system: dict[str, Any]) -> dict[str, Any]:
    """Medians of one system's rounds (and its speculation counters when it has them)."""
    summary = {"wall_median_s": median(system["wall_s"]), "decode_tps_median": median(system["decode_tps"]),
               "generated_tokens_median": median(system["generated_tokens"])}
    if system.get("spec") is not None:
        summary.update(spec_summary(system["spec"]))
    return summary


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def cell_ratios(cell: dict[str, Any], spec: str) -> dict[str, float | None]:
    """Prompt lookup `spec` against plain decoding (decode tokens/s and wall time, > 1: faster) and against mlx-lm
    (decode tokens/s), from the medians."""
    s = {name: system_summary(row) for name, row in cell["systems"].items()}
    ours, plain, peer = s[spec], s[PLAIN], s.get(MLX_LM)
    return {"decode_vs_plain": _ratio(ours["decode_tps_median"], plain["decode_tps_median"]),
            "wall_vs_plain": _ratio(plain["wall_median_s"], ours["wall_median_s"]),
            "decode_vs_mlx_lm": _ratio(ours["decode_tps_median"], peer["decode_tps_median"]) if peer else None}


def targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (model, mode, task, concurrency, prompt-lookup setting) the settings ask for: the measured
    ratio, the target and its status (not measured: the cell is missing)."""
    s = data["settings"]
    rows = []
    for model in s["models"]:
        for mode in s["modes"]:
            for task in s["tasks"]:
                for c in s["concurrency"]:
                    cell = find_cell(data["cells"], model, task, mode, c)
                    for spec in s["speculative"]:
                        ratio = cell_ratios(cell, spec)["decode_vs_plain"] if cell else None
                        target = target_for(task, c)
                        status = (Status.NOT_MEASURED if ratio is None
                                  else Status.MET if ratio >= target else Status.MISSED)
                        rows.append({"model": model, "mode": mode, "task": task, "concurrency": c, "system": spec,
                                     "ratio": ratio, "target": target, "status": status.value})
    return rows


def find_cell(cells: list[dict[str, Any]], model: str, task: str, mode: str, c: int) -> dict[str, Any] | None:
    return next((x for x in cells if x["model"] == model and x["task"] == task and x["mode"] == mode
                 and x["concurrency"] == c), None)


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def _exact(cell: dict[str, Any], name: str) -> str:
    if "differing_texts" not in cell:
        return "n/a (sampled)"
    n = cell["differing_texts_mlx_lm"] if name == MLX_LM else cell["differing_texts"].get(name)
    if n is None:
        return ""
    return "yes" if n == 0 else f"no ({n} of {cell['concurrency']} differ)"


def _cell_rows(cell: dict[str, Any], specs: list[str]) -> list[str]:
    rows = []
    names = [PLAIN, *specs, MLX_LM]
    for name in names:
        if name not in cell["systems"]:
            continue
        s = system_summary(cell["systems"][name])
        r = cell_ratios(cell, name) if name in specs else {}
        accept = s.get("acceptance_rate")
        rows.append(f"| {cell['task']} | {cell['concurrency']} | {name} | {_num(s['wall_median_s'])} | "
                    f"{_num(s['decode_tps_median'], 1)} | {_num(s['generated_tokens_median'], 0)} | "
                    f"{_num(r.get('decode_vs_plain'), 2, 'x')} | {_num(r.get('wall_vs_plain'), 2, 'x')} | "
                    f"{_num(r.get('decode_vs_mlx_lm'), 2, 'x')} | "
                    f"{'—' if accept is None else f'{100 * accept:.0f}%'} | "
                    f"{_num(s.get('accepted_per_verify'))} | {_exact(cell, name) if name != PLAIN else ''} |")
    return rows


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    lines = ["# Speculative decoding (prompt lookup) vs plain decoding and mlx-lm (issue #36)", ""]
    models = ", ".join(f"{m} ({s['model_records'].get(m, {}).get('source', 'not loaded')})" for m in s["models"])
    machine = f"{machine_sentence(data['machine'])}, mlx-lm {data['machine']['mlx_lm']}"
    lines += [f"Models: {models}  ", f"Machine: {machine}  ",
              f"Rerun: `{s['command']}`", ""]
    lines += [f"Prompts: chat template applied; {s['max_tokens']} new tokens at most per request (eos ends a request "
              f"early); {s['rounds']} round(s) per cell, the systems' order rotating each round, medians. Sampled: "
              f"temperature {s['temperature']:g} with no seed (a seeded request decodes plainly, so it would measure "
              f"nothing); its texts differ from round to round. Passages: {s['text_source']}.  ",
              "Decode tok/s: at concurrency 1 tokens after the first over the time after the first token (timed on "
              "the stream); above 1 the batch call's own stats (CortexStream: tokens after each request's first "
              "over the time from the first first token; mlx-lm: its generation_tps). Wall: the whole public call, "
              "engine construction included. Accept: drafted tokens accepted; acc/verify: accepted tokens per "
              "verify pass (one sequence's drafts checked in one forward). Same text: greedy texts equal plain "
              "decoding's in every round.", ""]
    lines += gap_lines(data)
    lines += ["", "## Targets (decode tok/s, prompt lookup / plain)", "",
              "| model | mode | task | concurrency | setting | ratio | target | status |",
              "|---|---|---|---|---|---|---|---|"]
    for t in data.get("targets") or targets(data):
        note = " (issue: at 8)" if Task(t["task"]).grounded and t["concurrency"] not in (1, 8) else ""
        lines.append(f"| {t['model']} | {t['mode']} | {t['task']} | {t['concurrency']} | {t['system']} | "
                     f"{_num(t['ratio'], 2, 'x')} | >= {t['target']:.1f}x{note} | {t['status']} |")
    for model in s["models"]:
        for mode in s["modes"]:
            cells = [c for c in data["cells"] if c["model"] == model and c["mode"] == mode]
            if not cells:
                continue
            lines += ["", f"## {model}, {mode}", "",
                      "| task | conc | system | wall s | decode tok/s | tokens | x plain decode | x plain wall | "
                      "x mlx-lm decode | accept | acc/verify | same text as plain |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            order = {t: i for i, t in enumerate(s["tasks"])}
            for cell in sorted(cells, key=lambda c: (order.get(c["task"], 99), c["concurrency"])):
                lines += _cell_rows(cell, s["speculative"])
    return "\n".join(lines) + "\n"


__all__ = ["CHAT", "GROUNDED_BATCHED", "GROUNDED_SINGLE", "Status", "cell_ratios", "find_cell", "markdown",
           "spec_summary", "system_summary", "target_for", "targets"]
