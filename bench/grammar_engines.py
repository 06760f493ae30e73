"""llguidance against xgrammar on the schemas of `bench structured` (`python -m bench.grammar_engines`).

Why the engine enforces schemas with llguidance: this measures, per model tokenizer, what each library costs at
the two moments a server pays for a grammar:
- compile: schema -> a matcher ready for the first mask (llguidance: `LLMatcher(tokenizer, grammar)`; xgrammar:
  `compile_json_schema` + `GrammarMatcher`, its compiler's cache off, so every schema is compiled from scratch as a
  server sees new schemas), plus each library's one-off tokenizer setup;
- mask: one token of a real constrained answer (the greedy batch-8 outputs in `bench/results/structured.json`,
  re-tokenized): fill the next-token bitmask, then accept the token. Both fill the same int32 bitmask layout on
  the host; applying it to the logits is the engine's and is the same for both.
Both are asked for the same JSON layout (`", "` / `": "`, no free whitespace); a schema one of them refuses, or an
answer one of them rejects, is counted, not hidden. Needs `pip install xgrammar` (it requires torch; the engine
does not). Writes `bench/results/grammar_engines.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable

from cortexstream.benchmarks.common import write_results
from cortexstream.benchmarks.machine import machine, machine_sentence
from cortexstream.benchmarks.runner import run_as_script
from cortexstream.benchmarks.structured_schemas import SCHEMA_CASES
from cortexstream.grammar.spec import JSON_LAYOUT

MODELS = {"smollm2-135m": None, "qwen2.5-coder-0.5b-instruct.gguf (benchmark asset)": "qwen"}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _stats(values: list[float], scale: float) -> dict[str, float]:
    return {"p50": _percentile(values, 0.5) * scale, "p99": _percentile(values, 0.99) * scale,
            "mean": statistics.fmean(values) * scale if values else float("nan"),
            "max": max(values) * scale if values else float("nan"), "n": len(values)}


def _load(which: str | None) -> tuple[Any, list[int], int]:
    """(tokenizers.Tokenizer, eos ids, the model's vocabulary size) of a model."""
    from tokenizers import Tokenizer

    from cortexstream.benchmarks.kv_dtype import QWEN, load_model

    model, tokenizer, _ = load_model(QWEN if which == "qwen" else None)
    vocab = int(model.args.vocab_size)
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_padding()
    backend.no_truncation()
    return backend, sorted(int(t) for t in tokenizer.eos_token_ids), vocab


def _answers(model_name: str, backend: Any, eos: list[int]) -> dict[str, list[int]]:
    """The valid constrained greedy answers, as token ids (plus end of sequence), by schema name."""
    data = json.load(open("bench/results/structured.json"))
    for row in data["validity"]:
        if row["model"] == model_name and row["constrained"] and row["decoding"] == "greedy" \
                and row["concurrency"] == data["settings"]["batch"]:
            return {o["schema"]: backend.encode(o["text"], add_special_tokens=False).ids + [eos[0]]
                    for o in row["outputs"] if o["verdict"] == "valid"}
    raise SystemExit(f"no constrained greedy outputs of {model_name} in bench/results/structured.json")


def _add_mask_times(name: str, tokens: list[int], step: Callable[[int], bool], mask_s: list[float],
                    rejected: list[str]) -> None:
    """Time `step` (fill the next-token bitmask, accept the token) per token of an answer; all its times go to
    `mask_s`, or its schema to `rejected` when a token is refused."""
    times = []
    for token in tokens:
        tic = time.perf_counter()
        ok = step(token)
        times.append(time.perf_counter() - tic)
        if not ok:
            rejected.append(name)
            return
    mask_s += times


def _llguidance(backend: Any, eos: list[int], vocab: int, answers: dict[str, list[int]]) -> dict[str, Any]:
    import llguidance
    import llguidance.numpy as lnp

    tic = time.perf_counter()
    tok = llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
    setup = time.perf_counter() - tic
    compile_s, mask_s, refused, rejected = [], [], [], []
    bitmask = lnp.allocate_token_bitmask(1, tok.vocab_size)
    for case in SCHEMA_CASES:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(case.schema, defaults=JSON_LAYOUT)
        tic = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        compile_s.append(time.perf_counter() - tic)
        if matcher.is_error():
            refused.append(case.name)
            continue
        if case.name in answers:
            def step(token: int, matcher: Any = matcher) -> bool:
                lnp.fill_next_token_bitmask(matcher, bitmask, 0)
                return matcher.consume_token(token)

            _add_mask_times(case.name, answers[case.name], step, mask_s, rejected)
    return {"setup_seconds": setup, "compile": _stats(compile_s, 1e3), "mask": _stats(mask_s, 1e6),
            "refused": refused, "rejected": rejected}


def _xgrammar(backend: Any, eos: list[int], vocab: int, answers: dict[str, list[int]]) -> dict[str, Any]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    tic = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=backend), vocab_size=vocab,
                                              stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - tic
    compile_s, mask_s, refused, rejected = [], [], [], []
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    for case in SCHEMA_CASES:
        tic = time.perf_counter()
        try:
            compiled = compiler.compile_json_schema(json.dumps(case.schema), any_whitespace=False,
                                                    separators=(", ", ": "), strict_mode=True)
            matcher = xgr.GrammarMatcher(compiled)
        except Exception as exc:  # noqa: BLE001 - a schema xgrammar cannot compile is a result
            refused.append(f"{case.name}: {type(exc).__name__}")
            continue
        compile_s.append(time.perf_counter() - tic)
        if case.name in answers:
            def step(token: int, matcher: Any = matcher) -> bool:
                matcher.fill_next_token_bitmask(bitmask)
                return matcher.accept_token(token)

            _add_mask_times(case.name, answers[case.name], step, mask_s, rejected)
    return {"setup_seconds": setup, "compile": _stats(compile_s, 1e3), "mask": _stats(mask_s, 1e6),
            "refused": refused, "rejected": rejected}


