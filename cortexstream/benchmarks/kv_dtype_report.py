"""Markdown, targets and the PNG plot for `bench kv-dtype` (matplotlib is optional: the `bench` extra).

The targets are the issue's, judged on the measured rows only: a target none of whose rows were measured is "not
measured", never met.
"""

from __future__ import annotations

from typing import Any

from cortexstream.benchmarks.machine import machine_sentence

H2O_25 = "h2o@0.25"
DECODE_TARGET = (8, 4096)  # batch, keys


def _ppl(data: dict[str, Any], context: int, storage: str, policy: str = "full", system: str = "cortexstream"):
    return next((r["ppl"] for r in data["perplexity"] if r["system"] == system and r["context"] == context
                 and r["storage"] == storage and r["policy"] == policy), None)


def _judge(checks: list[tuple[str, bool]]) -> tuple[str, str]:
    if not checks:
        return "not measured", "—"
    return ("met" if all(ok for _, ok in checks) else "missed"), "; ".join(text for text, _ in checks)


def _ppl_limit(data: dict[str, Any], storage: str, policy: str, limit: float) -> list[tuple[str, bool]]:
    """`storage` under `policy` against the full float cache: perplexity change at most `limit`, per context."""
    checks = []
    for context in data["settings"]["contexts"]:
        ref, ppl = _ppl(data, context, data["settings"]["model_dtype"]), _ppl(data, context, storage, policy)
        if ref is not None and ppl is not None:
            change = ppl / ref - 1
            checks.append((f"{context}: {change * 100:+.2f}%", change <= limit))
    return checks


def targets(data: dict[str, Any]) -> list[dict[str, str]]:
    """The issue's targets, each with what was measured and "met", "missed" or "not measured"."""
    s, out = data["settings"], []
    float_type = s["model_dtype"]

    def add(target: str, checks: list[tuple[str, bool]]) -> None:
        status, measured = _judge(checks)
        out.append({"target": target, "measured": measured, "status": status})

    add("int8 perplexity within +0.5% of float", _ppl_limit(data, "int8", "full", 0.005))
    passkey = []
    for r in data["passkey"]:
        ref = next((f for f in data["passkey"] if f["storage"] == float_type and f["context"] == r["context"]
                    and f["policy"] == r["policy"]), None)
        if r["storage"] == "int8" and ref is not None:
            passkey.append((f"{r['context']} {r['policy']}: {r['correct']}/{r['trials']} vs {ref['correct']}/"
                            f"{ref['trials']}", r["correct"] == ref["correct"]))
    add("int8 passkey unchanged from float (same policy)", passkey)
    add("int4 perplexity within +3% of float", _ppl_limit(data, "int4", "full", 0.03))
    equal_bits = []
    for context in s["contexts"]:
        for bits in s["mlx_lm_bits"]:
            ours, theirs = _ppl(data, context, f"int{bits}"), _ppl(data, context, f"int{bits}", system="mlx_lm")
            if ours is not None and theirs is not None:
                equal_bits.append((f"{context} int{bits}: {ours:.3f} vs {theirs:.3f}", ours <= theirs))
    add("at equal bits, perplexity no worse than mlx-lm QuantizedKVCache", equal_bits)
    add("int4 + H2O 25% within +5% of the full float cache", _ppl_limit(data, "int4", H2O_25, 0.05))
    batch, keys = DECODE_TARGET
    speed = {r["storage"]: r["tps_median"] for r in data["decode"]
             if (r["batch"], r["keys"]) == DECODE_TARGET and r.get("policy", "full") == "full"}
    decode = [(f"{name} {speed[name]:.1f} vs {speed[float_type]:.1f} tok/s", speed[name] >= 0.85 * speed[float_type])
              for name in ("int8", "int4") if name in speed and float_type in speed]
    add(f"decode at batch {batch} / {keys} keys within 15% of float (int8, int4)", decode)
    return out


