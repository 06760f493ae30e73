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
to plain decoding and mlx-lm, and the issue's targets with their measured status. Draft models are not built in
the engine yet, so they are not measured here.
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
from cortexstream.benchmarks.speculative_report import markdown, targets
from cortexstream.benchmarks.speculative_settings import Mode, SpeculativeSettings, from_args
from cortexstream.benchmarks.speculative_settings import add_arguments as add_size_arguments
from cortexstream.benchmarks.speculative_tasks import Task, build_prompts, local_wiki_text, prompt_tokens

NAME = "speculative"
PARTS = ("cells", "skipped", "runs")


def result_name(quick: bool) -> str:
    return f"{NAME}_quick" if quick else NAME


def load_model(source: str) -> tuple[Any, Any, dict[str, Any]]:
    """The model and tokenizer (a `model_assets.BenchAsset` name: its verified file, an AssetError saying how to
    fetch it when absent) and its record for the results (no local paths)."""
    from cortexstream.benchmarks.machine import model_record
    from cortexstream.benchmarks.model_assets import BenchAsset, qwen_coder_15b_gguf
    from cortexstream.models.loader import load
    from cortexstream.training.c2c.sharer_asset import qwen_coder_gguf

    path = source
    if source == BenchAsset.QWEN25_CODER_05B.value:
        path = qwen_coder_gguf()
    elif source == BenchAsset.QWEN25_CODER_15B.value:
        path = qwen_coder_15b_gguf()
    model, tokenizer = load(path)
    return model, tokenizer, model_record(model)


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
    """The options of `cortexstream bench speculative` (and `python -m cortexstream.benchmarks.speculative`)."""
    add_size_arguments(parser)
    parser.epilog = ("--models qwen2.5-coder-0.5b / qwen2.5-coder-1.5b: the verified benchmark assets (fetched from "
                     "a checkout with `python -m bench.assets --asset NAME`); draft models are not built in the "
                     "engine yet")


def run_from_args(args: argparse.Namespace) -> int:
    """Every option checked before anything loads (each error names its option), then `run`."""
    from cortexstream.backend import enable_linux_cpu_tuning

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