def markdown(data: dict[str, Any]) -> str:
    out = ["# llguidance vs xgrammar (`python -m bench.grammar_engines`)", "",
           f"Machine: {machine_sentence(data['machine'])}. llguidance {data['versions']['llguidance']}, xgrammar "
           f"{data['versions']['xgrammar']}. {len(SCHEMA_CASES)} schemas of `bench structured`; mask = fill the "
           "next-token bitmask + accept the token, over the re-tokenized valid constrained answers of "
           "`bench/results/structured.json` (plus end of sequence).", "",
           "| model | engine | tokenizer setup s | compile p50 ms | compile p99 ms | compile max ms | mask p50 µs | "
           "mask p99 µs | mask mean µs | tokens | schemas refused | answers rejected |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in data["rows"]:
        c, m = r["compile"], r["mask"]
        out.append(f"| {r['model']} | {r['engine']} | {r['setup_seconds']:.2f} | {c['p50']:.2f} | {c['p99']:.2f} | "
                   f"{c['max']:.2f} | {m['p50']:.0f} | {m['p99']:.0f} | {m['mean']:.0f} | {m['n']} | "
                   f"{', '.join(r['refused']) or 'none'} | {', '.join(r['rejected']) or 'none'} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    def add(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--out", default="bench/results")

    def run(args: argparse.Namespace) -> int:
        from importlib.metadata import version

        rows = []
        for name, which in MODELS.items():
            backend, eos, vocab = _load(which)
            answers = _answers(name, backend, eos)
            for engine, measure in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
                print(f"[grammar_engines] {name}: {engine}", flush=True)
                rows.append({"model": name, "engine": engine, **measure(backend, eos, vocab, answers)})
        data = {"machine": machine(), "versions": {"llguidance": version("llguidance"),
                                                   "xgrammar": version("xgrammar")}, "rows": rows}
        write_results(args.out, "grammar_engines", data, markdown(data))
        print(markdown(data))
        return 0

    return run_as_script(__doc__, add, run, argv, "python -m bench.grammar_engines")


if __name__ == "__main__":
    raise SystemExit(main())
