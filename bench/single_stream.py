"""One request's prefill and decode speed, CortexStream vs mlx_lm.generate_step: `python -m bench.single_stream`.

The user-facing single-request comparison is `cortexstream bench throughput --parts single` (whole-call wall time
vs mlx_lm.generate); this diagnostic splits a request into prefill and decode rates.

Both run on the same loaded model in the same process, alternating, best of `repeats`. Prefill tok/s = prompt
tokens / time to the first token; decode tok/s = (generated - 1) / time from the first to the last token.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import mlx.core as mx

from cortexstream.benchmarks.common import prompt_token_lists, show_report, write_results
from cortexstream.benchmarks.machine import machine, model_record
from cortexstream.benchmarks.runner import run_as_script


def _cortexstream(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> dict[str, float]:
    import cortexstream

    start = time.perf_counter()
    first = None
    count = 0
    # eos is not suppressed; the prompt is mid-text so the model keeps writing
    for response in cortexstream.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
        count += 1
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"prefill_tps": len(prompt) / (first - start), "decode_tps": (count - 1) / (end - first),
            "generated": count}


def _mlx_lm(model: Any, tokenizer: Any, prompt: list[int], max_tokens: int) -> dict[str, float]:
    from mlx_lm.generate import generate_step

    eos = set(tokenizer.eos_token_ids)
    start = time.perf_counter()
    first = None
    count = 0
    for (token, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
        count += 1
        if first is None:
            first = time.perf_counter()
        if int(token) in eos:
            break
    end = time.perf_counter()
    return {"prefill_tps": len(prompt) / (first - start), "decode_tps": (count - 1) / (end - first),
            "generated": count}


def run(model_source: str | None, prompt_tokens: int, max_tokens: int, out_dir: str, repeats: int = 3) -> dict:
    from cortexstream.models.loader import load

    model, tokenizer = load(model_source)
    prompt = prompt_token_lists(tokenizer, 1, prompt_tokens)[0]
    systems = {"cortexstream.stream_generate": _cortexstream, "mlx_lm.generate_step": _mlx_lm}
    for fn in systems.values():
        fn(model, tokenizer, prompt[:64], 8)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            runs[name].append(fn(model, tokenizer, prompt, max_tokens))
    best = {name: {k: max(r[k] for r in rs) for k in ("prefill_tps", "decode_tps")} | {"generated": rs[0]["generated"]}
            for name, rs in runs.items()}
    ours, ref = best["cortexstream.stream_generate"], best["mlx_lm.generate_step"]
    payload = {
        "benchmark": "single_stream",
        "machine": machine(),
        "model": model_record(model),
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "best": best,
        "runs": runs,
        "ratio_prefill": ours["prefill_tps"] / ref["prefill_tps"],
        "ratio_decode": ours["decode_tps"] / ref["decode_tps"],
    }
    m = payload["machine"]
    md = "\n".join([
        "# Single-stream baseline: cortexstream vs mlx_lm.generate_step",
        "",
        f"Model {payload['model']['source'].split('/')[-1]} ({payload['model']['weights']}), {prompt_tokens}-token "
        f"real-text prompt, up to {max_tokens} greedy tokens, best of {repeats} (alternating runs, same process).",
        f"Machine: {m['platform']}, {m['cpu_count']} cores, {m['device']}, BLAS: {m['blas']}, mlx {m['mlx']}.",
        "",
        "| system | prefill tok/s | decode tok/s | tokens generated |",
        "|---|---:|---:|---:|",
        *[f"| {n} | {b['prefill_tps']:.1f} | {b['decode_tps']:.1f} | {b['generated']} |" for n, b in best.items()],
        "",
        f"Ratio cortexstream / mlx_lm: prefill {payload['ratio_prefill']:.2f}x, decode {payload['ratio_decode']:.2f}x.",
        "",
    ])
    write_results(out_dir, "single_stream", payload, md)
    return payload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None)
    parser.add_argument("--out", default="bench/results", help="output folder")


def run_from_args(args: argparse.Namespace) -> int:
    from cortexstream.cli.number_lists import at_least

    for option in ("prompt_tokens", "max_tokens", "repeats"):
        at_least(getattr(args, option), "--" + option.replace("_", "-"), 1)
    run(args.model, args.prompt_tokens, args.max_tokens, args.out, args.repeats)
    return show_report(args.out, "single_stream")


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.single_stream")


if __name__ == "__main__":
    raise SystemExit(main())
