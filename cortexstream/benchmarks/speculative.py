"""`cortexstream bench speculative`: prompt lookup (`speculative="ngram:..."`) against plain decoding and mlx-lm.

Task families (`speculative_tasks`, built from text already on this machine): edit a given Python function, summarise
a Wikipedia passage, quote a sentence of a pasted document, open-ended chat; through the model's chat template,
greedy and sampled. Per (model, task, mode, concurrency) cell, every system makes the same whole public call on
the same token ids, several rounds in rotating order (`speculative_measure`): CortexStream plain, CortexStream with
each prompt-lookup setting (adaptive k), and mlx-lm on the same model object (`stream_generate` at concurrency 1,
`batch_generate` above). Measured: wall time, decode tokens/s, and for prompt lookup the acceptance rate and
accepted tokens per verify pass from `Engine.stats()`; greedy texts are checked against plain decoding's.

Cells are written to `<out>/speculative.json` (`speculative_quick.json` with --quick) as soon as they are measured
(`--resume` keeps those measured with the same settings); the report (`speculative_report`) gives medians, ratios
to plain decoding and mlx-lm, and the issue's targets with their measured status. A draft model is measured by
`--pair TARGET:DRAFT` (`speculative_pair`: its own settings, cells and `speculative_pair.{json,md}`).
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import time
from typing import Any, Callable

from cortexstream.benchmarks.common import show_report, write_report
from cortexstream.benchmarks.result_store import ResultStore
from cortexstream.benchmarks.speculative_measure import measure_cell, warm_up
from cortexstream.benchmarks.speculative_models import load_model
from cortexstream.benchmarks.speculative_pair_settings import DEFAULT_PAIR, PairSettings
from cortexstream.benchmarks.speculative_report import markdown, targets
from cortexstream.benchmarks.speculative_settings import Mode, SpeculativeSettings, from_args
from cortexstream.benchmarks.speculative_tasks import MAX_INPUTS, Task, build_prompts, local_wiki_text, prompt_tokens

NAME = "speculative"
PARTS = ("cells", "skipped", "runs")


def result_name(quick: bool) -> str:
    return f"{NAME}_quick" if quick else NAME


def key(s: SpeculativeSettings, model: str, task: Task, mode: Mode, concurrency: int) -> dict[str, Any]:
    """What names a cell in the results: where it was measured and the settings its numbers depend on."""
    return {"model": model, "task": task.value, "mode": mode.value, "concurrency": concurrency,
            "max_tokens": s.max_tokens, "rounds": s.rounds, "temperature": s.temperature,
            "speculative": list(s.speculative)}


def planned(s: SpeculativeSettings) -> list[tuple[Task, Mode, int]]:
    return [(task, mode, c) for task in s.tasks for mode in s.modes for c in s.concurrency]


def run(settings: SpeculativeSettings = SpeculativeSettings(), out_dir: str = "bench/results", *,
        quick: bool = False, resume: bool = False, max_minutes: float | None = None,
        loaded: dict[str, tuple[Any, Any]] | None = None, progress: bool = True,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure `settings` and write `<out_dir>/speculative[_quick].{json,md}` (`quick`: the name only; the sizes
    are the settings'). `loaded`: already loaded (model, tokenizer) pairs by model name."""
    from tqdm import tqdm

    from cortexstream.backend import ensure_buffer_cache
    from cortexstream.errors import CortexStreamError

    s = settings
    grounded_text = any(t in (Task.SUMMARIZE, Task.QUOTE) for t in s.tasks)
    wiki, text_source = local_wiki_text() if grounded_text else ("", "none needed")
    recorded = {"models": list(s.models), "tasks": [t.value for t in s.tasks], "modes": [m.value for m in s.modes],
                "concurrency": list(s.concurrency), "speculative": list(s.speculative), "max_tokens": s.max_tokens,
                "rounds": s.rounds, "temperature": s.temperature, "command": command_line(s, quick),
                "quick": quick, "text_source": text_source, "max_minutes": max_minutes, "model_records": {}}
    name = result_name(quick)
    os.makedirs(out_dir, exist_ok=True)
    results = ResultStore(os.path.join(out_dir, f"{name}.json"), NAME, recorded, PARTS, resume=resume,
                          fresh=("skipped",))
    for cell in results.data["cells"]:
        if cell["model"] in s.models and cell.get("model_record"):
            recorded["model_records"][cell["model"]] = cell["model_record"]
    started = time.perf_counter()
    total = len(s.models) * len(planned(s))
    done = sum(results.has("cells", **key(s, m, *cell)) for m in s.models for cell in planned(s))
    with tqdm(total=total, initial=done, desc="speculative cells", unit="cell", disable=not progress) as bar:
        say = bar.write if progress else log
        for model_name in s.models:
            todo = [c for c in planned(s) if not results.has("cells", **key(s, model_name, *c))]
            if not todo:
                continue
            try:
                if loaded and model_name in loaded:
                    (model, tokenizer), record = loaded[model_name], {"source": model_name}
                else:
                    model, tokenizer, record = load_model(model_name)
            except CortexStreamError as exc:  # an absent asset or an unloadable model: said, not fatal
                results.data["skipped"].append({"model": model_name, "reason": str(exc)})
                results.save()
                say(f"skipping {model_name}: {exc}")
                bar.update(len(todo))
                continue
            recorded["model_records"][model_name] = record
            ensure_buffer_cache()  # mlx-lm runs under the limit the engine sets, from its first call on
            prompts = {t: [prompt_tokens(tokenizer, p) for p in build_prompts(t, max(s.concurrency), wiki)]
                       for t in s.tasks}
            warm_up(model, tokenizer, min(prompts.values(), key=lambda ps: len(ps[0])), s.speculative)  # shortest
            for task, mode, c in todo:
                what = f"{model_name} {task.value} {mode.value} c={c}"
                if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
                    say(f"time budget spent: skipping {what}")  # listed as missing in the report
                    bar.update(1)
                    continue
                tic = time.perf_counter()
                cell = measure_cell(model, tokenizer, prompts[task][:c], s.max_tokens, mode, s.temperature,
                                    s.speculative, s.rounds)
                cell.update(key(s, model_name, task, mode, c), model_record=record,
                            seconds=round(time.perf_counter() - tic, 2))
                results.add("cells", cell)
                bar.update(1)
            del model, tokenizer
            _release()
    results.data["missing"] = [f"{m} {t.value} {mode.value} c={c}" for m in s.models for t, mode, c in planned(s)
                               if not results.has("cells", **key(s, m, t, mode, c))
                               and not any(x["model"] == m for x in results.data["skipped"])]
    results.data["cells"] = [c for c in results.data["cells"] if _current(c, s)]  # other settings' cells go
    results.data["targets"] = targets(results.data)
    results.data["runs"].append({"max_minutes": max_minutes, "seconds": round(time.perf_counter() - started, 1)})
    write_report(out_dir, name, results.data, markdown(results.data))
    return results.data


