"""Markdown tables and the PNG plot for `bench quality` (matplotlib is optional: the `bench` extra)."""

from __future__ import annotations

from typing import Any


def _ppl_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| context | policy | budget (tokens) | perplexity | vs full | chunk | seconds |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    full = {r["context"]: r["ppl"] for r in rows if r["policy"] == "full"}
    for r in rows:
        ref = full.get(r["context"])
        rel = f"{(r['ppl'] / ref - 1) * 100:+.1f}%" if ref else "n/a"
        lines.append(f"| {r['context']} | {r['spec']} | {r['budget_tokens']} | {r['ppl']:.3f} | {rel} | "
                     f"{r['chunk']} | {r['seconds']:.0f} |")
    return lines


def _passkey_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| context | policy | budget (tokens) | correct / trials | accuracy | by depth (10% → 90%) | seconds |",
             "|---:|---|---:|---:|---:|---|---:|"]
    for r in rows:
        marks = "".join("✓" if t["correct"] else "·" for t in r["results"])
        lines.append(f"| {r['context']} | {r['policy']} | {r['budget_tokens']} | {r['correct']} / {r['trials']} | "
                     f"{r['accuracy'] * 100:.0f}% | `{marks}` | {r['seconds']:.0f} |")
    return lines


def _streaming_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        seg = r["segment_ppl"]
        lines.append(f"{r['tokens']} tokens through a {r['cache']}-token cache ({r['policy']}), perplexity per "
                     f"{r['segment_tokens']}-token segment ({r['seconds']:.0f} s):")
        lines.append("")
        lines.append("| segment (perplexity) | " + " | ".join(str(i + 1) for i in range(len(seg))) + " |")
        lines.append("|---|" + "---:|" * len(seg))
        lines.append("| StreamingLLM | " + " | ".join(f"{s:.2f}" for s in seg) + " |")
        ref = r.get("full_reference_segment_ppl") or []
        if ref:
            lines.append("| full cache | " + " | ".join(f"{s:.2f}" for s in ref) + " |" + " — |" * (len(seg) - len(ref)))
        lines.append("")
        lines.append("Streaming/full ratio on the referenced segments: "
                     + ", ".join(f"{a / b:.3f}" for a, b in zip(seg, ref)) if ref else "")
        lines.append(f"First segment {seg[0]:.2f}, last {seg[-1]:.2f}; max/min over segments after the first "
                     f"{max(seg[1:] or seg) / min(seg[1:] or seg):.2f} (segments are different text, so they vary "
                     "with content; the full-cache row shows that variation where a full cache fits).")
    return lines


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    out = ["# KV eviction quality (`cortexstream bench quality`)", "",
           f"Model: {s['model']}. Text: {s['text_source']}. Machine: {data['machine'].get('device')}, "
           f"{data['machine'].get('cpu_count')} CPUs, {data['machine'].get('blas')}.", ""]
    if data["perplexity"]:
        out += ["## Perplexity", "",
                f"Teacher-forced, eviction after every chunk of {s['ppl_chunk']} tokens (full cache: chunks of "
                f"{s['full_chunk']}, no eviction). Budgets are fractions of the context; StreamingLLM and H2O "
                "keep 4 sinks; H2O's recent window is half of the rest.", ""] + _ppl_table(data["perplexity"]) + [""]
    if data["passkey"]:
        out += ["## Passkey retrieval", "",
                f"{s['passkey_trials']} trials per cell, needle depths evenly spaced 10% → 90%, greedy answer, "
                f"prompt chunks of {s['passkey_chunk']} tokens (full cache: 256).", ""] + _passkey_table(data["passkey"]) + [""]
    if data["streaming"]:
        out += ["## Streaming", ""] + _streaming_lines(data["streaming"]) + [""]
    for r in data.get("restart", []):
        out += ["The streaming run's last three segments again, on a fresh StreamingLLM cache after one warm-up "
                f"segment (positions {r['segment_tokens']}..{4 * r['segment_tokens']} instead of "
                f"{data['streaming'][-1]['tokens'] - 3 * r['segment_tokens']}..{data['streaming'][-1]['tokens']}):", "",
                "| run | " + " | ".join(f"segment -{3 - i}" for i in range(3)) + " |", "|---|---:|---:|---:|",
                "| in the 16k stream | " + " | ".join(f"{x:.2f}" for x in r["stream_segment_ppl"]) + " |",
                "| fresh cache | " + " | ".join(f"{x:.2f}" for x in r["segment_ppl"]) + " |", ""]
    if data.get("chunkcheck"):
        out += ["## Chunked scoring vs token by token", "",
                "The same policy scored with eviction after every token (chunk 1) and after every chunk:", "",
                "| context | policy | chunk | perplexity | seconds |", "|---:|---|---:|---:|---:|"]
        out += [f"| {r['context']} | {r['spec']} | {r['chunk']} | {r['ppl']:.3f} | {r['seconds']:.0f} |"
                for r in data["chunkcheck"]] + [""]
    if data.get("missing"):
        out += ["## Not measured", ""] + [f"- {m}" for m in data["missing"]] + [""]
    for run in data.get("runs", []):
        out.append(f"Run: parts {', '.join(run['parts'])}; {run['seconds'] / 60:.1f} min"
                   + (f" (time budget {run['max_minutes']} min)" if run.get("max_minutes") else "") + ".")
    for note in data.get("notes", []):
        out += ["", note]
    return "\n".join(out)


def plot(data: dict[str, Any], path: str) -> bool:
    """Perplexity vs budget, passkey accuracy, streaming segments."""
    import matplotlib  # ImportError without the `bench` extra: common.write_report says so

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for context in sorted({r["context"] for r in data["perplexity"]}):
        rows = [r for r in data["perplexity"] if r["context"] == context]
        for family, style in (("streaming", "s--"), ("h2o", "o-")):
            pts = sorted((float(r["policy"].split("@")[1]), r["ppl"]) for r in rows if r["policy"].startswith(family))
            if pts:
                ax.plot(*zip(*pts), style, label=f"{family} {context}")
        full = [r["ppl"] for r in rows if r["policy"] == "full"]
        if full:
            ax.axhline(full[0], linestyle=":", color="gray")
            ax.annotate(f"full {context}", (0.5, full[0]), fontsize=8, color="gray")
    ax.set(xlabel="budget (fraction of context)", ylabel="perplexity", title="Perplexity vs KV budget")
    ax.legend(fontsize=8)
    ax = axes[1]
    labels = [f"{r['policy']}\n{r['context']}" for r in data["passkey"]]
    ax.bar(range(len(labels)), [r["accuracy"] * 100 for r in data["passkey"]])
    ax.set_xticks(range(len(labels)), labels, fontsize=7, rotation=30)
    ax.set(ylabel="accuracy %", title="Passkey retrieval", ylim=(0, 105))
    ax = axes[2]
    for r in data["streaming"]:
        seg = r["segment_ppl"]
        ax.plot([(i + 1) * r["segment_tokens"] for i in range(len(seg))], seg, "o-",
                label=f"{r['policy']} ({r['cache']} cache)")
        ref = r.get("full_reference_segment_ppl") or []
        if ref:
            ax.plot([(i + 1) * r["segment_tokens"] for i in range(len(ref))], ref, "x:", color="gray",
                    label="full cache (same text)")
    ax.set(xlabel="tokens processed", ylabel="segment perplexity (log)", title="Streaming through a fixed cache",
           yscale="log")
    if data["streaming"]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
