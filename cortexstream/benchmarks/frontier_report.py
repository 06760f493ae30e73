"""Markdown table and PNG plot for `bench frontier` (matplotlib optional: the `bench` extra)."""

from __future__ import annotations

from typing import Any


FAMILY_STYLE = {"streaming": "s--", "h2o": "o-", "meanpool": "^-", "compressor": "D-", "sidecar": "*-",
                "tome": "v-"}


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| context | policy | perplexity | vs full | cache mean / max (tokens) | max / context | seconds |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    full = {r["context"]: r["ppl"] for r in rows if r["policy"] == "full"}
    for r in sorted(rows, key=lambda r: (r["context"], r["family"], r["max_fraction"])):
        ref = full.get(r["context"])
        rel = f"{(r['ppl'] / ref - 1) * 100:+.1f}%" if ref else "n/a"
        twin = " (sized like a merging policy)" if r.get("matched_to") else ""
        lines.append(f"| {r['context']} | {r['policy']}{twin} | {r['ppl']:.3f} | {rel} | "
                     f"{r['mean_physical']:.0f} / {r['max_physical']} | {r['max_fraction']:.3f} | {r['seconds']:.0f} |")
    return lines


MERGING = ("meanpool", "compressor", "sidecar", "tome")


def _matched(rows: list[dict[str, Any]]) -> list[str]:
    """Each merging policy next to H2O given a token budget equal to its measured max cache size."""
    lines = []
    for own in (r for r in rows if r["family"] in MERGING):
        twin = next((r for r in rows if r["context"] == own["context"]
                     and r["policy"] == f"h2o:budget={own['max_physical']}"), None)
        if twin is None:
            continue
        better = "lower" if own["ppl"] < twin["ppl"] else "higher"
        lines.append(f"| {own['context']} | {own['policy']} | {own['max_physical']} | {own['ppl']:.3f} | "
                     f"{twin['ppl']:.3f} | {better} |")
    if not lines:
        return []
    return ["| context | merging policy | cache (tokens) | its perplexity | H2O same size | merging is |",
            "|---:|---|---:|---:|---:|---|"] + lines


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    out = ["# Perplexity vs measured KV cache size (`cortexstream bench frontier`)", "",
           f"Model: {s['model']}. Text: {s['text_source']} (first tokens, held out from all training). "
           f"Machine: {data['machine'].get('device')}, {data['machine'].get('cpu_count')} CPUs.", "",
           f"Teacher-forced, policy step after every chunk of {s['chunk']} tokens (full cache: 256, no policy). "
           "Cache size = physical slots after each policy step, measured (mean over the run and max). Merging "
           "policies keep 4 sinks and the last 64 tokens raw unless their spec says otherwise.", ""]
    if data["perplexity"]:
        out += ["## Perplexity", ""] + _table(data["perplexity"]) + [""]
        matched = _matched(data["perplexity"])
        if matched:
            out += ["## At the same memory", "", "H2O given a token budget equal to the merging policy's measured "
                    "max cache size:", ""] + matched + [""]
    if data["passkey"]:
        out += ["## Passkey retrieval", "", f"At {s['passkey_context']} tokens, needle depths evenly spaced "
                "10% → 90%, greedy; the same generator and seed as `bench quality` (with 20 trials there the full "
                "cache scored 16/20 and H2O/StreamingLLM at 20% 0/20 and 1/20).", "",
                "| policy | correct / trials | by depth |", "|---|---:|---|"]
        out += [f"| {r['policy']} | {r['correct']} / {r['trials']} | "
                f"`{''.join('✓' if t['correct'] else '·' for t in r['results'])}` |" for r in data["passkey"]] + [""]
    if data.get("needle"):
        keys = [k for k in data["needle"][0] if k not in ("results", "heap")]
        out += ["## Needle in a heap", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        out += ["| " + " | ".join(_fmt(r.get(k)) for k in keys) + " |" for r in data["needle"]] + [""]
    if data.get("missing"):
        out += ["## Not measured", ""] + [f"- {m}" for m in data["missing"]] + [""]
    for note in data.get("notes", []):
        out += [note, ""]
    return "\n".join(out)


def _fmt(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def plot(data: dict[str, Any], path: str) -> bool:
    import matplotlib  # ImportError without the `bench` extra: common.write_report says so

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = sorted({r["context"] for r in data["perplexity"]})
    if not contexts:
        return False
    fig, axes = plt.subplots(1, len(contexts), figsize=(7 * len(contexts), 4.8), squeeze=False)
    for ax, context in zip(axes[0], contexts):
        rows = [r for r in data["perplexity"] if r["context"] == context and not r.get("matched_to")]
        for fam in sorted({r["family"] for r in rows} - {"full"}):
            variants: dict[str, list[tuple[float, float]]] = {}
            for r in rows:
                if r["family"] == fam:
                    label = fam + (" (no log-mass)" if "log_mass=0" in r["policy"] else "")
                    variants.setdefault(label, []).append((r["mean_physical"] / context, r["ppl"]))
            for label, pts in variants.items():
                ax.plot(*zip(*sorted(pts)), FAMILY_STYLE.get(fam, "x-"), label=label)
        twins = [r for r in data["perplexity"] if r["context"] == context and r.get("matched_to")]
        if twins:
            ax.plot([r["mean_physical"] / context for r in twins], [r["ppl"] for r in twins], "o", mfc="none",
                    color="black", label="h2o at a merging policy's size")
        full = [r["ppl"] for r in rows if r["family"] == "full"]
        if full:
            ax.axhline(full[0], linestyle=":", color="gray", label="full cache")
        ax.set(xlabel="mean cache size / context", ylabel="perplexity", title=f"Context {context}", xscale="log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