def _ppl_table(data: dict[str, Any]) -> list[str]:
    float_type = data["settings"]["model_dtype"]
    lines = ["| context | storage | policy | bytes / context token | kept tokens | perplexity | vs float full | "
             "vs float same policy | seconds |", "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["perplexity"]:
        full, same = _ppl(data, r["context"], float_type), _ppl(data, r["context"], float_type, r["policy"])
        storage = r["storage"] if r["system"] == "cortexstream" else f"mlx-lm QuantizedKVCache {r['storage'][3:]}-bit"
        rel = [f"{(r['ppl'] / ref - 1) * 100:+.2f}%" if ref else "n/a" for ref in (full, same)]
        lines.append(f"| {r['context']} | {storage} | {r['spec']} | {r['bytes_per_context_token']:.0f} | "
                     f"{r['kept_tokens']} | {r['ppl']:.3f} | {rel[0]} | {rel[1]} | {r['seconds']:.0f} |")
    return lines


def _passkey_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| context | storage | policy | correct / trials | by depth (10% → 90%) | seconds |",
             "|---:|---|---|---:|---|---:|"]
    for r in rows:
        marks = "".join("✓" if t["correct"] else "·" for t in r["results"])
        lines.append(f"| {r['context']} | {r['storage']} | {r['spec']} | {r['correct']} / {r['trials']} | "
                     f"`{marks}` | {r['seconds']:.0f} |")
    return lines


