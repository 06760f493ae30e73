"""Where a batched decode step's time goes per KV storage (`python -m bench.kv_decode_profile`): a diagnostic.

`bench kv-dtype` times engine decode steps per storage; this says why they differ. SmolLM2, `--batch` sequences of
`--keys` real-text tokens each, prefilled once per storage as `bench kv-dtype` does (`prefilled_engine`), then per
round and storage (order rotating): `--steps` decode steps timed whole (wall, `mx.synchronize()` at the end), then
the same number of steps under cProfile. MLX builds a lazy graph in Python and computes it when the engine reads a
step's tokens, so the profile splits a step's time into:
- `compute wait`: time blocked in MLX evaluation: the graph's arithmetic and memory traffic, including attention
  and the KV writes' own work. cProfile does not see MLX's (nanobind) functions, so their time lands in their
  caller's own time: the step blocks where the runner evaluates and reads its tokens (`ModelRunner._decode`, a few
  lines of Python around `mx.eval`/`mx.async_eval`), so that function's own time is counted here, with any
  builtin wait cProfile does see;
- `attention graph`: Python time building the attention of every layer (cumulative time of the batch attention
  strategies and the quantized readers, less the compute wait inside them);
- `KV write graph`: Python time building the arena writes (quantize + scatter for a quantized side);
- `other`: the rest of the step in Python (the model's other layers, the scheduler, sampling).
cProfile slows Python-side code, so the profiled step is longer than the timed one; shares, not absolute times,
are what it gives. The compute inside one eval cannot be split by this; `bench.kv_quant_layout` times the write +
attention of one layer in isolation.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from typing import Any

# MLX and everything importing it load inside the functions: `main` first re-executes with the CPU tuning (OpenBLAS),
# which it cannot do once mlx.core is imported.

RESULT = "kv_decode_profile"
# Functions whose time is a blocked wait for MLX compute (builtins as cProfile names them).
WAITS = ("eval", "async_eval", "synchronize", "item", "tolist")
ATTENTION = ("quantized_attention", "strided_attention", "blocks_attention", "per_sequence_attention",
             "paged_kernel_attention", "gather_attention", "decode_attention", "decode_attention_per_head",
             "_quantized_attend")
WRITES = ("write", "write_slots")  # KVArena's writes of the new rows (a decode batch's: write_slots)


def _steps(engine: Any, steps: int) -> int:
    import mlx.core as mx

    tokens = 0
    for _ in range(steps):
        tokens += sum(out.token is not None for out in engine.step())
    mx.synchronize()
    return tokens


def _is_wait(key: tuple[str, int, str]) -> bool:
    filename, _, name = key
    return filename == "~" and any(f"{w}" in name for w in WAITS) and ("mlx" in name or "array" in name
                                                                        or name.startswith("<built-in"))


def _buckets(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per bucket (see the module docstring) from one cProfile run."""
    raw = stats.stats  # {(file, line, name): (calls, primitive calls, tottime, cumtime, callers)}
    total = sum(v[2] for v in raw.values())
    wait = sum(v[2] for k, v in raw.items() if _is_wait(k) or (k[2] == "_decode" and k[0].endswith("runner.py")))

    def cumulative(names: tuple[str, ...], path_part: str) -> tuple[float, float]:
        """(cumulative seconds of the outermost matching functions, wait seconds under them)"""
        cum = wait_under = 0.0
        for key, value in raw.items():
            if key[2] in names and path_part in key[0]:
                callers = value[4]
                if any(c[2] in names and path_part in c[0] for c in callers):
                    continue  # nested in another matching function: counted there
                cum += value[3]
        for key, value in raw.items():
            if _is_wait(key):
                for caller, cstats in value[4].items():
                    if caller[2] in names and path_part in caller[0]:
                        wait_under += cstats[2]
        return cum, wait_under

    att, att_wait = cumulative(ATTENTION, "cortexstream")
    wr, wr_wait = cumulative(WRITES, "kv/arena.py")
    attention = max(att - att_wait, 0.0)
    writes = max(wr - wr_wait, 0.0)
    return {"total": total, "compute_wait": wait, "attention_graph": attention, "kv_write_graph": writes,
            "other": max(total - wait - attention - writes, 0.0)}


def _top(stats: pstats.Stats, count: int = 12) -> list[dict[str, Any]]:
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:count]
    return [{"function": f"{k[0].split('site-packages/')[-1].split('/work/main/')[-1]}:{k[1]}({k[2]})",
             "calls": v[1], "tottime_s": v[2], "cumtime_s": v[3]} for k, v in rows]


