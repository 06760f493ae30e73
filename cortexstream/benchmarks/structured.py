"""`cortexstream bench structured`: how often grammar-constrained output is valid, what the masks cost, and tool
calls over HTTP.

For every model given (SmolLM2-135M by default):
- validity (`structured_measure`): a set of JSON schemas (`structured_schemas`), each asked for in words through the
  model's chat template, greedy and sampled, one request at a time and `--batch` at once, every request under its
  own schema; the fraction of outputs that `json.loads` parses and `jsonschema` accepts, and the 'length' finishes.
  The same prompts unconstrained (greedy, `--batch` at once) are the baseline;
- mask cost (`structured_speed`): decode tokens/s at batch `--batch` with every request constrained vs free, the
  order alternating over `--rounds`; compile time per schema and `warm()`; host time of one mask per token.
Tool calls, and json_schema beside the peer servers, are `bench tools` (`tool_bench`).
Writes `<out>/structured.json` (rewritten after every cell) and `structured.md` (`structured_report`).
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any, Callable, Sequence

from cortexstream.benchmarks.common import show_report, write_report
from cortexstream.benchmarks.result_store import ResultStore
from cortexstream.benchmarks.structured_report import markdown, targets
from cortexstream.benchmarks.structured_schemas import SchemaCase, schema_cases
from cortexstream.benchmarks.structured_settings import (Decoding, StructuredSettings, add_arguments, command_line,
                                                         from_args)

NAME = "structured"
STORE_PARTS = ("validity", "mask_cost", "compile", "host_mask", "runs")
DEFAULT_MODEL = "SmolLM2-135M-Instruct (default)"
Loaded = tuple[str, Any, Any]  # (name in the results, model, tokenizer)


def model_name(source: str | None) -> str:
    from cortexstream.benchmarks.machine import neutral_source

    return DEFAULT_MODEL if source is None else neutral_source(source)


def measure_model(loaded: Loaded, cases: Sequence[SchemaCase], s: StructuredSettings, results: ResultStore, *,
                  progress: bool, log: Callable[[str], None]) -> None:
    from cortexstream.benchmarks.structured_measure import validity_cell
    from cortexstream.benchmarks.structured_speed import compile_and_mask, mask_cost
    from cortexstream.engine.engine import Engine
    from cortexstream.engine.prompt import prompt_to_tokens

    name, model, tokenizer = loaded
    prompts = [prompt_to_tokens(tokenizer, case.messages()) for case in cases]
    schemas = [case.schema for case in cases]
    engine = Engine(model, tokenizer, kv_tokens=s.batch * (max(map(len, prompts)) + s.max_tokens + 32),
                    max_num_seqs=s.batch)
    samples = None
    try:
        cells = [(d, c, True) for d in Decoding for c in s.concurrencies] + [(Decoding.GREEDY, s.batch, False)]
        for decoding, concurrency, constrained in cells:
            row, outs = validity_cell(engine, name, cases, prompts, decoding=decoding, constrained=constrained,
                                      concurrency=concurrency, max_tokens=s.max_tokens,
                                      temperature=s.temperature, seed=s.seed, progress=progress)
            results.add("validity", row)
            log(f"{name} {decoding.value} c={concurrency} {'constrained' if constrained else 'unconstrained'}: "
                f"{row['valid']}/{row['schemas']} valid, {row['length_finishes']} 'length' ({row['seconds']:.0f}s)")
            if constrained and decoding is Decoding.GREEDY and concurrency == s.batch:
                samples = outs
    finally:
        engine.close()
    compile_row, mask_row = compile_and_mask(model, tokenizer, name, [c.name for c in cases], schemas, samples,
                                             progress=progress)
    results.add("compile", compile_row)
    results.add("host_mask", mask_row)
    log(f"{name}: warm() {compile_row['warm_seconds']:.2f}s, compile p50 {compile_row['compile_ms_p50']:.2f} ms, "
        f"mask p50 {mask_row['mask_us_p50']:.0f} µs")
    results.add("mask_cost", mask_cost(model, tokenizer, name, prompts, schemas, batch=s.batch,
                                       max_tokens=s.max_tokens, rounds=s.rounds, progress=progress, log=log))


def run(settings: StructuredSettings = StructuredSettings(), out_dir: str = "bench/results", *,
        loaded: Sequence[Loaded] | None = None, progress: bool = True,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every model of `settings` (or the `loaded` ones instead) and write `<out_dir>/structured.{json,md}`."""
    s = settings
    cases = schema_cases(s.schemas)
    names = [n for n, _, _ in loaded] if loaded is not None else [model_name(m) for m in s.models]
    recorded = {"command": command_line(s), "model_names": names, "schemas": len(cases),
                "schema_names": [c.name for c in cases], "max_tokens": s.max_tokens, "batch": s.batch,
                "concurrencies": list(s.concurrencies), "rounds": s.rounds, "temperature": s.temperature,
                "seed": s.seed}
    os.makedirs(out_dir, exist_ok=True)
    results = ResultStore(os.path.join(out_dir, f"{NAME}.json"), NAME, recorded, STORE_PARTS, resume=False)
    started = time.perf_counter()
    if loaded is not None:
        for entry in loaded:
            measure_model(entry, cases, s, results, progress=progress, log=log)
    else:
        from cortexstream.benchmarks.kv_dtype import load_model

        for source, name in zip(s.models, names):
            model, tokenizer, record = load_model(source)
            results.data.setdefault("model_records", {})[name] = record
            measure_model((name, model, tokenizer), cases, s, results, progress=progress, log=log)
            del model, tokenizer
            gc.collect()
    results.data["targets"] = targets(results.data)
    results.data["runs"].append({"seconds": round(time.perf_counter() - started, 1)})
    write_report(out_dir, NAME, results.data, markdown(results.data))
    return results.data


def run_from_args(args: argparse.Namespace) -> int:
    """Every option checked before anything loads (each error names its option), then `run`."""
    from cortexstream.backend import enable_linux_cpu_tuning

    enable_linux_cpu_tuning()  # the CLI did it already; `python -m` gets it here, before MLX is imported
    settings = from_args(args)
    run(settings, args.out)
    return show_report(args.out, NAME)


def main(argv: list[str] | None = None) -> int:
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m cortexstream.benchmarks.structured")


__all__ = ["add_arguments", "main", "measure_model", "run", "run_from_args"]


if __name__ == "__main__":
    raise SystemExit(main())
