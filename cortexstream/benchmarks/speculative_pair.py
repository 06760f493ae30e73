"""`cortexstream bench speculative --pair TARGET:DRAFT`: draft-model speculative decoding against plain decoding
of the target and against mlx-lm's speculative decoding on the same pair (issue #36).

The target and the draft model are loaded once (verified benchmark assets by name, or any loadable sources with
the same vocabulary, checked before measuring); the same task prompts as a prompt-lookup run go through the
target's chat template; per (task, mode, concurrency) cell `speculative_pair_measure` runs every system. Cells are
written to `<out>/speculative_pair.json` (`speculative_pair_quick.json` with --quick) as soon as they are measured
(`--resume` keeps those measured with the same settings); the report is `speculative_pair_report`'s. A pair that
cannot be loaded (an absent asset, a vocabulary mismatch) is recorded as skipped with the reason.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any, Callable

from cortexstream.benchmarks.common import write_report
from cortexstream.benchmarks.result_store import ResultStore
from cortexstream.benchmarks.speculative_models import load_model, model_path
from cortexstream.benchmarks.speculative_pair_measure import draft_setting, measure_pair_cell, warm_up_pair
from cortexstream.benchmarks.speculative_pair_report import pair_markdown, pair_targets
from cortexstream.benchmarks.speculative_pair_settings import PairSettings, pair_command_line
from cortexstream.benchmarks.speculative_settings import Mode
from cortexstream.benchmarks.speculative_tasks import Task, build_prompts, local_wiki_text, prompt_tokens
from cortexstream.engine.draft_runner import check_pair

PAIR_NAME = "speculative_pair"
PARTS = ("cells", "skipped", "runs")


def pair_result_name(quick: bool) -> str:
    return f"{PAIR_NAME}_quick" if quick else PAIR_NAME


def pair_key(s: PairSettings, task: Task, mode: Mode, concurrency: int) -> dict[str, Any]:
    """What names a cell: where it was measured and the settings its numbers depend on."""
    return {"target": s.target, "draft": s.draft, "k": s.k, "task": task.value, "mode": mode.value,
            "concurrency": concurrency, "max_tokens": s.max_tokens, "rounds": s.rounds,
            "temperature": s.temperature}


def pair_planned(s: PairSettings) -> list[tuple[Task, Mode, int]]:
    return [(task, mode, c) for task in s.tasks for mode in s.modes for c in s.concurrency]


def load_pair(s: PairSettings, loaded: dict[str, tuple[Any, Any]] | None) -> tuple[Any, Any, Any, str, dict]:
    """(target, its tokenizer, draft model, the engine's draft setting, the models' records); a CortexStreamError
    when either cannot be loaded or the draft's vocabulary is not the target's. `loaded`: already loaded
    (model, tokenizer) pairs by source name."""
    def one(source: str) -> tuple[Any, Any, dict[str, Any]]:
        if loaded and source in loaded:
            return (*loaded[source], {"source": source})
        return load_model(source)

    setting = draft_setting(model_path(s.draft), s.k)  # an absent asset fails here, before the slow load
    target, tokenizer, target_record = one(s.target)
    draft, draft_tokenizer, draft_record = one(s.draft)
    check_pair(target, tokenizer, draft, draft_tokenizer, s.draft)
    return target, tokenizer, draft, setting, {"target": target_record, "draft": draft_record}


def run_pair(settings: PairSettings = PairSettings(), out_dir: str = "bench/results", *, quick: bool = False,
             resume: bool = False, max_minutes: float | None = None,
             loaded: dict[str, tuple[Any, Any]] | None = None, progress: bool = True,
             log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure `settings` and write `<out_dir>/speculative_pair[_quick].{json,md}`."""
    from tqdm import tqdm

    from cortexstream.errors import CortexStreamError

    s = settings
    grounded_text = any(t in (Task.SUMMARIZE, Task.QUOTE) for t in s.tasks)
    wiki, text_source = local_wiki_text() if grounded_text else ("", "none needed")
    recorded = {"target": s.target, "draft": s.draft, "k": s.k, "tasks": [t.value for t in s.tasks],
                "modes": [m.value for m in s.modes], "concurrency": list(s.concurrency),
                "max_tokens": s.max_tokens, "rounds": s.rounds, "temperature": s.temperature,
                "command": pair_command_line(s, quick), "quick": quick, "text_source": text_source,
                "max_minutes": max_minutes, "model_records": {}}
    name = pair_result_name(quick)
    os.makedirs(out_dir, exist_ok=True)
    results = ResultStore(os.path.join(out_dir, f"{name}.json"), PAIR_NAME, recorded, PARTS, resume=resume,
                          fresh=("skipped",))
    for cell in results.data["cells"]:
        if _current(cell, s) and cell.get("model_records"):
            recorded["model_records"] = cell["model_records"]
    started = time.perf_counter()
    planned = pair_planned(s)
    todo = [c for c in planned if not results.has("cells", **pair_key(s, *c))]
    with tqdm(total=len(planned), initial=len(planned) - len(todo), desc="pair cells", unit="cell",
              disable=not progress or not todo) as bar:
        say = bar.write if progress else log
        try:
            models = load_pair(s, loaded) if todo else None
        except CortexStreamError as exc:  # an absent asset, an unloadable model, a mismatched vocabulary
            results.data["skipped"].append({"model": s.pair, "reason": str(exc)})
            results.save()
            say(f"skipping {s.pair}: {exc}")
            models = None
        if models is not None:
            recorded["model_records"] = models[-1]
            _measure(results, s, todo, models, wiki, started, max_minutes, bar, say)
            del models
            _release()
    results.data["missing"] = [f"{t.value} {mode.value} c={c}" for t, mode, c in planned
                               if not results.has("cells", **pair_key(s, t, mode, c)) and not results.data["skipped"]]
    results.data["cells"] = [c for c in results.data["cells"] if _current(c, s)]  # other settings' cells go
    results.data["targets"] = pair_targets(results.data)
    results.data["runs"].append({"max_minutes": max_minutes, "seconds": round(time.perf_counter() - started, 1)})
    write_report(out_dir, name, results.data, pair_markdown(results.data))
    return results.data