def _memory_table(data: dict[str, Any]) -> list[str]:
    ref = next((r["bytes_per_token"] for r in data["memory"] if r["storage"] == data["settings"]["model_dtype"]), None)
    lines = ["| storage | bytes / token | tokens / GiB | tokens vs float |", "|---|---:|---:|---:|"]
    rows = [(r["storage"], r["bytes_per_token"], r["tokens_per_gib"]) for r in data["memory"]]
    seen = set()
    for r in data["perplexity"]:  # mlx-lm's bytes per token, as its caches allocated them
        if r["system"] == "mlx_lm" and r["storage"] not in seen:
            seen.add(r["storage"])
            rows.append((f"mlx-lm QuantizedKVCache {r['storage'][3:]}-bit", r["bytes_per_token"],
                         int(2**30 // r["bytes_per_token"])))
    for name, per_token, per_gib in rows:
        lines.append(f"| {name} | {per_token:.0f} | {per_gib} | {f'{ref / per_token:.2f}x' if ref else 'n/a'} |")
    return lines


def _decode_table(data: dict[str, Any]) -> list[str]:
    float_type = data["settings"]["model_dtype"]
    # Only storages timed together (same policy, batch and keys: one run, rotating order) are compared.
    lines = ["| batch | keys | policy | storage | tokens/s (median) | rounds | vs float |",
             "|---:|---:|---|---|---:|---|---:|"]
    for r in sorted(data["decode"], key=lambda r: (r["keys"], r["batch"], r.get("policy", "full") != "full",
                                                    r.get("policy", "full"))):
        policy = r.get("policy", "full")
        ref = next((f["tps_median"] for f in data["decode"] if f["storage"] == float_type
                    and f["batch"] == r["batch"] and f["keys"] == r["keys"] and f.get("policy", "full") == policy),
                   None)
        rel = f"{(r['tps_median'] / ref - 1) * 100:+.1f}%" if ref else "n/a"
        short = "" if r["tokens"] == r["expected_tokens"] else f" ({r['tokens']} of {r['expected_tokens']} tokens)"
        lines.append(f"| {r['batch']} | {r['keys']} | {policy} | {r['storage']} | {r['tps_median']:.1f}{short} | "
                     f"{', '.join(f'{x:.1f}' for x in r['tps'])} | {rel} |")
    return lines


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    group = f"group size {s['group_size']}"
    out = ["# Quantized KV storage (`cortexstream bench kv-dtype`)", "",
           f"Model: {s['model']} (float type {s['model_dtype']}). Text: {s['text_source']}. "
           f"Machine: {machine_sentence(data['machine'])}.", "",
           f"Storages: {', '.join(s['storages'])} (quantized sides in {group}, scales and biases in "
           f"{s['model_dtype']}); policies: full, StreamingLLM and H2O at {s['budget']:g} of the context (4 sinks).",
           "", "## Targets", "", "| target | measured | status |", "|---|---|---|"]
    out += [f"| {t['target']} | {t['measured']} | **{t['status']}** |" for t in targets(data)] + [""]
    if data["perplexity"]:
        out += ["## Perplexity", "",
                f"Teacher-forced, eviction after every chunk of {s['ppl_chunk']} tokens (full cache and mlx-lm: "
                f"chunks of {s['full_chunk']}). Kept tokens: the most the cache held after an eviction; bytes per "
                "context token = bytes per token x kept / context.", ""] + _ppl_table(data) + [""]
    if data["passkey"]:
        out += ["## Passkey retrieval", "",
                f"{s['passkey_trials']} trials per cell at depths spaced 10% → 90%, greedy answer, prompt chunks "
                f"of {s['passkey_chunk']} tokens (full cache: {s['full_chunk']}).", ""]
        out += _passkey_table(data["passkey"]) + [""]
    if data["memory"]:
        out += ["## Memory", "", "K + V of one token over all layers (scales and biases included) and the tokens a "
                "GiB of KV holds; under a policy the bytes per context token are in the perplexity table.", ""]
        out += _memory_table(data) + [""]
    if data["decode"]:
        out += ["## Decode speed", "",
                f"Engine decode steps after every prompt is in: {s['decode_steps']} steps per storage and round, "
                f"rounds: {s['rounds']}, the storage order rotating each round; median of the rounds. Under a "
                "policy every request evicts to its budget (a fraction of prompt + tokens to generate) while it "
                "prefills and decodes, so the timed steps attend to about that many keys, not `keys`.", ""]
        out += _decode_table(data) + [""]
    if data.get("missing"):
        out += ["## Not measured", ""] + [f"- {m}" for m in data["missing"]] + [""]
    if not _has_matplotlib():
        out += ["No plot: matplotlib is missing (pip install 'cortexstream[bench]').", ""]
    for run in data.get("runs", []):
        out.append(f"Run: parts {', '.join(run['parts'])}; {run['seconds'] / 60:.1f} min"
                   + (f" (time budget {run['max_minutes']} min)" if run.get("max_minutes") else "") + ".")
    return "\n".join(out) + "\n"


def plot(data: dict[str, Any], path: str) -> bool:
    """Perplexity at the largest context against bytes per context token (log x), one point per storage and
    policy; mlx-lm's caches as black crosses."""
    import matplotlib  # ImportError without the `bench` extra: common.write_report says so

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["perplexity"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    if rows:
        context = max(r["context"] for r in rows)
        rows = [r for r in rows if r["context"] == context]
        colors = {name: f"C{i}" for i, name in enumerate(data["settings"]["storages"])}
        markers = {"full": "o", "streaming": "s", "h2o": "^"}
        for r in rows:
            x, y = r["bytes_per_context_token"], r["ppl"]
            if r["system"] == "mlx_lm":
                ax.scatter(x, y, marker="x", color="black", s=60, label=f"mlx-lm {r['storage'][3:]}-bit")
                ax.annotate(f"mlx-lm {r['storage'][3:]}-bit", (x, y), fontsize=7, xytext=(4, -10),
                            textcoords="offset points")
                continue
            family = r["policy"].split("@")[0]
            ax.scatter(x, y, marker=markers.get(family, "o"), color=colors.get(r["storage"], "gray"), s=40,
                       label=f"{r['storage']} {r['policy']}")
            ax.annotate(f"{r['storage']} {r['policy']}", (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
        ax.set_title(f"Perplexity at {context} tokens vs KV bytes per context token")
    ax.set(xscale="log", xlabel="bytes per context token (log)", ylabel="perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


__all__ = ["markdown", "plot", "targets"]
