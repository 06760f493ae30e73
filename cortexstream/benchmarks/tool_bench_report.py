"""The Markdown of `bench tools`: tool calls and json_schema answers per server, and what each server said when it
refused a request (its HTTP status and message, as received)."""

from __future__ import annotations

from typing import Any

from cortexstream.benchmarks.machine import machine_sentence


def _pct(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else "0/0"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))) or "-"


def _errors(rows: list[dict[str, Any]], what: str) -> list[str]:
    """One line per (server, error outcome): how many, and the first message received."""
    out = []
    for r in rows:
        seen: dict[str, str] = {}
        for a in r["answers"]:
            if a["outcome"].startswith("http_") or a["outcome"] == "no_answer":
                seen.setdefault(a["outcome"], a["content"])
        for outcome, message in seen.items():
            label = f"{r['system']} {r.get('tool_choice', what)}"
            out.append(f"- {label}: {r['outcomes'][outcome]} x {outcome}: `{' '.join(message.split())[:300]}`")
    return out


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    out = ["# Tool calls and enforced JSON over HTTP (`cortexstream bench tools`)", "",
           f"Command: `{s['command']}`", "", f"Machine: {machine_sentence(data['machine'])}.", "",
           f"Model: {s['model']}, converted once to an mlx-lm directory that every server loads. Servers run one "
           f"at a time on 127.0.0.1, each asked with the `openai` SDK, {s['workers']} requests in flight, greedy "
           f"(temperature 0). vllm-mlx and rapid-mlx start with `--enable-auto-tool-choice --tool-call-parser "
           f"{s['tool_parser']}`; CortexStream and mlx_lm.server read the format from the chat template "
           "(`cortexstream auto`: `cortexstream serve` with its default KV storage).", ""]
    out += ["## Tool calls", "",
            f"A case counts when the response's `tool_calls` holds one call to the function its prompt needs, "
            f"with arguments that parse and validate against that tool's schema (`parallel_tool_calls=false`, "
            f"max_tokens {s['max_tokens']}). `untagged_call`: the answer is the right call written as JSON text "
            "that the server did not turn into a call (a client sees no call). `http_<n>`: the server answered "
            "with that error status.", "",
            "| server | tool_choice | right call, valid arguments | outcomes | finish reasons | seconds |",
            "|---|---|---:|---|---|---:|"]
    for r in data["tools"]:
        out.append(f"| {r['system']} | {r['tool_choice']} | {_pct(r['correct'], r['cases'])} | "
                   f"{_counts(r['outcomes'])} | {_counts(r['finish_reasons'])} | {r['seconds']:.1f} |")
    if data["schemas"]:
        out += ["", "## `response_format` json_schema", "",
                f"The first {s['schemas']} schemas of `bench structured`, asked in words and sent with "
                "`response_format: {type: json_schema, strict: true}` (max_tokens "
                f"{s['schema_max_tokens']}). Valid: `json.loads` parses the whole answer and `jsonschema` accepts "
                "it. A server that does not enforce the schema shows it here as invalid or unparseable answers.",
                "", "| server | valid | outcomes | valid once a code fence is removed | finish reasons | seconds |",
                "|---|---:|---|---:|---|---:|"]
        for r in data["schemas"]:
            lenient = sum(1 for a in r["answers"] if a.get("valid_unfenced"))
            out.append(f"| {r['system']} | {_pct(r['valid'], r['cases'])} | {_counts(r['outcomes'])} | {lenient} | "
                       f"{_counts(r['finish_reasons'])} | {r['seconds']:.1f} |")
    errors = _errors(data["tools"], "") + _errors(data["schemas"], "json_schema")
    if errors:
        out += ["", "## Errors the servers answered with", ""] + errors
    out += ["", "## Servers", "", "| server | started | peak RSS MiB | seconds (start to stop) |", "|---|---|---:|---:|"]
    failed = []
    for r in data["servers"]:
        if r["started"]:
            out.append(f"| {r['system']} | yes | {r['peak_rss_bytes'] / 2**20:.0f} | {r['seconds']:.0f} |")
        else:
            out.append(f"| {r['system']} | no | - | - |")
            failed.append(f"- {r['system']} did not start: `{' '.join(r['error'].split())[-400:]}`")
    out += ([""] + failed if failed else []) + [""]
    for run in data.get("runs", []):
        out.append(f"Run: {run['seconds'] / 60:.1f} min.")
    return "\n".join(out) + "\n"


__all__ = ["markdown"]
