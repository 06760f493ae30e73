"""Decode-step floor: how much of a batched decode step an engine can change at all, on this machine.

Run: ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m bench.decode_floor``
(about 3 min). Writes bench/results/decode_floor.json and decode_floor.md.

Issue #4 asks the engine's decode tokens/s at concurrency 8 to be >= 1.25x `mlx_lm.batch_generate`'s. Both run
the same mlx-lm model code; what an engine owns is the KV cache (write, fetch, attention), the batching and the
Python around the forward pass. This script times one decode step (batch B, every sequence with `context` keys,
greedy sampling, evaluated synchronously; median of `steps` steps after warm-up, the four systems interleaved
step by step so that load hits them alike) for:

- ``mlx_lm``: the model over mlx-lm's ``BatchKVCache`` (what ``batch_generate`` decodes with; batch 1:
  ``KVCache``), then log-softmax + argmax, as ``batch_generate`` does per step;
- ``engine``: ``Engine.step()`` of this engine with ``pipeline=False`` (schedule, batched forward over the arena,
  sampling, post-processing);
- ``floor``: the ``mlx_lm`` step with mlx-lm's attention replaced by a stub that returns its queries (the cache
  update stays): everything in the step that neither engine can change without changing the model's own
  computation (projections, norms, RoPE, MLP, vocabulary projection, sampling);
- ``floor_exp``: the same with a stub that only computes one ``exp`` per (query head, key) and sums them, the
  least work an exact softmax attention does (MLX's CPU ``exp`` is scalar, about 20 ns per element here).

``mlx_lm / floor`` is the most any cache or attention implementation could gain over mlx-lm (if attention cost
nothing), ``mlx_lm / floor_exp`` a tighter bound. If they are below 1.25, the 1.25x target cannot be reached by
the engine's parts on this machine.
Every system starts from the same `context` and grows by one token per step, as in a real decode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from cortexstream.benchmarks.common import NoEosTokenizer, prompt_token_lists, write_results
from cortexstream.benchmarks.machine import machine, model_record
from cortexstream.benchmarks.runner import run_as_script


def _mlx_lm_stepper(model: Any, prompts: list[list[int]]) -> Callable[[], None]:
    from mlx_lm.models.cache import BatchKVCache, KVCache

    batch = len(prompts)
    caches = [KVCache() if batch == 1 else BatchKVCache([0] * batch) for _ in model.layers]
    logits = model(mx.array(prompts), cache=caches)
    mx.eval(logits, [c.state for c in caches])
    tokens = mx.argmax(logits[:, -1, :], axis=-1)[:, None]

    def step() -> None:
        out = model(tokens, cache=caches)[:, -1, :]
        logprobs = out - mx.logsumexp(out, axis=-1, keepdims=True)
        mx.eval(mx.argmax(logprobs, axis=-1), logprobs)

    return step


def _engine_stepper(model: Any, tokenizer: Any, prompts: list[list[int]], num_steps: int) -> Callable[[], None]:
    from cortexstream.engine.engine import Engine

    max_tokens = num_steps + 4
    engine = Engine(model, NoEosTokenizer(tokenizer), kv_tokens=len(prompts) * (len(prompts[0]) + max_tokens + 16),
                    block_size=16, max_num_seqs=len(prompts), prefix_caching=False, pipeline=False)
    for prompt in prompts:
        engine.add_request(prompt, max_tokens=max_tokens)
    view = engine.snapshot(blocks=False)
    while view.waiting or any(s.num_pending > 1 for s in view.running):
        engine.step()
        view = engine.snapshot(blocks=False)
    if len(view.running) != len(prompts):
        raise RuntimeError(f"engine: {len(view.running)} of {len(prompts)} requests running")
    engine.step()  # first decode step: everything allocated

    def step() -> None:
        outputs = engine.step()
        assert len(outputs) == len(prompts), outputs

    return step


def _stub_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                    sinks: Any = None) -> mx.array:
    return queries


def _exp_only_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any, scale: float, mask: Any,
                        sinks: Any = None) -> mx.array:
    """The least any exact softmax attention computes: one exp per (query head, key) and their sum."""
    batch, heads, _, _ = queries.shape
    scores = mx.broadcast_to(queries[..., :1], (batch, heads, 1, keys.shape[2]))
    return queries + mx.exp(scores).sum(axis=-1, keepdims=True)


def run(context: int, batches: list[int], warmup: int, steps: int, out_dir: Path) -> dict[str, Any]:
    import mlx_lm.models.llama as llama_module

    from cortexstream.models.loader import load

    model, tokenizer = load(None)
    results = []
    for batch in batches:
        prompts = prompt_token_lists(tokenizer, batch, context)
        mlx_step = _mlx_lm_stepper(model, prompts)
        engine_step = _engine_stepper(model, tokenizer, prompts, warmup + steps)
        original = llama_module.scaled_dot_product_attention

        def with_attention(attention: Callable[..., mx.array]) -> Callable[[], None]:
            stepper = _mlx_lm_stepper(model, prompts)

            def step() -> None:
                llama_module.scaled_dot_product_attention = attention
                try:
                    stepper()
                finally:
                    llama_module.scaled_dot_product_attention = original

            return step

        systems = {"mlx_lm": mlx_step, "engine": engine_step, "floor": with_attention(_stub_attention),
                   "floor_exp": with_attention(_exp_only_attention)}
        times: dict[str, list[float]] = {name: [] for name in systems}
        for i in range(warmup + steps):
            for name, fn in systems.items():
                tic = time.perf_counter()
                fn()
                if i >= warmup:
                    times[name].append(time.perf_counter() - tic)
        med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        results.append({
            "batch": batch, "context": context, "median_ms": med,
            "p25_p75_ms": {n: [statistics.quantiles(ts, n=4)[0] * 1e3, statistics.quantiles(ts, n=4)[2] * 1e3]
                           for n, ts in times.items()},
            "engine_vs_mlx_lm_speed": med["mlx_lm"] / med["engine"],
            "max_speedup_if_attention_were_free": med["mlx_lm"] / med["floor"],
            "max_speedup_if_attention_were_only_its_exps": med["mlx_lm"] / med["floor_exp"],
            "attention_and_cache_share_of_mlx_lm_step": 1 - med["floor"] / med["mlx_lm"],
        })
        print(json.dumps(results[-1]))
    payload = {"benchmark": "decode_floor", "machine": machine(), "model": model_record(model),
               "warmup": warmup, "steps": steps, "results": results}
    write_results(str(out_dir), "decode_floor", payload, _markdown(payload))
    return payload


def _markdown(payload: dict[str, Any]) -> str:
    m = payload["machine"]
    lines = [
        "# Decode-step floor: what an engine can change in a batched decode step",
        "",
        f"`python -m bench.decode_floor`; model {payload['model'].get('source')} "
        f"({payload['model'].get('weights')}); machine {m['platform']}, {m['cpu_count']} cores, {m['device']}, "
        f"BLAS {m['blas']}, mlx {m['mlx']}. Median of {payload['steps']} synchronous steps after {payload['warmup']} "
        "warm-up, the four systems interleaved step by step. See the script's docstring for definitions.",
        "",
        "| batch | context | mlx-lm step ms | engine step ms | floor ms (attention stubbed) | floor_exp ms "
        "| engine speed vs mlx-lm | max speedup: attention free | max speedup: attention = its exps "
        "| attention + cache share of mlx-lm's step |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in payload["results"]:
        med = r["median_ms"]
        lines.append(f"| {r['batch']} | {r['context']} | {med['mlx_lm']:.1f} | {med['engine']:.1f} | "
                     f"{med['floor']:.1f} | {med['floor_exp']:.1f} | {r['engine_vs_mlx_lm_speed']:.2f}x | "
                     f"{r['max_speedup_if_attention_were_free']:.2f}x | "
                     f"{r['max_speedup_if_attention_were_only_its_exps']:.2f}x | "
                     f"{100 * r['attention_and_cache_share_of_mlx_lm_step']:.0f}% |")
    lines.append("")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=192, help="keys per sequence (default: the throughput "
                        "benchmark's mid-decode context, 128-token prompts + 64 generated)")
    parser.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))


def run_from_args(args: argparse.Namespace) -> int:
    run(args.context, [int(b) for b in args.batch.split(",")], args.warmup, args.steps, args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.decode_floor")


if __name__ == "__main__":
    main()