def _current(cell: dict[str, Any], s: SpeculativeSettings) -> bool:
    k = key(s, cell["model"], Task(cell["task"]), Mode(cell["mode"]), cell["concurrency"])
    return cell["model"] in s.models and all(cell.get(name) == value for name, value in k.items())


def _release() -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


def command_line(s: SpeculativeSettings, quick: bool = False) -> str:
    """The command that measures `s` (options that differ from the defaults, or from --quick's, only)."""
    d, words = SpeculativeSettings(), ["cortexstream", "bench", "speculative"]
    if quick:
        d, words = d.quick(), words + ["--quick"]
    for option, name, text in (
            ("--models", "models", ",".join(s.models)), ("--tasks", "tasks", ",".join(t.value for t in s.tasks)),
            ("--modes", "modes", ",".join(m.value for m in s.modes)),
            ("--concurrency", "concurrency", ",".join(map(str, s.concurrency))),
            ("--speculative", "speculative", ";".join(s.speculative)),
            ("--max-tokens", "max_tokens", str(s.max_tokens)), ("--rounds", "rounds", str(s.rounds)),
            ("--temperature", "temperature", f"{s.temperature:g}")):
        if getattr(s, name) != getattr(d, name):
            words += [option, text]
    return shlex.join(words)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `cortexstream bench speculative` (and `python -m cortexstream.benchmarks.speculative`). The
    sizes' defaults are None (not given), so that a `--pair` run takes its own (`PairSettings`) and a prompt-lookup
    run `SpeculativeSettings`'."""
    d, p = SpeculativeSettings(), PairSettings()
    parser.add_argument("--models", default=None,
                        help="comma-separated models: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b (verified "
                             "benchmark assets, skipped with a note when absent), or a GGUF file / model directory "
                             f"(default: {','.join(d.models)})")
    parser.add_argument("--tasks", default=None,
                        help=f"comma-separated among {', '.join(t.value for t in Task)} (default: "
                             f"{','.join(t.value for t in d.tasks)}; with --pair: "
                             f"{','.join(t.value for t in p.tasks)})")
    parser.add_argument("--modes", default=None,
                        help="comma-separated among greedy, sampled (temperature --temperature, no seed: a "
                             "seeded request decodes plainly) (default: "
                             f"{','.join(m.value for m in d.modes)}; with --pair: "
                             f"{','.join(m.value for m in p.modes)})")
    parser.add_argument("--concurrency", default=None,
                        help=f"comma-separated requests per call, each in 1..{MAX_INPUTS} (1: stream_generate, "
                             f"more: batch_generate) (default: {','.join(map(str, d.concurrency))}; with --pair: "
                             f"{','.join(map(str, p.concurrency))})")
    parser.add_argument("--speculative", default=None,
                        help="semicolon-separated prompt-lookup settings measured beside plain decoding, e.g. "
                             f"'ngram:k=4,n=3;ngram:k=8,n=3' (default: {';'.join(d.speculative)})")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"new tokens per request, at most (default: {d.max_tokens}; with --pair: "
                             f"{p.max_tokens})")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per cell, the systems' order rotating each round; medians are reported "
                             f"(default: {d.rounds}; with --pair: {p.rounds})")
    parser.add_argument("--temperature", type=float, default=None,
                        help=f"temperature of the sampled mode (default: {d.temperature:g})")
    parser.add_argument("--pair", default=None, metavar="TARGET:DRAFT",
                        help="measure draft-model speculative decoding instead of prompt lookup: TARGET decoded "
                             "plainly, drafted by DRAFT (same vocabulary) in CortexStream and in mlx-lm; "
                             f"e.g. {DEFAULT_PAIR} (the verified assets) or two GGUF files / model directories. "
                             "Results in speculative_pair.*")
    parser.add_argument("--draft-k", type=int, default=None,
                        help=f"with --pair: tokens drafted per verify pass, at most (default: {p.k}; "
                             "CortexStream adapts it per sequence, mlx-lm always drafts it)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: edit and chat, concurrency 1 and 2, 32 tokens, 1 round "
                             "(speculative_quick.*); with --pair: edit, concurrency 1, 32 tokens, 1 round "
                             "(speculative_pair_quick.*)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no new cell after this many minutes (skipped cells are listed as missing)")
    parser.add_argument("--resume", action="store_true", help="keep cells already in the JSON, run the rest")
    parser.add_argument("--out", default="bench/results", help="output folder")
    parser.epilog = ("--models qwen2.5-coder-0.5b / qwen2.5-coder-1.5b: the verified benchmark assets (fetched from "
                     "a checkout with `python -m bench.assets --asset NAME`). --pair TARGET:DRAFT measures a draft "
                     "model instead of prompt lookup, with smaller defaults (each option says which)")


def run_from_args(args: argparse.Namespace) -> int:
    """Every option checked before anything loads (each error names its option), then `run` (`--pair`:
    `speculative_pair.run_pair`)."""
    from cortexstream.backend import enable_linux_cpu_tuning

    if args.pair is not None:
        from cortexstream.benchmarks.speculative_pair import run_pair_from_args

        return run_pair_from_args(args)
    settings = from_args(args)
    enable_linux_cpu_tuning()
    run(settings, args.out, quick=args.quick, resume=args.resume, max_minutes=args.max_minutes)
    return show_report(args.out, result_name(args.quick))


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv,
                         "python -m cortexstream.benchmarks.speculative")


__all__ = ["add_arguments", "command_line", "key", "load_model", "main", "run", "run_from_args"]


if __name__ == "__main__":
    raise SystemExit(main())
