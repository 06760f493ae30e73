"""The Markdown report of `bench structured`: a short table per part, the command line and the machine.

Targets are judged on measured rows only; a target with no measured row is "not measured", never met.
"""

from __future__ import annotations

from typing import Any

from cortexstream.benchmarks.machine import machine_sentence

MASK_RATIO_TARGET = 0.9
MISSES_SHOWN = 20


def _pct(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else "—"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "—"


def targets(data: dict[str, Any]) -> list[dict[str, str]]:
    checks = [(f"{r['model']}: {r['ratio']:.3f}", r["ratio"] >= MASK_RATIO_TARGET) for r in data["mask_cost"]]
    status = "not measured" if not checks else "met" if all(ok for _, ok in checks) else "missed"
    return [{"target": f"constrained / unconstrained decode tokens/s at batch {data['settings']['batch']} >= "
                       f"{MASK_RATIO_TARGET}", "measured": "; ".join(t for t, _ in checks) or "—",
             "status": status}]


def _validity(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| model | decoding | requests at once | constrained | valid (parse + schema) | parse | 'length' "
           "finishes | finish reasons | tokens | seconds |", "|---|---|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['decoding']} | {r['concurrency']} | {'yes' if r['constrained'] else 'no'} | "
                   f"{_pct(r['valid'], r['schemas'])} | {r['parsed']} | {r['length_finishes']} | "
                   f"{_counts(r['finish_reasons'])} | {r['tokens']} | {r['seconds']:.1f} |")
    return out


def _misses(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if not r["constrained"]:
            continue
        for o in r["outputs"]:
            if o["verdict"] != "valid":
                snippet = o["text"][:70].replace("|", "\\|").replace("\n", " ")
                out.append(f"- {r['model']} {r['decoding']} c={r['concurrency']}: `{o['schema']}` {o['verdict']}, "
                           f"finish {o['finish_reason']} after {o['tokens']} tokens: `{snippet}`")
    more = len(out) - MISSES_SHOWN
    return out[:MISSES_SHOWN] + ([f"- ... and {more} more (all in the JSON)"] if more > 0 else [])


def _mask_cost(rows: list[dict[str, Any]]) -> list[str]:
    out = ["| model | batch | requests | tokens per run (constrained / free) | constrained tokens/s (median; rounds) "
           "| unconstrained tokens/s | ratio |", "|---|---:|---:|---|---|---|---:|"]
    for r in rows:
        each = [", ".join(f"{x:.1f}" for x in r[f"{side}_tps"]) for side in ("constrained", "unconstrained")]
        tokens = " / ".join(", ".join(map(str, sorted(set(r[f"{side}_tokens"]))))
                            for side in ("constrained", "unconstrained"))
        out.append(f"| {r['model']} | {r['batch']} | {r['requests']} | {tokens} | {r['constrained_tps_median']:.1f} "
                   f"({each[0]}) | {r['unconstrained_tps_median']:.1f} ({each[1]}) | **{r['ratio']:.3f}** |")
    return out


def _host(compiles: list[dict[str, Any]], masks: list[dict[str, Any]]) -> list[str]:
    out = ["| model | warm() s | compile p50 ms | compile p99 ms | compile max ms | mask tokens | mask + consume "
           "p50 µs | p99 µs | mean µs |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in compiles:
        m = next((x for x in masks if x["model"] == c["model"]), None)
        mask = (f"{m['tokens']} | {m['mask_us_p50']:.0f} | {m['mask_us_p99']:.0f} | {m['mask_us_mean']:.0f}" if m
                else "— | — | — | —")
        out.append(f"| {c['model']} | {c['warm_seconds']:.2f} | {c['compile_ms_p50']:.2f} | "
                   f"{c['compile_ms_p99']:.2f} | {c['compile_ms_max']:.2f} | {mask} |")
    return out


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    out = ["# Structured output (`cortexstream bench structured`)", "", f"Command: `{s['command']}`", "",
           f"Machine: {machine_sentence(data['machine'])}.", "",
           f"Models: {', '.join(s['model_names'])}. {s['schemas']} JSON schemas, max_tokens {s['max_tokens']}, "
           f"sampled runs at temperature {s['temperature']} (request i seeded {s['seed']} + i).", "",
           "## Targets", "", "| target | measured | status |", "|---|---|---|"]
    out += [f"| {t['target']} | {t['measured']} | **{t['status']}** |" for t in targets(data)] + [""]
    out += ["## Validity", "",
            "An output counts when `json.loads` parses all of it and `jsonschema.validate` accepts it. The schemas "
            "bound every string (maxLength, a pattern or an enum), array (maxItems) and integer, close every object "
            "(`additionalProperties: false`) and give most numbers a binary multipleOf: otherwise a small greedy "
            "model can loop inside a value until max_tokens. A 'length' finish is a miss, counted in its column. "
            "The unconstrained row (same prompts, greedy) is the baseline: what the model writes without the "
            "mask. Seconds are the cell's wall time, not a speed measurement (one engine runs every cell, so the "
            "cells after the first find their prompts in the prefix cache; speed is the next section's).", ""] + _validity(data["validity"]) + [""]
    for r in data["validity"]:
        if not r["constrained"]:
            out.append(f"Baseline {r['model']}: {r['valid_unfenced']} of {r['schemas']} valid once a Markdown code "
                       "fence around the JSON is removed (a lenient client).")
    misses = _misses(data["validity"])
    if misses:
        out += ["", "Constrained outputs that did not count:", ""] + misses
    out += ["", "## Mask cost", "",
            f"Decode tokens/s at batch {s['batch']}: every request constrained vs every request free, the same "
            f"prompts, {s['rounds']} round(s) alternating which goes first; tokens/s = generated tokens / wall seconds "
            "of the whole engine run. Each request's max_tokens is the length of its constrained greedy answer "
            "(a calibration run) and the free engine has no end-of-sequence token, so both decode the same tokens "
            "and the batch empties at the same steps: the ratio is the mask's cost, not a difference in lengths.",
            ""] + _mask_cost(data["mask_cost"]) + [""]
    out += ["## Grammar compile and host mask time", "",
            "A fresh `GrammarCompiler`: `warm()` once, then `constraint(GrammarSpec.json_schema(s))` per schema; "
            "the mask time is `allowed(vocab)` + `consume(token)` per token of an engine output, fed to a fresh "
            "constraint.", ""] + _host(data["compile"], data["host_mask"]) + [""]
    out += ["Tool calls, and json_schema requests to the peer servers, are measured by `cortexstream bench tools` "
            "(`tools.md`).", ""]
    for run in data.get("runs", []):
        seconds = run["seconds"]
        out.append(f"Run: {seconds / 60:.1f} min." if seconds >= 60 else f"Run: {seconds:.0f} s.")
    return "\n".join(out) + "\n"


__all__ = ["MASK_RATIO_TARGET", "markdown", "targets"]