def _measure(results: ResultStore, s: PairSettings, todo: list[tuple[Task, Mode, int]], models: tuple,
             wiki: str, started: float, max_minutes: float | None, bar: Any, say: Callable[[str], None]) -> None:
    from cortexstream.backend import ensure_buffer_cache

    target, tokenizer, draft, setting, records = models
    ensure_buffer_cache()  # mlx-lm runs under the limit the engine sets, from its first call on
    prompts = {t: [prompt_tokens(tokenizer, p) for p in build_prompts(t, max(s.concurrency), wiki)] for t in s.tasks}
    warm_up_pair(target, draft, tokenizer, min(prompts.values(), key=lambda ps: len(ps[0])), setting, s.k,
                 batched=max(s.concurrency) > 1)
    for task, mode, c in todo:
        what = f"{s.pair} {task.value} {mode.value} c={c}"
        if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
            say(f"time budget spent: skipping {what}")  # listed as missing in the report
            bar.update(1)
            continue
        tic = time.perf_counter()
        cell = measure_pair_cell(target, draft, tokenizer, prompts[task][:c], s.max_tokens, mode, s.temperature,
                                 setting, s.k, s.rounds)
        cell.update(pair_key(s, task, mode, c), model_records=records, seconds=round(time.perf_counter() - tic, 2))
        results.add("cells", cell)
        bar.update(1)


def _current(cell: dict[str, Any], s: PairSettings) -> bool:
    try:
        k = pair_key(s, Task(cell["task"]), Mode(cell["mode"]), cell["concurrency"])
    except (KeyError, ValueError):
        return False
    planned = (Task(cell["task"]), Mode(cell["mode"]), cell["concurrency"]) in pair_planned(s)
    return planned and all(cell.get(name) == value for name, value in k.items())


def _release() -> None:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


def run_pair_from_args(args: Any) -> int:
    """Every option checked before anything loads (each error names its option), then `run_pair`."""
    from cortexstream.backend import enable_linux_cpu_tuning
    from cortexstream.benchmarks.common import show_report
    from cortexstream.benchmarks.speculative_pair_settings import pair_from_args

    settings = pair_from_args(args)
    enable_linux_cpu_tuning()
    run_pair(settings, args.out, quick=args.quick, resume=args.resume, max_minutes=args.max_minutes)
    return show_report(args.out, pair_result_name(args.quick))


__all__ = ["PAIR_NAME", "load_pair", "pair_key", "pair_planned", "pair_result_name", "run_pair",
           "run_pair_from_args"]
