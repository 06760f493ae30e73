"""`cortexstream bench throughput`: this engine vs mlx_lm.batch_generate vs sequential mlx_lm generate_step.

Same loaded model, dtype and prompts (real text from the Python docs) for all three, greedy decoding, at each
concurrency level. Definitions (the same for every system):
- aggregate tok/s: all generated tokens / wall time from submitting the batch to the last token;
- decode tok/s: tokens produced by decode steps / time spent in decode steps (mlx-lm's own BatchStats definition;
  for the sequential baseline, the sum over requests of their decode phases);
- TTFT: time from submitting the batch (every request arrives at t=0) to a request's first token. mlx_lm's
  batch_generate does not expose per-request first-token times; its TTFT is reported as its total prefill time.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from cortexstream.benchmarks.common import machine, percentile, prompt_token_lists, write_results


def _engine_run(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from cortexstream.engine.engine import Engine

    engine = Engine(model, tokenizer, kv_tokens=len(prompts) * (len(prompts[0]) + max_tokens + 32),
                    max_num_seqs=len(prompts), prefix_caching=False)
    mx.reset_peak_memory()
    start = time.perf_counter()
    ids = [engine.add_request(p, max_tokens=max_tokens) for p in prompts]
    first: dict[str, float] = {}
    tokens = 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.token is not None:
                tokens += 1
                first.setdefault(out.request_id, time.perf_counter() - start)
    wall = time.perf_counter() - start
    ttfts = [first[i] for i in ids if i in first]
    return _metrics(tokens, wall, engine.num_decode_tokens, engine.decode_time, ttfts)


def _mlx_lm_batch_run(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from mlx_lm import batch_generate

    mx.reset_peak_memory()
    start = time.perf_counter()
    response = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
    wall = time.perf_counter() - start
    stats = response.stats
    tokens = sum(len(t) for t in response.token_ids)
    return _metrics(tokens, wall, stats.generation_tokens, stats.generation_time,
                    [stats.prompt_time] * len(prompts))


def _mlx_lm_sequential_run(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from mlx_lm.generate import generate_step

    eos = set(tokenizer.eos_token_ids)
    mx.reset_peak_memory()
    start = time.perf_counter()
    tokens = decode_tokens = 0
    decode_time = 0.0
    ttfts = []
    for prompt in prompts:
        count = 0
        for (token, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
            count += 1
            if count == 1:
                first = time.perf_counter()
                ttfts.append(first - start)
            if int(token) in eos:
                break
        decode_time += time.perf_counter() - first
        tokens += count
        decode_tokens += count - 1
    wall = time.perf_counter() - start
    return _metrics(tokens, wall, decode_tokens, decode_time, ttfts)


def _metrics(tokens: int, wall: float, decode_tokens: int, decode_time: float, ttfts: list[float]) -> dict[str, Any]:
    return {
        "generated_tokens": tokens,
        "wall_s": wall,
        "aggregate_tps": tokens / wall,
        "decode_tps": decode_tokens / decode_time if decode_time > 0 else float("nan"),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
    }


SYSTEMS = {
    "cortexstream": _engine_run,
    "mlx_lm.batch_generate": _mlx_lm_batch_run,
    "mlx_lm.generate_step (sequential)": _mlx_lm_sequential_run,
}


def run(model_source: str | None, concurrency: list[int], prompt_tokens: int, max_tokens: int,
        out_dir: str, repeats: int = 1) -> dict[str, Any]:
    from rich.progress import Progress

    from cortexstream.models.loader import load, model_info

    model, tokenizer = load(model_source)
    info = model_info(model)
    all_prompts = prompt_token_lists(tokenizer, max(concurrency), prompt_tokens)
    warm = all_prompts[:2]
    for system in SYSTEMS.values():  # compile kernels and fill allocator caches once per system
        system(model, tokenizer, [p[:32] for p in warm], 4)
    results: list[dict[str, Any]] = []
    with Progress() as progress:
        task = progress.add_task("throughput", total=len(concurrency) * len(SYSTEMS) * repeats)
        for c in concurrency:
            prompts = all_prompts[:c]
            for name, system in SYSTEMS.items():
                best = None
                for _ in range(repeats):
                    m = system(model, tokenizer, prompts, max_tokens)
                    if best is None or m["aggregate_tps"] > best["aggregate_tps"]:
                        best = m
                    progress.advance(task)
                results.append({"concurrency": c, "system": name, **best})
    payload = {
        "benchmark": "throughput",
        "machine": machine(),
        "model": info.as_dict() if info else model_source,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "results": results,
        "ratios": _ratios(results),
    }
    write_results(out_dir, "throughput", payload, _markdown(payload))
    return payload


def _ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for c in sorted({r["concurrency"] for r in results}):
        by = {r["system"]: r for r in results if r["concurrency"] == c}
        ours = by["cortexstream"]
        rows.append({
            "concurrency": c,
            "aggregate_vs_sequential": ours["aggregate_tps"] / by["mlx_lm.generate_step (sequential)"]["aggregate_tps"],
            "aggregate_vs_batch_generate": ours["aggregate_tps"] / by["mlx_lm.batch_generate"]["aggregate_tps"],
            "decode_vs_batch_generate": ours["decode_tps"] / by["mlx_lm.batch_generate"]["decode_tps"],
        })
    return rows


def _markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    lines = [
        "# Throughput: CortexStream engine vs mlx-lm",
        "",
        f"Model: {payload['model'].get('source', payload['model']) if isinstance(payload['model'], dict) else payload['model']}"
        f" ({payload['model'].get('weights', '') if isinstance(payload['model'], dict) else ''}); "
        f"{payload['prompt_tokens']}-token real-text prompts, up to {payload['max_tokens']} greedy tokens each; "
        f"best of {payload['repeats']}.",
        f"Machine: {m['platform']}, {m['cpu_count']} cores, {m['device']}, BLAS: {m['blas']}, mlx {m['mlx']}.",
        "",
        "| concurrency | system | aggregate tok/s | decode tok/s | TTFT p50 (s) | TTFT p95 (s) | peak mem (GB) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in payload["results"]:
        lines.append(
            f"| {r['concurrency']} | {r['system']} | {r['aggregate_tps']:.1f} | {r['decode_tps']:.1f} | "
            f"{r['ttft_p50_s']:.2f} | {r['ttft_p95_s']:.2f} | {r['peak_memory_gb']:.2f} |"
        )
    lines += ["", "| concurrency | aggregate vs sequential mlx_lm | aggregate vs batch_generate | decode vs batch_generate |",
              "|---:|---:|---:|---:|"]
    for r in payload["ratios"]:
        lines.append(f"| {r['concurrency']} | {r['aggregate_vs_sequential']:.2f}x | "
                     f"{r['aggregate_vs_batch_generate']:.2f}x | {r['decode_vs_batch_generate']:.2f}x |")
    lines += ["", "Targets: concurrency 1 >= 1.0x mlx_lm; concurrency 8 decode >= 1.25x mlx_lm.batch_generate.", ""]
    return "\n".join(lines)
