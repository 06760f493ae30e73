"""Medians, ratios, the issue's draft-model targets and the Markdown of `bench speculative --pair`, computed from the
stored cells (a resumed or partial run reports what it has).

Targets (issue #36, the 0.5B drafting the 1.5B): decode tokens/s of CortexStream's draft model >= 1.0x mlx-lm's
speculative decoding on the same pair and tasks, and >= 1.3x plain decoding of the target. Above concurrency 1
mlx-lm has no batched speculation, so the reference there is its `batch_generate` of the target alone (said in
every row that uses it).
"""

from __future__ import annotations

from typing import Any

from cortexstream.benchmarks.machine import machine_sentence, neutral_source
from cortexstream.benchmarks.speculative_measure import PLAIN
from cortexstream.benchmarks.speculative_pair_measure import DRAFT, MLX_LM_BATCH, MLX_LM_SPECULATIVE, mlx_lm_system
from cortexstream.benchmarks.speculative_pair_settings import PairSettings
from cortexstream.benchmarks.speculative_report import Status, gap_lines, median, system_summary

VS_MLX_LM = 1.0  # draft model / mlx-lm on the same pair
VS_PLAIN = 1.3  # draft model / plain decoding of the target

REFERENCE = {MLX_LM_SPECULATIVE: "mlx-lm speculative",
             MLX_LM_BATCH: "mlx-lm batch_generate, target alone (no batched speculation)"}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _status(ratio: float | None, target: float) -> str:
    return (Status.NOT_MEASURED if ratio is None else Status.MET if ratio >= target else Status.MISSED).value


def pair_ratios(cell: dict[str, Any]) -> dict[str, float | None]:
    """The draft system's decode tokens/s over plain decoding's and over mlx-lm's (medians; > 1: faster), and
    its wall time's ratio to plain decoding's."""
    s = {name: system_summary(row) for name, row in cell["systems"].items()}
    ours, plain, peer = s[DRAFT], s[PLAIN], s.get(cell["mlx_lm_system"])
    return {"decode_vs_plain": _ratio(ours["decode_tps_median"], plain["decode_tps_median"]),
            "wall_vs_plain": _ratio(plain["wall_median_s"], ours["wall_median_s"]),
            "decode_vs_mlx_lm": _ratio(ours["decode_tps_median"], peer["decode_tps_median"]) if peer else None}


def find_pair_cell(cells: list[dict[str, Any]], task: str, mode: str, c: int) -> dict[str, Any] | None:
    return next((x for x in cells if x["task"] == task and x["mode"] == mode and x["concurrency"] == c), None)


def pair_targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (mode, task, concurrency) the settings ask for: both ratios, their status, and (greedy)
    how many draft texts differ from plain decoding's (None: sampled or not measured)."""
    s = data["settings"]
    rows = []
    for mode in s["modes"]:
        for task in s["tasks"]:
            for c in s["concurrency"]:
                cell = find_pair_cell(data["cells"], task, mode, c)
                r = pair_ratios(cell) if cell else {}
                exact = cell.get("differing_texts", {}).get(DRAFT) if cell else None
                rows.append({"mode": mode, "task": task, "concurrency": c, "reference": mlx_lm_system(c),
                             "vs_mlx_lm": r.get("decode_vs_mlx_lm"), "vs_mlx_lm_target": VS_MLX_LM,
                             "vs_mlx_lm_status": _status(r.get("decode_vs_mlx_lm"), VS_MLX_LM),
                             "vs_plain": r.get("decode_vs_plain"), "vs_plain_target": VS_PLAIN,
                             "vs_plain_status": _status(r.get("decode_vs_plain"), VS_PLAIN),
                             "differing_texts": exact})
    return rows