def measure(storages: list[Any], batch: int, keys: int, steps: int, rounds: int) -> list[dict[str, Any]]:
    import cortexstream
    from cortexstream.benchmarks.common import prompt_token_lists, release_engines
    from cortexstream.benchmarks.kv_dtype_decode import prefilled_engine

    model, tokenizer = cortexstream.load("smollm2-135m")
    prompts = prompt_token_lists(tokenizer, batch, keys)
    max_tokens = 8 + 2 * rounds * steps + 16
    engines: dict[str, Any] = {}
    wall: dict[str, list[float]] = {s.text: [] for s in storages}
    tokens: dict[str, list[int]] = {s.text: [] for s in storages}
    profiles: dict[str, list[dict[str, float]]] = {s.text: [] for s in storages}
    tops: dict[str, list[dict[str, Any]]] = {}
    try:
        for storage in storages:
            tic = time.perf_counter()
            engines[storage.text] = prefilled_engine(model, tokenizer, prompts, storage, max_tokens, 8)
            print(f"{storage.text}: prompts in ({time.perf_counter() - tic:.0f}s)", flush=True)
        names = [s.text for s in storages]
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                tic = time.perf_counter()
                tokens[name].append(_steps(engines[name], steps))
                wall[name].append((time.perf_counter() - tic) / steps)
                profiler = cProfile.Profile()
                profiler.enable()
                _steps(engines[name], steps)
                profiler.disable()
                stats = pstats.Stats(profiler)
                profiles[name].append({k: v / steps for k, v in _buckets(stats).items()})
                tops[name] = _top(stats)
            print(f"round {r + 1} done", flush=True)
    finally:
        release_engines(engines)
    rows = []
    for storage in storages:
        name = storage.text
        median = {k: statistics.median(p[k] for p in profiles[name]) for k in profiles[name][0]}
        rows.append({"storage": name, "batch": batch, "keys": keys, "steps": steps, "rounds": rounds,
                     "ms_per_step": [w * 1e3 for w in wall[name]],
                     "ms_per_step_median": statistics.median(wall[name]) * 1e3,
                     "tokens_per_step": statistics.median(t / steps for t in tokens[name]),
                     "profiled_ms_per_step": {k: v * 1e3 for k, v in median.items()}, "top_tottime": tops[name]})
    return rows


def report(payload: dict) -> str:
    from cortexstream.benchmarks.machine import machine_sentence

    rows = payload["rows"]
    base = rows[0]
    lines = ["# Where a batched decode step's time goes per KV storage (`python -m bench.kv_decode_profile`)", "",
             f"{machine_sentence(payload['machine'])}. SmolLM2-135M, batch {base['batch']}, {base['keys']} keys per "
             f"sequence, {base['steps']} steps timed then {base['steps']} profiled per round, {base['rounds']} rounds "
             "(order rotating), medians. Profiled columns are ms per step under cProfile (Python slowed by it; "
             "compute wait = blocked in MLX evaluation).", "",
             "| storage | ms/step (timed) | vs first | tokens/step | compute wait | attention graph | KV write graph "
             "| other Python | profiled total |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r["profiled_ms_per_step"]
        lines.append(f"| {r['storage']} | {r['ms_per_step_median']:.1f} | "
                     f"{r['ms_per_step_median'] / base['ms_per_step_median']:.2f}x | {r['tokens_per_step']:.1f} | "
                     f"{p['compute_wait']:.1f} | {p['attention_graph']:.1f} | {p['kv_write_graph']:.1f} | "
                     f"{p['other']:.1f} | {p['total']:.1f} |")
    for r in rows:
        lines += ["", f"Top functions by own time, {r['storage']} (last profiled round, whole {r['steps']} steps):", "",
                  "| function | calls | own s | cumulative s |", "|---|---:|---:|---:|"]
        lines += [f"| `{t['function']}` | {t['calls']} | {t['tottime_s']:.3f} | {t['cumtime_s']:.3f} |"
                  for t in r["top_tottime"]]
    lines += ["", f"Rerun: `{payload['command']}`", ""]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storages", default="float32;int8;int4", help="semicolon-separated KV storages")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="bench/results")


def run_from_args(args: argparse.Namespace) -> int:
    from cortexstream.benchmarks.common import write_results
    from cortexstream.benchmarks.kv_dtype_measure import Storage
    from cortexstream.benchmarks.machine import machine

    storages = [Storage.parse(s, args.group_size, "float32") for s in args.storages.split(";") if s]
    rows = measure(storages, args.batch, args.keys, args.steps, args.rounds)
    command = (f"python -m bench.kv_decode_profile --storages '{args.storages}' --group-size {args.group_size} "
               f"--batch {args.batch} --keys {args.keys} --steps {args.steps} --rounds {args.rounds}")
    payload = {"benchmark": RESULT, "machine": machine(), "command": command, "rows": rows}
    write_results(args.out, RESULT, payload, report(payload))
    print(report(payload))
    return 0


def main(argv: list[str] | None = None) -> int:
    from cortexstream.backend import enable_linux_cpu_tuning

    enable_linux_cpu_tuning()
    from cortexstream.benchmarks.runner import run_as_script

    return run_as_script(__doc__, add_arguments, run_from_args, argv, prog="python -m bench.kv_decode_profile")


if __name__ == "__main__":
    raise SystemExit(main())