def _num(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "—" if value is None else f"{value:.{digits}f}{suffix}"


def _same(n: int | None, concurrency: int, mode: str) -> str:
    if mode != "greedy":
        return "n/a (sampled)"
    if n is None:
        return "—"
    return "yes" if n == 0 else f"no ({n} of {concurrency} differ)"


def _cell_rows(cell: dict[str, Any]) -> list[str]:
    rows = []
    r = pair_ratios(cell)
    for name in (PLAIN, DRAFT, cell["mlx_lm_system"]):
        if name not in cell["systems"]:
            continue
        s = system_summary(cell["systems"][name])
        accept = s.get("acceptance_rate")
        ours = name == DRAFT
        same = "" if name == PLAIN else _same(cell.get("differing_texts", {}).get(name), cell["concurrency"],
                                              cell["mode"])
        rows.append(f"| {cell['task']} | {cell['concurrency']} | {REFERENCE.get(name, name)} | "
                    f"{_num(s['wall_median_s'])} | {_num(median(cell['systems'][name].get('prepare_s') or []), 1)} | "
                    f"{_num(s['decode_tps_median'], 1)} | {_num(s['generated_tokens_median'], 0)} | "
                    f"{_num(r['decode_vs_plain'] if ours else None, 2, 'x')} | "
                    f"{_num(r['decode_vs_mlx_lm'] if ours else None, 2, 'x')} | "
                    f"{'—' if accept is None else f'{100 * accept:.0f}%'} | {_num(s.get('accepted_per_verify'))} | "
                    f"{same} |")
    return rows


def _named(name: str, record: dict[str, Any] | None) -> str:
    """A model's name and the file it was loaded from (when that says more)."""
    source = (record or {}).get("source", "not loaded")
    return name if source == name else f"{name} ({source})"


def _sizes(d: PairSettings) -> str:
    return (f"{', '.join(t.value for t in d.tasks)}; {', '.join(m.value for m in d.modes)}; concurrency "
            f"{', '.join(map(str, d.concurrency))}; {d.max_tokens} tokens; {d.rounds} round(s)")


def pair_markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    records = s.get("model_records", {})
    target, draft = neutral_source(s["target"]), neutral_source(s["draft"])  # names, never local folders
    lines = [f"# Draft-model speculative decoding: {target} drafted by {draft} (issue #36)", "",
             f"Target: {_named(target, records.get('target'))}; draft: {_named(draft, records.get('draft'))}, up "
             f"to {s['k']} drafted tokens per verify pass  ",
             f"Machine: {machine_sentence(data['machine'])}, mlx-lm {data['machine']['mlx_lm']}  ",
             f"Rerun: `{s['command']}`", "",
             f"Sizes: tasks {', '.join(s['tasks'])}; {', '.join(s['modes'])}; concurrency "
             f"{', '.join(map(str, s['concurrency']))}; {s['max_tokens']} new tokens at most per request; "
             f"{s['rounds']} round(s) per cell, the systems' order rotating each round, medians. --pair's defaults "
             f"are small on purpose ({_sizes(PairSettings())}): the default "
             "target, a K-quant GGUF dequantised to float32, decodes slowly on a small CPU. Passages: "
             f"{s['text_source']}.  ",
             "Systems: plain and draft are CortexStream's public call (stream_generate at concurrency 1, "
             "batch_generate above) on an engine built before the timed call as the private one would be; draft's "
             "engine has speculative=\"draft:model=DRAFT,k=K\" (adaptive k) and loads the draft model when built, "
             "hence its prepare s (untimed). mlx-lm runs on the same model objects: at concurrency 1 its "
             "speculative decoding with num_draft_tokens=K; above 1 it cannot batch speculation, so the reference "
             "is its batch_generate of the target alone. Decode tok/s: at concurrency 1 tokens after the first over "
             "the time after the first token (timed on the stream), above 1 the batch call's own stats. Accept: "
             "drafted tokens kept; acc/verify: kept drafts per verify pass (mlx-lm's rebuilt from its stream's "
             "from_draft flags). Same text: greedy texts equal plain decoding's in every round.", ""]
    lines += gap_lines(data)
    lines += ["", "## Targets (decode tok/s of the draft model)", "",
              "| mode | task | concurrency | vs mlx-lm (reference) | target | status | vs plain | target | status | "
              "same text as plain |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t in data.get("targets") or pair_targets(data):
        lines.append(f"| {t['mode']} | {t['task']} | {t['concurrency']} | {_num(t['vs_mlx_lm'], 2, 'x')} "
                     f"({REFERENCE[t['reference']]}) | >= {t['vs_mlx_lm_target']:.1f}x | {t['vs_mlx_lm_status']} | "
                     f"{_num(t['vs_plain'], 2, 'x')} | >= {t['vs_plain_target']:.1f}x | {t['vs_plain_status']} | "
                     f"{_same(t['differing_texts'], t['concurrency'], t['mode'])} |")
    order = {t: i for i, t in enumerate(s["tasks"])}
    for mode in s["modes"]:
        cells = sorted((c for c in data["cells"] if c["mode"] == mode),
                       key=lambda c: (order.get(c["task"], 99), c["concurrency"]))
        if not cells:
            continue
        lines += ["", f"## {mode}", "",
                  "| task | conc | system | wall s | prepare s | decode tok/s | tokens | x plain decode | "
                  "x mlx-lm decode | accept | acc/verify | same text as plain |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for cell in cells:
            lines += _cell_rows(cell)
    return "\n".join(lines) + "\n"


__all__ = ["REFERENCE", "VS_MLX_LM", "VS_PLAIN", "find_pair_cell", "pair_markdown", "pair_ratios", "pair_targets"]
